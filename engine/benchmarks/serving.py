"""Serving under load, `python bench.py serve`: serve.py on 127.0.0.1 with continuous batching
beside one request at a time, per concurrency level, and the first request's TTFT (load); 1 vs 2
workers splitting the cores (workers); the PSS of N workers sharing the weights or not (memory);
our weight formats beside outside servers (formats); running streams' token gaps while
context-length prompts are read, per sample.prefill_chunk (prefill). RESULTS/serve_NAME.{json,md}.

    python bench.py serve --checkpoint out/shakespeare_char --threads 1 --parts load,workers
    python bench.py serve --gpt2-shaped --parts prefill --weights bfloat16 --name prefill
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from config import Config, opt
from engine import checkpoint, runtime
from engine.benchmarks import decode, options
from engine.benchmarks.report import MIB, section, write_report
from engine.benchmarks.runner import REPO_ROOT
from engine.serving.workers import pss_bytes

TEXT = REPO_ROOT / "data" / "tinyshakespeare.txt"
PROMPT_CHARS = (8, 32, 96)  # the fixed mix: request i takes PROMPT_CHARS[i % 3] ...
OUTPUT_TOKENS = (16, 64, 128)  # ... and OUTPUT_TOKENS[(i // 3) % 3]
GPT2_OUTPUT_TOKENS = (8, 16, 32)
START_S = 600  # bound on a server's start-up (a compile on a busy CPU is slow)
QUIET_CHUNKS = 16  # prefill: text chunks per stream, all running, before the first long prompt
STREAM_TOKENS = 100_000  # prefill: the streams' max_tokens; they are cut off once measured
LONG_MARGIN = 4  # prefill: a long prompt is block_size - LONG_MARGIN tokens
PARTS = ("load", "workers", "memory", "formats", "prefill")


@dataclass
class ServeOptions:
    checkpoint: str = opt("out/shakespeare_char", "the checkpoint served (the default run's)")
    gpt2_shaped: bool = opt(False, "serve a random-weight GPT-2 124M-shaped model instead")
    concurrency: str = opt("1,4,16", "client concurrency levels")
    requests: int = opt(36, "requests per level (the fixed mix of prompt and output lengths)")
    slots: int = opt(16, "decode slots of the batched server")
    rounds: int = opt(2, "the servers take turns this many times; medians")
    threads: int = opt(0, "torch threads of the server; 0 = every core")
    memory_workers: str = opt("1,2,4", "worker counts whose PSS is measured; '' = skip")
    compile: bool = opt(False, "serve with --compile (warm-up compiles every shape)")
    weights: str = opt("float32,bfloat16,int8", "formats: sample.weights, a server each")
    outside: str = opt("", "formats: outside OpenAI-compatible servers on the same weights "
                       "(vLLM, llama.cpp's), LABEL=URL,...")
    fixed_tokens: int = opt(64, "formats: tokens every request generates")
    parts: str = opt("load,workers,memory", "a comma list of " + ", ".join(PARTS))
    chunks: str = opt("0,128", "prefill: sample.prefill_chunk settings, a server each (0: "
                      "every waiting prompt whole)")
    streams: int = opt(8, "prefill: streams decoding while the long prompts arrive")
    long_prompts: int = opt(4, "prefill: context-length prompts sent one after another")
    name: str = opt("cpu", "results go to RESULTS/serve_NAME.{md,json}")
    results: str = opt("bench_results", "the results directory")


class Server:
    """One serve.py subprocess on a free port, healthy once every worker has warmed up."""

    def __init__(self, args: list[str], workers: int = 1):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "serve.py"), "--port=0",
                                      *args], cwd=REPO_ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        started = time.perf_counter()
        port = self._wait(r"listening on http://[\d.]+:(\d+)")
        self.url = f"http://127.0.0.1:{port}"
        self._wait(r"ready, warm-up", count=workers)
        self.ready_s = time.perf_counter() - started
        assert httpx.get(f"{self.url}/health", timeout=60).status_code == 200  # as a balancer

    def _wait(self, pattern: str, count: int = 1) -> str:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text()
            if len(found := re.findall(pattern, text)) >= count:
                return found[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py exited:\n{text}")
            time.sleep(0.1)
        raise RuntimeError(f"serve.py did not start in {START_S}s:\n"
                           + Path(self.log.name).read_text())

    def pss(self) -> dict[str, int]:
        """PSS of the supervisor and each worker (its children)."""
        pids = [self.proc.pid] + [int(p) for p in Path(
            f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]
        return {str(pid): pss_bytes(pid) for pid in pids}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


@contextlib.contextmanager
def servers(args: dict[str, list[str]], workers: int = 1):
    """label -> Server for each label's arguments, all up at once, stopped on the way out."""
    up: dict[str, Server] = {}
    try:
        for label, server_args in args.items():
            up[label] = Server(server_args, workers)
        yield up
    finally:
        for server in up.values():
            server.stop()


