"""Batched generation over the KV cache: many prompts a forward, each read once and its cache row
copied for each of its samples; the rows decode together, each at its own position, and leave
the batch as they finish. Callable from anywhere (eval.py; reinforcement learning's G samples
per prompt):

    outs = generate_batch(model, tokenizer, [ids_a, ids_b], max_new_tokens=32, samples=4,
                          temperature=1.0, stop_ids={eot}, stop_strings=["\\n"],
                          generator=torch.Generator().manual_seed(0))
    outs[0][2].text, outs[0][2].tokens, outs[0][2].finish      # prompt a's third sample

Greedy at temperature 0 (then one sample a prompt). Sampling draws every row's token from one
generator in one call, so a fixed seed gives the same completions for the same prompts in the
same batches (batch_rows). logprobs=True records each generated token's log-probability under
softmax(logits / temperature), top-k and top-p not applied (reinforcement learning's old
policy; it samples with neither), the stop token's last.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from engine.evaluation.scoring import expand
from engine.inference.kv_cache import new_kv_cache
from engine.inference.sampling import sample_next


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)  # generated, the stop token not included
    text: str = ""  # their text, cut before the first stop string
    finish: str = "length"  # length | stop (a stop token or string ended it)
    stop_token: int | None = None  # the stop token that ended it
    logprobs: list[float] = field(default_factory=list)  # logprobs=True: tokens', stop_token's


@torch.no_grad()
def generate_batch(model: torch.nn.Module, tokenizer, prompts: list[list[int]],
                   max_new_tokens: int, samples: int = 1, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, stop_ids: set[int] | None = None,
                   stop_strings: list[str] | None = None,
                   generator: torch.Generator | None = None, batch_rows: int = 32,
                   autocast=None, logprobs: bool = False) -> list[list[Completion]]:
    """`samples` completions of each prompt (one at temperature 0). A prompt is cropped from
    the left to leave room for max_new_tokens in the context."""
    samples = 1 if temperature == 0 else samples
    room = model.config.block_size - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in "
                         f"block_size {model.config.block_size}")
    prompts = [p[-room:] for p in prompts]
    if not all(prompts):
        raise ValueError("every prompt needs at least one token")
    per_batch = max(1, batch_rows // samples)
    out: list[list[Completion]] = []
    for b in range(0, len(prompts), per_batch):
        with autocast() if autocast else contextlib.nullcontext():
            out += _generate(model, tokenizer, prompts[b:b + per_batch], max_new_tokens,
                             samples, (temperature, top_k, top_p), set(stop_ids or ()),
                             list(stop_strings or ()), generator, logprobs)
    return out


def _generate(model, tokenizer, prompts, max_new_tokens, samples, sampling, stop_ids,
              stop_strings, generator, logprobs) -> list[list[Completion]]:
    device = model.lm_head.weight.device
    width = max(map(len, prompts))
    cache = new_kv_cache(model, len(prompts), positions=width)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    cache.filled = width
    last = torch.tensor([[len(p) - 1] for p in prompts], device=device)
    logits = model(ids.to(device), kv_cache=cache, input_pos=torch.arange(width, device=device),
                   logits_at=last)[0][:, 0]  # (P, vocab): each prompt's next-token logits
    source = torch.arange(len(prompts), device=device).repeat_interleave(samples)
    rows = expand(cache, source, width + max_new_tokens)  # a row per sample
    logits = logits[source]
    positions = torch.tensor([len(prompts[i]) for i in source.tolist()], device=device)
    outs = [Completion() for _ in range(len(source))]
    active = list(range(len(source)))  # the completion each row of `rows` belongs to
    for step in range(max_new_tokens):
        tokens = sample_next(logits, *sampling, generator)  # (rows, 1)
        if logprobs:
            scaled = torch.log_softmax(logits.float() / (sampling[0] or 1.0), dim=-1)
            for r, lp in enumerate(scaled.gather(1, tokens)[:, 0].tolist()):
                outs[active[r]].logprobs.append(lp)
        keep = [r for r, t in enumerate(tokens[:, 0].tolist())
                if not _append(outs[active[r]], t, tokenizer, stop_ids, stop_strings)]
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(active):  # finished rows leave the batch
            index = torch.tensor(keep, device=device)
            rows = _select(rows, index)
            tokens, positions = tokens[index], positions[index]
            active = [active[r] for r in keep]
        rows.filled = None  # each row at its own position: a mask per row
        logits = model(tokens, kv_cache=rows, input_pos=positions[:, None])[0][:, -1]
        positions = positions + 1
    for c in outs:
        c.text = _cut(tokenizer.decode(c.tokens), stop_strings)[0]
    return [outs[i * samples:(i + 1) * samples] for i in range(len(prompts))]


def _append(c: Completion, token: int, tokenizer, stop_ids: set[int],
            stop_strings: list[str]) -> bool:
    """Record a sampled token; whether the completion has ended."""
    if token in stop_ids:
        c.finish, c.stop_token = "stop", token
        return True
    c.tokens.append(token)
    if stop_strings and _cut(tokenizer.decode(c.tokens), stop_strings)[1]:
        c.finish = "stop"
        return True
    return False


def _cut(text: str, stop_strings: list[str]) -> tuple[str, bool]:
    """text before the first stop string, and whether there was one."""
    hits = [i for s in stop_strings if (i := text.find(s)) >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def _select(cache, index: torch.Tensor):
    """The cache's rows `index`, in that order (finished rows dropped)."""
    cache.kv = [layer.index_select(1, index) for layer in cache.kv]
    if cache.tokens is not None:
        cache.tokens = cache.tokens.index_select(0, index)
    return cache
