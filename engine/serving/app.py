"""serve.py's HTTP side: an OpenAI-compatible API (FastAPI) over the continuous-batching engine.

    POST /v1/completions   prompt, max_tokens, temperature, top_p, top_k (extension), seed, stop,
                           n, stream (server-sent events ending in `data: [DONE]`), usage,
                           logprobs (0-5) and echo (engine/serving/logprobs.py)
    POST /v1/chat/completions  messages through the model's chat template, the same fields,
                           OpenAI's chat shapes (chat.py); 400 for a model without a template
    GET  /v1/models        the one model served;   GET /health: 200 once warmed up, else 503
    GET  /                 the playground page (playground.py): prompt, controls, stream
    GET  /metrics          Prometheus' text format, summed over the workers (supervisor.py)

    app = create_app(engine, ServedModel(name, block_size, vocab_size, options, template),
                     tokenizer)

With an API key, every /v1 route needs `Authorization: Bearer KEY` (else 401); /, /health and
/metrics stay open. Every error has OpenAI's shape, {"error": {"message", "type", "param",
"code"}}: bad requests 400, no or a wrong key 401, an unknown model or route 404, a wrong method
405, a body over the cap 413, a full queue 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, multiprocess)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException  # 404, 405 are these
from starlette.routing import Match

from data.chat_template import ChatTemplate
from data.tokenizer import TokenizerError
from engine.serving import chat, logprobs
from engine.serving.batching import BatchEngine, QueueFull, SamplingParams, Sequence
from engine.serving.chat import ChatRequest
from engine.serving.logprobs import MAX_LOGPROBS, Scored
from engine.serving.options import ServeOptions
from engine.serving.playground import Playground

UNSUPPORTED = {"best_of": None, "suffix": None, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "logit_bias": None}
WARM_UP_CLIENT = ("warm-up", 0)  # the client address of the in-process warm-up: not counted
# 5 ms .. 60 s: a small model's token on a CPU up to a long completion of GPT-2 on 1 core
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                   60.0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(SamplingParams):
    """The body of POST /v1/completions; OpenAI's defaults. The sampling fields are
    SamplingParams' (batching.py), the rest are the request's. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


@dataclass
class ServedModel:
    """What the API says about the model, and the options it is served with (its limits)."""

    name: str
    block_size: int
    vocab_size: int
    options: ServeOptions
    template: ChatTemplate | None = None  # its checkpoint's chat template (None: no chat)

    @property
    def max_prompt_tokens(self) -> int:
        return self.options.max_prompt_tokens or self.block_size


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, \
            kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Metrics:
    """One worker's Prometheus metrics. With PROMETHEUS_MULTIPROC_DIR set (serve.py's
    supervisor sets it before forking), each worker writes its values to files there and
    exposition() reports the sum over every worker, whichever one answers."""

    def __init__(self, slots: int):
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=None)

        def gauge(name: str, doc: str) -> Gauge:  # livesum: the workers alive now, added up
            return Gauge(name, doc, multiprocess_mode="livesum", registry=None)

        self.requests = Counter("gpt2s_requests", "HTTP requests by route and status (a full "
                                "queue: 503)", ["route", "status"], registry=None)
        self.prompt_tokens = Counter("gpt2s_prompt_tokens", "prompt tokens of the accepted "
                                     "completion requests", registry=None)
        self.completion_tokens = Counter("gpt2s_completion_tokens", "tokens generated (also "
                                         "those of cancelled completions)", registry=None)
        self.time_to_first_token = histogram("gpt2s_time_to_first_token_seconds", "from a "
                                             "request's submission to its first token")
        self.inter_token_latency = histogram("gpt2s_inter_token_latency_seconds", "a "
                                             "completion's mean time between its tokens")
        self.e2e_latency = histogram("gpt2s_e2e_request_latency_seconds", "from a request's "
                                     "submission to its last token")
        self.queue_depth = gauge("gpt2s_queue_depth", "sequences waiting for a decode slot")
        self.busy_slots = gauge("gpt2s_busy_slots", "decode slots generating a sequence")
        self.slots = gauge("gpt2s_slots", "decode slots")
        self.slots.set(slots)

    def refresh(self, engine: BatchEngine) -> None:
        """The gauges from the engine's counts now."""
        stats = engine.stats()
        self.busy_slots.set(stats["active"])
        self.queue_depth.set(stats["queued"])

    def exposition(self) -> bytes:
        registry = CollectorRegistry()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            multiprocess.MultiProcessCollector(registry)
        else:  # one process (an app made in-process): this object's own values
            for metric in vars(self).values():
                registry.register(metric)
        return generate_latest(registry)


