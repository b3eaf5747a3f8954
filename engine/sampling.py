"""Token generation: top-k/top-p sampling, a KV cache at explicit positions, context overflow,
and the weight layout decoding reads fastest.

    set_weight_layout(model, "auto", huge_pages=True)    # by shape on CPU, in 2 MiB pages
    out = generate_tokens(model, idx, 100, temperature=0.8, top_k=200)   # (B, T + 100)
"""
import contextlib
import math
import mmap
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine import weights
from model import GPT, KVCache, Linear


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
def set_weight_layout(model: GPT, layout: str, huge_pages: bool = False) -> str:
    """Store every float Linear weight (the blocks' and the tied LM head, which is also the
    token embedding) row-major (as trained), column-major, or by shape -> the layout used. The
    values, shapes and parameters stay; only the strides change, so training, state_dict and
    saved checkpoints are unaffected (checkpoints are written contiguous). Column-major lets a
    one-token F.linear read the weight as a plain (in, out) matrix. On the 2-core AMD EPYC
    MKL's matrix-vector product runs faster that way for weights with more outputs than
    inputs (the fused qkv, the MLP's c_fc, the LM head: ~1.2-1.4x) and slower for the MLP's
    c_proj (3072 in, 768 out: ~0.7x), so by_shape makes only the former column-major.
    huge_pages (where huge_pages_for allows it): each weight of 2 MiB or more is copied into
    memory mapped in 2 MiB pages, which the same products read 0-6% faster there.
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


def set_matvec(model: GPT, mode: str) -> str:
    """How the model's Linears multiply a single row (a decoded token) by their weights -> what
    they will do: 'blas' (one F.linear, MKL's matrix-vector product) or 'sliced' (model.Linear's
    slices = the threads now: one bmm over a block of the outputs per thread). auto: sliced on a
    CPU running two or more threads."""
    if mode not in MATVECS:
        raise ValueError(f"matvec {mode!r} is not one of {', '.join(MATVECS)}")
    threads = torch.get_num_threads()
    if mode == "auto":
        cpu = model.transformer.wte.weight.device.type == "cpu"
        mode = "sliced" if cpu and threads > 1 else "blas"
    for module in model.modules():
        if isinstance(module, Linear):
            module.slices = threads if mode == "sliced" else 1
    return mode


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) tokens: greedy at temperature 0, else top-k then top-p sampling."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def prefill(model: GPT, ids: torch.Tensor, cache: KVCache, bucket: int = 0,
            start: int = 0, every_position: bool = False) -> tuple[torch.Tensor, int]:
    """Write ids (B, L) into the cache at start..start+L-1 (after 0..start-1, written by earlier
    calls: a prompt read in chunks) -> (the last position's logits (B, 1, vocab), start + L).
    bucket > 0 right-pads to a multiple of it (within block_size, masked): few compiled shapes.
    The LM head runs at the last real position only; every_position: at each of the L (logits
    (B, L, vocab): a prompt scored token by token)."""
    length = ids.size(1)
    room = model.config.block_size - start
    padded = min(room, -(-length // bucket) * bucket) if bucket > 0 else length
    # a copy with standard strides: a slice of the growing idx carries its row stride, which
    # compiled code would guard on (and recompile for)
    ids = F.pad(ids, (0, padded - length)).clone(memory_format=torch.contiguous_format)
    input_pos = torch.arange(start, start + padded, device=ids.device)
    cache.filled = start + padded
    last = torch.arange(0 if every_position else length - 1, length, device=ids.device)
    return model(ids, kv_cache=cache, input_pos=input_pos, logits_at=last)[0], start + length


def decode_step(model: GPT, token: torch.Tensor, cache: KVCache, pos: int,
                input_pos: torch.Tensor) -> torch.Tensor:
    """One token (B, 1) at position pos (input_pos holds the same, as a (1,) tensor; compiled
    code sees only the tensor, so one graph serves every step) -> its logits (B, 1, vocab).
    Weights packed for the CPU kernels (engine/weights.py): each block one compiled call."""
    cache.filled = pos + 1  # eager attention reads the prefix written so far
    if isinstance(model, GPT) and weights.fused(model):
        return weights.decode_rows(model, token, cache.kv, input_pos.expand(token.size(0)))
    return model(token, kv_cache=cache, input_pos=input_pos)[0]


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, kv_cache: bool = True,
                    generator: torch.Generator | None = None,
                    on_token: Callable[[torch.Tensor], None] | None = None,
                    autocast=None, prompt_bucket: int = 0) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens, passing each (B, 1) to on_token. When the
    context is full its oldest half is dropped and the rest re-read once (cache or not)."""
    block = model.config.block_size
    start = max(0, idx.size(1) - block)
    cache = model.new_kv_cache(idx.size(0)) if kv_cache else None
    pos = None  # the next token's position in the cache; None: read the context first
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block:  # keep the newest half; positions shift: re-read once
            start, pos = idx.size(1) - (block - block // 2), None
        with (autocast or contextlib.nullcontext)():
            if cache is None:
                logits, _ = model(idx[:, start:])
            elif pos is None:
                logits, pos = prefill(model, idx[:, start:], cache, prompt_bucket)
                input_pos = torch.tensor([pos], device=idx.device)
            else:  # the last token (a fresh (B, 1) tensor) at the next position
                logits = decode_step(model, next_id, cache, pos, input_pos)
                pos, input_pos = pos + 1, input_pos + 1
        next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat([idx, next_id], dim=1)
        if on_token is not None:
            on_token(next_id)
    return idx


def warm_up(model: GPT, prompt_length: int, max_new_tokens: int, bucket: int,
            autocast=None) -> None:
    """Compile every shape this generation will use before the first real token: the prompt's
    bucket, one decode step, and the re-read of the kept half when the context overflows."""
    block, device = model.config.block_size, model.transformer.wte.weight.device
    lengths = {min(prompt_length, block)}
    if prompt_length + max_new_tokens > block:
        lengths.add(block - block // 2)
    for length in sorted(lengths):
        dummy = torch.zeros((1, length), dtype=torch.long, device=device)
        generate_tokens(model, dummy, 2, temperature=0, autocast=autocast, prompt_bucket=bucket)
