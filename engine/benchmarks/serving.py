"""Serving under load, `python bench.py serve`, one part each (RESULTS/serve_NAME.{json,md}):
load (batching beside one request at a time; the first request), workers (1 vs 2 splitting the
cores), formats (our weight formats beside outside servers such as vLLM), prefill (running
streams' token gaps while long prompts are read, per prefill chunk), memory (PSS of N workers).

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
from typing import Iterator

import httpx
import torch

from config import Config, opt
from engine import checkpoint, saving
from engine.benchmarks import checks, decode
from engine.benchmarks.report import MIB, section, write_report
from engine.benchmarks.timing import REPO_ROOT
from engine.device import machine_line
from engine.serving.supervisor import pss_bytes

TEXT = REPO_ROOT / "data" / "tinyshakespeare.txt"
PROMPT_CHARS = (8, 32, 96)  # the fixed mix: request i takes PROMPT_CHARS[i % 3] ...
OUTPUT_TOKENS = (16, 64, 128)  # ... and OUTPUT_TOKENS[(i // 3) % 3]
GPT2_OUTPUT_TOKENS = (8, 16, 32)
START_S = 600  # bound on a server's start-up
QUIET_CHUNKS = 16  # prefill: text chunks per stream, all running, before the first long prompt
STREAM_TOKENS = 100_000  # prefill: the streams' max_tokens; they are cut off once measured
LONG_MARGIN = 4  # prefill: a long prompt is block_size - LONG_MARGIN tokens
PARTS = ("load", "workers", "formats", "prefill", "memory")


@dataclass
class ServeOptions:
    checkpoint: str = opt("out/shakespeare_char", "the checkpoint served (the default run's)")
    gpt2_shaped: bool = opt(False, "serve a random-weight GPT-2 124M-shaped model instead")
    parts: str = opt("load,workers,memory", "a comma list of " + ", ".join(PARTS))
    concurrency: str = opt("1,4,16", "client concurrency levels")
    requests: int = opt(36, "requests per level (the fixed mix of prompt and output lengths)")
    slots: int = opt(16, "decode slots of the batched server")
    rounds: int = opt(2, "the servers take turns this many times; medians")
    threads: int = opt(0, "torch threads of the server; 0 = every core")
    memory_workers: str = opt("1,2,4", "memory: worker counts whose PSS is measured")
    weights: str = opt("float32,bfloat16,int8", "formats: sample.weights, a server each")
    outside: str = opt("", "formats: outside OpenAI-compatible servers, LABEL=URL,...")
    fixed_tokens: int = opt(64, "formats: tokens every request generates")
    chunks: str = opt("0,128", "prefill: sample.prefill_chunk settings, a server each")
    streams: int = opt(8, "prefill: streams decoding while the long prompts arrive")
    long_prompts: int = opt(4, "prefill: context-length prompts sent one after another")
    name: str = opt("cpu", "results go to RESULTS/serve_NAME.{md,json}")
    results: str = opt("bench_results", "the results directory")


@dataclass
class Server:
    url: str
    ready_s: float  # launch to healthy
    pid: int


def wait_for(proc: subprocess.Popen, log: Path, pattern: str, count: int = 1) -> str:
    """The first match of `pattern` in serve.py's log, once it has `count` of them."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if len(found := re.findall(pattern, text := log.read_text())) >= count:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited:\n{text}")
        time.sleep(0.1)
    raise RuntimeError(f"serve.py did not start in {START_S}s:\n{log.read_text()}")


@contextlib.contextmanager
def server(o: ServeOptions, ckpt: Path, *flags: str, workers: int = 1) -> Iterator[Server]:
    """serve.py on a free port with these flags, healthy once every worker has warmed up;
    stopped on the way out."""
    threads = [f"--threads={o.threads}"] if o.threads else []  # before flags: theirs win
    args = ["--port=0", "--device=cpu", "--max_queue=64", f"--checkpoint={ckpt}", *threads]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "serve.py"), *args, *flags],
                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            started = time.perf_counter()
            url = "http://127.0.0.1:" + wait_for(proc, Path(log.name), r"listening on .*:(\d+)")
            wait_for(proc, Path(log.name), r"ready, warm-up", workers)
            up = Server(url, time.perf_counter() - started, proc.pid)
            assert asyncio.run(health(url)) == 200  # as a balancer would
            yield up
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def servers(o: ServeOptions, ckpt: Path, flags: dict[str, list[str]]
            ) -> Iterator[dict[str, Server]]:
    """label -> server(its flags), all up at once."""
    with contextlib.ExitStack() as stack:
        yield {label: stack.enter_context(server(o, ckpt, *f)) for label, f in flags.items()}


