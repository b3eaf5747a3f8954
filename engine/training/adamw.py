"""Non-fused AdamW off a CPU (train.fused_adamw=false, and the float32 masters of
system.weights_dtype=bfloat16): torch's foreach AdamW update, a handful of multi-tensor kernels
over all of a group's tensors at once (what torch.optim.AdamW runs on a GPU by default), with
the step count on the device and a non-finite step skipped there, as fused AdamW skips it.
optim.py loads this when AdamW is not fused and the device is not a CPU.

torch's own foreach AdamW cannot skip a step it is told of (it refuses found_inf), so skipping
with it would need the host to read the flag first: a wait for the device every step. This
update reads `found_inf` on the device: at 1, the gradients are zeroed bit for bit (their
NaN/inf would spread) and every factor of the update becomes the identity, so the weights and
the state, step count included, stay as they were. On a CPU reading the flag waits for nothing
and torch's per-tensor AdamW is fastest there (foreach kernels are loops on a CPU), so a CPU run
keeps torch's.
"""
from __future__ import annotations

import torch

INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}  # a float's bits, by its width


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW(foreach=True, capturable=True)'s update (decoupled weight decay, the
    bias corrections computed on the device) that reads `found_inf`, a 0-dim float tensor on the
    device set by the caller for one step: at 1 nothing changes and the host never reads it.
    Over torch's: a pass zeroing the gradients of a skipped step and one more over exp_avg
    (a multiply and an add instead of one lerp, so that a skipped step leaves it exactly)."""

    skips_nonfinite = True  # engine/training/step.py hands it found_inf

    def __init__(self, params, **kwargs):
        kwargs.pop("foreach", None)  # always foreach: the point of this class
        super().__init__(params, foreach=False, **kwargs)
        if self.defaults["amsgrad"] or self.defaults["maximize"]:
            raise ValueError("engine.training.adamw.AdamW has neither amsgrad nor maximize")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params, found_inf)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # resumed from torch's non-fused AdamW (host count)
            state["step"] = state["step"].to(p.device, torch.float32)
        return state

    def _update(self, group: dict, params: list[torch.Tensor],
                found_inf: torch.Tensor | None) -> None:
        states = [self._state(p) for p in params]
        grads = [p.grad for p in params]
        steps, exp_avgs, exp_avg_sqs = ([s[k] for s in states]
                                        for k in ("step", "exp_avg", "exp_avg_sq"))
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        skip = None if found_inf is None else found_inf.to(params[0].device) != 0

        def unless_skipped(value: float, identity: float = 1.0) -> torch.Tensor | float:
            """value, or identity on a skipped step (a 0-dim tensor: no host read)."""
            return value if skip is None else torch.where(skip, identity, value)

        if skip is not None:  # a skipped step's NaN/inf gradients -> +0, bit for bit
            keep_bits = (~skip).to(torch.int32)
            torch._foreach_mul_([g.view(INT_VIEW[g.element_size()]) for g in grads], keep_bits)
        # the bias corrections at this step's count (t + 1 >= 1: finite even when skipped);
        # a group's tensors always step together here, so its first tensor's count serves all
        count = steps[0] + 1
        torch._foreach_add_(steps, 1.0 if skip is None else (~skip).float())
        if weight_decay != 0:
            torch._foreach_mul_(params, unless_skipped(1 - lr * weight_decay))
        torch._foreach_mul_(exp_avgs, unless_skipped(beta1))  # exp_avg.lerp_(grad, 1 - beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, unless_skipped(beta2))
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias_correction1 = 1 - torch.pow(beta1, count)
        bias_correction2_sqrt = (1 - torch.pow(beta2, count)).sqrt()
        step_size = lr / bias_correction1  # a skipped step: 0, so the update below is +-0
        if skip is not None:
            step_size = torch.where(skip, 0.0, step_size)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(denom, -step_size)  # -(sqrt(v / bc2) + eps) / step_size: +-inf
        torch._foreach_addcdiv_(params, exp_avgs, denom)  # p - step_size * m / (...)
