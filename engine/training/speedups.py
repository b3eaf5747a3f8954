"""The speedups and memory strategies applied to a built model, in one ordered place (as
torchtitan's parallelize), and the start-up banner that says what each became on this device.

    model, notes = speedups.apply(raw_model, cfg, rt, dist)   # then make the optimizer

apply() runs, in order:  (flag -> function; a module of its own is loaded only when asked for)
    1. train.tokens_per_step       -> set_global_batch (grad_accum_steps from the token budget)
    2. train.batch_size_auto       -> auto_batch.auto_micro_batch (the largest that fits)
    3. system.weights_dtype        -> master_weights.hold_weights (bf16, float32 masters)
    4. model.attention=sdpa        -> probe_attention (the kernel that runs, for the banner)
    5. system.parallel             -> parallel.wrap (DDP or FSDP2), with several processes
    6. system.compile/compile_mode -> compiling.compile_model, then warm_up (every shape first)
raw_model stays the plain GPT (saving, eval, sampling); FSDP replaces its parameters, so the
optimizer is made after apply(). Other flags act where read: model.py (attention, norm,
activation, activation_checkpointing, loss, ...), device.setup (dtype, TF32), optim.py (fused
AdamW), data/loader.py (pin_memory, prefetch), build.py (loader_workers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from config import Config, ConfigError, TrainConfig, speedup_flags
from engine.device import Runtime, SetupError, kernel_overrides, machine_line
from engine.fields import departures
from engine.training.processes import Dist
from model import GPT

SDPA_KERNELS = {  # aten op -> the kernel's name
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (device plugin)",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math (mps)",
}


@dataclass
class Notes:
    """What each technique became on this device (banner values), and start-up notes."""

    batch: str = ""
    weights: str = "float32"
    kernels: list[str] = field(default_factory=list)
    compile: str = "off"
    compile_s: float = 0.0  # the compile warm-up's seconds
    fused_adamw: str = "off"
    global_batch: str = ""  # sequences and tokens per step, and how they split
    lines: list[str] = field(default_factory=list)  # printed as `note: ...` (resume)


def apply(raw_model: GPT, cfg: Config, rt: Runtime, dist: Dist,
          evaluates: bool = True) -> tuple[torch.nn.Module, Notes]:
    t, model = cfg.train, raw_model
    accumulation = set_global_batch(t, cfg.model.block_size, dist.world_size)
    notes = Notes(batch=f"{t.batch_size}x{t.grad_accum_steps}")
    if t.batch_size_auto:  # may change the micro-batch
        from engine.training.auto_batch import auto_micro_batch

        notes.batch = auto_micro_batch(cfg, raw_model, rt, dist)
    notes.global_batch = global_batch_line(t.batch_size, t.grad_accum_steps, cfg.model.block_size,
                                           dist.world_size, accumulation)
    if cfg.system.weights_dtype == "bfloat16":  # bf16 weights, float32 masters
        from engine.training.master_weights import hold_weights

        notes.weights = hold_weights(raw_model, cfg.system.parallel, dist.world_size)
    notes.kernels = probe_attention(raw_model, rt, t.batch_size)  # before FSDP shards it
    if dist.enabled:
        from engine.training.parallel import wrap

        model = wrap(raw_model, cfg, rt, dist)
    if cfg.system.compile:  # every shape compiled now: no recompiles (or stalls) later
        from engine import compiling

        model, notes.compile = compiling.compile_model(model, cfg.system, rt)
        notes.compile_s = compiling.warm_up_training(model, raw_model, rt, t.batch_size,
                                                     evaluates, dist.is_main)
    return model, notes


def set_global_batch(t: TrainConfig, block_size: int, world_size: int) -> str:
    """train.tokens_per_step: grad_accum_steps = tokens_per_step / (batch_size x block_size x
    world_size), the same batch on any number of GPUs. Returns a note when it changed."""
    if not t.tokens_per_step:
        return ""
    per_micro_step = t.batch_size * block_size * world_size
    accum, left = divmod(t.tokens_per_step, per_micro_step)
    if left or accum == 0:
        fits = [b for b in range(1, t.batch_size + 1)
                if t.tokens_per_step % (b * block_size * world_size) == 0]
        fix = (f"use --batch_size={max(fits)}" if fits else
               f"no batch_size fits {world_size} processes: change the number of processes")
        raise ConfigError(
            f"tokens_per_step={t.tokens_per_step:,} is not a multiple of batch_size x block_size "
            f"x processes = {t.batch_size} x {block_size} x {world_size} = {per_micro_step:,}; "
            f"{fix}, or another tokens_per_step (or 0, to use grad_accum_steps as it is)")
    note = "" if accum == t.grad_accum_steps else (
        f"grad_accum_steps {t.grad_accum_steps} -> {accum} for tokens_per_step="
        f"{t.tokens_per_step:,} on {world_size} process{'es' if world_size > 1 else ''}")
    t.grad_accum_steps = accum
    return note


def global_batch_line(micro_batch: int, accum: int, block_size: int, world_size: int,
                      note: str) -> str:
    sequences = micro_batch * accum * world_size
    return (f"global batch: {sequences} sequences = {sequences * block_size:,} tokens per step "
            f"({micro_batch} micro-batch x {accum} accumulation x {world_size} "
            f"process{'es' if world_size > 1 else ''})" + (f"  [{note}]" if note else ""))


class _OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched under it (below autograd and autocast, so
    forward and backward kernels alike); about free, where torch.profiler's first start
    imports torch._dynamo, seconds of a run's start-up."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()


def _record_op(self: _OpNames, func, types, args=(), kwargs=None):
    self.names.add(func._schema.name)
    return func(*args, **(kwargs or {}))


# set after the class is made: a __torch_dispatch__ in the class body gets wrapped in torch's
# lazy torch._dynamo import, which alone would cost every run a second or so of start-up
_OpNames.__torch_dispatch__ = _record_op


def attention_kernels(run: Callable[[], object]) -> list[str]:
    """Run eager code and name every SDPA kernel it dispatched to ([] when none). Compiled code
    calls its kernels from generated code, out of a dispatch mode's sight: bench.py reads those
    under torch.profiler (engine/benchmarks/measure.py)."""
    with _OpNames() as ops:
        run()
    return sorted({SDPA_KERNELS[name] for name in ops.names if name in SDPA_KERNELS})


def probe_attention(model: GPT, rt: Runtime, micro_batch: int) -> list[str]:
    """The SDPA kernels the first attention layer runs (forward and backward) at the training
    shape and precision; every layer dispatches alike."""
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

    with torch.random.fork_rng(devices=[rt.device] if rt.device.type == "cuda" else []):
        try:
            kernels = attention_kernels(run)
        except RuntimeError as e:  # torch's kernel cannot run this shape or precision here
            raise SetupError(sdpa_failure(e, rt)) from None
    model.zero_grad(set_to_none=True)
    return kernels


def sdpa_failure(e: RuntimeError, rt: Runtime) -> str:
    """What to say when torch's attention kernel fails at the training shape (the case seen on
    a CPU with AMX, under a narrowed ATEN_CPU_CAPABILITY: docs/speedups.md)."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    hint, capability = "", kernel_overrides().get("ATEN_CPU_CAPABILITY")
    if rt.device.type == "cpu" and capability:
        hint = (f"; ATEN_CPU_CAPABILITY={capability} narrows torch's kernels below what its "
                "attention code expects of this CPU: unset it")
    return (f"--attention=sdpa: torch's attention kernel failed at the training shape in "
            f"{str(rt.dtype).removeprefix('torch.')} ({first}){hint}, or use "
            "--attention=scratch")