def workload(n: int, gpt2: bool) -> list[dict]:
    """n greedy requests: prompts cut from the bundled text, output lengths cycled."""
    text, outputs = TEXT.read_text(), GPT2_OUTPUT_TOKENS if gpt2 else OUTPUT_TOKENS
    starts = [(i * 997) % (len(text) - 200) for i in range(n)]
    return [{"prompt": text[start:start + PROMPT_CHARS[i % 3]], "temperature": 0,
             "max_tokens": outputs[(i // 3) % 3], "stream": True, "ignore_eos": True,
             "stream_options": {"include_usage": True}} for i, start in enumerate(starts)]


def client(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4)
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits)


async def health(url: str) -> int:
    """GET /health through the async client, whose first use is then not a request's."""
    async with client(url, 1) as http:
        return (await http.get("/health")).status_code


async def one_request(client: httpx.AsyncClient, body: dict,
                      arrivals: list[float] | None = None) -> dict:
    """Stream one completion -> ttft, latency (s), tokens; or error. `arrivals` gets the
    time.perf_counter() of each chunk that carries text."""
    t0, tokens, arrivals = time.perf_counter(), 0, [] if arrivals is None else arrivals
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return {"ttft": arrivals[0] - t0 if arrivals else None, "tokens": tokens,
                            "latency": time.perf_counter() - t0}
                chunk = json.loads(line[6:]) if line.startswith("data: ") else {}
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    return {"error": "no [DONE]"}


def quantiles(name: str, values: list[float]) -> dict:
    """NAME_p50_ms and NAME_p99_ms (the nearest rank) of values in seconds."""
    ms = sorted(1e3 * v for v in values)
    return {f"{name}_p50_ms": statistics.median(ms),
            f"{name}_p99_ms": ms[round(0.99 * (len(ms) - 1))]}


def measured_load(url: str, jobs: list[dict], concurrency: int) -> dict:
    """The jobs from `concurrency` clients, each taking the next job when its last is done ->
    req/s, tok/s, TTFT and latency p50/p99 (ms), errors."""
    async def send() -> list[dict]:
        queue, results = list(jobs), []
        async with client(url, concurrency) as http:
            async def one_client() -> None:
                while queue:
                    results.append(await one_request(http, queue.pop(0)))
            await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return results

    t0 = time.perf_counter()
    results = asyncio.run(send())
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


def take_turns(urls: dict[str, str], jobs: dict[str, list[dict]], levels: list[int],
               rounds: int, rotate: bool = False) -> dict[str, list[dict]]:
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
                m = runs[label][-1][str(level)] = measured_load(url, jobs[label], level)
                print(f"  {label:<16} concurrency {level:>2}: {m['req_per_s']:.2f} req/s, "
                      f"{m['tok_per_s']:.0f} tok/s, TTFT p50 {m['ttft_p50_ms']:.0f} ms, "
                      f"errors {m['errors']}", flush=True)
    return runs


def figures(m: dict, keys: tuple[str, ...]) -> list[str]:
    """A table row's cells: req/s to 2 decimals, every other figure to a whole number."""
    return [f"{m[k]:.2f}" if k == "req_per_s" else f"{m[k]:.0f}" for k in keys]


def load_part(o: ServeOptions, ckpt: Path, levels: list[int]) -> tuple[dict, list[str]]:
    """The batched and the one-at-a-time server take turns at each level in each round; first,
    each one's first request and a later one, and those of a batched server without warm-up."""
    jobs, slots = workload(o.requests, o.gpt2_shaped), {"batched": o.slots, "one_at_a_time": 1}
    cold = "batched, --warmup=false"
    flags = {**{mode: [f"--slots={n}"] for mode, n in slots.items()},
             cold: [f"--slots={o.slots}", "--warmup=false"]}
    with servers(o, ckpt, flags) as up:
        first = {mode: measured_load(s.url, jobs[:1], 1)["ttft_p50_ms"] for mode, s in up.items()}
        time.sleep(1)
        starts = {mode: {"first_request_ttft_ms": first[mode], "ready_s": s.ready_s,
                         "later_request_ttft_ms": measured_load(s.url, jobs[:1], 1)["ttft_p50_ms"]}
                  for mode, s in up.items()}
        rounds = take_turns({mode: up[mode].url for mode in slots}, dict.fromkeys(slots, jobs),
                            levels, o.rounds)
    runs = {mode: {**median_run(rounds[mode]), **starts[mode]} for mode in slots}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms", "errors")
    rows = [[mode.replace("_", " ") + f" (slots {n})", level,
             *figures(runs[mode][level], ("req_per_s", "tok_per_s")),
             f"{runs[mode][level]['tok_per_s'] / runs['one_at_a_time'][level]['tok_per_s']:.2f}x",
             *figures(runs[mode][level], keys)]
            for level in map(str, levels) for mode, n in slots.items()]
    outputs = "/".join(map(str, GPT2_OUTPUT_TOKENS if o.gpt2_shaped else OUTPUT_TOKENS))
    intro = (f"Load: {o.requests} greedy streamed requests per level, prompts of "
             f"{'/'.join(map(str, PROMPT_CHARS))} characters cut from tinyshakespeare, outputs "
             f"of {outputs} tokens, in a fixed mix. Both servers up at once, taking turns at each "
             f"level; medians of {o.rounds} rounds; with this few requests p99 is the slowest.")
    header = ["server", "concurrency", "req/s", "tokens/s", "vs one at a time", "TTFT p50 ms",
              "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "errors"]
    start_keys = ("first_request_ttft_ms", "later_request_ttft_ms")
    start_rows = [[mode.replace("_", " "), *figures(m, start_keys), f"{m['ready_s']:.1f}"]
                  for mode, m in {**runs, cold: starts[cold]}.items()]
    return ({"levels": levels, "slots": slots, "requests": o.requests, "cold": starts[cold],
             "runs": runs, "rounds": rounds},
            [*section(intro, header, rows),
             *section("The first request after /health is 200 against the same request sent "
                      "later from a new client (TTFT ms; start: launch to healthy, s):",
                      ["server", "first request TTFT ms", "later request TTFT ms", "start s"],
                      start_rows)])


def workers_part(o: ServeOptions, ckpt: Path, levels: list[int]) -> tuple[dict, list[str]]:
    """Throughput of 1 and 2 workers splitting the cores and the slots, at the top concurrency."""
    rows, jobs = [], workload(o.requests, o.gpt2_shaped)
    for workers in (1, 2):
        threads, slots = max(1, (os.cpu_count() or 1) // workers), max(1, o.slots // workers)
        with server(o, ckpt, f"--workers={workers}", f"--threads={threads}", f"--slots={slots}",
                    workers=workers) as up:
            rows.append({"workers": workers, "threads": threads, "slots": slots,
                         "concurrency": max(levels), **measured_load(up.url, jobs, max(levels))})
        print(f"  workers {workers} x {threads} threads: {rows[-1]['tok_per_s']:.0f} tok/s")
    columns = {"workers": "workers", "threads each": "threads", "slots each": "slots",
               "concurrency": "concurrency", "req/s": "req_per_s", "tokens/s": "tok_per_s",
               "latency p50 ms": "latency_p50_ms", "errors": "errors"}
    return {"workers": rows}, section(
        "Workers splitting the cores and the slots (the same load, the top concurrency):",
        list(columns), [figures(r, tuple(columns.values())) for r in rows])


def memory_part(o: ServeOptions, ckpt: Path, levels: list[int]) -> tuple[dict, list[str]]:
    """Total PSS of serve.py with N workers sharing the weights, and with one copy each."""
    rows = []
    for workers in map(int, checks.comma_list(o.memory_workers)):
        for shared in (True, False):
            with server(o, ckpt, f"--workers={workers}", "--threads=1", "--slots=4",
                        f"--share-weights={shared}", workers=workers) as up:
                measured_load(up.url, workload(2 * workers, o.gpt2_shaped), 2 * workers)
                pids = [up.pid, *map(int, Path(
                    f"/proc/{up.pid}/task/{up.pid}/children").read_text().split())]
                pss = {str(pid): pss_bytes(pid) / MIB for pid in pids}
            rows.append({"workers": workers, "shared": shared,
                         "pss_total_mib": sum(pss.values()), "pss_mib": pss})
    cells = [[r["workers"], "one shared copy" if r["shared"] else "a copy per worker",
              f"{r['pss_total_mib']:.0f}"] for r in rows]
    return {"memory": rows}, section(
        "Memory: total PSS (/proc/PID/smaps_rollup) of the supervisor and its workers, after a "
        "few requests:", ["workers", "weights", "total PSS MiB"], cells)


def formats_part(o: ServeOptions, ckpt: Path, levels: list[int]) -> tuple[dict, list[str]]:
    """Our server per weight format beside the --outside servers, all up at once, taking turns
    at each level (each round starting one server later): greedy requests of --fixed-tokens."""
    outside = dict(item.split("=", 1) for item in checks.comma_list(o.outside))
    jobs = [{**job, "max_tokens": o.fixed_tokens} for job in workload(o.requests, o.gpt2_shaped)]
    with servers(o, ckpt, {f"ours {fmt}": [f"--slots={o.slots}", f"--weights={fmt}"]
                           for fmt in checks.comma_list(o.weights)}) as ours:
        urls = {**{label: s.url for label, s in ours.items()}, **outside}
        # the model id each lists first: outside servers want it named
        models = {label: httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
                  for label, url in urls.items()}
        rounds = take_turns(urls, {label: [{**job, "model": models[label]} for job in jobs]
                                   for label in urls}, levels, o.rounds, rotate=True)
    runs = {label: median_run(r) for label, r in rounds.items()}
    at = [str(c) for c in levels]
    header = ["server", *(f"tok/s at {c}" for c in at), *(f"TTFT p50 ms at {c}" for c in at),
              "errors"]
    rows = [[label, *(f"{m[c]['tok_per_s']:.0f}" for c in at),
             *(f"{m[c]['ttft_p50_ms']:.0f}" for c in at), sum(m[c]["errors"] for c in at)]
            for label, m in runs.items()]
    named = ", ".join(f"{k} {v}" for k, v in outside.items()) or "none"
    intro = (f"Formats: {o.requests} greedy streamed requests of {o.fixed_tokens} tokens per "
             f"level, our servers with --slots {o.slots}; every server up at once, taking turns "
             f"at each level; medians over the rounds. Outside: {named}.")
    return ({"formats": {"levels": levels, "requests": o.requests, "tokens": o.fixed_tokens,
                         "slots": o.slots, "outside": outside, "models": models, "runs": runs}},
            section(intro, header, rows))


async def prefill_round(url: str, block: int, vocab: int, o: ServeOptions) -> dict:
    """--streams greedy streams, once all running, get QUIET_CHUNKS more text chunks each, then
    --long-prompts prompts of block - LONG_MARGIN tokens (1 token asked) go one after another ->
    the streams' gaps between chunks before them (quiet) and overlapping them (reading), and the
    long prompts' time to their token (send to [DONE])."""
    def prompt(length: int, seed: int) -> list[int]:  # token ids any tokenizer takes
        return [(seed * 7919 + 31 * i) % vocab for i in range(length)]

    async def wait(more: int) -> float:  # until every stream has `more` chunks more -> when
        targets = [len(times) + more for times in arrivals]
        while not all(len(times) >= n for times, n in zip(arrivals, targets)):
            if ended := [task.result() for task in streams if task.done()]:  # left its window
                raise RuntimeError(f"a stream ended before it was measured: {ended[0]}")
            await asyncio.sleep(0.01)
        return time.perf_counter()

    body = {"temperature": 0, "max_tokens": STREAM_TOKENS, "stream": True, "ignore_eos": True}
    arrivals: list[list[float]] = [[] for _ in range(o.streams)]
    async with client(url, o.streams) as http:
        streams = [asyncio.create_task(one_request(http, {**body, "prompt": prompt(8, i)}, times))
                   for i, times in enumerate(arrivals)]
        try:
            running, start = await wait(1), await wait(QUIET_CHUNKS)
            longs = [await one_request(http, {**body, "max_tokens": 1, "prompt": prompt(
                block - LONG_MARGIN, 1000 + k)}) for k in range(o.long_prompts)]
            end = time.perf_counter()
            await wait(1)  # each stream's gap that spans the end, too
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    if errors := [r["error"] for r in longs if "error" in r]:
        raise RuntimeError(f"long prompts failed: {errors}")
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    out = {"long_ttft_p50_ms": 1e3 * statistics.median(r["latency"] for r in longs),
           "long_requests": len(longs), "reading_s": end - start}
    for window, inside in (("quiet", lambda a, b: a >= running and b <= start),
                           ("reading", lambda a, b: b > start and a < end)):
        window_gaps = [b - a for a, b in gaps if inside(a, b)]
        out.update({f"{window}_gaps": len(window_gaps), **quantiles(f"{window}_gap", window_gaps),
                    f"{window}_gap_max_ms": 1e3 * max(window_gaps)})
    return out


PREFILL_KEYS = ("quiet_gap_p50_ms", "quiet_gap_p99_ms", "reading_gap_p50_ms",
                "reading_gap_p99_ms", "reading_gap_max_ms", "long_ttft_p50_ms")


def prefill_part(o: ServeOptions, ckpt: Path, levels: list[int]) -> tuple[dict, list[str]]:
    """Per round, our server once per prefill chunk setting, one up at a time (two would share
    the cores), each measured by prefill_round; medians over the rounds."""
    shape = json.loads((ckpt / "config.json").read_text())["model"]
    chunks, weights = checks.comma_list(o.chunks), checks.comma_list(o.weights)[0]
    rounds: dict[str, list[dict]] = {chunk: [] for chunk in chunks}
    for _ in range(o.rounds):
        for chunk in chunks:
            with server(o, ckpt, f"--slots={o.slots}", f"--weights={weights}",
                        f"--sample.prefill_chunk={chunk}",
                        f"--max-tokens-limit={STREAM_TOKENS}") as up:
                m = asyncio.run(prefill_round(up.url, shape["block_size"], shape["vocab_size"], o))
            rounds[chunk].append(m)
            print(f"  prefill chunk {chunk:>4}: gap p99 {m['quiet_gap_p99_ms']:.0f} ms quiet, "
                  f"{m['reading_gap_p99_ms']:.0f} ms reading", flush=True)
    runs = {chunk: median_run(r) for chunk, r in rounds.items()}
    rows = [[f"{c} (whole prompts)" if c == "0" else f"{c} tokens a step",
             *figures(m, PREFILL_KEYS),
             f"{m['quiet_gaps']:.0f} / {m['reading_gaps']:.0f}"] for c, m in runs.items()]
    lines = section(
        f"Prefill: {o.streams} greedy streams (8-token prompts) decode on our server (--weights "
        f"{weights}, --slots {o.slots}); after {QUIET_CHUNKS} text chunks each (quiet), "
        f"{o.long_prompts} prompts of {shape['block_size'] - LONG_MARGIN} tokens asking 1 token "
        "go one after another (reading: the gaps that overlap that time). A gap: the time between "
        "two text chunks of one stream, at the client; long prompt TTFT: send to its token. One "
        f"server at a time; medians of {o.rounds} rounds.",
        ["prefill chunk", *(k.replace("_", " ").replace("long ttft", "long prompt TTFT")
                            for k in PREFILL_KEYS), "gaps (quiet / reading)"], rows)
    if len(runs) > 1:
        (a, before), (b, after) = list(runs.items())[0], list(runs.items())[-1]
        lines.append(f"While the long prompts are read, a running stream waits "
                     f"{after['reading_gap_p99_ms']:.0f} ms (p99) for its next token with prefill "
                     f"chunk {b}, against {before['reading_gap_p99_ms']:.0f} ms with chunk {a} "
                     f"(quiet: {before['quiet_gap_p99_ms']:.0f} ms); a long prompt's token takes "
                     f"{after['long_ttft_p50_ms']:.0f} ms against "
                     f"{before['long_ttft_p50_ms']:.0f} ms (p50).")
    return {"prefill": {"chunks": [int(c) for c in chunks], "streams": o.streams,
                        "weights": weights, "long_prompts": o.long_prompts,
                        "prompt_tokens": shape["block_size"] - LONG_MARGIN, "slots": o.slots,
                        "rounds_run": o.rounds, "rounds": rounds, "runs": runs}}, lines


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
    ckpt = saving.save(folder, 0, model, cfg, {"tokenizer": {"kind": "gpt2"}})
    return ckpt, "random-weight GPT-2 124M shape (12 x 768, block 1024, vocab 50257, sdpa)"


def run(o: ServeOptions, command: str) -> int:
    """The parts asked for; the page to stdout and RESULTS/serve_NAME.{json,md}."""
    asked = checks.check_list(o, "parts", PARTS)
    levels = [int(c) for c in checks.comma_list(o.concurrency)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # servers stopped on the way out
    report = {"name": o.name, "machine": machine_line(torch.device("cpu")),
              "command": command}
    page: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, report["model"] = served_model(o, Path(tmp))
        for part in (p for p in PARTS if p in asked):
            data, lines = MEASURE[part](o, ckpt, levels)
            report.update(data)
            page += lines
    page = [f"# Serving benchmark ({o.name})", "", f"Machine: {report['machine']}", "",
            f"Model: {report['model']}", "", f"Command: `{command}`", "", *page]
    print("\n".join(page))
    write_report(report, "\n".join(page), o.results, f"serve_{o.name}")
    return 0


MEASURE = {"load": load_part, "workers": workers_part, "formats": formats_part,
           "prefill": prefill_part, "memory": memory_part}
