"""Non-fused AdamW that skips a non-finite step on the device, for a GPU run's
train.fused_adamw=false and the float32 masters of system.weights_dtype=bfloat16. optim.py loads
this when AdamW is not fused and the device is not a CPU.

torch's own non-fused AdamW counts its steps on the host and refuses found_inf, so skipping a
step with it needs the host to read the flag first: a wait for the device every step. This is
its update (one tensor at a time, in its order of operations: the same bits on a CPU) with the
step count on the device, each new value kept only where found_inf is 0, as fused AdamW does.
On a CPU reading the flag waits for nothing and torch's in-place update is faster (these
selects and temporaries take 3-6x its time there), so a CPU run keeps torch's.
"""
from __future__ import annotations

import torch


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW(foreach=False)'s update that reads `found_inf` (a 0-dim float tensor on
    the device, set by the caller for one step): at 1 the weights and the state, step count
    included, stay as they were, and the host never reads it. Extra cost on a GPU: four selects
    and a few scalar kernels a tensor (torch's capturable AdamW pays the same scalar kernels)."""

    skips_nonfinite = True  # engine/training/step.py hands it found_inf

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if self.defaults["amsgrad"] or self.defaults["maximize"]:
            raise ValueError("engine.training.adamw.AdamW has neither amsgrad nor maximize")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else found_inf == 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, keep)
        return loss

    def _update(self, p: torch.Tensor, group: dict, keep: torch.Tensor | None) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # resumed from torch's non-fused AdamW (host count)
            state["step"] = state["step"].to(p.device)
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        grad = p.grad
        step = state["step"] + (1 if keep is None else keep)
        count = step.double()  # bias corrections in float64, as torch's host-side Python floats
        # a true division (a number / a tensor is a reciprocal times the number)
        neg_step_size = (count.new_full((), -lr) / (1 - beta1 ** count)).float()
        bias_correction2_sqrt = (1 - beta2 ** count).sqrt().float()
        exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        decayed = p.mul(1 - lr * weight_decay) if weight_decay != 0 else p
        new_p = decayed + exp_avg.mul(neg_step_size).div_(denom)  # addcdiv's p + (s * m) / d
        for old, new in ((p, new_p), (state["exp_avg"], exp_avg),
                         (state["exp_avg_sq"], exp_avg_sq), (state["step"], step)):
            old.copy_(new if keep is None else torch.where(keep, new, old))
