"""Log-probabilities for the completions API's `logprobs` and `echo` (serve.py): the engine
scores tokens with `score`, the HTTP side turns them into OpenAI's legacy shape with
`openai_logprobs` (the chat API's: `chat_logprobs`).

    scored = score(logits, targets=[17, 4], top=2)    # logits (2, vocab) -> 2 Scored
    openai_logprobs(tokenizer, scored)   # {"tokens", "token_logprobs", "top_logprobs",
                                         #  "text_offset"}

A log-probability is the model's own distribution at that position: log_softmax of the raw
logits in float32, before temperature, top-k or top-p (what OpenAI reports, and vLLM by
default), so a score does not depend on how the token was sampled. A token's string is its
bytes as UTF-8; a token that is part of a character (GPT-2's byte-level BPE splits some) is
written `bytes:` and its bytes as `\\xNN` (OpenAI's convention): `bytes:\\xe2\\x80`.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 5  # the most alternatives a token may carry, as OpenAI's legacy completions
PROMPT_LOGITS = 1 << 23  # logits per forward of a scored prompt (32 MiB in float32)


@dataclass
class Scored:
    """One token with its log-probability and the `top` likeliest tokens at its position."""

    token: int
    logprob: float | None  # None: a prompt's first token (nothing before it predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)  # likeliest first
    offset: int = 0  # where its text begins in the text returned
    end: int = 0  # generated tokens: the text's length once this token's text is whole


def prompt_rows(vocab_size: int) -> int:
    """Positions per forward of a scored prompt: PROMPT_LOGITS bounds its logits (166 at
    GPT-2's vocabulary), so a long prompt is scored in pieces, never as (prompt, vocab) whole."""
    return max(1, PROMPT_LOGITS // vocab_size)


@torch.no_grad()
def score(logits: torch.Tensor, targets: list[int], top: int) -> list[Scored]:
    """logits (N, vocab), targets (N token ids) -> each target's log-probability and the `top`
    likeliest tokens of its row (0: none)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, vocab)
    index = torch.tensor(targets, device=logits.device).view(-1, 1)
    chosen = logprobs.gather(1, index).view(-1).tolist()
    if top <= 0:
        return [Scored(t, lp) for t, lp in zip(targets, chosen)]
    values, ids = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)  # (N, top)
    return [Scored(t, lp, list(zip(i, v)))
            for t, lp, i, v in zip(targets, chosen, ids.tolist(), values.tolist())]


def token_bytes(tokenizer):
    """The tokenizer's ids -> bytes (tiktoken's decode_bytes; a char tokenizer: its text)."""
    return getattr(tokenizer, "decode_bytes", None) or (
        lambda ids: tokenizer.decode(ids).encode())


def token_text(to_bytes, token: int) -> str:
    """A token's string: its UTF-8 text, or `bytes:\\xNN...` for bytes that are not text alone."""
    raw = to_bytes([token])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def decoded(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of ids, and where each token's text begins in it (a token that completes a
    character begins where that character does; bytes that never form one read as U+FFFD)."""
    to_bytes = token_bytes(tokenizer)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, offsets = "", []
    for token in ids:
        offsets.append(len(text))  # the characters complete before it
        text += utf8.decode(to_bytes([token]))
    return text + utf8.decode(b"", final=True), offsets


def openai_logprobs(tokenizer, scored: list[Scored], shift: int = 0) -> dict:
    """Scored tokens -> OpenAI's legacy `logprobs` object; text_offset moved by `shift` (the
    echoed prompt's length, for generated tokens). top_logprobs holds the top tokens and the
    chosen one (up to top + 1 entries, as OpenAI), None where the logprob is None."""
    to_bytes = token_bytes(tokenizer)
    tops = []
    for s in scored:
        if s.logprob is None:
            tops.append(None)
            continue
        top = {token_text(to_bytes, t): lp for t, lp in s.top}
        top.setdefault(token_text(to_bytes, s.token), s.logprob)
        tops.append(top)
    return {"tokens": [token_text(to_bytes, s.token) for s in scored],
            "token_logprobs": [s.logprob for s in scored], "top_logprobs": tops,
            "text_offset": [s.offset + shift for s in scored]}


def chat_logprobs(tokenizer, scored: list[Scored]) -> list[dict]:
    """Scored tokens -> OpenAI's chat `logprobs.content`: each token's string, logprob and
    bytes, and its `top` likeliest tokens (top_logprobs: the chosen one only if among them)."""
    to_bytes = token_bytes(tokenizer)

    def entry(token: int, logprob: float) -> dict:
        return {"token": token_text(to_bytes, token), "logprob": logprob,
                "bytes": list(to_bytes([token]))}

    return [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
            for s in scored]
