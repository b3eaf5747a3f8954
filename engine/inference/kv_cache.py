"""Decoding's KV cache: the keys and values each layer has seen, at positions the caller gives,
so a decoded token costs the same however long the text (generate.py, serve.py's slots).

    cache = new_kv_cache(model, batch=1)
    logits, _ = model(idx, kv_cache=cache, input_pos=torch.arange(T))
"""
from __future__ import annotations

import copy

import torch

from model import ModelConfig


class KVCache:
    """Keys and values per layer, (2, B, nh, S, hs) (S: block_size unless given), written at the
    caller's explicit positions: input_pos (T,), the same for every row (a prompt, generate.py's
    steps), or (B, T), each row its own (serve.py's slots, each sequence at its own length). A
    call with fewer rows than the cache uses its first rows.

    With `filled` unset, attention reads every position under a mask of each query's past: one
    shape for every step, as compiled code needs. A caller that has written everything at
    positions 0..filled-1 sets filled; eager attention then reads only those (a single token per
    row at the last of them needs no mask: a whole read of GPT-2's 1024 slots costs ~72 MB per
    token, and the mask ops cost more than the attention). Stale keys beyond a query are never
    seen."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype,
                 positions: int | None = None):
        shape = (2, batch, cfg.n_head, positions or cfg.block_size, cfg.n_embd // cfg.n_head)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.slots = torch.arange(shape[3], device=device)
        self.filled: int | None = None
        # model.smear: each row's tokens at their positions, (B, S), for the token before each
        self.tokens = torch.zeros(shape[1], shape[3], dtype=torch.long, device=device) \
            if cfg.smear else None

    def update(self, layer: int, input_pos: torch.Tensor, kv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store kv (2, rows, nh, T, hs), keys and values, at input_pos (T,) or (rows, T) -> the
        layer's keys and values (rows, nh, n, hs) and the mask of what each query sees, (T, n)
        or (rows, 1, T, n) (None: everything)."""
        rows, T = kv.size(1), kv.size(3)
        cache = self.kv[layer][:, :rows]
        kv = kv if kv.dtype == cache.dtype else kv.to(cache.dtype)
        if input_pos.dim() == 1:
            cache.index_copy_(3, input_pos, kv)
        else:
            cache.scatter_(3, input_pos.view(1, rows, 1, T, 1).expand_as(kv), kv)
        n = self.filled
        if n is None or torch.compiler.is_compiling():
            n = cache.size(3)
        elif T == 1 and (rows == 1 or input_pos.dim() == 1):  # each row's one query sees all n
            return cache[0, :, :, :n], cache[1, :, :, :n], None
        if input_pos.dim() == 1:
            mask = self.slots[None, :n] <= input_pos[:, None]  # (T, n)
        else:
            mask = (self.slots[:n] <= input_pos[..., None])[:, None]  # (rows, 1, T, n)
        return cache[0, :, :, :n], cache[1, :, :, :n], mask

    def previous_tokens(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Store idx (rows, T) at input_pos (T,) or (rows, T) -> the token before each, (rows,
        T): the one stored at position - 1 (at position 0 whatever is there; the caller
        leaves it out)."""
        rows, T = idx.shape
        tokens, where = self.tokens[:rows], input_pos.expand(rows, T)
        tokens.scatter_(1, where, idx)
        return tokens.gather(1, (where - 1).clamp(min=0))

    def rows(self, first: int, count: int = 1) -> "KVCache":
        """A view of rows first..first+count-1 (the same storage): one slot decoding alone."""
        view = copy.copy(self)
        view.kv = [kv[:, first:first + count] for kv in self.kv]
        if self.tokens is not None:
            view.tokens = self.tokens[first:first + count]
        return view

    def copy_row(self, row: int, source: "KVCache", length: int, source_row: int = 0) -> None:
        """Copy positions 0..length-1 of source's row source_row into this cache's row."""
        for mine, theirs in zip(self.kv, source.kv):
            mine[:, row, :, :length].copy_(theirs[:, source_row, :, :length])
        if self.tokens is not None:
            self.tokens[row, :length].copy_(source.tokens[source_row, :length])


def new_kv_cache(model: torch.nn.Module, batch: int, positions: int | None = None) -> KVCache:
    """An empty cache of `positions` (default block_size) for `model`, on its weights' device
    and in the dtype of the residual stream's inputs (the position embedding's, else the token
    embedding's: float32 unless the model is bf16)."""
    t = model.transformer
    p = t.wpe.weight if "wpe" in t else t.wte.weight
    return KVCache(model.config, batch, p.device, p.dtype, positions)
