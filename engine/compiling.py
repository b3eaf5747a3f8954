"""system.compile: torch.compile for training (compiled, then every shape warmed up before step 1)
and for decoding (generate.py, serve.py), with the checks TorchInductor needs made up front and
its caches kept apart per CPU vector ISA. Loaded only when compile is on.

    model, note = compile_model(model, cfg.system, rt)
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import time

import torch

from config import SystemConfig
from engine.device import Runtime, SetupError


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


def compile_model(model: torch.nn.Module, system: SystemConfig,
                  rt: Runtime) -> tuple[torch.nn.Module, str]:
    """system.compile: (torch.compile(model), banner value). Checks for what TorchInductor needs
    up front, not at the first step deep in a compiler traceback."""
    if not system.compile:
        return model, "off"
    device = rt.device.type
    if device == "cpu" and not (os.environ.get("CXX") or any(
            shutil.which(c) for c in ("g++", "c++", "clang++"))):
        raise SetupError("--compile=true on CPU needs a C++ compiler for TorchInductor "
                                 "and none was found (g++, c++, clang++ or $CXX); install one "
                                 "(e.g. apt install g++) or use --compile=false")
    if device == "cuda" and importlib.util.find_spec("triton") is None:
        raise SetupError("--compile=true on CUDA needs Triton, which is not installed; "
                                 "pip install triton (it ships with the CUDA torch wheels) or "
                                 "use --compile=false")
    if device == "cpu":
        inductor_cache_per_isa()
    note = system.compile_mode
    if system.compile_mode == "reduce-overhead" and device != "cuda":
        note += " (its CUDA graphs need CUDA: plain inductor here)"
    return torch.compile(model, mode=system.compile_mode), note


def warm_up_training(model: torch.nn.Module, raw_model: torch.nn.Module, rt: Runtime,
                     batch_size: int, evaluates: bool, says: bool) -> float:
    """warm_up, said before and after (says: the main process) -> its seconds."""
    steps = "training and eval steps" if evaluates else "training step"
    if says:
        print(f"compiling: torch.compile warms up the {batch_size}x{raw_model.config.block_size} "
              f"{steps} before step 1 ({compile_kernels(rt.device)}); this can take minutes ...",
              flush=True)
    start = time.perf_counter()
    warm_up(model, raw_model, rt, batch_size, evaluates)
    seconds = time.perf_counter() - start
    if says:
        print(f"compiled: the {steps} in {seconds:.1f} s", flush=True)
    return seconds


def warm_up(model: torch.nn.Module, raw_model: torch.nn.Module, rt: Runtime,
            batch_size: int, evaluates: bool = True) -> None:
    """Compile the training forward+backward and (evaluates) the eval forward before step 1
    (shapes never change after). Leaves no gradients, RNG draws or mode change behind."""
    cfg, device = raw_model.config, rt.device
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), device=device)
    # as the loader hands them: views into (B, T+1) rows (compiled code is specialised on
    # strides: contiguous inputs here would compile step 1 again)
    rows = torch.cat([idx, idx[:, :1]], dim=1)
    x, y = rows[:, :-1], rows[:, 1:]
    was_training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        with rt.autocast():
            _, loss = model(x, y)
        loss.backward()
        model.eval()
        if evaluates:
            with torch.no_grad(), rt.autocast():
                model(x, y)
    model.train(was_training)
    raw_model.zero_grad(set_to_none=True)
    for module in raw_model.modules():  # FSDP2 keeps the root gathered after an eval forward:
        if callable(getattr(module, "reshard", None)):  # the optimizer must see the shards
            module.reshard()