def workload(n: int, gpt2: bool) -> list[dict]:
    """n greedy requests: prompts cut from the bundled text, output lengths cycled."""
    text, outputs = TEXT.read_text(), GPT2_OUTPUT_TOKENS if gpt2 else OUTPUT_TOKENS
    starts = [(i * 997) % (len(text) - 200) for i in range(n)]
    return [{"prompt": text[start:start + PROMPT_CHARS[i % 3]], "temperature": 0,
             "max_tokens": outputs[(i // 3) % 3], "stream": True, "ignore_eos": True,
             "stream_options": {"include_usage": True}} for i, start in enumerate(starts)]


async def one_request(client: httpx.AsyncClient, body: dict,
                      arrivals: list[float] | None = None) -> dict:
    """Stream one completion -> ttft, latency (s), tokens; or error. `arrivals` gets the
    time.perf_counter() of each chunk that carries text."""
    t0 = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if done := line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    ttft = now - t0 if ttft is None else ttft
                    if arrivals is not None:
                        arrivals.append(now)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    if not done:
        return {"error": "no [DONE]"}
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": tokens}


def client(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4)
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits)


async def run_load(url: str, jobs: list[dict], concurrency: int) -> list[dict]:
    """Send jobs from `concurrency` clients, each taking the next job when its last is done."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: list[dict] = []
    async with client(url, concurrency) as http:
        async def client_loop():
            while not queue.empty():
                results.append(await one_request(http, queue.get_nowait()))
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def quantiles(name: str, values: list[float]) -> dict:
    """NAME_p50_ms and NAME_p99_ms of values in seconds."""
    ms = [1e3 * v for v in values]
    return {f"{name}_p50_ms": statistics.median(ms), f"{name}_p99_ms": percentile(ms, .99)}


def measured_load(url: str, jobs: list[dict], concurrency: int) -> dict:
    """run_load, summed up: req/s, tok/s, TTFT and latency p50/p99 (ms), errors."""
    t0 = time.perf_counter()
    results = asyncio.run(run_load(url, jobs, concurrency))
    wall, ok = time.perf_counter() - t0, [r for r in results if "error" not in r]
    return {"requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
            "req_per_s": len(ok) / wall, "tok_per_s": sum(r["tokens"] for r in ok) / wall,
            **quantiles("ttft", [r["ttft"] for r in ok if r["ttft"] is not None]),
            **quantiles("latency", [r["latency"] for r in ok])}


def median_run(runs: list[dict]) -> dict:
    """Per level and metric, the median over rounds (errors: their sum)."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: (sum if k == "errors" else statistics.median)(r[key][k] for r in runs)
                        for k in value}
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def take_turns(urls: dict[str, str], jobs: list[dict], levels: list[int], rounds: int,
               rotate: bool = False, models: dict[str, str] | None = None) -> dict:
    """label -> one dict per round of level -> measured_load, the servers taking turns at each
    level (A B A B: load on the machine hits each alike); rotate: each round starts one later."""
    runs: dict[str, list[dict]] = {label: [] for label in urls}
    for r in range(rounds):
        turns = list(urls.items())
        turns = turns[r % len(turns):] + turns[:r % len(turns)] if rotate else turns
        for label in urls:
            runs[label].append({})
        for level in levels:
            for label, url in turns:
                model = {"model": models[label]} if models else {}
                m = measured_load(url, [{**j, **model} for j in jobs], level)
                runs[label][-1][str(level)] = m
                print(f"  {label:<16} concurrency {level:>2}: {m['req_per_s']:.2f} req/s, "
                      f"{m['tok_per_s']:.0f} tok/s, TTFT p50 {m['ttft_p50_ms']:.0f} ms, "
                      f"errors {m['errors']}", flush=True)
    return runs


