"""Weight-only matrix products for CPU decoding (engine/inference/cpu_kernels.cpp): weights held as
float32, bfloat16, int8 (a scale per output) or int4 (a scale per output and group of inputs),
multiplied by float32 activations, built on first use with the system's C++ compiler.

    packed = pack(linear.weight, "int8")              # once, when a model is loaded
    y = matmul(x, packed, bias)                       # (M, K) -> (M, N), float32

Where no compiler is found (or the build fails) `matmul` is plain torch on the same packed
weights, with the same result to float32 rounding, and `status()` says why.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.device import cpu_info

SOURCE = Path(__file__).with_suffix(".cpp")
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
BLOCK = 16  # outputs per block of the packed layout
INT4_GROUP = 32  # inputs sharing one int4 scale
ISAS = ("portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16")
# the layout each path reads: vnni (int8, int4) and pairs (bfloat16) are their paths' own
LAYOUT_OF = {"avx512_vnni": "vnni", "avx512_bf16": "pairs"}
QBLOCK = 32  # inputs per activation scale on the vnni path (and its int4 group)


@dataclass
class Packed:
    """One Linear's weight in a decode format: data in the blocked layout, scales, shape."""

    format: str
    data: torch.Tensor  # float32/bfloat16/int8: (N/16, K, 16); int4: uint8 (N/16, K/2, 16);
    # bfloat16 pairs: (N/16, K/2, 16, 2)
    scales: torch.Tensor  # int8: (N,); int4: float16 (N/16, K/group, 16), by block; floats: empty
    out_features: int  # N before padding to a multiple of 16
    in_features: int
    group: int = 0
    layout: str = "blocked"

    @property
    def padded(self) -> int:
        return self.data.size(0) * BLOCK

    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


