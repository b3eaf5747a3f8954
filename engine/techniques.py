"""The techniques applied to a built model, in one place (being assembled: see docs/layout.md).
"""
from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from config import SystemConfig
from engine import runtime


def compile_model(model: torch.nn.Module, system: SystemConfig,
                  rt: runtime.Runtime) -> tuple[torch.nn.Module, str]:
    """torch.compile the model when system.compile is on; returns (model, banner value).

    Checks up front for what TorchInductor needs (a C++ compiler on CPU, Triton on CUDA), because
    otherwise the failure only surfaces at the first step, deep in a compiler traceback.
    """
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
    note = system.compile_mode
    if "reduce-overhead" == system.compile_mode and device != "cuda":
        note += " (its CUDA graphs need CUDA: plain inductor here)"
    return torch.compile(model, mode=system.compile_mode), note
