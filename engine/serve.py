"""serve.py's HTTP side: an OpenAI-compatible API (FastAPI) over the continuous-batching engine.

    POST /v1/completions   prompt, max_tokens, temperature, top_p, top_k (extension), seed, stop,
                           n, stream (server-sent events ending in `data: [DONE]`), usage
    GET  /v1/models        the one model served;   GET /health: 200 once warmed up, else 503

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: bad requests 400,
an unknown model 404, a full queue 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.serve_batch import BatchEngine, QueueFull, SamplingParams, Sequence
from engine.tokenizer import TokenizerError

UNSUPPORTED = {"echo": False, "logprobs": None, "best_of": None, "suffix": None,
               "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions; OpenAI's defaults. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension: 0 = off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: GPT-2 goes on past <|endoftext|>
    user: str | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


@dataclass
class ServedModel:
    """What the API says about the model, and the limits it enforces."""

    name: str
    block_size: int
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int
    retry_after_s: int = 1


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


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic's errors for a request body -> (one actionable sentence, the field)."""
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
        known = ", ".join(CompletionRequest.model_fields)
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
    if body.max_tokens > served.max_tokens:
        raise ApiError(400, f"max_tokens={body.max_tokens} is over this server's limit of "
                       f"{served.max_tokens}; ask for fewer, or start the server with "
                       f"--max-tokens-limit={body.max_tokens}", "max_tokens")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
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
        out.append(ids)
    return out


def make_sequences(body: CompletionRequest, prompts: list[list[int]], stop_token: int | None,
                   on_event) -> list[Sequence]:
    """n sequences per prompt, choice index = prompt * n + i; with a seed, choice j uses
    seed + j (so one prompt with n=1 uses the seed itself)."""
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seqs = []
    for ids in prompts:
        for _ in range(body.n):
            j = len(seqs)
            params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature,
                                    top_k=body.top_k, top_p=body.top_p, stop=stops,
                                    seed=None if body.seed is None else body.seed + j,
                                    stop_token=None if body.ignore_eos else stop_token)
            seqs.append(Sequence(ids, params, lambda event, j=j: on_event(j, event)))
    return seqs


def sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Completion:
    """One request's sequences in the engine, their events gathered on the event loop."""

    def __init__(self, engine: BatchEngine, body: CompletionRequest, prompts: list[list[int]],
                 served: ServedModel, stop_token: int | None):
        self.engine, self.served = engine, served
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.seqs = make_sequences(body, prompts, stop_token, lambda j, event: loop.
                                   call_soon_threadsafe(self.events.put_nowait, (j, event)))
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.completion_tokens = 0
        self.id, self.created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

    def submit(self) -> None:
        try:
            self.engine.submit(self.seqs)
        except QueueFull as e:
            raise ApiError(503, f"the server is at capacity ({e}); retry after "
                           f"{self.served.retry_after_s}s", kind="server_overloaded",
                           headers={"Retry-After": str(self.served.retry_after_s)}) from None

    def cancel(self) -> None:
        for seq in self.seqs:
            if not seq.done:
                self.engine.cancel(seq)

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
            yield batch

    async def events_until_done(self) -> AsyncIterator[tuple[int, tuple]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    def chunk(self, choices: list[dict], usage: bool = False) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.served.name, "choices": choices}
        if usage:
            out["usage"] = {"prompt_tokens": self.prompt_tokens,
                            "completion_tokens": self.completion_tokens,
                            "total_tokens": self.prompt_tokens + self.completion_tokens}
        return out


def choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


async def complete(request: Request, job: Completion) -> dict:
    """The whole completion as one JSON body; a client that goes away cancels it."""
    texts, reasons = [""] * len(job.seqs), [None] * len(job.seqs)
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
            if event[0] == "text":
                texts[j] += event[1]
            else:
                reasons[j] = event[1]
    finally:
        job.cancel()
    return job.chunk([choice(j, texts[j], reasons[j]) for j in range(len(texts))], usage=True)


