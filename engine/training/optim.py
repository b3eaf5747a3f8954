"""The optimizer and the learning-rate schedule.

    make_optimizer   AdamW over the model's decay / no-decay groups: fused where the device has
                     it (train.fused_adamw; else off a CPU adamw.py's foreach update, skipping a
                     NaN/inf step on the device), over float32 masters when the model holds
                     bf16 weights (system.weights_dtype=bfloat16: master_weights.py); with
                     train.optimizer=muon, Muon on the blocks' Linear weights and AdamW on
                     embeddings, the tied head, biases and norms (muon.py)
    lr_at            linear warmup, then cosine decay to min_lr_ratio x peak, constant, or
                     warmup-stable-decay (wsd: linear over the last cooldown_frac of the steps)
    momentum_at      Muon's momentum, warmed up from muon_momentum_start
    set_schedule     a step's lr on every group, and Muon's momentum on its groups
"""
from __future__ import annotations

import math

import torch

from config import Config
from model import GPT

# float32 state tensors each train.optimizer keeps per parameter: (in the blocks' Linear weights,
# elsewhere). AdamW: exp_avg and exp_avg_sq; Muon: one momentum buffer, AdamW on the rest
STATE_TENSORS = {"adamw": (2, 2), "muon": (1, 2)}


def lr_at(step: int, cfg: Config) -> float:
    t = cfg.train
    peak = t.learning_rate
    if step < t.warmup_iters:
        return peak * (step + 1) / t.warmup_iters
    if t.lr_schedule == "constant" or t.max_iters <= t.warmup_iters:
        return peak
    min_lr = peak * t.min_lr_ratio
    if t.lr_schedule == "wsd":  # the peak, then a straight line to min_lr at max_iters
        cooldown = max(1.0, t.cooldown_frac * t.max_iters)
        left = min(1.0, max(0.0, (t.max_iters - step) / cooldown))
        return min_lr + left * (peak - min_lr)
    progress = min(1.0, (step - t.warmup_iters) / (t.max_iters - t.warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def momentum_at(step: int, cfg: Config) -> float:
    """Muon's momentum at this step: muon_momentum, or with muon_momentum_warmup a straight line
    up to it from muon_momentum_start (early updates follow the newest gradients more)."""
    t = cfg.train
    if step >= t.muon_momentum_warmup:
        return t.muon_momentum
    return t.muon_momentum_start + step / t.muon_momentum_warmup * (
        t.muon_momentum - t.muon_momentum_start)


def set_schedule(optimizer: torch.optim.Optimizer, lr: float,
                 momentum: float | None = None) -> None:
    """A step's lr on every group (Muon scales its own by muon_lr / learning_rate), and Muon's
    momentum on its groups when given (AdamW's betas stay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        if momentum is not None and group.get("muon"):
            group["momentum"] = momentum


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (or Muon + AdamW) as configured; fused AdamW where asked and the device has it
    (fused_note says which ran). Off a CPU each skips a NaN/inf step on the device."""
    t = cfg.train
    kwargs = dict(lr=t.learning_rate, betas=(t.beta1, t.beta2))
    bf16 = next(model.parameters()).dtype == torch.bfloat16  # system.weights_dtype=bfloat16
    if t.fused_adamw and not bf16:
        groups, make = optimizer_maker(model, cfg, device, torch.optim.AdamW)
        try:
            return make(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # fused_note tells the banner
            pass
    # non-fused: torch's on a CPU, where reading the skip flag waits for nothing; elsewhere
    # adamw.py's foreach update, which skips on the device (torch's foreach refuses found_inf)
    adamw = torch.optim.AdamW
    if device.type != "cpu":
        from engine.training.adamw import AdamW

        adamw = AdamW
    groups, make = optimizer_maker(model, cfg, device, adamw)
    if bf16:
        from engine.training.master_weights import MasterWeights

        return MasterWeights(groups, make, foreach=False, **kwargs)
    return make(groups, foreach=False, **kwargs)


def optimizer_maker(model: GPT, cfg: Config, device: torch.device, adamw: type) -> tuple:
    """(the parameter groups, a maker of the optimizer): `adamw`, or Muon + `adamw` (muon.py)."""
    groups = model.optimizer_groups(cfg.train.weight_decay)
    if cfg.train.optimizer != "muon":
        return groups, adamw
    from engine.training.muon import muon_optimizer

    return muon_optimizer(model, groups, cfg, device, adamw)


def fused_note(optimizer: torch.optim.Optimizer, cfg: Config) -> str:
    """The banner's fused_adamw: on, off, or off with why when it was asked for."""
    if any(group.get("fused") for group in optimizer.param_groups):
        return "on"
    if not cfg.train.fused_adamw or hasattr(optimizer, "masters"):  # MasterWeights: not fused
        return "off"
    return "off (fused AdamW is unsupported on this device or dtype)"


