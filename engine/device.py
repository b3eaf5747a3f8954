"""The device a process runs on, set up the same way by every script: the device, seeds, threads
and precision (autocast, TF32, dtype=auto); what the machine is (CPU model, vector ISA, native
bf16). What a training run will cost on it: engine/training/metrics.py.

    rt = setup(cfg.system)          # rt.device, rt.dtype; `with rt.autocast(): ...`
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from config import SystemConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SetupError(RuntimeError):
    """A system setting this machine cannot honour."""


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype
    tf32: bool
    notes: list[str]  # what was not honoured, for the banner

    def autocast(self):  # a no-op in float32
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SetupError(f"--device={name!r} is not a device; use auto, cpu, cuda, cuda:N "
                         "or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"--device={name} but CUDA is not available here; use --device=cpu "
                         "or --device=auto")
    if device.type == "cuda" and device.index is not None and \
            device.index >= torch.cuda.device_count():
        raise SetupError(f"--device={name} but only {torch.cuda.device_count()} CUDA "
                         "device(s) exist")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SetupError("--device=mps but MPS is not available here; use --device=cpu")
    return device


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    return info


def cpu_bf16_units() -> list[str]:
    """The CPU's native bf16 matmul units that oneDNN may use: AMX and/or AVX-512-BF16 ([]: bf16
    is emulated; also where ONEDNN_MAX_CPU_ISA caps oneDNN below them)."""
    flags = set(cpu_info().get("flags", "").split())
    units = [name for name, has, isa in (
        ("AMX", "amx_bf16" in flags or torch.cpu._is_amx_tile_supported(), "AVX512_CORE_AMX"),
        ("AVX512-BF16", "avx512_bf16" in flags or torch.cpu._is_avx512_bf16_supported(),
         "AVX512_CORE_BF16")) if has and onednn_allows(isa)]
    return units


# oneDNN's ISAs in order (ONEDNN_MAX_CPU_ISA caps which it may use)
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
               "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
               "AVX512_CORE_AMX_FP16")


def onednn_allows(isa: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (unset: no cap) lets oneDNN use `isa`."""
    cap = kernel_overrides().get("ONEDNN_MAX_CPU_ISA", "").upper()
    return cap not in ONEDNN_ISAS or ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


# environment variables that narrow the CPU kernels torch, oneDNN and MKL choose
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def kernel_overrides() -> dict[str, str]:
    """Those of KERNEL_ENV that are set ({} on a machine left to choose for itself)."""
    return {name: os.environ[name] for name in KERNEL_ENV if os.environ.get(name)}


def cpu_has_native_bf16() -> bool:
    return bool(cpu_bf16_units())


def cpu_model() -> str:
    """'AMD EPYC (family 25)', 'Intel(R) Xeon(R) Platinum 8480+ (family 6)'."""
    info = cpu_info()
    name = info.get("model name") or platform.processor() or platform.machine()
    return name + (f" (family {info['cpu family']})" if "cpu family" in info else "")


def machine_line(device: torch.device) -> str:
    """What this process runs on, for banners and benchmark headers: the CPU, the vector ISA
    torch's kernels dispatch to, whether bf16 is native, the threads (and the GPU, if used)."""
    threads = torch.get_num_threads()
    units = cpu_bf16_units()
    bf16 = f"bf16 native ({', '.join(units)})" if units else \
        "bf16 emulated (no AMX / AVX512-BF16)"
    line = (f"CPU {cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, {bf16}, "
            f"{threads} thread{'s' if threads > 1 else ''} of {os.cpu_count()} CPUs")
    if overrides := kernel_overrides():
        line += " (kernels narrowed: " + " ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        native = props.major >= 8
        line = (f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, compute "
                f"{props.major}.{props.minor}, bf16 {'native' if native else 'not native'}) | "
                + line)
    return line


def resolve_dtype(name: str, device: torch.device) -> tuple[str, str]:
    """system.dtype -> (the dtype to use, why; '' unless it was auto). auto: bfloat16 where the
    hardware runs it natively (CUDA compute >= 8.0, a CPU with AMX or AVX512-BF16), else
    float32 (never float16: its loss scaling is a choice to make, not a default)."""
    if name != "auto":
        return name, ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if torch.cuda.is_bf16_supported() and major >= 8:
            return "bfloat16", f"dtype=auto: bfloat16 (compute {major}.{minor} runs it natively)"
        return "float32", (f"dtype=auto: float32 (compute {major}.{minor}: bf16 needs 8.0, "
                           "Ampere, or newer)")
    if device.type == "cpu":
        if units := cpu_bf16_units():
            return "bfloat16", f"dtype=auto: bfloat16 (native on this CPU: {', '.join(units)})"
        return "float32", (f"dtype=auto: float32 (this CPU's ISA is "
                           f"{torch.backends.cpu.get_cpu_capability()}: no AMX / AVX512-BF16, "
                           "bf16 would be emulated)")
    return "float32", f"dtype=auto: float32 (bf16 is not known to be fast on {device.type})"


def setup(system: SystemConfig, device: str = "") -> Runtime:
    """Device (`device`: a distributed rank's own, else system.device), seeds, threads, dtype."""
    device = resolve_device(device or system.device)
    notes: list[str] = []
    if system.threads:
        torch.set_num_threads(system.threads)
    random.seed(system.seed)
    np.random.seed(system.seed)
    torch.manual_seed(system.seed)  # also seeds every CUDA device
    system.dtype, why = resolve_dtype(system.dtype, device)  # what a checkpoint then stores
    if why:
        notes.append(why)
    dtype = DTYPES[system.dtype]
    if dtype == torch.bfloat16:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise SetupError(f"--dtype=bfloat16 is not supported by "
                                f"{torch.cuda.get_device_name(device)}; use --dtype=float16")
        if device.type == "cpu" and not cpu_has_native_bf16():
            warnings.warn("this CPU has no native bfloat16: bfloat16 matmuls are emulated and "
                          "much slower than float32 here; --dtype=float32 is faster on it")
            notes.append("bf16 emulated on this CPU")
    tf32 = system.tf32
    if tf32 and device.type != "cuda":
        notes.append("tf32 needs CUDA: off")
        tf32 = False
    elif tf32 and torch.cuda.get_device_capability(device) < (8, 0):
        notes.append(f"tf32 needs an Ampere or newer GPU, not {torch.cuda.get_device_name(device)}"
                     ": off")
        tf32 = False
    if device.type == "cuda":
        # the reference path keeps full float32 matmuls: TF32 only when asked for
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return Runtime(device=device, dtype=dtype, tf32=tf32, notes=notes)


def format_bytes(n: int) -> str:
    """'12.3 MiB', '1.50 GiB'."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def release_cached(device: torch.device, enabled: bool) -> bool:
    """system.empty_cache: hand cached CUDA blocks back, between phases only (inside a step it
    would only force new cudaMallocs). Returns whether it ran."""
    if not enabled or device.type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True
