"""The techniques applied to a built model, in one ordered place (as torchtitan's parallelize).

    model, notes = techniques.apply(raw_model, cfg, rt, dist)   # then make the optimizer

apply() runs, in order:  (flag -> function)
    1. train.tokens_per_step       -> set_global_batch (grad_accum_steps from the token budget)
    2. train.batch_size_auto       -> auto_micro_batch (the largest micro-batch that fits)
    3. system.weights_dtype        -> hold_weights (float32 masters: optim.MasterWeights)
    4. model.activation_checkpointing is read in model.Block (model.checkpoint_plan)
    5. model.attention=sdpa        -> probe_attention (the kernel that runs, for the banner)
    6. system.parallel             -> wrap (DDP or FSDP2 shard) and grad_sync
    7. system.compile/compile_mode -> compile_model, then warm_up (every shape before step 1)
raw_model stays the plain GPT (saving, eval, sampling); FSDP replaces its parameters, so the
optimizer is made after apply(). Other flags act where read: model.py, runtime.setup (dtype,
TF32), optim.make_optimizer (fused AdamW), data/loader.py, memory.release_cached.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import inspect
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from config import Config, ConfigError, SystemConfig, TrainConfig
from engine import runtime
from engine.distributed import Dist
from model import GPT, departures, padded_vocab_size

# share of free CUDA memory a trial step may reserve: room for fragmentation, eval, autotuning
MEMORY_HEADROOM = 0.90

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
    fused_adamw: str = "off"
    global_batch: str = ""  # sequences and tokens per step, and how they split
    lines: list[str] = field(default_factory=list)  # printed as `note: ...` (resume)


def apply(raw_model: GPT, cfg: Config, rt: runtime.Runtime,
          dist: Dist) -> tuple[torch.nn.Module, Notes]:
    t = cfg.train
    accumulation = set_global_batch(t, cfg.model.block_size, dist.world_size)
    notes = Notes(batch=auto_micro_batch(cfg, raw_model, rt, dist))  # may change the micro-batch
    notes.global_batch = global_batch_line(t.batch_size, t.grad_accum_steps, cfg.model.block_size,
                                           dist.world_size, accumulation)
    notes.weights = hold_weights(raw_model, cfg.system.weights_dtype, cfg.system.parallel,
                                 dist.world_size)
    notes.kernels = probe_attention(raw_model, rt, t.batch_size)  # before FSDP shards it
    model = wrap(raw_model, cfg, rt, dist)
    model, notes.compile = compile_model(model, cfg.system, rt)
    if cfg.system.compile:  # every shape compiled now: no recompiles (or stalls) later
        if dist.is_main:
            print(f"compiling: torch.compile warms up the {t.batch_size}x{cfg.model.block_size} "
                  f"training and eval steps before step 1 ({compile_kernels(rt.device)}); "
                  "this can take minutes ...", flush=True)
        warm_up(model, raw_model, rt, t.batch_size)
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


def split_global_batch(global_batch: int, fits: Callable[[int], bool]) -> tuple[int, int] | None:
    """(micro_batch, grad_accum_steps) for the largest divisor of the global batch that fits
    (binary search: below a fitting size all fit); None if 1 does not."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    lo, hi = -1, len(divisors)  # divisors[lo] fits, divisors[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(divisors[mid]) else (lo, mid)
    return (divisors[lo], global_batch // divisors[lo]) if lo >= 0 else None


def _trial_step(model: GPT, rt: runtime.Runtime, micro_batch: int) -> None:
    """One forward+backward at this micro-batch, with AdamW's two moments per parameter held."""
    moments = [torch.empty_like(p) for p in model.parameters() for _ in range(2)]  # noqa: F841
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), device=rt.device)
    with rt.autocast():
        _, loss = model(idx, idx)
    loss.backward()
    torch.cuda.synchronize(rt.device)


def _fits(model: GPT, rt: runtime.Runtime, micro_batch: int, budget: int) -> bool:
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


