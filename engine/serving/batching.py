"""Continuous batching for serve.py: a fixed number of decode slots over one static KV cache
with a position per slot. New sequences join at the next step, finished ones leave at once.

    engine = BatchEngine(model, raw_model, tokenizer, device, slots=8, max_queue=32)
    engine.start()                               # a thread: warm-up, then the decode loop
    engine.submit([Sequence(prompt_ids, params, on_event)])   # events: text, done, error

Each step, every running sequence does one forward: the ones with a cache row decode together
(one batched step, each row at its own position; packed weights: each block one compiled
call; a sequence alone: its own row of the cache, as generate.py decodes), then new or
re-windowed ones are prefilled alone (the same `sampling.prefill` as generate.py), up to
prefill_chunk prompt tokens a step (a long prompt is read over several steps, so the running
streams wait for one chunk, never for the whole prompt), and copied into their row. With
packed weights (--weights float32, bfloat16, int8, int4) a step is one forward instead: the
decoding rows' tokens and the prompt tokens read this step, each straight into its slot's row
(packed.forward_tokens). Sampling is
`sampling.sample_next` per sequence with its own generator, so a request's tokens do not depend
on what else is in the batch, and the same seed gives the same text.

Log-probabilities (logprobs.py) cost only the sequences that ask: params.logprobs scores each
generated token from the logits it was sampled from; with params.echo too, the prompt is
read alone by the uncompiled model with logits at every position, a bounded piece at a time
(logprobs.prompt_rows), and each prompt token is scored from the position before it.
"""
from __future__ import annotations

import codecs
import collections
import contextlib
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, Field

from config import SampleConfig, SystemConfig
from engine.device import release_cached
from engine.fields import bounds
from engine.inference.kv_cache import new_kv_cache
from engine.inference.sampling import prefill, sample_next
from engine.serving import logprobs
from engine.serving.logprobs import Scored
from model import GPT

# prompt tokens a packed step reads when no sequence is decoding (nothing waits on it): larger
# products use the cores better than prefill_chunk's, and long prompts start sooner
READ_ALONE = 1024


class QueueFull(RuntimeError):
    """More sequences than the free slots and the queue can hold; retry later (HTTP 503)."""


class Sampling(BaseModel):
    """How a reply is sampled: the fields every request shares (completions and chat), with
    OpenAI's defaults and the limits generate.py's own options hold (config.py's fields: one
    definition of each limit)."""

    temperature: float = Field(1.0, **bounds(SampleConfig, "temperature"))  # 0: greedy
    top_p: float = Field(1.0, **bounds(SampleConfig, "top_p"))
    top_k: int = Field(0, **bounds(SampleConfig, "top_k"))  # extension: 0 = off
    seed: int | None = Field(None, **bounds(SystemConfig, "seed"))  # None: a fresh seed
    stop: str | list[str] | None = None  # end before this text (not in it); up to 4 strings