def validation_message(errors: list[dict], fields: dict = CompletionRequest.model_fields
                       ) -> tuple[str, str | None]:
    """Pydantic's errors for a request body (its model's fields) -> (one actionable sentence,
    the field)."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = where[0] if where and not where[0].isdigit() else None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail}); send a JSON object", None
    if kind in ("model_attributes_type", "dict_type") and field is None:
        return ("the request body must be a JSON object, sent with Content-Type: "
                "application/json"), None
    if kind == "extra_forbidden":
        known = ", ".join(fields)
        return f"unknown field {field!r}; the fields are: {known}", field
    if kind == "missing":
        return f"{field} is required", field
    if field == "prompt":
        return ("prompt must be a non-empty string, a list of strings, a list of token ids or "
                "a list of lists of token ids"), field
    got = first.get("input")
    shown = json.dumps(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"{'.'.join(where)}: {first.get('msg', 'invalid value')} (got {shown})", field


def check_request(body: CompletionRequest, served: ServedModel) -> None:
    """Everything the schema cannot say: unsupported options, model name, limits."""
    for name, default in UNSUPPORTED.items():
        if getattr(body, name) != default:
            raise ApiError(400, f"{name} is not supported by this server; leave it out", name)
    if body.model is not None and body.model != served.name:
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                       f"{served.name!r} (GET /v1/models)", "model", code="model_not_found")
    if body.logprobs is not None and body.logprobs > MAX_LOGPROBS:
        raise ApiError(400, f"logprobs={body.logprobs} is more alternatives than this server "
                       f"returns; ask for 0 to {MAX_LOGPROBS} (as OpenAI's completions)",
                       "logprobs")
    if body.max_tokens > (limit := served.options.max_tokens_limit):
        raise ApiError(400, f"max_tokens={body.max_tokens} is over this server's limit of "
                       f"{limit}; ask for fewer, or start the server with "
                       f"--max-tokens-limit={body.max_tokens}", "max_tokens")
    stops = body.stop_strings()
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop must be one non-empty string or a list of at most 4 of them",
                       "stop")


def encode_prompts(body: CompletionRequest, tokenizer, served: ServedModel) -> list[list[int]]:
    """The request's prompts as token ids, each checked against the limits."""
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
        else prompt
    if not prompts:
        raise ApiError(400, "prompt is empty; send the text to continue", "prompt")
    out = []
    for i, p in enumerate(prompts):
        which = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        try:
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        except TokenizerError as e:
            raise ApiError(400, f"{which}: {e}", "prompt") from None
        if not ids:
            raise ApiError(400, f"{which} is empty; send the text to continue", "prompt")
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise ApiError(400, f"{which} has token ids outside 0..{served.vocab_size - 1}: "
                           f"{bad[:5]}", "prompt")
        if len(ids) > served.max_prompt_tokens:
            raise ApiError(400, f"{which} has {len(ids)} tokens but this server takes at most "
                           f"{served.max_prompt_tokens} (the model's context is "
                           f"{served.block_size}); send a shorter prompt", "prompt")
        if body.echo and body.logprobs is not None and len(ids) > served.block_size:
            raise ApiError(400, f"{which} has {len(ids)} tokens, but echo with logprobs scores "
                           f"a prompt whole in the model's context of {served.block_size}; "
                           "send a shorter prompt", "prompt")
        out.append(ids)
    return out