async def warm_client() -> None:
    """One streamed request to a stand-in server in this process, so the client's own first
    use (imports, connection machinery) is not counted as a server's first request."""
    body = (b'data: {"choices": [{"text": "x"}]}\n\ndata: {"choices": [], "usage": '
            b'{"completion_tokens": 1}}\n\ndata: [DONE]\n\n')

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    stand_in = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with stand_in:
        await run_load(f"http://127.0.0.1:{stand_in.sockets[0].getsockname()[1]}",
                       [{"prompt": "x"}], 1)


def request_ttft(server: Server, job: dict, when: str) -> dict:
    """Time to first token of one request (a fresh client: each pays a new connection)."""
    result = asyncio.run(run_load(server.url, [job], 1))[0]
    return {f"{when}_request_ttft_ms": 1e3 * result["ttft"], "ready_s": server.ready_s}


def load_part(o: ServeOptions, ckpt: Path, base: list[str], levels: list[int]) -> dict:
    """The batched and the one-at-a-time server, both up, take turns at each level in each
    round; the first request of each before round 1; then a cold server (no warm-up)."""
    jobs, slots = workload(o.requests, o.gpt2_shaped), {"batched": o.slots, "one_at_a_time": 1}
    asyncio.run(warm_client())
    with servers({mode: [*base, f"--checkpoint={ckpt}", f"--slots={n}"]
                  for mode, n in slots.items()}) as up:
        first = {mode: request_ttft(server, jobs[0], "first") for mode, server in up.items()}
        later = {mode: request_ttft(server, jobs[0], "later") for mode, server in up.items()}
        rounds = take_turns({mode: s.url for mode, s in up.items()}, jobs, levels, o.rounds)
    print("cold: batched, --warmup=false", flush=True)
    with servers({"cold": [*base, f"--checkpoint={ckpt}", f"--slots={o.slots}",
                           "--warmup=false"]}) as up:
        cold = request_ttft(up["cold"], jobs[0], "first")
        time.sleep(1)
        cold.update(request_ttft(up["cold"], jobs[0], "later"))
    outputs = GPT2_OUTPUT_TOKENS if o.gpt2_shaped else OUTPUT_TOKENS
    return {"levels": levels, "slots": slots, "requests": o.requests, "cold": cold,
            "runs": {mode: {**median_run(runs), **first[mode], **later[mode]}
                     for mode, runs in rounds.items()}, "rounds": rounds,
            "load": (f"Load: {o.requests} greedy streamed requests per level, prompts of "
                     f"{'/'.join(map(str, PROMPT_CHARS))} characters cut from tinyshakespeare, "
                     f"outputs of {'/'.join(map(str, outputs))} tokens, in a fixed mix. Both "
                     f"servers up at once, taking turns at each level; medians of {o.rounds} "
                     "rounds; with this few requests p99 is about the slowest.")}


