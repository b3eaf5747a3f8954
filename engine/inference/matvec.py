"""How decoding multiplies one token by each weight, fast on a CPU: the weights' layout (row- or
column-major), 2 MiB pages, and products cut into one slice of outputs per thread. Training
never loads this; generate.py and serve.py apply it to a loaded model (docs/gpt2.md#decoding).

    set_weight_layout(model, "auto", huge_pages=True)   # by shape on CPU, in 2 MiB pages
    set_matvec(model, "auto")                          # sliced products with 2+ threads
"""
from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

WEIGHT_LAYOUTS = ("auto", "row", "column")
MATVECS = ("auto", "blas", "sliced")
HUGE_PAGE = 2 << 20  # bytes in one x86-64 transparent huge page
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def weight_layout_for(layout: str, device: torch.device) -> str:
    """sample.weight_layout -> 'row', 'column' or 'by_shape': auto is by_shape on CPU (each
    weight in the layout measured faster for its shape) and row-major (as trained) elsewhere,
    where it was not measured."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout {layout!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")
    if layout == "auto":
        return "by_shape" if device.type == "cpu" else "row"
    return layout


def huge_pages_for(requested: bool, device: torch.device) -> tuple[bool, str]:
    """(whether set_weight_layout puts the weights in 2 MiB pages, the banner's word for it):
    on a CPU under Linux with transparent huge pages in 'always' or 'madvise' mode."""
    if not requested:
        return False, "off"
    if device.type != "cpu":
        return False, f"off (CPU only; {device.type} memory is the driver's)"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False, "off (this system has no transparent huge pages)"
    if not hasattr(mmap, "MADV_HUGEPAGE") or "[never]" in mode:
        return False, f"off (transparent huge pages are disabled: {THP_MODE} says 'never')"
    return True, "on"


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor starting on a 2 MiB boundary of a private anonymous mapping
    advised MADV_HUGEPAGE: its first write maps it in 2 MiB pages, one TLB entry where 4 KiB
    pages take 512. The mapping lives as long as the tensor's storage; the unused lead-in
    before the boundary is never touched, so it costs address space, not memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    return torch.frombuffer(area, dtype=dtype, count=math.prod(shape), offset=skip).view(shape)


@torch.no_grad()
def set_weight_layout(model: nn.Module, layout: str, huge_pages: bool = False) -> str:
    """Store every float Linear weight (the blocks' and the tied LM head, which is also the
    token embedding) row-major (as trained), column-major, or by shape -> the layout used. The
    values, shapes and parameters stay; only the strides change, so training, state_dict and
    saved checkpoints are unaffected (checkpoints are written contiguous). Column-major lets a
    one-token F.linear read the weight as a plain (in, out) matrix. Measured on CPUs, MKL's
    matrix-vector product ran faster that way for weights with more outputs than inputs (the
    fused qkv, the MLP's c_fc, the LM head) and slower for the MLP's c_proj (3072 in, 768 out),
    so by_shape makes only the former column-major (docs/gpt2.md has the figures).
    huge_pages (where huge_pages_for allows it): each weight of 2 MiB or more is copied into
    memory mapped in 2 MiB pages, which the same products read a little faster there.
    Quantized (int8) weights are left as they are."""
    device = model.transformer.wte.weight.device
    layout, (huge, _) = weight_layout_for(layout, device), huge_pages_for(huge_pages, device)
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or type(module.weight.data) is not torch.Tensor:
            continue  # quantized weights are tensor subclasses
        weight = module.weight.data
        column = layout == "column" or (layout == "by_shape" and weight.size(0) > weight.size(1))
        plain = weight.t() if column else weight  # column-major (out, in): a contiguous (in, out)
        if huge and weight.nbytes >= HUGE_PAGE and not (
                plain.is_contiguous() and weight.data_ptr() % HUGE_PAGE == 0):
            stored = huge_page_empty(tuple(plain.shape), weight.dtype).copy_(plain)
        else:
            stored = plain.contiguous()
        stored = stored.t() if column else stored
        if stored.data_ptr() != weight.data_ptr():  # a copy: swap it in, the old one is freed
            module.weight.data = stored
    return layout


def set_matvec(model: nn.Module, mode: str) -> str:
    """How the model's Linears multiply a single row (a decoded token) by their weights -> what
    they will do: 'blas' (one F.linear, the BLAS matrix-vector product) or 'sliced' (each
    nn.Linear becomes a SlicedLinear, the same weights: one bmm over a block of the outputs per
    thread). auto: sliced on a CPU running two or more threads."""
    if mode not in MATVECS:
        raise ValueError(f"matvec {mode!r} is not one of {', '.join(MATVECS)}")
    threads = torch.get_num_threads()
    if mode == "auto":
        cpu = model.transformer.wte.weight.device.type == "cpu"
        mode = "sliced" if cpu and threads > 1 else "blas"
    for module in model.modules():
        if type(module) in (nn.Linear, SlicedLinear):  # packed or quantized ones stay
            module.__class__ = SlicedLinear if mode == "sliced" else nn.Linear
            module.slices = threads if mode == "sliced" else 1
    return mode


SLICED_MIN_BYTES = 1 << 20  # smaller weights are multiplied by one F.linear


class SlicedLinear(nn.Linear):
    """nn.Linear whose one-row products go through sliced_matvec: a single row times a float
    weight of SLICED_MIN_BYTES or more, stored row- or column-major (set_matvec)."""

    slices = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.slices > 1 and x.numel() == self.in_features and type(w) is nn.Parameter and (
                w.nbytes >= SLICED_MIN_BYTES and (w.is_contiguous() or w.t().is_contiguous())):
            return sliced_matvec(x, w, self.bias, self.slices)
        return F.linear(x, w, self.bias)


def sliced_matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  slices: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for x holding one row, with the outputs cut into `slices`
    equal blocks (the few left over done apart) that one bmm multiplies side by side, a thread
    each. Where the BLAS matrix-vector product reads a weight at one core's bandwidth whatever
    the threads, this reads it with all of them; below about 1 MiB the bmm's overhead outweighs
    the read (docs/gpt2.md). weight is row-major (out, in) or column-major (its transpose
    contiguous)."""
    out, width = weight.shape
    cut = out // slices * slices
    if weight.is_contiguous():  # each slice a block of rows, used transposed
        blocks = weight[:cut].view(slices, cut // slices, width).transpose(1, 2)
    else:  # each slice a block of columns of the contiguous (in, out) matrix
        blocks = weight.t()[:, :cut].view(width, slices, cut // slices).transpose(0, 1)
    rows = x.reshape(1, 1, width).expand(slices, 1, width)
    if bias is None:
        y = torch.bmm(rows, blocks)  # (slices, 1, out / slices)
    else:
        y = torch.baddbmm(bias[:cut].view(slices, 1, cut // slices), rows, blocks)
    y = y.view(*x.shape[:-1], cut)
    if cut < out:
        rest = F.linear(x, weight[cut:], None if bias is None else bias[cut:])
        y = torch.cat([y, rest], dim=-1)
    return y
