"""The update on one batch of samples: updates_per_batch steps of GRPO's loss (grpo.py), each a
forward and backward over the rows (micro_rows at a time, the gradient summed exactly), clipping,
and the optimizer step, skipped when the loss or the gradient norm is NaN/inf.

    stats = update(model, optimizer, batch, u)   # {"loss", "clip_frac", "kl", "norm", ...}
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from engine.rl.grpo import policy_loss, token_logprobs
from engine.rl.rollout import Rollout


@dataclass
class UpdateSettings:
    temperature: float
    clip_eps: float
    updates_per_batch: int
    kl_coef: float
    normalize: str
    micro_rows: int  # 0: every row in one forward
    grad_clip: float
    autocast: object = None
    reference: torch.nn.Module | None = None  # kl_coef > 0: the starting model, frozen


def row_logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float,
                 autocast=None) -> torch.Tensor:
    """(B, T) rows -> (B, T - 1): each next token's log-probability under the model, as the
    sampler computed it (softmax(logits / temperature))."""
    with autocast() if autocast else contextlib.nullcontext():
        logits = model(ids[:, :-1])[0]
    return token_logprobs(logits, ids[:, 1:], temperature)


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Rollout,
           u: UpdateSettings) -> dict:
    t0, device = time.perf_counter(), next(model.parameters()).device
    ids, mask = batch.ids.to(device), batch.mask.to(device)
    old, adv = batch.old_logp.to(device), batch.advantages.to(device)
    rows = ids.size(0)
    step = u.micro_rows or rows
    total = float(mask.sum()) if u.normalize == "token" else float(rows)
    params = [p for p in model.parameters() if p.requires_grad]
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tokens": 0.0}
    skipped, norms = 0, []
    for _ in range(u.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for a in range(0, rows, step):
            part = slice(a, a + step)
            logp = row_logprobs(model, ids[part], u.temperature, u.autocast)
            ref = None
            if u.kl_coef:  # the reference forward only when the penalty is on
                with torch.no_grad():
                    ref = row_logprobs(u.reference, ids[part], u.temperature, u.autocast)
            loss, stats = policy_loss(logp, old[part], adv[part], mask[part], u.clip_eps,
                                      u.kl_coef, ref, u.normalize, total)
            loss.backward()
            loss_sum += loss.item()
            for key in ("clipped", "kl", "tokens"):
                sums[key] += float(stats[key])
        norm = float(torch.nn.utils.clip_grad_norm_(params, u.grad_clip or math.inf))
        norms.append(norm)
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            skipped += 1  # the weights stay as they were
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        sums["loss"] += loss_sum
    optimizer.zero_grad(set_to_none=True)
    n, tokens = u.updates_per_batch, max(1.0, sums["tokens"])
    return {"loss": sums["loss"] / max(1, n - skipped) if skipped < n else math.nan,
            "clip_frac": sums["clipped"] / tokens, "kl": sums["kl"] / tokens,
            "norm": max(norms), "skipped": skipped, "seconds": time.perf_counter() - t0,
            "tokens": ids.size(0) * (ids.size(1) - 1) * n}