def load_markdown(report: dict) -> list[str]:
    runs, keys = report["runs"], ("ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms",
                                  "latency_p99_ms", "errors")
    rows = []
    for level, mode in ((str(level), mode) for level in report["levels"]
                        for mode in ("batched", "one_at_a_time")):
        m = runs[mode][level]
        ratio = m["tok_per_s"] / runs["one_at_a_time"][level]["tok_per_s"]
        rows.append([mode.replace("_", " ") + f" (slots {report['slots'][mode]})", level,
                     f"{m['req_per_s']:.2f}", f"{m['tok_per_s']:.0f}", f"{ratio:.2f}x",
                     *(f"{m[k]:.0f}" for k in keys)])
    starts = {**runs, "batched, --warmup=false": report["cold"]}
    first = [[name.replace("_", " "), f"{m['first_request_ttft_ms']:.0f}",
              f"{m['later_request_ttft_ms']:.0f}", f"{m['ready_s']:.1f}"]
             for name, m in starts.items()]
    header = ["server", "concurrency", "req/s", "tokens/s", "vs one at a time", "TTFT p50 ms",
              "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "errors"]
    return [*section(report["load"], header, rows),
            *section("The very first request after /health is 200 against the same request "
                     "sent later from a new client (time to first token, ms; start: launch to "
                     "healthy, s):", ["server", "first request TTFT ms", "later request TTFT "
                                      "ms", "start s"], first)]


def workers_part(o: ServeOptions, ckpt: Path, common: list[str], levels: list[int]
                 ) -> list[dict]:
    """Throughput of 1 and 2 workers splitting the cores and the slots, at the top concurrency."""
    rows, cores, jobs = [], os.cpu_count() or 1, workload(o.requests, o.gpt2_shaped)
    for workers in (1, 2):
        threads, slots = max(1, cores // workers), max(1, o.slots // workers)
        with servers({"w": [*common, f"--checkpoint={ckpt}", f"--workers={workers}",
                            f"--threads={threads}", f"--slots={slots}"]}, workers) as up:
            rows.append({"workers": workers, "threads": threads, "slots": slots,
                         "concurrency": max(levels),
                         **measured_load(up["w"].url, jobs, max(levels))})
        print(f"  workers {workers} x {threads} threads: {rows[-1]['tok_per_s']:.0f} tok/s",
              flush=True)
    return rows


def workers_markdown(rows: list[dict]) -> list[str]:
    cells = [[r["workers"], r["threads"], r["slots"], r["concurrency"], f"{r['req_per_s']:.2f}",
              f"{r['tok_per_s']:.0f}", f"{r['latency_p50_ms']:.0f}", r["errors"]] for r in rows]
    return section("Workers splitting the cores and the slots (the same load, the top "
                   "concurrency):", ["workers", "threads each", "slots each", "concurrency",
                                     "req/s", "tokens/s", "latency p50 ms", "errors"], cells)


def memory_part(o: ServeOptions, ckpt: Path) -> list[dict]:
    """Total PSS of serve.py with N workers sharing the weights, and with one copy each."""
    rows = []
    for workers in (int(n) for n in options.comma_list(o.memory_workers)):
        for shared in (True, False):
            with servers({"m": ["--device=cpu", f"--checkpoint={ckpt}", f"--workers={workers}",
                                "--threads=1", "--slots=4", f"--share-weights={shared}"]},
                         workers) as up:
                asyncio.run(run_load(up["m"].url, workload(2 * workers, o.gpt2_shaped),
                                     2 * workers))
                pss = up["m"].pss()
            rows.append({"workers": workers, "shared": shared, "pss_total_mib": sum(
                pss.values()) / MIB, "pss_mib": {pid: v / MIB for pid, v in pss.items()}})
            print(f"  workers {workers} shared={shared}: PSS {rows[-1]['pss_total_mib']:.0f} MiB",
                  flush=True)
    return rows


def memory_markdown(rows: list[dict]) -> list[str]:
    cells = [[r["workers"], "one shared copy" if r["shared"] else "a copy per worker",
              f"{r['pss_total_mib']:.0f}"] for r in rows]
    return section("Memory: total PSS (/proc/PID/smaps_rollup) of the supervisor and its "
                   "workers, after a few requests:", ["workers", "weights", "total PSS MiB"],
                   cells)


def formats_part(o: ServeOptions, ckpt: Path, base: list[str], levels: list[int]) -> dict:
    """Our server once per weight format beside the --outside servers, all up at once and taking
    turns at each level (each round starting one server later), on one load: --requests greedy
    requests of --fixed-tokens tokens each."""
    outside = dict(item.split("=", 1) for item in options.comma_list(o.outside))
    jobs = [{**job, "max_tokens": o.fixed_tokens} for job in workload(o.requests, o.gpt2_shaped)]
    asyncio.run(warm_client())
    with servers({f"ours {fmt}": [*base, f"--checkpoint={ckpt}", f"--slots={o.slots}",
                                  f"--weights={fmt}"]
                  for fmt in options.comma_list(o.weights)}) as ours:
        urls = {**{label: s.url for label, s in ours.items()}, **outside}
        # the model id each lists first (GET /v1/models): outside servers want it named
        models = {label: httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
                  for label, url in urls.items()}
        rounds = take_turns(urls, jobs, levels, o.rounds, rotate=True, models=models)
    return {"levels": levels, "requests": o.requests, "tokens": o.fixed_tokens,
            "slots": o.slots, "outside": outside, "models": models,
            "runs": {label: median_run(runs) for label, runs in rounds.items()}}


def formats_markdown(f: dict) -> list[str]:
    levels = [str(c) for c in f["levels"]]
    header = ["server", *(f"tok/s at {c}" for c in levels),
              *(f"TTFT p50 ms at {c}" for c in levels), "errors"]
    rows = [[label, *(f"{m[c]['tok_per_s']:.0f}" for c in levels),
             *(f"{m[c]['ttft_p50_ms']:.0f}" for c in levels),
             sum(m[c]["errors"] for c in levels)] for label, m in f["runs"].items()]
    outside = ", ".join(f"{k} {v}" for k, v in f["outside"].items()) or "none"
    return section(f"Formats: {f['requests']} greedy streamed requests of {f['tokens']} tokens "
                   f"per level (prompts of {'/'.join(map(str, PROMPT_CHARS))} characters), our "
                   f"servers with --slots {f['slots']}; every server up at once, taking turns "
                   f"at each level; medians over the rounds. Outside: {outside}.", header, rows)


def token_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """A prompt of `length` token ids spread over the vocabulary (any tokenizer takes it)."""
    return [(seed * 7919 + 31 * i) % vocab for i in range(length)]


async def wait_chunks(arrivals: list[list[float]], streams: list[asyncio.Task],
                      targets: list[int]) -> float:
    """Wait until stream i has had targets[i] text chunks -> the time then. A stream that has
    ended is an error: it would leave the window it was to measure."""
    while True:
        if ended := [task.result() for task in streams if task.done()]:
            raise RuntimeError(f"a stream ended before it was measured: {ended[0]}")
        if all(len(times) >= n for times, n in zip(arrivals, targets)):
            return time.perf_counter()
        await asyncio.sleep(0.01)


def gap_figures(window: str, gaps: list[float]) -> dict:
    return {f"{window}_gaps": len(gaps), **quantiles(f"{window}_gap", gaps),
            f"{window}_gap_max_ms": 1e3 * max(gaps)}


async def prefill_round(url: str, shape: dict, o: ServeOptions) -> dict:
    """--streams greedy streams, once all running, get QUIET_CHUNKS more text chunks each, then
    --long-prompts prompts of the context minus LONG_MARGIN tokens (1 token asked) go one after
    another -> the gaps between the streams' chunks before them (quiet) and overlapping the
    time they took (reading), and the long prompts' time to their token (send to [DONE])."""
    block, vocab = shape["block_size"], shape["vocab_size"]
    body = {"temperature": 0, "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True}
    arrivals: list[list[float]] = [[] for _ in range(o.streams)]
    async with client(url, o.streams) as http:
        streams = [asyncio.create_task(one_request(
            http, {**body, "prompt": token_prompt(8, vocab, i)}, times))
            for i, times in enumerate(arrivals)]
        try:
            running = await wait_chunks(arrivals, streams, [1] * o.streams)
            start = await wait_chunks(arrivals, streams, [len(times) + QUIET_CHUNKS
                                                          for times in arrivals])
            longs = [await one_request(http, {**body, "max_tokens": 1, "prompt": token_prompt(
                block - LONG_MARGIN, vocab, 1000 + k)}) for k in range(o.long_prompts)]
            end = time.perf_counter()  # then each stream's gap that spans the end, too
            await wait_chunks(arrivals, streams, [len(times) + 1 for times in arrivals])
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    if errors := [r["error"] for r in longs if "error" in r]:
        raise RuntimeError(f"long prompts failed: {errors}")
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    return {**gap_figures("quiet", [b - a for a, b in gaps if a >= running and b <= start]),
            **gap_figures("reading", [b - a for a, b in gaps if b > start and a < end]),
            "long_ttft_p50_ms": 1e3 * statistics.median(r["latency"] for r in longs),
            "long_requests": len(longs), "reading_s": end - start}


def prefill_part(o: ServeOptions, ckpt: Path, base: list[str]) -> dict:
    """Per round, our server once per prefill chunk setting, one up at a time (two would share
    the cores), each measured by prefill_round; medians over the rounds."""
    shape = json.loads((ckpt / "config.json").read_text())["model"]
    chunks, weights = options.comma_list(o.chunks), options.comma_list(o.weights)[0]
    rounds: dict[str, list[dict]] = {chunk: [] for chunk in chunks}
    asyncio.run(warm_client())
    for _ in range(o.rounds):
        for chunk in chunks:
            with servers({"p": [*base, f"--checkpoint={ckpt}", f"--slots={o.slots}",
                                f"--weights={weights}", f"--sample.prefill_chunk={chunk}",
                                f"--max-tokens-limit={STREAM_TOKENS}"]}) as up:
                rounds[chunk].append(asyncio.run(prefill_round(up["p"].url, shape, o)))
            m = rounds[chunk][-1]
            print(f"  prefill chunk {chunk:>4}: gap p99 {m['quiet_gap_p99_ms']:.0f} ms quiet, "
                  f"{m['reading_gap_p99_ms']:.0f} ms reading; long TTFT p50 "
                  f"{m['long_ttft_p50_ms']:.0f} ms", flush=True)
    return {"chunks": [int(c) for c in chunks], "streams": o.streams, "weights": weights,
            "long_prompts": o.long_prompts, "prompt_tokens": shape["block_size"] - LONG_MARGIN,
            "slots": o.slots, "rounds_run": o.rounds, "rounds": rounds,
            "runs": {chunk: median_run(runs) for chunk, runs in rounds.items()}}


PREFILL_COLUMNS = {"quiet gap p50 ms": "quiet_gap_p50_ms", "quiet gap p99 ms": "quiet_gap_p99_ms",
                   "reading gap p50 ms": "reading_gap_p50_ms",
                   "reading gap p99 ms": "reading_gap_p99_ms",
                   "reading gap max ms": "reading_gap_max_ms",
                   "long prompt TTFT p50 ms": "long_ttft_p50_ms"}


def prefill_markdown(p: dict) -> list[str]:
    runs = {c: p["runs"][str(c)] for c in p["chunks"]}
    rows = [[f"{c} (whole prompts)" if c == 0 else f"{c} tokens a step",
             *(f"{m[key]:.0f}" for key in PREFILL_COLUMNS.values()),
             f"{m['quiet_gaps']:.0f} / {m['reading_gaps']:.0f}"] for c, m in runs.items()]
    lines = section(
        f"Prefill: {p['streams']} greedy streams (8-token prompts) decode on our server "
        f"(--weights {p['weights']}, --slots {p['slots']}); after {QUIET_CHUNKS} text chunks "
        f"each (quiet), {p['long_prompts']} prompts of {p['prompt_tokens']} tokens (the context) "
        "asking 1 token go one after another (reading: the gaps that overlap that time). A gap: "
        "the time between two text chunks of one stream, at the client; long prompt TTFT: send "
        f"to its token. One server at a time; medians of {p['rounds_run']} rounds.",
        ["prefill chunk", *PREFILL_COLUMNS, "gaps (quiet / reading)"], rows)
    if len(runs) > 1:
        (a, before), (b, after) = list(runs.items())[0], list(runs.items())[-1]
        lines += [f"While the long prompts are read, a running stream waits "
                  f"{after['reading_gap_p99_ms']:.0f} ms (p99) for its next token with prefill "
                  f"chunk {b}, against {before['reading_gap_p99_ms']:.0f} ms with chunk {a} "
                  f"(quiet: {before['quiet_gap_p99_ms']:.0f} ms); a long prompt's token takes "
                  f"{after['long_ttft_p50_ms']:.0f} ms against "
                  f"{before['long_ttft_p50_ms']:.0f} ms (p50)."]
    return lines


def served_model(o: ServeOptions, folder: Path) -> tuple[Path, str]:
    """(the checkpoint served, its description); --gpt2-shaped saves one in folder."""
    if not o.gpt2_shaped:
        ckpt = checkpoint.resolve(o.checkpoint)
        m = json.loads((ckpt / "config.json").read_text())["model"]
        return ckpt, (f"{ckpt} ({m['n_layer']} layers x {m['n_embd']}, {m['n_head']} heads, "
                      f"block {m['block_size']}, vocab {m['vocab_size']}, attention "
                      f"{m['attention']})")
    model, cfg = decode.random_gpt2(), Config()
    cfg.model = model.config
    ckpt = checkpoint.save(folder, 0, model, cfg, {"tokenizer": {"kind": "gpt2"}})
    return ckpt, "random-weight GPT-2 124M shape (12 x 768, block 1024, vocab 50257, sdpa)"


def run(o: ServeOptions, command: str) -> int:
    """The parts asked for; the page to stdout and RESULTS/serve_NAME.{json,md}."""
    parts = options.check_list(o, "parts", PARTS)
    levels = [int(c) for c in options.comma_list(o.concurrency)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # servers stopped on the way out
    report = {"name": o.name, "machine": runtime.machine_line(torch.device("cpu")),
              "command": command}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, report["model"] = served_model(o, Path(tmp))
        common = ["--device=cpu", "--max_queue=64", *(["--compile=true"] if o.compile else [])]
        base = [*common, *([f"--threads={o.threads}"] if o.threads else [])]
        if "load" in parts:
            report.update(load_part(o, ckpt, base, levels))
        if "workers" in parts:
            report["workers"] = workers_part(o, ckpt, common, levels)
        if "formats" in parts:
            report["formats"] = formats_part(o, ckpt, base, levels)
        if "prefill" in parts:
            report["prefill"] = prefill_part(o, ckpt, base)
        if "memory" in parts and o.memory_workers:
            report["memory"] = memory_part(o, ckpt)
    page = [f"# Serving benchmark ({o.name})", "", f"Machine: {report['machine']}", "",
            f"Model: {report['model']}", "", f"Command: `{command}`", "",
            *(load_markdown(report) if "runs" in report else [])]
    for part, to_markdown in (("workers", workers_markdown), ("formats", formats_markdown),
                              ("prefill", prefill_markdown), ("memory", memory_markdown)):
        if report.get(part):
            page += to_markdown(report[part])
    print("\n".join(page))
    write_report(report, "\n".join(page), o.results, f"serve_{o.name}")
    return 0
