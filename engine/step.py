"""One training step and one evaluation: what train.py's loop and the benchmarks run.

    train_step   forward + backward over grad_accum_steps micro-batches (fetching the next batch
                 while the device works), unscale, clip, then the update unless the guard finds
                 the loss or gradient norm non-finite (the step is then skipped)
    evaluate     mean loss per split over fixed batches
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from data.loader import Batches
from engine import distributed
from engine.resume import NonFiniteGuard
from engine.runtime import Runtime


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # summed over the micro-steps, on the device (not synced)
    norm: torch.Tensor  # the gradient norm before clipping
    updated: bool  # False when the guard skipped the update
    next_batch: tuple  # (x, y) already fetched for the next step


def train_step(model: torch.nn.Module, raw_model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               batches: Batches, batch: tuple, rt: Runtime, lr: float, accum_steps: int,
               grad_clip: float, guard: NonFiniteGuard | None = None,
               grad_sync=None, sync=None) -> StepResult:
    """One optimizer step. grad_sync(last): all-reduce on the last micro-step only; sync(loss_sum):
    the mean over ranks before the guard reads it; guard: skip a non-finite step (else update)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = batch
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(accum_steps):
        last = micro == accum_steps - 1
        with grad_sync(last) if grad_sync else contextlib.nullcontext():
            with rt.autocast():
                _, loss = model(x, y)
            x, y = batches.next()  # fetch the next batch while the device works
            loss_sum += loss.detach()
            scaler.scale(loss / accum_steps).backward()
    if sync is not None:
        loss_sum = sync(loss_sum)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                          grad_clip if grad_clip > 0 else math.inf)
    norm = distributed.full_tensor(norm)  # under FSDP: a DTensor over every rank's shard
    updated = guard.check(loss_sum, norm) if guard is not None else True
    if updated:
        scaler.step(optimizer)
    scaler.update()  # with float16, a skipped step also lowers the loss scale
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, norm, updated, (x, y))


@torch.no_grad()
def evaluate(model: torch.nn.Module, loaders: dict[str, Batches], eval_sets: dict[str, list],
             rt: Runtime) -> dict[str, float]:
    """Mean loss per split over fixed batches (the same ones at every evaluation)."""
    was_training = model.training
    model.eval()
    out = {}
    for split, starts_list in eval_sets.items():
        losses = []
        for starts in starts_list:
            x, y = loaders[split].windows(starts)
            with rt.autocast():
                _, loss = model(x, y)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train(was_training)
    return out
