"""The optimizer and the learning-rate schedule.

    make_optimizer   AdamW over the model's decay / no-decay groups: fused where the device has
                     it (train.fused_adamw), over float32 master weights when the model holds
                     bf16 weights (system.weights_dtype=bfloat16: MasterWeights); with
                     train.optimizer=muon, MuonWithAdamW: Muon on the blocks' Linear weights
                     (muon_params), AdamW on embeddings, the tied head, biases and norms
    lr_at            linear warmup, then cosine decay to min_lr_ratio x peak, constant, or
                     warmup-stable-decay (wsd: linear over the last cooldown_frac of the steps)
    momentum_at      Muon's momentum, warmed up from muon_momentum_start (set_momentum applies it)
    polar_express_coefficients
                     train.muon_ns_coefficients=polar_express: a Newton-Schulz quintic per step
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
import torch

from config import Config, ConfigError
from model import GPT


# float32 state tensors each train.optimizer keeps per parameter: (in the blocks' Linear weights,
# elsewhere). AdamW: exp_avg and exp_avg_sq; Muon: one momentum buffer, AdamW on the rest
STATE_TENSORS = {"adamw": (2, 2), "muon": (1, 2)}
# train.muon_ns_coefficients=polar_express: the smallest singular value (of the update over its
# Frobenius norm) each step's quintic is made for; smaller ones still grow, less exactly
POLAR_EXPRESS_LOWER = 1e-3
NEAR_ONE = (15 / 8, -5 / 4, 3 / 8)  # the quintic with p(1) = 1 and p'(1) = p''(1) = 0


def state_floats(optimizer: str, params: int, block_matrices: int) -> int:
    """Float32 numbers `optimizer` keeps for `params` parameters, `block_matrices` of them in
    the blocks' Linear weights (the memory estimate, made before any model exists)."""
    hidden, rest = STATE_TENSORS[optimizer]
    return hidden * block_matrices + rest * (params - block_matrices)


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


def set_momentum(optimizer: torch.optim.Optimizer, momentum: float) -> None:
    """Every Muon group's momentum (AdamW's betas stay)."""
    for group in optimizer.param_groups:
        if group.get("muon"):
            group["momentum"] = momentum


def muon_params(model: GPT) -> list[torch.nn.Parameter]:
    """The hidden matrices Muon orthogonalizes: every Linear weight inside the blocks (c_attn,
    attn.c_proj, c_fc, mlp.c_proj); not the embeddings or the tied LM head."""
    return [module.weight for module in model.transformer.h.modules()
            if isinstance(module, torch.nn.Linear) and module.weight.requires_grad]


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (or Muon + AdamW) as configured; fused AdamW where asked and the device has it
    (fused_note says which ran)."""
    t = cfg.train
    groups, make = model.optimizer_groups(t.weight_decay), torch.optim.AdamW
    if t.optimizer == "muon":
        muon = dict(momentum=t.muon_momentum, adjust_lr_fn=t.muon_adjust_lr,
                    ns_steps=t.muon_ns_steps)
        polar = t.muon_ns_coefficients == "polar_express"
        if polar:  # a quintic per step: only Float32Muon's iteration takes a schedule
            muon["ns_coefficients"] = polar_express_coefficients(t.muon_ns_steps)
        float32 = t.muon_ns_dtype == "float32" or (t.muon_ns_dtype == "auto"
                                                   and (device.type != "cuda" or polar))
        groups, make = muon_groups(model, groups, cfg), functools.partial(
            MuonWithAdamW, muon_class=Float32Muon if float32 else torch.optim.Muon, muon=muon)
    kwargs = dict(lr=t.learning_rate, betas=(t.beta1, t.beta2))
    if next(model.parameters()).dtype == torch.bfloat16:  # system.weights_dtype=bfloat16
        return MasterWeights(groups, make, foreach=False, **kwargs)
    if t.fused_adamw:
        try:
            return make(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # fused_note tells the banner
            pass
    return make(groups, foreach=False, **kwargs)


def fused_note(optimizer: torch.optim.Optimizer, cfg: Config) -> str:
    """The banner's fused_adamw: on, off, or off with why when it was asked for."""
    if any(group.get("fused") for group in optimizer.param_groups):
        return "on"
    if not cfg.train.fused_adamw or isinstance(optimizer, MasterWeights):
        return "off"
    return "off (fused AdamW is unsupported on this device or dtype)"


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
    """torch.optim.Muon over the groups marked "muon", AdamW over the others, as one optimizer:
    one param_groups list and one state (the inner two share both), so GradScaler, clipping,
    the lr schedule and state_dict / load_state_dict see an ordinary torch optimizer."""

    def __init__(self, groups: list[dict], muon: dict, muon_class: type | None = None,
                 **adamw):
        self.adamw = torch.optim.AdamW([g for g in groups if not g.get("muon")], **adamw)
        self.muon = (muon_class or torch.optim.Muon)([g for g in groups if g.get("muon")],
                                                      **muon)
        super().__init__(self.adamw.param_groups + self.muon.param_groups, {})
        self._share()

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
        self.adamw.step()
        scheduled = [group["lr"] for group in self.muon.param_groups]
        for group, lr in zip(self.muon.param_groups, scheduled):
            group["lr"] = lr * group["lr_scale"]
        self.muon.step()
        for group, lr in zip(self.muon.param_groups, scheduled):
            group["lr"] = lr  # what the schedule set, so a step never compounds the scale
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state
        self._share()


