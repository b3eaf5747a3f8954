"""system.weights_dtype=bfloat16: the model holds bf16 weights and gradients (hold_weights), and
the optimizer steps float32 copies of them (MasterWeights), so small updates accumulate instead
of vanishing in bf16. speedups.py and optim.py load this when the option is on.
"""
from __future__ import annotations

import torch

from config import ConfigError


def hold_weights(model: torch.nn.Module, parallel: str, world_size: int) -> str:
    """The weights (and so their gradients) cast to bf16 in place -> the banner's value."""
    if parallel == "fsdp" and world_size > 1:
        raise ConfigError("--weights_dtype=bfloat16 with --parallel=fsdp: FSDP2 keeps float32 "
                          "shards and computes in bf16 itself; use --weights_dtype=float32 "
                          "--dtype=bfloat16")
    model.to(torch.bfloat16)
    return "bfloat16 (float32 master weights + AdamW state)"


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

    @property
    def skips_nonfinite(self) -> bool:
        """Whether found_inf (1: skip) reaches an inner optimizer that reads it: a skipped step
        leaves the masters, and so the weights copied from them, as they were."""
        return getattr(self.inner, "skips_nonfinite", False)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for p, master in zip(self.model_params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        self.inner.found_inf = getattr(self, "found_inf", None)
        try:
            self.inner.step()
        finally:
            self.inner.found_inf = None
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
