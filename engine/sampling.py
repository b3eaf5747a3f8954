"""Token generation, shared by generate.py, the benchmarks and any server: one KV cache written at
explicit positions, sampling with temperature / top-k / top-p.

    out = generate_tokens(model, idx, 100, temperature=0.8, top_k=200)   # (B, T + 100)

When the context fills up, the oldest half is dropped and the kept half re-read once (with or
without the cache, so both give the same tokens).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from model import GPT, KVCache


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
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def fresh(ids: torch.Tensor) -> torch.Tensor:
    """A copy with standard strides: a slice of the growing idx carries its row stride, a
    changing number that compiled code would otherwise guard on (and recompile for)."""
    return ids.clone(memory_format=torch.contiguous_format)


def prefill(model: GPT, ids: torch.Tensor, cache: KVCache,
            bucket: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the context ids (B, L) into the cache from position 0; returns its logits
    (B, L, vocab) and the next position (1,). bucket > 0 right-pads the context to a multiple of
    it (at most block_size), so compiled code sees few shapes: the padding lands beyond L, is
    masked out and is overwritten by the tokens that follow."""
    length = ids.size(1)
    padded = min(model.config.block_size, -(-length // bucket) * bucket) if bucket > 0 else length
    ids = fresh(F.pad(ids, (0, padded - length)))
    input_pos = torch.arange(padded, device=ids.device)
    logits, _ = model(ids, kv_cache=cache, input_pos=input_pos)  # (B, padded, vocab)
    return logits[:, :length], input_pos[length - 1:length] + 1


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, kv_cache: bool = True,
                    generator: torch.Generator | None = None,
                    on_token: Callable[[torch.Tensor], None] | None = None,
                    autocast=None, prompt_bucket: int = 0) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens; on_token(next_id (B, 1)) sees each as it
    comes. The model sees idx[:, start:], start jumping by half a context when it is full."""
    block = model.config.block_size
    keep = block - block // 2  # context kept when it overflows: the newest half
    start = max(0, idx.size(1) - block)
    cache = model.new_kv_cache(idx.size(0)) if kv_cache else None
    input_pos = None  # the next token's position in the cache; None: read the context first
    ctx = autocast or contextlib.nullcontext
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block:
            start, input_pos = idx.size(1) - keep, None  # positions shifted: re-read once
        with ctx():
            if cache is None:
                logits, _ = model(idx[:, start:])
            elif input_pos is None:
                logits, input_pos = prefill(model, idx[:, start:], cache, prompt_bucket)
            else:
                logits, _ = model(fresh(idx[:, -1:]), kv_cache=cache, input_pos=input_pos)
                input_pos = input_pos + 1
        next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat([idx, next_id], dim=1)
        if on_token is not None:
            on_token(next_id)
    return idx


def warm_up(model: GPT, prompt_length: int, max_new_tokens: int, bucket: int,
            autocast=None) -> None:
    """Compile every shape this generation will use before the first real token: the prompt's
    bucket, one decode step, and the re-read of the kept half when the context overflows."""
    block = model.config.block_size
    lengths = {min(prompt_length, block)}
    if prompt_length + max_new_tokens > block:
        lengths.add(block - block // 2)
    for length in sorted(lengths):
        dummy = torch.zeros((1, length), dtype=torch.long,
                            device=model.transformer.wte.weight.device)
        generate_tokens(model, dummy, 2, temperature=0, autocast=autocast, prompt_bucket=bucket)