def pack(weight: torch.Tensor, fmt: str, group: int = INT4_GROUP,
         layout: str = "blocked") -> Packed:
    """A (N, K) float weight -> its packed form (N padded with zero rows to a multiple of 16).
    int8: symmetric per output, scale = max|w| / 127; int4: symmetric per output and group of
    `group` inputs, scale = max|w| / 7 (in float16), values -7..7 stored + 8. layout: 'blocked'
    for the float32-activation paths, 'vnni' (int8, int4 in groups of 32) for avx512_vnni,
    'pairs' (bfloat16) for avx512_bf16."""
    if layout == "pairs" and (fmt != "bfloat16" or weight.size(1) % 2):
        raise ValueError("the pairs layout takes bfloat16 weights with an even number of inputs")
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
    if layout == "vnni" and (fmt not in ("int8", "int4") or weight.size(1) % QBLOCK
                             or fmt == "int4" and group != QBLOCK):
        raise ValueError(f"the vnni layout takes int8, or int4 in groups of {QBLOCK}, with the "
                         f"inputs a multiple of {QBLOCK}")
    w = weight.detach().float().cpu()
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % BLOCK))  # (Np, K)
    if fmt in ("float32", "bfloat16"):
        w = w.to(torch.bfloat16) if fmt == "bfloat16" else w
        data = pairs(w) if layout == "pairs" else blocked(w)
        return Packed(fmt, data, torch.empty(0), n, k, layout=layout)
    if fmt == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127)
        data = vnni_int8(q) if layout == "vnni" else blocked(q.to(torch.int8))
        return Packed(fmt, data, scales.contiguous(), n, k, layout=layout)
    if k % group or group % 2:
        raise ValueError(f"int4 needs an even group that divides the {k} inputs, not {group}")
    groups = w.view(w.size(0), k // group, group)
    # (Np, K/group), held in float16 as llama.cpp's q4_0 blocks hold theirs (1e-7: above
    # float16's smallest step, so an all-zero group divides by a nonzero scale)
    scales = (groups.abs().amax(dim=2) / 7).clamp(min=1e-7).half()
    q = torch.round(groups / scales.float()[..., None]).clamp(-7, 7) + 8
    q = q.to(torch.uint8).view(-1, k)
    data = vnni_int4(q) if layout == "vnni" else blocked(q[:, 0::2] | (q[:, 1::2] << 4))
    # each block's scales together, in the order its kernel reads them
    by_block = scales.view(-1, BLOCK, k // group).transpose(1, 2).contiguous()
    return Packed(fmt, data, by_block, n, k, group, layout)


def blocked(w: torch.Tensor) -> torch.Tensor:
    """(Np, K) -> (Np/16, K, 16): each block of 16 outputs k-major (int4: K is K/2 bytes)."""
    return w.view(-1, BLOCK, w.size(1)).transpose(1, 2).contiguous()


def pairs(w: torch.Tensor) -> torch.Tensor:
    """(Np, K) -> (Np/16, K/2, 16, 2): per block of 16 outputs, each two inputs side by side."""
    return w.view(-1, BLOCK, w.size(1) // 2, 2).permute(0, 2, 1, 3).contiguous()


def vnni_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 values (Np, K) -> uint8 (Np/16, K/4, 16, 4), stored + 128: four inputs per lane."""
    u = (q + 128).to(torch.uint8).view(-1, BLOCK, q.size(1) // 4, 4)
    return u.permute(0, 2, 1, 3).contiguous()


def vnni_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values + 8 (Np, K) -> uint8 (Np/16, K/8, 16, 4): per 8 inputs, the first 4 in the
    low nibbles and the last 4 in the high ones."""
    v = q.view(-1, BLOCK, q.size(1) // 8, 2, 4)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()


def unpack(packed: Packed) -> torch.Tensor:
    """The (N, K) float32 weight the packed form stands for (what every path multiplies by)."""
    rows, k = packed.padded, packed.in_features
    if packed.layout == "pairs":
        return packed.data.permute(0, 2, 1, 3).reshape(rows, k).float()[:packed.out_features]
    if packed.layout == "vnni":  # (Np/16, K/4 or K/8, 16, 4) -> the values (Np, K)
        data = packed.data.permute(0, 2, 1, 3).reshape(rows, -1)
        if packed.format == "int8":
            q = data.float() - 128
        else:
            quads = data.view(rows, k // 8, 1, 4)
            q = torch.cat([quads & 15, quads >> 4], dim=2).view(rows, k).float() - 8
    else:
        data = packed.data.transpose(1, 2).reshape(rows, -1)  # (Np, K or K/2)
        if packed.format == "int4":
            q = torch.stack([data & 15, data >> 4], dim=-1).view(rows, k).float() - 8
        else:
            q = data.float()
    if packed.format == "int4":
        scales = packed.scales.float().transpose(1, 2).reshape(rows, -1)  # (Np, K/group)
        w = q * scales.repeat_interleave(packed.group, dim=1)  # (Np, K)
    elif packed.format == "int8":
        w = q * packed.scales[:, None]
    else:
        w = q
    return w[:packed.out_features]


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the vnni path multiplies it: rounded to int8 per block of 32 inputs."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QBLOCK)
    peak = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))
    return (torch.round(blocks * inverse) * (peak / 127)).reshape(x.shape)


def reference(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: the same product from the unpacked weight (and, for the vnni and pairs
    layouts, the activations rounded as those paths round them: int8 per block, bfloat16)."""
    if packed.layout == "vnni":
        x = rounded_activations(x)
    else:
        x = x.bfloat16().float() if packed.layout == "pairs" else x.float()
    return F.linear(x, unpack(packed), bias)


def cpu_isas() -> list[str]:
    """The kernel paths this CPU can run, slowest first."""
    flags = set(cpu_info().get("flags", "").split())
    isas = ["portable"]
    if {"avx2", "fma", "f16c"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl"} <= flags:
            isas.append("avx512")
            if "avx512_vnni" in flags:
                isas.append("avx512_vnni")
            if "avx512_bf16" in flags:
                isas.append("avx512_bf16")
    return isas


def best_path(fmt: str) -> tuple[str, str]:
    """(kernel path, layout) for a weight format on this CPU: the vnni path for int8 and int4
    and the bf16 path for bfloat16 where the CPU has them, else the widest float32-activation
    path."""
    isas = cpu_isas()
    if fmt in ("int8", "int4") and "avx512_vnni" in isas:
        return "avx512_vnni", "vnni"
    if fmt == "bfloat16" and "avx512_bf16" in isas:
        return "avx512_bf16", "pairs"
    return next(i for i in reversed(isas) if i not in LAYOUT_OF), "blocked"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpt2-scratch" / "kernels"


def compiler() -> str | None:
    return os.environ.get("CXX") or next(
        (c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def build_command(cxx: str, source: Path, out: Path) -> list[str]:
    from torch.utils import cpp_extension
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is OpenMP inside torch; libgomp.so.1 then resolves to the
    # copy torch has loaded, so both share one pool of threads
    return [cxx, "-O3", "-std=c++20", "-fPIC", "-shared", "-fno-math-errno", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(source), "-o", str(out),
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


@functools.cache
def status() -> tuple[bool, str]:
    """(whether the compiled kernels are loaded, what happened): built on first use into the
    cache folder, named by a hash of the source, the compiler and torch, then reused."""
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler (g++, c++, clang++ or $CXX): plain torch instead"
    command = " ".join(build_command(cxx, SOURCE, Path("out.so")))
    key = hashlib.sha256(f"{SOURCE.read_text()}|{command}|{torch.__version__}".encode())
    library = cache_dir() / f"cpu_kernels_{key.hexdigest()[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            print(f"building the CPU decode kernels ({cxx}, once) ...", file=sys.stderr, flush=True)
            proc = subprocess.run(build_command(cxx, SOURCE, built), capture_output=True,
                                  text=True)
            if proc.returncode != 0 or not built.exists():
                last = proc.stderr.strip().splitlines()[-1:] or ["no library written"]
                return False, f"building the CPU kernels failed ({last[0][:200]}): plain torch"
            os.replace(built, library)  # atomic: a concurrent build finds a whole file
    torch.ops.load_library(str(library))
    # its shape for torch.compile, which calls it as an opaque kernel
    torch.library.register_fake("gpt2s::weight_matmul")(
        lambda x, weight, scales, bias, n, fmt, group, isa: x.new_empty(x.size(0), n))
    return True, f"compiled kernels ({library.name})"


def matmul(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x (..., K) float32 times the packed weight -> (..., N) float32, on the given kernel path
    (default: the best this CPU runs for the packed layout); plain torch where the kernels are
    not built. bias: (N,), or already padded to a multiple of 16."""
    if not status()[0] or isa == "torch":
        return reference(x, packed, None if bias is None else bias[:packed.out_features])
    if isa is None:
        own = {layout: path for path, layout in LAYOUT_OF.items()}
        isa = own.get(packed.layout) or best_path("float32")[0]
    rows = x.reshape(-1, packed.in_features).float().contiguous()
    if bias is not None and bias.numel() != packed.padded:
        bias = F.pad(bias.float(), (0, packed.padded - bias.numel()))
    y = torch.ops.gpt2s.weight_matmul(rows, packed.data, packed.scales, bias,
                                      packed.padded, FORMATS[packed.format], packed.group,
                                      ISAS.index(isa))
    return y[:, :packed.out_features].reshape(*x.shape[:-1], packed.out_features)