class SamplingParams(Sampling):
    """How one completion is sampled and when it ends: the fields of a completion request that
    the engine reads. app.CompletionRequest extends this class, so a field declared here is a
    request field too, validated, and reaches the engine as it was sent (each choice's seed
    offset: app.make_sequences)."""

    # 0: with echo, the prompt scored, nothing generated
    max_tokens: int = Field(16, **bounds(SampleConfig, "max_new_tokens"))
    ignore_eos: bool = False  # extension: GPT-2 goes on past <|endoftext|> (its stop token)
    logprobs: int | None = Field(None, ge=0)  # score each generated token, with this many
    # alternatives (at most logprobs.MAX_LOGPROBS: app.check_request)
    echo: bool = False  # hand the prompt back first (with logprobs: each token scored)

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TextStream:
    """Token ids in, text out: UTF-8 assembled across byte-level tokens, and `stop` strings found
    across token boundaries. Text that might be the start of a stop string is held back."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.to_bytes = logprobs.token_bytes(tokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop, self.text, self.sent = stop, "", 0

    def push(self, token: int) -> tuple[str, bool]:
        """(the text that may be sent now, whether a stop string ended the completion)."""
        self.text += self.utf8.decode(self.to_bytes([token]))
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            return self._send(min(hits)), True
        hold = max((k for s in self.stop for k in range(1, len(s))
                    if self.text.endswith(s[:k])), default=0)
        return self._send(max(self.sent, len(self.text) - hold)), False

    def finish(self) -> str:
        """What is left when the completion ends without a stop string."""
        self.text += self.utf8.decode(b"", final=True)
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], end
        return out


# ("text", str, [Scored]: the tokens whose text it completes) | ("prompt", [Scored]: with echo,
# before any text; scored with logprobs, else empty) | ("done", finish_reason,
# completion_tokens) | ("error", message)
Event = tuple


@dataclass(eq=False)
class Sequence:
    """One completion being generated. on_event is called from the engine's thread."""

    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    slot: int | None = None
    pos: int | None = None  # the next token's position in the slot; None: (re)read the context
    start: int = 0  # where the context window begins in tokens
    read: int = 0  # context tokens prefilled so far (into the engine's scratch cache)
    cancelled: bool = False
    done: bool = False
    pending: list[Scored] = field(default_factory=list)  # scored, its text not all sent yet
    prompt_scores: list[Scored] = field(default_factory=list)  # echo with logprobs
    end_token: int | None = None  # ends it, not in its text (a chat template's end of turn);
    # None: the tokenizer's end of text (the engine's stop_token)

    def __post_init__(self):
        self.tokens = list(self.prompt)
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.seed = seed
        self.generator: torch.Generator | None = None
        self.text: TextStream | None = None

    def scores_prompt(self) -> bool:
        """Whether its first read scores every prompt token (echo with logprobs)."""
        return self.params.echo and self.params.logprobs is not None and self.generated == 0