def make_sequences(body: CompletionRequest, prompts: list[list[int]],
                   on_event) -> list[Sequence]:
    """n sequences per prompt, choice index = prompt * n + i, each sampled as the request says
    (it is a SamplingParams); with a seed, choice j uses seed + j (so one prompt with n=1 uses
    the seed itself)."""
    seqs = []
    for ids in prompts:
        for _ in range(body.n):
            j = len(seqs)
            params = body if body.seed is None else body.model_copy(update={"seed": body.seed + j})
            seqs.append(Sequence(ids, params, lambda event, j=j: on_event(j, event)))
    return seqs


def sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Completion:
    """One request's sequences in the engine, their events gathered on the event loop, and
    timed for the metrics (None: not counted, the warm-up)."""

    def __init__(self, engine: BatchEngine, body: CompletionRequest, prompts: list[list[int]],
                 served: ServedModel, tokenizer, metrics: Metrics | None = None):
        self.engine, self.served, self.metrics = engine, served, metrics
        self.tokenizer, self.logprobs = tokenizer, body.logprobs is not None
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.seqs = make_sequences(body, prompts, lambda j, event: self._arrived(loop, j, event))
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.completion_tokens = 0
        self.id, self.created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        self.started = time.perf_counter()
        self.first_at: list[float | None] = [None] * len(self.seqs)  # per choice
        self.done_at: list[float | None] = [None] * len(self.seqs)
        self.recorded = False
        self.echoed = [0] * len(self.seqs)  # each choice's echoed prompt: its length in text

    def _arrived(self, loop: asyncio.AbstractEventLoop, j: int, event: tuple) -> None:
        """In the engine's thread: the event's time, then the event to the event loop."""
        now = time.perf_counter()
        if self.first_at[j] is None and event[0] != "prompt":
            self.first_at[j] = now
        if event[0] == "done":
            self.done_at[j] = now
        loop.call_soon_threadsafe(self.events.put_nowait, (j, event))

    def submit(self) -> None:
        try:
            self.engine.submit(self.seqs)
        except QueueFull as e:
            retry_after_s = self.served.options.retry_after_s
            raise ApiError(503, f"the server is at capacity ({e}); retry after "
                           f"{retry_after_s}s", kind="server_overloaded",
                           headers={"Retry-After": str(retry_after_s)}) from None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def close(self) -> None:
        """The request is over (answered, failed or its client gone): cancel what still runs,
        and record it."""
        for seq in self.seqs:
            if not seq.done:
                self.engine.cancel(seq)
        self.record()

    def record(self) -> None:
        """Once: the tokens generated, the time to the first token of any choice, to the last
        of every choice (if all finished), and each finished choice's mean time per token."""
        if self.metrics is None or self.recorded:
            return
        self.recorded, m = True, self.metrics
        m.completion_tokens.inc(sum(seq.generated for seq in self.seqs))
        if firsts := [t for t in self.first_at if t is not None]:
            m.time_to_first_token.observe(min(firsts) - self.started)
        if all(t is not None for t in self.done_at):
            m.e2e_latency.observe(max(self.done_at) - self.started)
        for seq, first, done in zip(self.seqs, self.first_at, self.done_at):
            if done is not None and seq.generated > 1:
                m.inter_token_latency.observe((done - first) / (seq.generated - 1))

    async def batches(self) -> AsyncIterator[list[tuple[int, tuple]]]:
        """Lists of (choice index, event), everything that has arrived, until every sequence
        is done; ApiError 500 on an engine error."""
        left = len(self.seqs)
        while left:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            for j, event in batch:
                if event[0] == "error":
                    raise ApiError(500, event[1], kind="server_error")
                if event[0] == "done":
                    left -= 1
                    self.completion_tokens += event[2]
            if not left:  # recorded before the client has the last of it
                self.record()
            yield batch

    async def events_until_done(self) -> AsyncIterator[tuple[int, tuple]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    def piece(self, j: int, event: tuple) -> tuple[str, list[Scored]]:
        """Choice j's "prompt" (echo) or "text" event -> its text and scored tokens, their
        text_offset set within the choice's whole text (the echoed prompt first)."""
        if event[0] == "prompt":
            text, offsets = logprobs.decoded(self.tokenizer, self.seqs[j].prompt)
            self.echoed[j] = len(text)
            for scored, offset in zip(event[1], offsets):
                scored.offset = offset
            return text, event[1]
        for scored in event[2]:
            scored.offset += self.echoed[j]
        return event[1], event[2]

    def opening(self) -> list[dict]:
        """The chunks a stream begins with, before any text (the chat API's role)."""
        return []

    def choice(self, j: int, text: str, scored: list[Scored], reason: str | None) -> dict:
        """Choice j of a chunk or of the answer; its logprobs in OpenAI's shape, if asked."""
        shaped = logprobs.openai_logprobs(self.tokenizer, scored) if self.logprobs else None
        return {"index": j, "text": text, "logprobs": shaped, "finish_reason": reason}

    def chunk(self, choices: list[dict], usage: bool = False) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.served.name, "choices": choices}
        if usage:
            out["usage"] = {"prompt_tokens": self.prompt_tokens,
                            "completion_tokens": self.completion_tokens,
                            "total_tokens": self.prompt_tokens + self.completion_tokens}
        return out


