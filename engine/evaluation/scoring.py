"""Log-likelihoods for multiple choice and bits per byte, batched over the KV cache.

    scores = choice_logprobs(model, [(context_ids, [choice_ids, ...]), ...])
    # per request, per choice: (sum of log p over the choice's tokens, its token count)

Each batch reads its questions' contexts once (right-padded, one forward), copies each context's
keys and values into a row per choice (the prefix shared by a question's choices), then reads
every choice's tokens in one more forward, each row at its own positions after its context.
kv_cache=False is the reference: each context + choice read whole, as transformers would.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math

import torch
import torch.nn.functional as F

from engine.inference.kv_cache import KVCache, new_kv_cache

Request = tuple[list[int], list[list[int]]]  # (context ids, each choice's ids)
LOGITS_BUDGET = 2**27  # float32 logits a bits-per-byte forward may hold (512 MiB)


def crop(request: Request, block_size: int) -> list[Request]:
    """A request within the window, as each context + choice would be cropped alone (its last
    block_size + 1 tokens, as HellaSwag and lm-eval crop): one request when no context token is
    lost, else one per choice, each with its own context (no shared prefix then)."""
    context, choices = request
    choices = [c[-(block_size - 1):] for c in choices]  # a choice after >= 1 context token
    if len(context) + max(map(len, choices)) <= block_size + 1:
        return [(context, choices)]
    return [(context[-(block_size + 1 - len(c)):], [c]) for c in choices]


@torch.no_grad()
def choice_logprobs(model: torch.nn.Module, requests: list[Request], batch_rows: int = 16,
                    kv_cache: bool = True, autocast=None) -> list[list[tuple[float, int]]]:
    """(log-likelihood, tokens) of each choice after its context; batch_rows: choices a batch."""
    block = model.config.block_size
    for i, (context, choices) in enumerate(requests):
        if not context or not choices or not all(choices):
            raise ValueError(f"request {i}: needs context tokens and non-empty choices")
    pieces = [crop(r, block) for r in requests]
    flat = [piece for p in pieces for piece in p]
    scores: list[list[tuple[float, int]]] = []
    batch: list[Request] = []
    for request in flat + [None]:
        rows = sum(len(c) for _, c in batch)
        if batch and (request is None or rows + len(request[1]) > batch_rows):
            score = _batch_cached if kv_cache else _batch_whole
            with autocast() if autocast else contextlib.nullcontext():
                scores += score(model, batch)
            batch = []
        if request is not None:
            batch.append(request)
    out, i = [], 0
    for p in pieces:  # a request cropped choice by choice: its pieces back together
        out.append([s for piece in scores[i:i + len(p)] for s in piece])
        i += len(p)
    return out


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's weights (or, for a stand-in without any, its buffers) are."""
    return next(itertools.chain(model.parameters(), model.buffers())).device


def _gather(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) from logits (..., vocab) and targets (...) of the same leading shape."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def _batch_whole(model, batch: list[Request]) -> list[list[tuple[float, int]]]:
    """The reference: each context + choice one row, right-padded, read from position 0."""
    rows = [(ctx + c, len(c)) for ctx, choices in batch for c in choices]
    width = max(len(r) for r, _ in rows) - 1
    device = device_of(model)
    ids = torch.zeros(len(rows), width + 1, dtype=torch.long)
    for i, (row, _) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    ids = ids.to(device)
    logp = _gather(model(ids[:, :-1])[0], ids[:, 1:])  # (rows, width)
    sums = [float(logp[i, len(r) - 1 - n:len(r) - 1].sum()) for i, (r, n) in enumerate(rows)]
    return _regroup(batch, sums)


def _regroup(batch: list[Request], sums: list[float]) -> list[list[tuple[float, int]]]:
    out, i = [], 0
    for _, choices in batch:
        out.append([(sums[i + j], len(c)) for j, c in enumerate(choices)])
        i += len(choices)
    return out


