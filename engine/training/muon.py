"""train.optimizer=muon: Muon (torch.optim.Muon's update) on the blocks' Linear weights and AdamW
on the rest, as one optimizer (MuonWithAdamW). Muon's Newton-Schulz iteration runs in bfloat16 a
matrix at a time as torch's own, or (on a CPU, or with Polar Express's quintics) in float32 over
all of a group's matrices at once; both halves skip a non-finite step on the device (found_inf).
engine/training/optim.py loads this when the option is on.

    groups, make = muon_optimizer(model, groups, cfg, device, adamw)  # make(groups, lr=..., ...)
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from config import Config, ConfigError
from model import GPT

Coefficients = tuple[float, float, float]


def muon_optimizer(model: GPT, groups: list[dict], cfg: Config, device: torch.device,
                   adamw: type = torch.optim.AdamW) -> tuple[list[dict], functools.partial]:
    """(the AdamW groups less the hidden matrices + one Muon group, a maker of the optimizer)."""
    t = cfg.train
    muon = dict(momentum=t.muon_momentum, adjust_lr_fn=t.muon_adjust_lr, ns_steps=t.muon_ns_steps)
    polar = t.muon_ns_coefficients == "polar_express"
    if polar:  # a quintic per step, iterated in float32 (config.py refuses bfloat16)
        from engine.training.polar_express import polar_express_coefficients

        muon["ns_coefficients"] = polar_express_coefficients(t.muon_ns_steps)
    float32 = t.muon_ns_dtype == "float32" or (t.muon_ns_dtype == "auto"
                                               and (device.type != "cuda" or polar))
    muon["ns_dtype"] = torch.float32 if float32 else torch.bfloat16
    return muon_groups(model, groups, cfg), functools.partial(MuonWithAdamW, muon=muon,
                                                              adamw=adamw)


def muon_params(model: GPT) -> list[torch.nn.Parameter]:
    """The hidden matrices Muon orthogonalizes: every Linear weight inside the blocks (c_attn,
    attn.c_proj, c_fc, mlp.c_proj); not the embeddings or the tied LM head."""
    return [module.weight for module in model.transformer.h.modules()
            if isinstance(module, torch.nn.Linear) and module.weight.requires_grad]


def muon_groups(model: GPT, groups: list[dict], cfg: Config) -> list[dict]:
    """The AdamW groups less the hidden matrices, then one Muon group of those. Every group's lr
    is set to the schedule's value each step; the Muon group's lr_scale maps it onto muon_lr."""
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"train.optimizer=muon needs torch.optim.Muon, which torch "
                          f"{torch.__version__} lacks; upgrade torch or use --optimizer=adamw")
    hidden = {id(p) for p in muon_params(model)}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in hidden]} for g in groups]
    t = cfg.train
    return [g for g in rest if g["params"]] + [
        {"params": muon_params(model), "weight_decay": t.weight_decay, "muon": True,
         "lr_scale": t.muon_lr / t.learning_rate}]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked "muon", `adamw` over the others, as one optimizer: one
    param_groups list and one state (the inner two share both), so GradScaler, clipping, the lr
    schedule and state_dict / load_state_dict see an ordinary torch optimizer."""

    def __init__(self, groups: list[dict], muon: dict, adamw: type = torch.optim.AdamW,
                 **adamw_kwargs):
        self.adamw = adamw([g for g in groups if not g.get("muon")], **adamw_kwargs)
        self.muon = Muon([g for g in groups if g.get("muon")], **muon)
        super().__init__(self.adamw.param_groups + self.muon.param_groups, {})
        self._share()
        self.skips_nonfinite = getattr(self.adamw, "skips_nonfinite", False) or all(
            group.get("fused") for group in self.adamw.param_groups)  # found_inf to both halves

    def _share(self) -> None:
        count = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = (self.param_groups[:count],
                                                           self.param_groups[count:])
        self.adamw.state = self.muon.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.found_inf = self.muon.found_inf = getattr(self, "found_inf", None)
        scheduled = [group["lr"] for group in self.muon.param_groups]
        try:
            self.adamw.step()
            for group, lr in zip(self.muon.param_groups, scheduled):
                group["lr"] = lr * group["lr_scale"]
            self.muon.step()
        finally:  # the schedule's lr, so a step never compounds the scale; found_inf for one step
            for group, lr in zip(self.muon.param_groups, scheduled):
                group["lr"] = lr
            self.adamw.found_inf = self.muon.found_inf = None
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state
        self._share()