class ChatCompletion(Completion):
    """A chat request (chat.py): a completion of its prompt ids whose replies end at the
    template's end-of-turn token (not in their text, nor in their logprobs; in usage), in
    OpenAI's chat shapes."""

    def __init__(self, engine: BatchEngine, body: CompletionRequest, served: ServedModel,
                 tokenizer, metrics: Metrics | None = None):
        super().__init__(engine, body, [body.prompt], served, tokenizer, metrics)
        self.id, self.streamed = f"chatcmpl-{secrets.token_hex(12)}", body.stream
        self.end_id = served.template.end_id(tokenizer)
        for seq in self.seqs:
            seq.end_token = self.end_id

    def piece(self, j: int, event: tuple) -> tuple[str, list[Scored]]:
        text, scored = super().piece(j, event)
        return text, [s for s in scored if s.token != self.end_id]

    def opening(self) -> list[dict]:
        return [self.chunk([chat.opening(j) for j in range(len(self.seqs))])]

    def choice(self, j: int, text: str, scored: list[Scored], reason: str | None) -> dict:
        asked = self.logprobs and (scored or not self.streamed)  # a stream's last: null
        content = logprobs.chat_logprobs(self.tokenizer, scored) if asked else None
        return chat.choice(j, text, content, reason, self.streamed)

    def chunk(self, choices: list[dict], usage: bool = False) -> dict:
        return {**super().chunk(choices, usage), "object": chat.object_name(self.streamed)}


async def complete(request: Request, job: Completion) -> dict:
    """The whole completion as one JSON body; a client that goes away cancels it."""
    texts, reasons = [""] * len(job.seqs), [None] * len(job.seqs)
    scored: list[list[Scored]] = [[] for _ in job.seqs]
    events = job.events_until_done()
    try:
        while True:
            waiter = asyncio.ensure_future(anext(events, None))
            while not waiter.done():
                await asyncio.wait([waiter], timeout=0.5)
                if not waiter.done() and await request.is_disconnected():
                    waiter.cancel()
                    return {}
            if (item := waiter.result()) is None:
                break
            j, event = item
            if event[0] == "done":
                reasons[j] = event[1]
            else:
                text, tokens = job.piece(j, event)
                texts[j] += text
                scored[j] += tokens
    finally:
        job.close()
    return job.chunk([job.choice(j, texts[j], scored[j], reasons[j])
                      for j in range(len(texts))], usage=True)


