"""Token generation: temperature, top-k and top-p sampling, a prompt read into the KV cache
(prefill), one decode step, the loop that extends a text (dropping the oldest half of a full
context), and compiling every shape before the first token.

    out = generate_tokens(model, idx, 100, temperature=0.8, top_k=200)   # (B, T + 100)
"""
import codecs
import contextlib
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from engine.inference.kv_cache import KVCache, new_kv_cache
from model import GPT


def call_forward_directly(model: torch.nn.Module) -> None:
    """Decoding only: the parts inside each block call their forward straight, without
    nn.Module.__call__'s hook checks, and dropout (the identity in eval) is not called at all.
    A decoded token of a small model makes dozens of such calls, a few percent of its time
    (docs/gpt2.md); the weights and the math stay the same, and training never does this
    (FSDP's and DDP's hooks live there)."""
    for block in model.transformer.h:
        for name, module in list(block.named_modules())[1:]:
            if isinstance(module, torch.nn.Dropout):
                parent, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent), attr, torch.nn.Identity())
    for block in model.transformer.h:
        for module in list(block.modules())[1:]:
            module.__class__ = _direct_class(type(module))


@functools.cache
def _direct_class(cls: type) -> type:
    """cls whose instances, called, run forward: __call__ is forward."""
    return cls if cls.__call__ is cls.forward else type(cls.__name__, (cls,),
                                                          {"__call__": cls.forward})


class StreamPrinter:
    """Tokens in, text written as it completes: the bytes of an unfinished UTF-8 character held
    back; the token `end` and what follows it are not written (a chat reply's end of turn).
    .text is what was written."""

    def __init__(self, tokenizer, write: Callable[[str], None] | None = None,
                 end: int | None = None):
        as_bytes = getattr(tokenizer, "decode_bytes", None)  # GPT-2 BPE: bytes, maybe partial
        self.to_bytes = as_bytes or (lambda ids: tokenizer.decode(ids).encode())
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.write = write or (lambda text: print(text, end="", flush=True))
        self.end, self.ended, self.pieces = end, False, []

    def __call__(self, token: torch.Tensor) -> None:
        token = int(token[0, 0])
        self.ended = self.ended or token == self.end
        if not self.ended:
            self._out(self.utf8.decode(self.to_bytes([token])))

    def finish(self) -> str:
        """Write what was held back; the whole text."""
        self._out(self.utf8.decode(b"", final=True))
        return self.text

    def _out(self, piece: str) -> None:
        self.pieces.append(piece)
        self.write(piece)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


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
    Weights packed for the CPU kernels (engine/inference/packed.py) give the model its own
    decode_rows: each block one compiled call."""
    cache.filled = pos + 1  # eager attention reads the prefix written so far
    if (packed := model.__dict__.get("decode_rows")) is not None:
        return packed(token, cache.kv, input_pos.expand(token.size(0)))
    return model(token, kv_cache=cache, input_pos=input_pos)[0]


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, kv_cache: bool = True,
                    generator: torch.Generator | None = None,
                    on_token: Callable[[torch.Tensor], None] | None = None,
                    autocast=None, prompt_bucket: int = 0,
                    stop_ids: set[int] | None = None) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens, passing each (B, 1) to on_token. When the
    context is full its oldest half is dropped and the rest re-read once (cache or not).
    stop_ids: end early once every row has sampled one of them (it is the last token kept)."""
    stops = torch.tensor(sorted(stop_ids), device=idx.device) if stop_ids else None
    stopped = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    block = model.config.block_size
    start = max(0, idx.size(1) - block)
    cache = new_kv_cache(model, idx.size(0)) if kv_cache else None
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
        if stops is not None:  # a chat reply ends at its end-of-turn token
            stopped |= torch.isin(next_id[:, 0], stops)
            if stopped.all():
                break
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