def per_step(coefficients: Coefficients | Sequence[Coefficients], steps: int
             ) -> list[Coefficients]:
    """The quintic of each of `steps` Newton-Schulz steps: one (a, b, c) for all of them
    (torch.optim.Muon's), or a schedule of one per step (polar_express_coefficients)."""
    if isinstance(coefficients[0], (int, float)):
        return [tuple(coefficients)] * steps
    if len(coefficients) != steps:
        raise ValueError(f"{len(coefficients)} Newton-Schulz quintics for {steps} steps")
    return [tuple(c) for c in coefficients]


def orthogonalize(update: torch.Tensor, coefficients: Coefficients | Sequence[Coefficients],
                  steps: int, eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration in dtype (torch.optim.Muon's order of operations; in
    bfloat16 its bits): about U V^T of update = U S V^T. coefficients: as per_step takes them."""
    tall = update.size(0) > update.size(1)
    x = update.to(dtype).T if tall else update.to(dtype)  # (short, long): a small Gram matrix
    x = x / x.norm().clamp(min=eps)
    for a, b, c in per_step(coefficients, steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize_all(updates: list[torch.Tensor],
                      coefficients: Coefficients | Sequence[Coefficients], steps: int,
                      eps: float) -> list[torch.Tensor]:
    """orthogonalize() over many matrices at once, to float32 rounding: the matrices of one
    (short, long) shape as one batch, and a long one through its Gram matrix (gram_iteration),
    which needs 40% fewer FLOPs at 4:1 (the MLP's matrices) and 30% fewer at 3:1 (c_attn).
    Sharded matrices (FSDP's DTensors) go one by one through orthogonalize."""
    if any(type(u) is not torch.Tensor for u in updates):
        return [orthogonalize(u, coefficients, steps, eps) for u in updates]
    schedule = per_step(coefficients, steps)
    out: list[torch.Tensor | None] = [None] * len(updates)
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, u in enumerate(updates):
        shapes.setdefault((min(u.shape), max(u.shape)), []).append(i)
    for (short, long), where in shapes.items():
        x = torch.stack([updates[i].float().mT if updates[i].size(0) > updates[i].size(1)
                         else updates[i].float() for i in where])  # (matrices, short, long)
        x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
        # per matrix, in units of short^3 FLOPs / 2: the plain iteration, the Gram one
        if steps * (2 * long / short + 1) > 2 * long / short + 4 * steps - 3:
            x = gram_iteration(x, schedule)
        else:
            for a, b, c in schedule:
                gram = x @ x.mT
                x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for i, result in zip(where, x):
            out[i] = result.mT if updates[i].size(0) > updates[i].size(1) else result
    return out


def gram_iteration(x: torch.Tensor, schedule: list[Coefficients]) -> torch.Tensor:
    """The Newton-Schulz iteration on x (matrices, short, long) carried out on short x short
    matrices. Each step maps x to p(A) x with A = x x^T and p(A) = a + b A + c A^2, so after k
    steps x_k = Q_k x_0 where Q_k = p(A_{k-1}) ... p(A_0), and A_{k+1} = p(A_k) A_k p(A_k)
    (every factor is a polynomial in A_0, so they commute). Only the first Gram matrix and the
    last product touch the long side."""
    gram = x @ x.mT
    eye = torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
    product = None
    for step, (a, b, c) in enumerate(schedule):
        poly = torch.baddbmm(torch.add(eye * a, gram, alpha=b), gram, gram, alpha=c)
        product = poly if product is None else poly @ product
        if step < len(schedule) - 1:
            gram = poly @ gram @ poly
    return product @ x


def muon_lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix lr factor (shape is the whole matrix's, also under FSDP)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # "original" (torch's default)


# a torch without Muon still imports this module: muon_groups refuses before the class is used
class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon's update, state and settings; its Newton-Schulz iteration in bfloat16 a
    matrix at a time as torch's, or in float32 over a group's matrices at once (orthogonalize_all:
    a CPU without AMX emulates bfloat16 slowly). At found_inf = 1 (engine/training/adamw.py) the
    weights and momentum stay as they were, the host never reading it."""

    skips_nonfinite = True

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else found_inf == 0
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                new_buf = buf.lerp(p.grad, 1 - momentum)
                updates.append(p.grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf)
                buf.copy_(new_buf if keep is None else torch.where(keep, new_buf, buf))
            settings = group["ns_coefficients"], group["ns_steps"], group["eps"]
            updates = (orthogonalize_all(updates, *settings) if self.ns_dtype == torch.float32
                       else [orthogonalize(u, *settings, self.ns_dtype) for u in updates])
            for p, update in zip(params, updates):
                new_p = p.mul(1 - lr * group["weight_decay"]).add_(
                    update, alpha=-lr * muon_lr_scale(group["adjust_lr_fn"], p.shape))
                p.copy_(new_p if keep is None else torch.where(keep, new_p, p))
        return loss
