"""The optimizer and the learning-rate schedule.

    make_optimizer   AdamW over the model's decay / no-decay groups: fused where the device has
                     it (train.fused_adamw), over float32 master weights when the model holds
                     bf16 weights (system.weights_dtype=bfloat16: MasterWeights)
    lr_at            linear warmup, then cosine (or constant) decay to min_lr_ratio x peak
"""
from __future__ import annotations

import math

import torch

from config import Config
from model import GPT


def lr_at(step: int, cfg: Config) -> float:
    t = cfg.train
    peak = t.learning_rate
    if step < t.warmup_iters:
        return peak * (step + 1) / t.warmup_iters
    if t.lr_schedule == "constant" or t.max_iters <= t.warmup_iters:
        return peak
    progress = min(1.0, (step - t.warmup_iters) / (t.max_iters - t.warmup_iters))
    min_lr = peak * t.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def make_optimizer(model: GPT, cfg: Config, device: torch.device
                   ) -> tuple[torch.optim.Optimizer, str]:
    """AdamW as configured; returns (optimizer, banner value of fused_adamw)."""
    t = cfg.train
    groups = model.optimizer_groups(t.weight_decay)
    kwargs = dict(lr=t.learning_rate, betas=(t.beta1, t.beta2))
    if next(model.parameters()).dtype == torch.bfloat16:  # system.weights_dtype=bfloat16
        return MasterWeights(groups, torch.optim.AdamW, foreach=False, **kwargs), "off"
    if t.fused_adamw:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs), "on"
        except (RuntimeError, ValueError) as e:
            note = f"off (fused AdamW unsupported on {device.type}: {e})"
            return torch.optim.AdamW(groups, **kwargs), note
    return torch.optim.AdamW(groups, foreach=False, **kwargs), "off"


class MasterWeights:
    """An optimizer over float32 copies of bf16 weights: small updates accumulate in float32
    instead of vanishing in bf16; the rounded result is copied back into the model."""

    def __init__(self, groups: list[dict], make: type, **kwargs):
        self.model_params = [p for g in groups for p in g["params"]]
        self.inner = make([{**g, "params": [p.detach().float().clone().requires_grad_(True)
                                            for p in g["params"]]} for g in groups], **kwargs)
        self.masters = [p for g in self.inner.param_groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for p, master in zip(self.model_params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, master in zip(self.model_params, self.masters):
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        self.inner.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        state["master_weights"] = [m.detach().clone() for m in self.masters]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        masters = state.pop("master_weights", None)
        self.inner.load_state_dict(state)
        if masters is not None:  # else the masters stay the (bf16-rounded) loaded weights
            for p, master, saved in zip(self.model_params, self.masters, masters):
                master.copy_(saved)
                p.copy_(saved)