def auto_micro_batch(cfg: Config, model: GPT, rt: runtime.Runtime, dist: Dist | None = None) -> str:
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
        raise runtime.SetupError(
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


def hold_weights(model: torch.nn.Module, weights_dtype: str, parallel: str,
                 world_size: int) -> str:
    """system.weights_dtype=bfloat16: weights (and gradients) cast to bf16 in place."""
    if weights_dtype == "float32":
        return "float32"
    if parallel == "fsdp" and world_size > 1:
        raise ConfigError("--weights_dtype=bfloat16 with --parallel=fsdp: FSDP2 keeps float32 "
                          "shards and computes in bf16 itself; use --weights_dtype=float32 "
                          "--dtype=bfloat16")
    model.to(torch.bfloat16)
    return "bfloat16 (float32 master weights + AdamW state)"


class _OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched under it (below autograd and autocast, so
    forward and backward kernels alike); about free, where torch.profiler's first start
    imports torch._dynamo (~3 s of a run's start-up)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()


def _record_op(self: _OpNames, func, types, args=(), kwargs=None):
    self.names.add(func._schema.name)
    return func(*args, **(kwargs or {}))


# set after the class is made: a __torch_dispatch__ in the class body gets wrapped in torch's
# lazy torch._dynamo import, which alone would cost ~1.2 s of every run's start-up
_OpNames.__torch_dispatch__ = _record_op


def attention_kernels(run: Callable[[], object], eager: bool = False) -> list[str]:
    """Run `run` and name every SDPA kernel it dispatched to; [] when none. eager: `run` is
    eager code, whose ops a dispatch mode sees at no cost; otherwise (compiled code) under
    torch.profiler, whose first start costs ~3 s."""
    if eager:
        with _OpNames() as ops:
            run()
        names = ops.names
    else:
        prof = profile(activities=[ProfilerActivity.CPU])  # aten calls are recorded on the host
        with _quiet_stderr():
            prof.start()
        try:
            run()
        finally:
            with _quiet_stderr():
                prof.stop()
        names = {e.name for e in prof.events()}
    return sorted({SDPA_KERNELS[name] for name in names if name in SDPA_KERNELS})


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level stderr (the profiler's chatter)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def probe_attention(model: GPT, rt: runtime.Runtime, micro_batch: int) -> list[str]:
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
            kernels = attention_kernels(run, eager=True)
        except RuntimeError as e:  # torch's kernel cannot run this shape or precision here
            raise runtime.SetupError(sdpa_failure(e, rt)) from None
    model.zero_grad(set_to_none=True)
    return kernels


def sdpa_failure(e: RuntimeError, rt: runtime.Runtime) -> str:
    """What to say when torch's attention kernel fails at the training shape. One case seen:
    on a CPU with AMX, torch 2.13's CPU Flash kernel takes its AMX path where oneDNN may use
    AMX, but that code is built only into its AVX-512 kernels, so under ATEN_CPU_CAPABILITY=avx2
    or default a bf16 step raises 'pack_vnni2 is only supported when avx512 is supported'."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    hint, capability = "", runtime.kernel_overrides().get("ATEN_CPU_CAPABILITY")
    if rt.device.type == "cpu" and capability:
        hint = (f"; ATEN_CPU_CAPABILITY={capability} narrows torch's kernels below what its "
                "attention code expects of this CPU: unset it")
    return (f"--attention=sdpa: torch's attention kernel failed at the training shape in "
            f"{str(rt.dtype).removeprefix('torch.')} ({first}){hint}, or use "
            "--attention=scratch")


def compile_kernels(device: torch.device) -> str:
    """What TorchInductor generates here: Triton on CUDA; on CPU, C++ vectorized for the ISA
    its own check picks (AVX2, AVX512, ...; none: scalar C++)."""
    if device.type != "cpu":
        return "Triton kernels" if device.type == "cuda" else f"inductor on {device.type}"
    try:
        from torch._inductor import cpu_vec_isa
        isa = cpu_vec_isa.pick_vec_isa()  # falsy where none is usable
        isa = str(isa).upper() if isa else "none (scalar)"
    except Exception:  # noqa: BLE001 - a private module: only the note is lost
        isa = "unknown"
    return f"inductor C++ kernels, vectorized for {isa}"


def inductor_cache_per_isa() -> str:
    """On CPU, TorchInductor's caches go in one folder per vector ISA (its default folder +
    /isa_avx2, /isa_avx512_avx512_vnni_amx_tile, /isa_scalar) unless TORCHINDUCTOR_CACHE_DIR
    names another -> the folder. torch 2.13's FX graph cache does not key on the ISA that
    ATEN_CPU_CAPABILITY selects: here a graph cached under avx512 crashed the run (SIGSEGV)
    when reused under avx2, and failed to build under default."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != default_cache_dir():  # the user's (or ours, set)
        return chosen
    isa = cpu_vec_isa.pick_vec_isa()  # InvalidVecISA where none: scalar C++
    # by its type, not its truth: an ISA object is falsy where this CPU lacks it
    scalar = isinstance(isa, cpu_vec_isa.InvalidVecISA)
    isa = "scalar" if scalar else "_".join(str(isa).split())  # 'avx512 avx512_vnni amx_tile'
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"isa_{isa}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def wrap(model: GPT, cfg: Config, rt: runtime.Runtime, dist: Dist) -> torch.nn.Module:
    """system.parallel: DDP around the model, or FSDP2 sharding it in place; else the model."""
    if dist.parallel == "none":
        return model
    if dist.parallel == "fsdp":
        return shard(model, cfg.system, rt)
    from torch.nn.parallel import DistributedDataParallel as DDP

    # the only buffer is the constant causal mask: nothing to broadcast each forward
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(model, device_ids=ids, **no_buffer_sync)


def shard(model: GPT, system: SystemConfig, rt: runtime.Runtime) -> GPT:
    """FSDP2: each block its own unit, the rest (embeddings, final norm, head) the root."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise runtime.SetupError(f"--parallel=fsdp needs torch >= 2.6 (FSDP2 fully_shard); this "
                                 f"is torch {torch.__version__}: upgrade it or use "
                                 "--parallel=ddp") from None
    # bf16 weights gathered for compute (half the traffic), gradients reduced in float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rt.dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=system.fsdp_reshard, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # the logits are a view of the padded head's output, never modified in place: harmless
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    return model


def grad_sync(model: torch.nn.Module) -> Callable[[bool], contextlib.AbstractContextManager] | None:
    """For train_step: gradients all-reduced on the last micro-step only (DDP no_sync, FSDP2
    set_requires_gradient_sync). None with one process."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2
        return lambda last: inner.set_requires_gradient_sync(last) or contextlib.nullcontext()
    if hasattr(inner, "no_sync"):  # DDP
        return lambda last: contextlib.nullcontext() if last else inner.no_sync()
    return None


def compile_model(model: torch.nn.Module, system: SystemConfig,
                  rt: runtime.Runtime) -> tuple[torch.nn.Module, str]:
    """system.compile: (torch.compile(model), banner value). Checks for what TorchInductor needs
    up front, not at the first step deep in a compiler traceback."""
    if not system.compile:
        return model, "off"
    device = rt.device.type
    if device == "cpu" and not (os.environ.get("CXX") or any(
            shutil.which(c) for c in ("g++", "c++", "clang++"))):
        raise runtime.SetupError("--compile=true on CPU needs a C++ compiler for TorchInductor "
                                 "and none was found (g++, c++, clang++ or $CXX); install one "
                                 "(e.g. apt install g++) or use --compile=false")
    if device == "cuda" and importlib.util.find_spec("triton") is None:
        raise runtime.SetupError("--compile=true on CUDA needs Triton, which is not installed; "
                                 "pip install triton (it ships with the CUDA torch wheels) or "
                                 "use --compile=false")
    if device == "cpu":
        inductor_cache_per_isa()
    note = system.compile_mode
    if system.compile_mode == "reduce-overhead" and device != "cuda":
        note += " (its CUDA graphs need CUDA: plain inductor here)"
    return torch.compile(model, mode=system.compile_mode), note


def warm_up(model: torch.nn.Module, raw_model: GPT, rt: runtime.Runtime, batch_size: int) -> None:
    """Compile the training forward+backward and the eval forward before step 1 (shapes never
    change after). Leaves no gradients, RNG draws or mode change behind."""
    cfg, device = raw_model.config, rt.device
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), device=device)
    was_training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        with rt.autocast():
            _, loss = model(idx, idx)
        loss.backward()
        model.eval()
        with torch.no_grad(), rt.autocast():
            model(idx, idx)
    model.train(was_training)
    raw_model.zero_grad(set_to_none=True)
    for module in raw_model.modules():  # FSDP2 keeps the root gathered after an eval forward:
        if callable(getattr(module, "reshard", None)):  # the optimizer must see the shards
            module.reshard()


