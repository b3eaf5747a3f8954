"""Runtime setup shared by every script: device, seeds, threads, precision (autocast, TF32),
and the device's peak FLOP/s for MFU."""
from __future__ import annotations

import contextlib
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from config import SystemConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# dense datasheet peaks (bf16/fp16, tf32, fp32), by substring of the device name; first wins
PEAK_FLOPS = [
    ("H200", (989e12, 494e12, 67e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100", (989e12, 494e12, 67e12)),
    ("A100", (312e12, 156e12, 19.5e12)),
    ("A10G", (125e12, 62.5e12, 31.2e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30e12)),
    ("RTX 4090", (165e12, 82.6e12, 82.6e12)),
    ("RTX 3090", (71e12, 35.6e12, 35.6e12)),
    ("V100", (125e12, 15.7e12, 15.7e12)),
    ("T4", (65e12, 8.1e12, 8.1e12)),
]


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


def cpu_has_native_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def setup(system: SystemConfig, device: str = "") -> Runtime:
    """Device (`device`: a distributed rank's own, else system.device), seeds, threads, dtype."""
    device = resolve_device(device or system.device)
    notes: list[str] = []
    if system.threads:
        torch.set_num_threads(system.threads)
    random.seed(system.seed)
    np.random.seed(system.seed)
    torch.manual_seed(system.seed)  # also seeds every CUDA device
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


def peak_flops(rt: Runtime, override: float = 0.0) -> float:
    """Peak FLOP/s at the precision in use; 0 when unknown (no MFU)."""
    if override:
        return override
    if rt.device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(rt.device)
    for key, (half, tf32, fp32) in PEAK_FLOPS:
        if key in name:
            return half if rt.dtype != torch.float32 else tf32 if rt.tf32 else fp32
    return 0.0