def _batch_cached(model, batch: list[Request]) -> list[list[tuple[float, int]]]:
    """Contexts once, then every choice from a copy of its context's cache row."""
    block = model.config.block_size
    longest_choice = max(len(c) for _, cs in batch for c in cs)
    # padding sits at each row's positions after its own tokens; they must stay in the window
    if len(batch) > 1 and max(len(ctx) for ctx, _ in batch) + longest_choice - 1 > block:
        return [r for request in batch for r in _batch_cached(model, [request])]
    device = device_of(model)
    contexts = [ctx for ctx, _ in batch]
    width = max(map(len, contexts))
    cache = new_kv_cache(model, len(batch), positions=width)
    ids = _padded(contexts, width).to(device)
    last = torch.tensor([[len(c) - 1] for c in contexts], device=device)  # (Q, 1)
    cache.filled = width
    first = model(ids, kv_cache=cache, input_pos=torch.arange(width, device=device),
                  logits_at=last)[0][:, 0]  # (Q, vocab): each context's next-token logits
    question = torch.tensor([q for q, (_, cs) in enumerate(batch) for _ in cs], device=device)
    choices = [c for _, cs in batch for c in cs]
    starts = torch.tensor([len(contexts[q]) for q in question.tolist()], device=device)
    targets = _padded(choices, longest_choice).to(device)  # (R, K)
    logp = torch.zeros(len(choices), longest_choice, device=device)
    logp[:, 0] = _gather(first[question], targets[:, 0])
    if longest_choice > 1:  # each choice's tokens but its last, after its context
        rows = expand(cache, question, width + longest_choice - 1)
        positions = starts[:, None] + torch.arange(longest_choice - 1, device=device)  # (R, K-1)
        rows.filled = None  # each row sees its own past only: a mask per row
        logits = model(targets[:, :-1], kv_cache=rows, input_pos=positions)[0]
        logp[:, 1:] = _gather(logits, targets[:, 1:])
    lengths = torch.tensor([len(c) for c in choices], device=device)
    mask = torch.arange(longest_choice, device=device)[None] < lengths[:, None]
    return _regroup(batch, (logp * mask).sum(dim=1).tolist())


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    return ids


def expand(cache: KVCache, source_rows: torch.Tensor, positions: int) -> KVCache:
    """A cache of `positions` slots whose row r holds source row source_rows[r]'s keys, values
    (and tokens): one context read once, copied into a row per choice or per sample."""
    out = copy.copy(cache)  # the same kind of cache, its tensors replaced below
    kv = cache.kv[0]
    shape = (2, len(source_rows), kv.size(2), positions, kv.size(4))
    out.kv = []
    for layer in cache.kv:
        rows = layer.new_zeros(shape)
        rows[:, :, :, :layer.size(3)] = layer.index_select(1, source_rows)
        out.kv.append(rows)
    out.slots = torch.arange(positions, device=kv.device)
    out.filled = None
    if cache.tokens is not None:
        out.tokens = cache.tokens.new_zeros(len(source_rows), positions)
        out.tokens[:, :cache.tokens.size(1)] = cache.tokens.index_select(0, source_rows)
    return out


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, ids: list[int], n_bytes: int, batch_rows: int = 8,
                  autocast=None) -> dict:
    """Bits per byte of a text whose tokens are ids[1:] (ids[0]: a start token, predicting
    nothing itself): the text cut into windows of block_size predicted tokens, each read after
    the token before it (as lm-eval's rolling log-likelihood), n_bytes its UTF-8 length."""
    block = model.config.block_size
    device = device_of(model)
    windows = [ids[s:s + block + 1] for s in range(0, len(ids) - 1, block)]
    # the logits of a batch (and their log-softmax) within ~512 MiB each: GPT-2's 1,024 x
    # 50,257 per window allow two windows a forward, a character model's hundreds
    batch_rows = max(1, min(batch_rows, LOGITS_BUDGET // (block * model.config.vocab_size)))
    nll = 0.0
    for b in range(0, len(windows), batch_rows):
        chunk = windows[b:b + batch_rows]
        width = max(map(len, chunk))
        x = _padded(chunk, width).to(device)
        with autocast() if autocast else contextlib.nullcontext():
            logp = _gather(model(x[:, :-1])[0], x[:, 1:])  # (rows, width - 1)
        mask = torch.arange(width - 1, device=device)[None] < torch.tensor(
            [len(w) - 1 for w in chunk], device=device)[:, None]
        nll -= float((logp * mask).sum())
    return {"bpb": nll / math.log(2) / n_bytes, "tokens": len(ids) - 1, "bytes": n_bytes,
            "nll_nats": nll}