def merged(job: Completion, batch: list[tuple[int, tuple]]) -> list[list]:
    """Events -> [choice, text, scored tokens, finish_reason] chunks, a choice's adjacent
    pieces joined."""
    out: list[list] = []
    for j, event in batch:
        if event[0] == "done":
            out.append([j, "", [], event[1]])
            continue
        text, scored = job.piece(j, event)
        if not text and not scored:  # nothing to send (a chat reply's end-of-turn token)
            continue
        if out and out[-1][0] == j and out[-1][3] is None:
            out[-1][1] += text
            out[-1][2] += scored
        else:
            out.append([j, text, scored, None])
    return out


async def stream(job: Completion, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text (what arrived since the last; with
    logprobs, those of the tokens whose text it completes), one with each finish_reason, usage
    if asked, then [DONE]. Cancelled (the client went away): the sequences leave their
    slots."""
    try:
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null until the last
        for chunk in job.opening():
            yield sse({**chunk, **usage})
        async for batch in job.batches():  # a client that reads slower gets longer chunks
            yield "".join(sse({**job.chunk([job.choice(*piece)]), **usage})
                          for piece in merged(job, batch))
        if include_usage:
            yield sse(job.chunk([], usage=True))
        yield sse("[DONE]")
    except ApiError as e:
        yield sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
    finally:
        job.close()


def check_ready(engine: BatchEngine, served: ServedModel) -> None:
    if not engine.ready.is_set():
        raise ApiError(503, "the server is warming up; retry shortly", kind="server_busy",
                       headers={"Retry-After": str(served.options.retry_after_s)})


def check_room(engine: BatchEngine, completions: int) -> None:
    if completions > engine.slots + engine.max_queue:
        raise ApiError(400, f"this request asks for {completions} completions (prompts x n) "
                       f"but the server holds at most {engine.slots + engine.max_queue}", "n")


async def answer(request: Request, job: Completion, body: CompletionRequest):
    """Queue the job, then stream it or answer it whole."""
    job.submit()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(job, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await complete(request, job)


async def completion(request: Request, body: CompletionRequest, engine: BatchEngine,
                     served: ServedModel, tokenizer, metrics: Metrics | None):
    """POST /v1/completions: checked, queued, then streamed or answered whole."""
    check_ready(engine, served)
    check_request(body, served)
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not \
        isinstance(body.prompt[0], int) else [body.prompt]
    check_room(engine, len(prompts) * body.n)
    job = Completion(engine, body, encode_prompts(body, tokenizer, served), served, tokenizer,
                     metrics)
    return await answer(request, job, body)


async def chat_completion(request: Request, body: ChatRequest, engine: BatchEngine,
                          served: ServedModel, tokenizer, metrics: Metrics | None):
    """POST /v1/chat/completions: the messages through the model's chat template (chat.py),
    then run as a completion of those ids."""
    check_ready(engine, served)
    if served.template is None:
        raise ApiError(400, chat.no_template(served.name), "messages")
    try:
        ids = chat.prompt_ids(body.messages, served.template, tokenizer,
                              served.max_prompt_tokens, served.block_size)
        fields = body.completion_fields(len(ids), served.block_size,
                                        served.options.max_tokens_limit)
    except chat.ChatError as e:
        raise ApiError(400, str(e), e.param) from None
    options = StreamOptions(include_usage=body.include_usage())
    as_completion = CompletionRequest(prompt=ids, stream_options=options, **fields)
    check_request(as_completion, served)
    check_room(engine, body.n)
    job = ChatCompletion(engine, as_completion, served, tokenizer, metrics)
    return await answer(request, job, as_completion)


async def when_ready(app: FastAPI, engine: BatchEngine, on_ready: Callable[[], None] | None,
                     api_key: str = "") -> None:
    """Once the engine has warmed up, warm the HTTP path too (a plain and a streamed request
    through the app, in-process, not counted in the metrics), then report healthy; a failed
    warm-up ends the process."""
    while not engine.ready.is_set():
        if not engine.thread.is_alive():
            print("serve: the engine failed during warm-up (see above)", file=sys.stderr,
                  flush=True)
            os._exit(1)
        await asyncio.sleep(0.05)
    if engine.warmup:
        transport = httpx.ASGITransport(app=app, client=WARM_UP_CLIENT)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://warm-up",
                                     headers=headers) as client:
            for stream in (False, True):
                body = {"prompt": [0], "max_tokens": 2, "stream": stream}
                (await client.post("/v1/completions", json=body)).raise_for_status()
    # what is alive now (the model, the app, torch's and pydantic's caches) lives as long as
    # the server: out of the collector's sight, its pauses scan only what requests allocate
    # (what it bought in time to first token: docs/serve.md#warm-shapes)
    gc.collect()
    gc.freeze()
    app.state.healthy = True
    if on_ready is not None:
        on_ready()


def is_warm_up(scope: dict) -> bool:
    return tuple(scope.get("client") or ()) == WARM_UP_CLIENT


def header(scope: dict, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def key_error(authorization: bytes | None, api_key: str) -> ApiError | None:
    """None if `Authorization: Bearer <api_key>` (compared in constant time), else the 401."""
    scheme, _, token = (authorization or b"").partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode()):
        return None
    where = "the key this server was started with (--api-key or $GPT2S_API_KEY)"
    message = (f"no API key: send the header 'Authorization: Bearer KEY' with {where}"
               if authorization is None else
               f"the API key is not valid: send 'Authorization: Bearer KEY' with {where}")
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(max_bytes: int) -> str:
    return (f"the request body is over this server's limit of {max_bytes:,} bytes; send a "
            f"shorter one, or start the server with a larger --max-body-bytes")


def route_of(routes: list, scope: dict) -> str:
    """The route's template (/v1/models/{name}) for the metrics' labels, or 'unmatched'."""
    for route in routes:
        if route.matches(scope)[0] != Match.NONE:
            return route.path
    return "unmatched"


class Gate:
    """ASGI middleware in front of the app: counts each request by route and status, answers
    401 to a /v1 request without the API key, and 413 to a body over max_body_bytes (0: no
    limit): at once from Content-Length, else counted as it arrives, before it is read whole."""

    def __init__(self, app, routes: list, metrics: Metrics, api_key: str, max_body_bytes: int):
        self.app, self.routes, self.metrics = app, routes, metrics
        self.api_key, self.max_body_bytes = api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = is_warm_up(scope)  # True: counted already, or never (the warm-up)

        async def send_counted(message: dict) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:  # before the body
                counted = True
                self.count(scope, message["status"])
            await send(message)

        try:
            if (refusal := self.refusal(scope)) is not None:
                return await refusal.response()(scope, receive, send_counted)
            await self.app(scope, self.limited(receive), send_counted)
        finally:
            if not counted:  # an exception before any response: the 500
                self.count(scope, 500)

    def count(self, scope: dict, status: int) -> None:
        self.metrics.requests.labels(route_of(self.routes, scope), str(status)).inc()

    def refusal(self, scope: dict) -> ApiError | None:
        path = scope["path"]
        if self.api_key and (path == "/v1" or path.startswith("/v1/")) and (
                error := key_error(header(scope, b"authorization"), self.api_key)) is not None:
            return error
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and self.over(int(length)):
            return ApiError(413, body_too_large(self.max_body_bytes))
        return None

    def over(self, size: int) -> bool:
        return 0 < self.max_body_bytes < size

    def limited(self, receive):
        """receive, raising 413 once the body's bytes so far pass the cap (a chunked body).
        FastAPI's HTTPException: its body parsing passes that through to the handler (any
        other exception would become a 400)."""
        seen = 0

        async def receive_limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if self.over(seen):
                raise HTTPException(413, body_too_large(self.max_body_bytes))
            return message

        return receive_limited


def http_error_message(request: Request, e: StarletteHTTPException, routes: list) -> str:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, a body that cannot be
    parsed) -> a sentence that says what to send instead."""
    if e.status_code == 404:
        known = ", ".join(f"{' '.join(sorted(r.methods))} {r.path}" for r in routes
                          if getattr(r, "include_in_schema", False))
        return f"there is no route {request.url.path}; this server has {known}"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "another method")
        return f"{request.url.path} does not take {request.method}; use {allowed}"
    cause = e.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8 JSON: send a JSON object encoded in UTF-8"
    if isinstance(cause, RecursionError):
        return ("the request body's JSON is nested too deeply to parse: send a JSON object "
                "whose values are at most lists of lists, as POST /v1/completions takes")
    if cause is not None:
        return (f"the request body could not be parsed ({type(cause).__name__}): send a JSON "
                "object encoded in UTF-8")
    return str(e.detail)