def settings(cfg: Config, rt: runtime.Runtime, notes: Notes) -> dict[str, str]:
    """What each speedup flag became on this device, in the order the README lists them."""
    m, d = cfg.model, cfg.data
    pin = "on" if d.pin_memory and rt.device.type == "cuda" else (
        "off (needs CUDA)" if d.pin_memory else "off")
    attention = m.attention + (f" [{', '.join(notes.kernels)}]" if notes.kernels else "")
    padded = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple)
    vocab = f"{m.vocab_size}->{padded}" if padded != m.vocab_size else f"{m.vocab_size}"
    return {"device": str(rt.device), "causal_mask": m.causal_mask,
            "tf32": "on" if rt.tf32 else "off", "fused_adamw": notes.fused_adamw,
            "pin_memory": pin, "dtype": cfg.system.dtype, "norm": m.norm,
            "activation": f"{m.activation}/{m.activation_impl}",
            "attention": attention, "compile": notes.compile, "vocab": vocab,
            "loss": m.loss, "optimizer": cfg.train.optimizer, "batch": notes.batch,
            "recipe": recipe(cfg)}


def recipe(cfg: Config) -> str:
    """The speedrun techniques on ('gpt2' when none): the model's, the schedule, Muon's warmup."""
    t = cfg.train
    on = departures(cfg.model) + [f"lr_schedule={t.lr_schedule}"] * (t.lr_schedule == "wsd")
    on += [f"muon_momentum_warmup={t.muon_momentum_warmup}"] * (
        t.optimizer == "muon" and t.muon_momentum_warmup > 0)
    return ",".join(on) or "gpt2"


def banner(values: dict[str, str], notes: list[str]) -> str:
    """'machine: CPU ..., ISA AVX2, bf16 emulated ..., 2 threads' then 'speedups: k=v ...'."""
    tail = f"  [{'; '.join(notes)}]" if notes else ""
    machine = runtime.machine_line(torch.device(values.get("device", "cpu")))
    return (f"machine: {machine}\nspeedups: " + " ".join(f"{k}={v}" for k, v in values.items())
            + tail)


def effective(values: dict[str, str]) -> dict[str, str]:
    """The settings without their explanations ('off (needs CUDA)' -> 'off')."""
    return {k: v.split(" (")[0].split(" [")[0] for k, v in values.items()}