class BatchEngine:
    """The decode loop, in its own thread. Thread-safe: submit, cancel, stats, stop."""

    def __init__(self, model: torch.nn.Module, raw_model: GPT, tokenizer, device: torch.device,
                 slots: int, max_queue: int, prompt_bucket: int = 0, prefill_chunk: int = 0,
                 autocast=None,
                 static: bool = False, warmup: bool = True, idle_release_s: float = 30.0,
                 empty_cache: bool = True, log: Callable[[str], None] | None = None):
        self.model, self.raw_model, self.tokenizer = model, raw_model, tokenizer
        self.device = device
        self.block_size = raw_model.config.block_size
        self.slots, self.max_queue, self.bucket = slots, max_queue, prompt_bucket
        self.autocast = autocast or contextlib.nullcontext
        self.static, self.warmup, self.idle_release_s = static, warmup, idle_release_s
        self.empty_cache, self.log = empty_cache, log or (lambda text: print(text, file=sys.stderr))
        self.cache = new_kv_cache(raw_model, slots)  # a row per slot, each at its own position
        self.scratch = new_kv_cache(raw_model, 1)  # prefills run batch 1 here, as generate.py's
        self.packed = None  # weights packed for the CPU kernels: one call a block per step
        if raw_model.__dict__.get("decode_rows") is not None:
            from engine.inference import packed

            self.packed = packed
        # prompt tokens a step reads (a multiple of the bucket: only the last chunk is padded)
        self.chunk = -(-prefill_chunk // max(prompt_bucket, 1)) * max(prompt_bucket, 1)
        self.prefilling: Sequence | None = None  # the one part-read into scratch
        self.running: list[Sequence | None] = [None] * slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.lock = threading.Condition()
        self.ready = threading.Event()
        self.stopping = False
        self.warmup_seconds = 0.0
        self.released_idle = 0  # times cached CUDA memory was handed back in an idle window
        self.thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)
        # GPT-2's <|endoftext|>: a sequence finishes there (not in its text), unless ignore_eos
        self.stop_token = getattr(tokenizer, "eot_id", None)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finish what is running and queued, then end the thread."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join()

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue seqs for the next free slots; QueueFull when slots + queue cannot take them."""
        with self.lock:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            busy = sum(s is not None for s in self.running) + len(self.waiting)
            if busy + len(seqs) > self.slots + self.max_queue:
                raise QueueFull(f"{busy} sequences are running or queued and {len(seqs)} more "
                                f"would exceed the {self.slots} slots + {self.max_queue} queue")
            self.waiting.extend(seqs)
            self.lock.notify_all()

    def cancel(self, seq: Sequence) -> None:
        """Drop seq (a client went away); its slot is free at the next step. No event follows."""
        with self.lock:
            seq.cancelled = True
            self.lock.notify_all()

    def stats(self) -> dict:
        with self.lock:
            return {"slots": self.slots, "active": sum(s is not None for s in self.running),
                    "queued": len(self.waiting), "max_queue": self.max_queue}

    def _run(self) -> None:
        with torch.no_grad():
            if self.warmup:
                t0 = time.perf_counter()
                self.warm_up()
                self.warmup_seconds = time.perf_counter() - t0
            self.ready.set()
            while self._wait_for_work():
                try:
                    self.step()
                except Exception as e:  # fail what is running, keep serving
                    self.log(f"error in the decode loop: {traceback.format_exc()}")
                    self._fail_all(f"the server failed while generating: {type(e).__name__}: {e}")

    def _wait_for_work(self) -> bool:
        """Block until something is queued or running (False: stopping with nothing left). An
        idle window of idle_release_s hands cached CUDA memory back, once."""
        with self.lock:
            idle_since, released = time.monotonic(), False
            while not self.waiting and all(s is None for s in self.running):
                if self.stopping:
                    return False
                left = idle_since + self.idle_release_s - time.monotonic()
                if not released and left <= 0:
                    if release_cached(self.device, self.empty_cache):
                        self.released_idle += 1
                    released = True
                self.lock.wait(timeout=None if released else left)
            return True

    def step(self) -> None:
        """A batched decode of every sequence with a cache row, then prefills of up to
        self.chunk prompt tokens in all (0: every waiting prompt whole), the one part-read
        first (it holds the scratch cache). Packed weights: both in one forward (_step_tokens)."""
        self._admit()
        if self.model is self.raw_model and self.packed is not None:
            return self._step_tokens()
        decoding = [s for s in self.running if s is not None and s.pos is not None]
        if decoding:
            self._decode(decoding)
        budget = self.chunk or float("inf")
        if self.prefilling is not None:  # it holds the scratch cache: finish it first
            budget -= self._prefill(self.prefilling, budget)
        fresh = [s for s in self.running if s is not None and s.pos is None
                 and s is not self.prefilling]
        while fresh and budget > 0 and self.prefilling is None:
            group = self._group(fresh, budget)
            if len(group) > 1:
                budget -= self._prefill_group(group)
            else:  # alone (as generate.py reads it), in chunks when longer than the budget
                budget -= self._prefill(fresh[0], budget)
            fresh = fresh[len(group) or 1:]

    def _step_tokens(self) -> None:
        """One forward (packed.forward_tokens): each decoding sequence's next token in its
        row, and up to self.chunk prompt tokens of the sequences reading their context, in slot
        order, straight into their rows (with nothing decoding, up to READ_ALONE: no stream
        waits); logits only where a token is sampled or a prompt token scored."""
        running = [s for s in self.running if s is not None]
        decoding = [s for s in running if s.pos is not None]
        tokens = [s.tokens[-1] for s in decoding]
        rows, positions = [s.slot for s in decoding], [s.pos for s in decoding]
        logits_at, reads = list(range(len(decoding))), []
        budget = self.chunk or float("inf")  # 0: each prompt whole
        if not decoding:
            budget = max(budget, READ_ALONE)
        for seq in (s for s in running if s.pos is None):
            context = seq.tokens[seq.start:]
            n = int(min(len(context) - seq.read, budget))
            if seq.scores_prompt():
                n = min(n, logprobs.prompt_rows(self.raw_model.config.vocab_size))
            if n <= 0:
                break
            first = len(tokens)
            tokens += context[seq.read:seq.read + n]
            rows += [seq.slot] * n
            positions += range(seq.read, seq.read + n)
            scored, done = seq.scores_prompt(), seq.read + n == len(context)
            at = range(first, first + n) if scored else range(first + n - 1, first + n)
            reads.append((seq, context, seq.read, n, len(logits_at), scored, done))
            logits_at += at if scored or done else []
            seq.read += n
            budget -= n
        logits = self.packed.forward_tokens(self.raw_model, torch.tensor(tokens), self.cache.kv,
                                        torch.tensor(rows), torch.tensor(positions),
                                        torch.tensor(logits_at))
        for seq, context, start, n, at, scored, done in reads:
            if scored:
                self._score_prompt(seq, context, start, logits[at:at + n])
            if done:
                seq.pos, seq.read = len(context), 0
                self._prefilled(seq, logits[at + (n - 1 if scored else 0)][None])
        self._sample(decoding, logits, {s.slot: i for i, s in enumerate(decoding)})

    def _admit(self) -> None:
        """Drop cancelled sequences; move queued ones into free slots (lowest first)."""
        with self.lock:
            for i, seq in enumerate(self.running):
                if seq is not None and seq.cancelled:
                    self.running[i] = None
                    if seq is self.prefilling:
                        self.prefilling = None
            self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
            for i in range(self.slots):
                if self.running[i] is None and self.waiting:
                    seq = self.waiting.popleft()
                    seq.slot, self.running[i] = i, seq
                    seq.start = max(0, len(seq.tokens) - self.block_size)
                    seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
                    seq.text = TextStream(self.tokenizer, seq.params.stop_strings())

    def _prefill(self, seq: Sequence, budget: float) -> int:
        """Read up to `budget` more tokens of seq's context window alone (as generate.py does);
        once it is all read, copy it into the slot's row and sample -> the tokens read. A
        scored prompt is read by the uncompiled model (no new compiled shapes), at most
        logprobs.prompt_rows tokens a forward."""
        context = seq.tokens[seq.start:]
        n = int(min(len(context) - seq.read, budget))
        scoring = seq.scores_prompt()
        if scoring:
            n = min(n, logprobs.prompt_rows(self.raw_model.config.vocab_size))
        ids = torch.tensor([context[seq.read:seq.read + n]], dtype=torch.long, device=self.device)
        with self.autocast():
            if scoring:  # logits (1, n, vocab)
                logits, end = prefill(self.raw_model, ids, self.scratch, 0, seq.read,
                                       every_position=True)
                self._score_prompt(seq, context, seq.read, logits[0])
                seq.read = end
            else:
                logits, seq.read = prefill(self.model, ids, self.scratch, self.bucket, seq.read)
        if seq.read < len(context):
            self.prefilling = seq
            return n
        self.prefilling = None
        self.cache.copy_row(seq.slot, self.scratch, seq.read)
        seq.pos, seq.read = seq.read, 0
        self._prefilled(seq, logits[:, -1, :])
        return n

    def _score_prompt(self, seq: Sequence, context: list[int], start: int,
                      logits: torch.Tensor) -> None:
        """Score the prompt tokens that the logits (n, vocab) at positions start..start+n-1
        predict (the last position's predicts the first generated token: not scored here)."""
        if start == 0:
            seq.prompt_scores.append(Scored(context[0], None))
        targets = context[start + 1:start + 1 + logits.size(0)]
        if targets:
            seq.prompt_scores += logprobs.score(logits[:len(targets)], targets,
                                                seq.params.logprobs)

    def _prefilled(self, seq: Sequence, logits: torch.Tensor) -> None:
        """seq's context is in its row: the prompt back first if asked, then the first token
        from logits (1, vocab); max_tokens 0 asks for none."""
        if seq.params.echo and seq.generated == 0:
            seq.on_event(("prompt", seq.prompt_scores))
            seq.prompt_scores = []
        if seq.params.max_tokens == 0:
            return self._finish(seq, "length")
        self._advance(seq, logits)

    def _group(self, fresh: list[Sequence], budget: float) -> list[Sequence]:
        """The first of `fresh` that fit in one batched prefill of at most `budget` rows
        (sequences x the longest context); eager code only (compiled code would see new
        shapes)."""
        if self.static:
            return fresh[:1]
        group, longest = [], 0
        for seq in fresh:
            if seq.scores_prompt():  # read alone (_prefill), its logits at every position
                break
            longest = max(longest, len(seq.tokens) - seq.start)
            if (len(group) + 1) * longest > budget:
                break
            group.append(seq)
        return group

    def _prefill_group(self, group: list[Sequence]) -> int:
        """Read several whole context windows in one forward, right-padded to the longest
        (padding sits after each row's last token, so no real token attends to it), each
        row's logits at its own last token -> the rows read."""
        contexts = [seq.tokens[seq.start:] for seq in group]
        longest = max(map(len, contexts))
        ids = torch.tensor([c + [0] * (longest - len(c)) for c in contexts], device=self.device)
        last = torch.tensor([[len(c) - 1] for c in contexts], device=self.device)
        cache = new_kv_cache(self.raw_model, len(group), positions=longest)
        cache.filled = longest
        with self.autocast():
            logits = self.model(ids, kv_cache=cache, input_pos=torch.arange(
                longest, device=self.device), logits_at=last)[0]  # (rows, 1, vocab)
        for i, (seq, context) in enumerate(zip(group, contexts)):
            self.cache.copy_row(seq.slot, cache, len(context), i)
            seq.pos = len(context)
            self._prefilled(seq, logits[i:i + 1, -1, :])
        return len(group) * longest

    def _decode(self, seqs: list[Sequence]) -> None:
        """Each seq's last token at its own position, all in one (rows, 1) batch."""
        rows = self.slots if self.static else max(s.slot for s in seqs) + 1
        tokens = torch.zeros((rows, 1), dtype=torch.long)
        positions = torch.zeros((rows, 1), dtype=torch.long)  # rows without a decode: 0, unread
        for s in seqs:
            tokens[s.slot, 0], positions[s.slot, 0] = s.tokens[-1], s.pos
        # eager attention reads positions 0..filled-1 of the first `rows` rows; static
        # (compiled) code every position of every slot, under the mask of each row's past
        self.cache.filled = None if self.static else max(s.pos for s in seqs) + 1
        row = {s.slot: s.slot for s in seqs}  # each seq's row of the logits
        cache = self.cache
        eager = self.model is self.raw_model
        if eager and self.packed is not None:  # one call a block
            logits = self.packed.decode_rows(self.raw_model, tokens, self.cache.kv,
                                         positions.view(rows))[:, -1, :]  # (rows, V)
        else:
            if eager and len(seqs) == 1:  # alone: its own row of the cache, no mask
                s = seqs[0]
                tokens, positions = tokens[s.slot:s.slot + 1], positions[s.slot:s.slot + 1]
                cache, row = self.cache.rows(s.slot), {s.slot: 0}
            with self.autocast():
                logits = self.model(tokens.to(self.device), kv_cache=cache,
                                    input_pos=positions.to(self.device))[0][:, -1, :]
        self._sample(seqs, logits, row)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, row: dict[int, int]) -> None:
        """Each seq's next token from its row of the logits (row: slot -> row), its position
        one further."""
        for s in seqs:
            s.pos += 1
        greedy = [s for s in seqs if s.params.temperature == 0]
        if greedy:  # argmax per row, as sample_next does at temperature 0: one call for all
            picks = logits[[row[s.slot] for s in greedy]].float().argmax(dim=-1).tolist()
            for s, token in zip(greedy, picks):
                self._append(s, token, logits[row[s.slot]:row[s.slot] + 1])
        for s in seqs:
            if s.params.temperature > 0:
                self._advance(s, logits[row[s.slot]:row[s.slot] + 1])

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        p = seq.params
        token = sample_next(logits, p.temperature, p.top_k, p.top_p, seq.generator)
        self._append(seq, int(token), logits)

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Record a token sampled from logits (1, vocab), send its text (and its score if
        asked), and finish seq if it is done."""
        seq.tokens.append(token)
        seq.generated += 1
        begins = len(seq.text.text)
        end = self.stop_token if seq.end_token is None else seq.end_token
        if token == end and not seq.params.ignore_eos:
            # the text held back is not a stop string's start: it goes out now
            self._score(seq, token, logits, begins, begins)  # a score per token; not in the text
            self._send(seq, seq.text.finish(), last=True)
            return self._finish(seq, "stop")
        text, stopped = seq.text.push(token)
        # a token that is part of a character goes out with the character
        self._score(seq, token, logits, begins, max(len(seq.text.text), begins + 1))
        if stopped:
            self._send(seq, text, last=True)
            return self._finish(seq, "stop")
        if seq.generated >= seq.params.max_tokens:
            self._send(seq, text + seq.text.finish(), last=True)
            return self._finish(seq, "length")
        self._send(seq, text)
        if len(seq.tokens) - seq.start > self.block_size:  # keep the newest half, re-read it
            seq.start, seq.pos = len(seq.tokens) - (self.block_size - self.block_size // 2), None

    def _score(self, seq: Sequence, token: int, logits: torch.Tensor, begins: int,
               ends: int) -> None:
        """With params.logprobs: token's score, held until its text (begins..ends) is sent."""
        if seq.params.logprobs is not None:
            scored = logprobs.score(logits, [token], seq.params.logprobs)[0]
            scored.offset, scored.end = begins, ends
            seq.pending.append(scored)

    def _send(self, seq: Sequence, text: str, last: bool = False) -> None:
        """Send text, with the scored tokens whose text is now all sent. last: the completion
        ends here: also those whose text it cuts (a stop string); those after the cut go."""
        ready, pending, sent = [], seq.pending, seq.text.sent
        if pending:  # only with params.logprobs
            ready = [t for t in pending if t.end <= sent or (last and t.offset < sent)]
            seq.pending = [] if last else [t for t in pending if t.end > sent]
        if text or ready:
            seq.on_event(("text", text, ready))

    def _finish(self, seq: Sequence, reason: str) -> None:
        with self.lock:
            if self.running[seq.slot] is seq:
                self.running[seq.slot] = None
        seq.done = True
        seq.on_event(("done", reason, seq.generated))

    def _fail_all(self, message: str) -> None:
        with self.lock:
            failed = [s for s in self.running if s is not None] + list(self.waiting)
            self.running, self.waiting = [None] * self.slots, collections.deque()
            self.prefilling = None
        for seq in failed:
            seq.done = True
            seq.on_event(("error", message))

    def warm_up(self) -> None:
        """Run every shape serving will use before the first request: a prefill at each prompt
        length bucket (with a bucket: the multiples of it up to block_size), a decode step at
        each row count (static: the one full batch), and each sampling path."""
        block = self.block_size
        lengths = ([min(block, k) for k in range(self.bucket, block + self.bucket, self.bucket)]
                   if self.bucket > 0 else sorted({1, block - block // 2, block}))
        params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),  # every step
                  SamplingParams(max_tokens=2, temperature=1.0, top_k=5, top_p=0.9, seed=0,
                                 ignore_eos=True)]
        for length in lengths:
            self._warm([Sequence([0] * length, params[length % 2], lambda event: None)])
        row_counts = [self.slots] if self.static else range(1, self.slots + 1)
        for rows in row_counts:
            self._warm([Sequence([0], params[i % 2], lambda event: None) for i in range(rows)])

    def _warm(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)
        while any(not s.done for s in seqs):
            self.step()