async def refresh_gauges(metrics: Metrics, engine: BatchEngine, every_s: float = 0.25) -> None:
    """The worker's gauges, kept current for whichever worker answers /metrics."""
    while True:
        metrics.refresh(engine)
        await asyncio.sleep(every_s)


def create_app(engine: BatchEngine, served: ServedModel, tokenizer,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine (warm-up first) and stops it. The API
    key and the body limit are served.options' (--api-key, --max-body-bytes)."""
    metrics = Metrics(engine.slots)
    api_key = served.options.effective_api_key()
    app = FastAPI(title="gpt2-scratch serve",
                  lifespan=engine_lifespan(engine, metrics, on_ready, api_key))
    app.state.healthy = False
    app.add_middleware(Gate, routes=app.routes, metrics=metrics, api_key=api_key,
                       max_body_bytes=served.options.max_body_bytes)
    add_error_handlers(app)
    add_routes(app, engine, served, tokenizer, metrics)
    return app


def engine_lifespan(engine: BatchEngine, metrics: Metrics, on_ready: Callable[[], None] | None,
                    api_key: str):
    """The app's lifespan: the engine's thread, the warm-up watcher (when_ready) and the
    gauges' refresher run while the app serves; at the end the engine finishes its work."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.ensure_future(when_ready(app, engine, on_ready, api_key))
        refresher = asyncio.ensure_future(refresh_gauges(metrics, engine))
        yield
        watcher.cancel()
        refresher.cancel()
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours (ApiError), a body the schema refuses (400),
    Starlette's own (404, 405, 413 ...), and any crash (500, its traceback in the log only)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        fields = (ChatRequest if request.url.path == "/v1/chat/completions"
                  else CompletionRequest).model_fields
        message, field = validation_message(list(e.errors()), fields)
        return ApiError(400, message, field).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return ApiError(e.status_code, http_error_message(request, e, app.routes), kind=kind,
                        headers=e.headers).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        return ApiError(500, "the server failed on this request (its log has the traceback)",
                        kind="server_error").response()


def add_routes(app: FastAPI, engine: BatchEngine, served: ServedModel, tokenizer,
               metrics: Metrics) -> None:
    """GET /, POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{name}],
    GET /metrics, GET /health."""
    playground = Playground(served.name, bool(served.options.effective_api_key()),
                            served.options.max_tokens_limit, served.template is not None)

    @app.get("/")
    async def page() -> Response:  # open without the key: the page's own requests send it
        return playground.response()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await completion(request, body, engine, served, tokenizer,
                                None if is_warm_up(request.scope) else metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        return await chat_completion(request, body, engine, served, tokenizer,
                                     None if is_warm_up(request.scope) else metrics)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name != served.name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves "
                           f"{served.name!r}", "model", code="model_not_found")
        return model_card(served)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        metrics.refresh(engine)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = app.state.healthy
        body = {"status": "ok" if ready else "warming_up", "model": served.name,
                "worker_pid": os.getpid(), "warmup_s": round(engine.warmup_seconds, 3),
                **engine.stats()}
        return JSONResponse(body, status_code=200 if ready else 503)


def model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "gpt2-scratch",
            "max_model_len": served.block_size, "chat_template": served.template is not None}