Coefficients = tuple[float, float, float]


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
                  steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (torch.optim.Muon's order of operations) in
    float32: about U V^T of update = U S V^T. coefficients: as per_step takes them."""
    tall = update.size(0) > update.size(1)
    x = update.float().T if tall else update.float()  # (short, long): the Gram matrix is small
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


def quintic(coefficients: Coefficients, s: np.ndarray | float) -> np.ndarray | float:
    a, b, c = coefficients
    return a * s + b * s**3 + c * s**5


def closest_quintic(lo: float, hi: float) -> tuple[Coefficients, float]:
    """The odd quintic p(s) = a s + b s^3 + c s^5 closest to 1 in max norm over [lo, hi]
    (0 < lo < hi), and that distance E. The best one's error 1 - p alternates in sign at four
    points (lo, two inner turning points, hi) with the same size E (Chebyshev's equioscillation
    theorem); Remez's exchange finds them: solve for the p and E that alternate at the current
    points, move them to where the new error turns, repeat until they stay put."""
    grid = np.geomspace(lo, hi, 20001)
    points = np.linspace(lo, hi, 4)
    for _ in range(100):
        system = np.stack([points, points**3, points**5, [1.0, -1.0, 1.0, -1.0]], axis=1)
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        miss = 1 - quintic((a, b, c), grid)
        turns = np.flatnonzero(np.diff(miss[:-1]) * np.diff(miss[1:]) < 0) + 1
        squares = np.roots([5 * c, 3 * b, a])  # where p' = 0: a quadratic in s^2
        squares = squares[np.isreal(squares) & (squares.real > 0)].real
        if len(turns) != 2 or len(squares) != 2:
            break
        roots = np.sqrt(squares)  # each turn to its exact place, off the grid
        inner = [roots[np.argmin(abs(roots - grid[i]))] for i in turns]
        moved = np.array([lo, *inner, hi])
        if np.allclose(moved, points, rtol=1e-13, atol=0):
            break
        points = moved
    return (float(a), float(b), float(c)), float(abs(error))


@functools.cache
def polar_express_coefficients(steps: int, lower: float = POLAR_EXPRESS_LOWER
                               ) -> tuple[Coefficients, ...]:
    """train.muon_ns_coefficients=polar_express: Polar Express (Amsel, Persson, Musco and Gower
    2025; the speedrun's later records), a quintic per step instead of one for all. Divided by
    its Frobenius norm, an update's singular values lie in (0, 1]; the schedule is made for
    those in [lower, 1]. Step k's quintic is the one closest to 1 on where they can be then,
    [lo, hi] (closest_quintic), which maps them into [1 - E, 1 + E]: step k + 1's interval.
    Each step takes what is left from the last, so fewer steps get near 1: from [1e-3, 1],
    three end in [0.14, 1.86] and five in [0.89, 1.11], where torch's one quintic, made to
    lift small values fast, ends in [0.47, 1.20] after five."""
    schedule, lo, hi = [], lower, 1.0
    for _ in range(steps):
        if hi - lo > 1e-4:
            coefficients, error = closest_quintic(lo, hi)
        else:  # (after ~6 steps) so near 1 that Remez's system is singular: the quintics' limit,
            coefficients = NEAR_ONE  # flat at 1 to third order: 1 + d -> 1 + 2.5 d^3
            error = max(abs(1 - quintic(NEAR_ONE, s)) for s in (lo, hi))
        schedule.append(coefficients)
        lo, hi = 1 - error, 1 + error
    return tuple(schedule)


def muon_lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix lr factor (shape is the whole matrix's, also under FSDP)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # "original" (torch's default)


# a torch without Muon still imports this module: muon_groups refuses before the class is used
class Float32Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch.optim.Muon's update, state and settings, with the Newton-Schulz iteration in
    float32 (torch's runs in bfloat16, which a CPU without AMX emulates slowly), over all of a
    group's matrices at once (orthogonalize_all)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
            updates = orthogonalize_all(updates, group["ns_coefficients"], group["ns_steps"],
                                        group["eps"])
            for p, update in zip(params, updates):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * muon_lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


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