# the banner's value of a speedup field that says more than the value it was set to: what it
# became on this device (config, runtime, notes) -> text; any other field shows its value
SHOWN = {
    "attention": lambda c, rt, n: c.model.attention + (f" [{', '.join(n.kernels)}]"
                                                      if n.kernels else ""),
    "vocab_pad_multiple": lambda c, rt, n: padded_vocab(c.model),
    "pin_memory": lambda c, rt, n: ("on" if rt.device.type == "cuda" else "off (needs CUDA)")
    if c.data.pin_memory else "off",
    "fused_adamw": lambda c, rt, n: n.fused_adamw,
    "tf32": lambda c, rt, n: "on" if rt.tf32 else "off",
    "compile": lambda c, rt, n: n.compile,
}


def padded_vocab(m) -> str:
    """'64 (65->128)': the multiple, and the vocabulary it pads (1: '1')."""
    padded = -(-m.vocab_size // m.vocab_pad_multiple) * m.vocab_pad_multiple
    return f"{m.vocab_pad_multiple}" + (f" ({m.vocab_size}->{padded})"
                                        if padded != m.vocab_size else "")


def settings(cfg: Config, rt: Runtime, notes: Notes) -> dict[str, str]:
    """What each speedup became on this device: the device, then every field stating a fast
    value, in config.py's order (SHOWN, or its value), then the micro-batch and the recipe."""
    values = {"device": str(rt.device)}
    for flag in speedup_flags(cfg).values():
        for key in flag.keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            values[name] = SHOWN[name](cfg, rt, notes) if name in SHOWN else (
                ("on" if value else "off") if isinstance(value, bool) else str(value))
    return {**values, "batch": notes.batch, "recipe": recipe(cfg)}


def recipe(cfg: Config) -> str:
    """The departures from GPT-2 on ('gpt2' when none), the model's and the schedule's."""
    return ",".join(departures(cfg.model) + departures(cfg.train)) or "gpt2"


def banner(values: dict[str, str], notes: list[str]) -> str:
    """'machine: CPU ..., ISA AVX2, bf16 emulated ..., 2 threads' then 'speedups: k=v ...'."""
    tail = f"  [{'; '.join(notes)}]" if notes else ""
    machine = machine_line(torch.device(values.get("device", "cpu")))
    return (f"machine: {machine}\nspeedups: " + " ".join(f"{k}={v}" for k, v in values.items())
            + tail)


def effective(values: dict[str, str]) -> dict[str, str]:
    """The settings without their explanations ('off (needs CUDA)' -> 'off')."""
    return {k: v.split(" (")[0].split(" [")[0] for k, v in values.items()}
