"""The speedup flags that need more than one line, shared by train.py and bench.py.

    compile_model        system.compile / compile_mode, with a preflight that names the fix
    auto_micro_batch     train.batch_size_auto: the largest micro-batch that fits on the device,
                         keeping the global batch through gradient accumulation
    attention_kernels    which scaled_dot_product_attention kernel actually ran (flash,
                         memory-efficient, cudnn, math), read from the profiler
    settings / banner    what each flag became on this device, as one start-up line
    reset_peak_memory / peak_memory   CUDA max allocated/reserved, CPU peak RSS

The other flags are read where they act: attention, causal mask, norm, GELU and vocab padding in
model.py; dtype and TF32 in runtime.setup; fused AdamW in train.make_optimizer; pinned memory in
data/loader.py.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine import runtime
from config import Config
from model import GPT

# A micro-batch "fits" when its trial step keeps the process's reserved CUDA memory under this
# share of what was free: room for allocator fragmentation, evaluation and compile autotuning.
MEMORY_HEADROOM = 0.90

# aten op -> kernel name, for the SDPA backends PyTorch can dispatch to
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (device plugin)",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math (mps)",
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """Binary search for the largest candidate (ascending list) that fits, assuming that
    everything below a fitting size fits too. None when even the smallest does not."""
    lo, hi = -1, len(candidates)  # candidates[lo] fits, candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid
    return candidates[lo] if lo >= 0 else None


def _trial_step(model: GPT, rt: runtime.Runtime, micro_batch: int) -> None:
    """One forward+backward at this micro-batch on random tokens, with AdamW's two moment
    buffers per parameter held alongside, as they will be during training."""
    moments = [torch.empty_like(p) for p in model.parameters() for _ in range(2)]  # noqa: F841
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), device=rt.device)
    with rt.autocast():
        _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize(rt.device)


def _fits(model: GPT, rt: runtime.Runtime, micro_batch: int, budget: int) -> bool:
    """Does a training step at this micro-batch keep reserved CUDA memory under budget bytes?"""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(rt.device)
    try:
        _trial_step(model, rt, micro_batch)  # its tensors are freed when it returns or raises
        fits = torch.cuda.max_memory_reserved(rt.device) <= budget
    except torch.cuda.OutOfMemoryError:
        fits = False
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return fits


def auto_micro_batch(cfg: Config, model: GPT, rt: runtime.Runtime) -> str:
    """train.batch_size_auto: the global batch (batch_size x grad_accum_steps sequences) stays;
    the micro-batch becomes its largest divisor whose training step fits in device memory, and
    grad_accum_steps makes up the rest. Updates cfg.train; returns the banner value.

    The trial steps run the uncompiled model (compiling every candidate would take minutes);
    compiled code keeps fewer activations, so a size that fits eagerly fits compiled.
    """
    t = cfg.train
    plain = f"{t.batch_size}x{t.grad_accum_steps}"
    if not t.batch_size_auto:
        return plain
    if rt.device.type != "cuda":
        return f"{plain} (batch_size_auto needs CUDA: kept)"
    global_batch = t.batch_size * t.grad_accum_steps
    free, _ = torch.cuda.mem_get_info(rt.device)
    budget = int(MEMORY_HEADROOM * (free + torch.cuda.memory_reserved(rt.device)))
    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=[rt.device]):  # dropout in the trials leaves no trace
        split = split_global_batch(global_batch, lambda b: _fits(model, rt, b, budget))
    model.train(was_training)
    if split is None:
        raise runtime.SetupError(
            f"batch_size_auto: not even a micro-batch of 1 sequence of {cfg.model.block_size} "
            f"tokens fits in {budget / 2**30:.1f} GiB; use a smaller model or block_size, "
            "--dtype=bfloat16, or --attention=sdpa")
    t.batch_size, t.grad_accum_steps = split
    return f"{t.batch_size}x{t.grad_accum_steps} (auto, of {global_batch} per step)"


def split_global_batch(global_batch: int, fits: Callable[[int], bool]) -> tuple[int, int] | None:
    """(micro_batch, grad_accum_steps) with the largest fitting micro-batch that divides the
    global batch, so micro_batch * grad_accum_steps == global_batch exactly."""
    micro = largest_fitting(divisors(global_batch), fits)
    return None if micro is None else (micro, global_batch // micro)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level stderr (the profiler's start/stop chatter) for a moment."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def attention_kernels(run: Callable[[], object]) -> list[str]:
    """Run `run` under the profiler and name every SDPA kernel it dispatched to; [] when none."""
    prof = profile(activities=[ProfilerActivity.CPU])  # aten calls are recorded on the host
    with _quiet_stderr():
        prof.start()
    try:
        run()
    finally:
        with _quiet_stderr():
            prof.stop()
    seen = {SDPA_KERNELS[e.name] for e in prof.events() if e.name in SDPA_KERNELS}
    return sorted(seen)


def probe_attention(model: GPT, rt: runtime.Runtime, micro_batch: int) -> list[str]:
    """The SDPA kernels the first attention layer runs, forward and backward, at the training
    shape and precision (one layer: cheap, and every layer dispatches alike)."""
    cfg = model.config
    if cfg.attention != "sdpa":
        return []
    attn = model.transformer.h[0].attn

    def run():
        x = torch.randn(micro_batch, cfg.block_size, cfg.n_embd, device=rt.device,
                        requires_grad=True)  # (B, T, C)
        with rt.autocast():
            y = attn(x)
        y.float().sum().backward()

    # the probe draws random numbers: training's random stream must not notice
    with torch.random.fork_rng(devices=[rt.device] if rt.device.type == "cuda" else []):
        kernels = attention_kernels(run)
    model.zero_grad(set_to_none=True)
    return kernels


def settings(cfg: Config, rt: runtime.Runtime, fused_note: str, compile_note: str,
             batch_note: str, kernels: list[str] | None = None) -> dict[str, str]:
    """What each speedup flag became on this device, in the order the README lists them."""
    m, d = cfg.model, cfg.data
    pin = "on" if d.pin_memory and rt.device.type == "cuda" else (
        "off (needs CUDA)" if d.pin_memory else "off")
    attention = m.attention + (f" [{', '.join(kernels)}]" if kernels else "")
    padded = -(-m.vocab_size // m.vocab_pad_multiple) * m.vocab_pad_multiple
    vocab = f"{m.vocab_size}->{padded}" if padded != m.vocab_size else f"{m.vocab_size}"
    return {"device": str(rt.device), "causal_mask": m.causal_mask,
            "tf32": "on" if rt.tf32 else "off", "fused_adamw": fused_note, "pin_memory": pin,
            "dtype": cfg.system.dtype, "norm": m.norm, "gelu": m.gelu, "attention": attention,
            "compile": compile_note, "vocab": vocab, "batch": batch_note}


def banner(values: dict[str, str], notes: list[str]) -> str:
    tail = f"  [{'; '.join(notes)}]" if notes else ""
    return "speedups: " + " ".join(f"{k}={v}" for k, v in values.items()) + tail


def effective(values: dict[str, str]) -> dict[str, str]:
    """The settings without their explanations ('off (needs CUDA)' -> 'off'), to tell whether a
    flag changed anything on this device."""
    return {k: v.split(" (")[0].split(" [")[0] for k, v in values.items()}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # resets VmHWM (peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak bytes since the last reset: CUDA allocated/reserved, else the process's peak RSS."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"rss": int(line.split()[1]) * 1024}
    try:
        import resource
    except ImportError:  # Windows: no peak RSS without extra packages
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss": peak if sys.platform == "darwin" else peak * 1024}
