"""One training step and one evaluation: what train.py's loop and the benchmarks run.

    forward_backward  forward + backward over grad_accum_steps micro-batches (the gradients
                      all-reduced on the last; the next batch fetched while the device works)
    update            unscale, clip, then the update unless the loss or the gradient norm is
                      non-finite (the step is then skipped)
    train_step        the two in one process, at an lr: what the benchmarks and tests run
                      (train.py calls them itself, the mean over ranks between them)
    NonFiniteGuard    counts the skipped steps on the device; the loop reads it at log intervals
    evaluate          mean loss per split over fixed batches, and bits per byte
"""
import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from data.loader import Batches
from engine.device import Runtime
from engine.training.optim import set_schedule


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # summed over the micro-steps, on the device (not synced)
    norm: torch.Tensor  # the gradient norm before clipping
    finite: torch.Tensor  # on the device: False when the update was skipped
    next_batch: tuple  # (x, y) already fetched for the next step


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer reads found_inf and skips a flagged step on the device, so the host
    never reads the flag: fused torch AdamW, and every optimizer make_optimizer builds off a CPU
    (skips_nonfinite: adamw.py's AdamW, Muon, the two as one, float32 masters over them). Any
    other (torch's non-fused AdamW, which a CPU run keeps) is stepped after the host reads the
    flag: free on a CPU, a wait for the device on a GPU."""
    return getattr(optimizer, "skips_nonfinite", False) or (
        isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and all(g.get("fused") for g in optimizer.param_groups))


def update_unless_nonfinite(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """The update, or none at all when finite is False: the weights and the optimizer state,
    its step count too, stay as they were. With float16 the gradients were unscaled already and
    GradScaler's own inf check is contained in finite (an inf gradient makes the norm inf)."""
    if not skips_on_device(optimizer):
        if bool(finite):
            optimizer.step()
        return
    optimizer.found_inf = (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def grad_sync(model: torch.nn.Module) -> Callable[[bool], contextlib.AbstractContextManager] | None:
    """grad_sync(last): gradients all-reduced on the last micro-step only (DDP's no_sync, FSDP2's
    set_requires_gradient_sync); None with one process."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2
        return lambda last: inner.set_requires_gradient_sync(last) or contextlib.nullcontext()
    if hasattr(inner, "no_sync"):  # DDP
        return lambda last: contextlib.nullcontext() if last else inner.no_sync()
    return None


@dataclass
class Trainer:
    """What train_step works on, made once per run (build.Run.trainer)."""

    model: torch.nn.Module  # as trained: compiled, DDP or FSDP around raw_model, or raw_model
    raw_model: torch.nn.Module  # its parameters are clipped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    batches: Batches  # the next batch is fetched while the device works
    rt: Runtime
    accum_steps: int = 1  # micro-batches per step (train.grad_accum_steps)
    grad_clip: float = 0.0  # 0: no clipping
    grad_sync: Callable | None = None  # grad_sync(last): all-reduce on the last micro-step only


def forward_backward(trainer: Trainer, batch: tuple) -> tuple[torch.Tensor, tuple]:
    """The gradients of one step over trainer.accum_steps micro-batches, the first being batch
    (x, y) -> (the micro-batches' summed loss, on the device, not synced; the next batch)."""
    model, rt, accum_steps, grad_sync = (trainer.model, trainer.rt, trainer.accum_steps,
                                         trainer.grad_sync)
    x, y = batch
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(accum_steps):
        last = micro == accum_steps - 1
        with grad_sync(last) if grad_sync else contextlib.nullcontext():
            with rt.autocast():
                _, loss = model(x, y)
            x, y = trainer.batches.next()  # fetch the next batch while the device works
            loss_sum += loss.detach()
            trainer.scaler.scale(loss / accum_steps).backward()
    return loss_sum, (x, y)


def update(trainer: Trainer, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscale and clip the gradients, then the optimizer's update unless loss_sum (every rank's
    alike) or the gradient norm is non-finite -> (the norm before clipping, whether finite)."""
    optimizer, scaler = trainer.optimizer, trainer.scaler
    scaler.unscale_(optimizer)
    clip = trainer.grad_clip if trainer.grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(trainer.raw_model.parameters(), clip)
    if hasattr(norm, "full_tensor"):  # under FSDP: a DTensor over every rank's shard
        norm = norm.full_tensor()
    finite = torch.isfinite(loss_sum) & torch.isfinite(norm)  # no sync
    update_unless_nonfinite(optimizer, finite)
    scaler.update()  # with float16, a skipped step also lowers the loss scale
    optimizer.zero_grad(set_to_none=True)
    return norm, finite


def train_step(trainer: Trainer, batch: tuple, lr: float) -> StepResult:
    """One optimizer step at learning rate lr in one process: forward_backward, then update."""
    set_schedule(trainer.optimizer, lr)
    loss_sum, next_batch = forward_backward(trainer, batch)
    return StepResult(loss_sum, *update(trainer, loss_sum), next_batch)


@dataclass
class NonFiniteGuard:
    """The steps skipped for a NaN/inf loss or gradient norm, kept on the device until read;
    `limit` of them in a row stop the run."""

    limit: int
    in_a_row: int = 0  # as of the last read
    pending: list = field(default_factory=list)  # (step, finite, loss_sum, norm) since the read

    def record(self, step: int, result: StepResult) -> None:
        """Keep this step's flag and values (device tensors, not its batch) for the next read."""
        self.pending.append((step, result.finite, result.loss_sum, result.norm))

    def read(self, accum_steps: int) -> list[tuple[int, float, float, int]]:
        """(step, mean loss, norm, non-finite in a row) of each skipped step since the last read:
        one transfer from the device."""
        if not self.pending:
            return []
        values = torch.stack([torch.stack([finite.float(), loss_sum.float() / accum_steps,
                                           norm.float()])
                              for _, finite, loss_sum, norm in self.pending]).tolist()
        skipped = []
        for (step, *_), (finite, loss, norm) in zip(self.pending, values):
            self.in_a_row = 0 if finite else self.in_a_row + 1
            if not finite:
                skipped.append((step, loss, norm, self.in_a_row))
        self.pending.clear()
        return skipped

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit


@torch.no_grad()
def evaluate(model: torch.nn.Module, loaders: dict[str, Batches], eval_sets: dict[str, list],
             rt: Runtime, token_bytes: torch.Tensor | None = None) -> dict[str, float]:
    """Mean loss per split over fixed batches (the same ones at every evaluation); given each
    id's bytes, also SPLIT_bpb: bits per byte = loss / ln 2 x tokens / bytes of the targets."""
    was_training = model.training
    model.eval()
    out = {}
    for split, starts_list in eval_sets.items():
        losses, n_bytes, n_tokens = [], 0, 0
        for starts in starts_list:
            x, y = loaders[split].windows(starts)
            with rt.autocast():
                _, loss = model(x, y)
            losses.append(loss.item())
            if token_bytes is not None:
                n_bytes, n_tokens = n_bytes + token_bytes[y].sum(), n_tokens + y.numel()
        out[split] = sum(losses) / len(losses)
        if token_bytes is not None:  # every batch the same size: the mean of means is the mean
            out[f"{split}_bpb"] = out[split] / math.log(2) * n_tokens / max(int(n_bytes), 1)
    model.train(was_training)
    return out