def merged(batch: list[tuple[int, tuple]]) -> list[list]:
    """Events -> [choice, text, finish_reason] chunks, a choice's adjacent texts joined."""
    out: list[list] = []
    for j, event in batch:
        if event[0] != "text":
            out.append([j, "", event[1]])
        elif out and out[-1][0] == j and out[-1][2] is None:
            out[-1][1] += event[1]
        else:
            out.append([j, event[1], None])
    return out


async def stream(job: Completion, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text (what arrived since the last), one with
    each finish_reason, usage if asked, then [DONE]. Cancelled (the client went away): the
    sequences leave their slots."""
    try:
        usage = {"usage": None} if include_usage else {}  # as OpenAI: null until the last
        async for batch in job.batches():  # a client that reads slower gets longer chunks
            yield "".join(sse({**job.chunk([choice(j, text, reason)]), **usage})
                          for j, text, reason in merged(batch))
        if include_usage:
            yield sse(job.chunk([], usage=True))
        yield sse("[DONE]")
    except ApiError as e:
        yield sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
    finally:
        job.cancel()


async def completion(request: Request, body: CompletionRequest, engine: BatchEngine,
                     served: ServedModel, tokenizer, stop_token: int | None):
    """POST /v1/completions: checked, queued, then streamed or answered whole."""
    if not engine.ready.is_set():
        raise ApiError(503, "the server is warming up; retry shortly", kind="server_busy",
                       headers={"Retry-After": str(served.retry_after_s)})
    check_request(body, served)
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not \
        isinstance(body.prompt[0], int) else [body.prompt]
    if len(prompts) * body.n > engine.slots + engine.max_queue:
        raise ApiError(400, f"this request asks for {len(prompts) * body.n} completions "
                       f"(prompts x n) but the server holds at most "
                       f"{engine.slots + engine.max_queue}", "n")
    job = Completion(engine, body, encode_prompts(body, tokenizer, served), served, stop_token)
    job.submit()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(job, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await complete(request, job)


async def when_ready(app: FastAPI, engine: BatchEngine,
                     on_ready: Callable[[], None] | None) -> None:
    """Once the engine has warmed up, warm the HTTP path too (a plain and a streamed request
    through the app, in-process), then report healthy; a failed warm-up ends the process."""
    while not engine.ready.is_set():
        if not engine.thread.is_alive():
            print("serve: the engine failed during warm-up (see above)", file=sys.stderr,
                  flush=True)
            os._exit(1)
        await asyncio.sleep(0.05)
    if engine.warmup:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://warm-up") as client:
            for stream in (False, True):
                body = {"prompt": [0], "max_tokens": 2, "stream": stream}
                (await client.post("/v1/completions", json=body)).raise_for_status()
    app.state.healthy = True
    if on_ready is not None:
        on_ready()


def create_app(engine: BatchEngine, served: ServedModel, tokenizer,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine (warm-up first) and stops it."""
    stop_token = getattr(tokenizer, "eot_id", None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.ensure_future(when_ready(app, engine, on_ready))
        yield
        watcher.cancel()
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="gpt2-scratch serve", lifespan=lifespan)
    app.state.healthy = False

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        message, field = validation_message(list(e.errors()))
        return ApiError(400, message, field).response()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await completion(request, body, engine, served, tokenizer, stop_token)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name != served.name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves "
                           f"{served.name!r}", "model", code="model_not_found")
        return model_card(served)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = app.state.healthy
        body = {"status": "ok" if ready else "warming_up", "model": served.name,
                "worker_pid": os.getpid(), "warmup_s": round(engine.warmup_seconds, 3),
                **engine.stats()}
        return JSONResponse(body, status_code=200 if ready else 503)

    return app


def model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "gpt2-scratch",
            "max_model_len": served.block_size}

