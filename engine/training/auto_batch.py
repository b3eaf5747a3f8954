"""train.batch_size_auto: the same sequences per step, in the largest micro-batch that fits in
the GPU's memory, found by trial steps (CUDA only). engine/training/speedups.py loads this when
the option is on.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from config import Config
from engine.device import Runtime, SetupError
from engine.training.processes import Dist
from model import GPT

# share of free CUDA memory a trial step may reserve: room for fragmentation, eval, autotuning
MEMORY_HEADROOM = 0.90
# what CUDA's libraries say when they cannot allocate their own workspace: torch raises these
# as a plain RuntimeError, not OutOfMemoryError, but for the search they mean "does not fit"
ALLOCATION_FAILED = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                     "CUBLAS_STATUS_NOT_INITIALIZED", "out of memory")


def allocation_failed(error: RuntimeError) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or any(
        text in str(error) for text in ALLOCATION_FAILED)


def split_global_batch(global_batch: int, fits: Callable[[int], bool]) -> tuple[int, int] | None:
    """(micro_batch, grad_accum_steps) for the largest divisor of the global batch that fits
    (binary search: below a fitting size all fit); None if 1 does not."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    lo, hi = -1, len(divisors)  # divisors[lo] fits, divisors[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(divisors[mid]) else (lo, mid)
    return (divisors[lo], global_batch // divisors[lo]) if lo >= 0 else None


def _trial_step(model: GPT, rt: Runtime, micro_batch: int) -> None:
    """One forward+backward at this micro-batch, with AdamW's two moments per parameter held."""
    moments = [torch.empty_like(p) for p in model.parameters() for _ in range(2)]  # noqa: F841
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), device=rt.device)
    with rt.autocast():
        _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize(rt.device)


def _fits(model: GPT, rt: Runtime, micro_batch: int, budget: int) -> bool:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(rt.device)
    try:
        _trial_step(model, rt, micro_batch)  # its tensors are freed when it returns or raises
        fits = torch.cuda.max_memory_reserved(rt.device) <= budget
    except RuntimeError as e:  # OutOfMemoryError, or a library that could not allocate
        if not allocation_failed(e):
            raise
        fits = False
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return fits


def auto_micro_batch(cfg: Config, model: GPT, rt: Runtime, dist: Dist | None = None) -> str:
    """train.batch_size_auto: the global batch stays; the micro-batch becomes its largest divisor
    whose step fits in device memory (the smallest over processes). Updates cfg.train; returns
    the banner value. Trials run eagerly: compiled code keeps fewer activations, so it fits."""
    t = cfg.train
    plain = f"{t.batch_size}x{t.grad_accum_steps}"
    if not t.batch_size_auto:
        return plain
    if dist is not None and dist.parallel == "fsdp":
        return f"{plain} (batch_size_auto measures the unsharded model: off with fsdp)"
    if rt.device.type != "cuda":
        return f"{plain} (batch_size_auto needs CUDA: kept)"
    global_batch = t.batch_size * t.grad_accum_steps
    if dist is None or dist.is_main:
        print(f"batch_size_auto: trial steps for the largest micro-batch dividing {global_batch} "
              "that fits ...", flush=True)
    free, _ = torch.cuda.mem_get_info(rt.device)
    budget = int(MEMORY_HEADROOM * (free + torch.cuda.memory_reserved(rt.device)))
    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=[rt.device]):  # dropout in the trials leaves no trace
        split = split_global_batch(global_batch, lambda b: _fits(model, rt, b, budget))
    model.train(was_training)
    if split is None:
        raise SetupError(
            f"batch_size_auto: not even a micro-batch of 1 sequence of {cfg.model.block_size} "
            f"tokens fits in {budget / 2**30:.1f} GiB; use a smaller model or block_size, "
            "--dtype=bfloat16, or --attention=sdpa")
    t.batch_size, t.grad_accum_steps = split
    note = f"{t.batch_size}x{t.grad_accum_steps} (auto, of {global_batch} per step)"
    smallest = dist.min_int(t.batch_size) if dist is not None else t.batch_size
    if smallest != t.batch_size:
        t.batch_size, t.grad_accum_steps = smallest, global_batch // smallest
        note = f"{t.batch_size}x{t.grad_accum_steps} (auto, the smallest fit over the processes)"
    return note
