"""Decoding on a device in a precision, `python bench.py decode-device`: random GPT-2 124M-shaped
weights, greedy, a prompt then --new-tokens tokens, in rows (--rows):
    eager     batch 1 as generate.py --dtype=D decodes (float32 weights under autocast)
    weights   batch 1 with the weights themselves held in D (autocast then casts nothing): what
              reading float32 weights and casting them every step costs the eager row
    compiled  batch 1 as generate.py --dtype=D --compile=true (static cache, warmed up first)
    engine    --streams sequences at once through serve.py's BatchEngine (continuous batching,
              its own warm-up of every shape first): tokens/s in all, per stream, time to the
              first token
The batch-1 rows take turns, round after round (medians). RESULTS/decode_device_NAME.{json,md}.

    python bench.py decode-device --device cuda --dtype bfloat16 --streams 16
"""
from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from config import ConfigError, SystemConfig, opt
from data.bpe import GPT2Tokenizer
from engine.benchmarks import checks
from engine.benchmarks.decode import DECODE_SHAPES, our_generate, random_gpt2
from engine.benchmarks.report import section, utc_now, write_report
from engine.benchmarks.timing import take_turns
from engine.device import Runtime, machine_line, setup
from engine.inference import sampling

ROWS = ("eager", "weights", "compiled", "engine")


@dataclass
class DecodeDeviceOptions:
    device: str = opt("auto", "where to decode: auto (CUDA when present) | cpu | cuda | cuda:N")
    dtype: str = opt("bfloat16", "the precision decoded in", ("float32", "bfloat16", "float16"))
    model: str = opt("gpt2", "the shape of the random weights", tuple(DECODE_SHAPES))
    rows: str = opt(",".join(ROWS), "the rows, a comma list of " + ", ".join(ROWS))
    prompt_tokens: int = opt(16, "prompt length (random token ids, seed 0)")
    new_tokens: int = opt(128, "greedy tokens per run (the prefill included)")
    rounds: int = opt(3, "timed runs of each batch-1 row, the rows taking turns; medians")
    streams: int = opt(16, "engine: sequences decoded at once (its slots)")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("", "outputs: RESULTS/decode_device_NAME.{json,md} (default: the device)")


def compiled_run(model: torch.nn.Module, prompt: torch.Tensor, new: int, rt: Runtime,
                 bucket: int) -> tuple[object, float]:
    """(run(n) as generate.py --compile=true decodes, the compile warm-up's seconds)."""
    from engine.compiling import compile_model

    runner, _ = compile_model(model, SystemConfig(compile=True), rt)
    start = time.perf_counter()
    sampling.warm_up(runner, prompt.size(1), new, bucket, rt.autocast)
    rt.synchronize()
    return (lambda n: sampling.generate_tokens(runner, prompt, n, temperature=0,
                                               autocast=rt.autocast, prompt_bucket=bucket),
            time.perf_counter() - start)


def wait_while_alive(event: threading.Event, thread: threading.Thread) -> bool:
    """Wait for event while thread lives -> whether it was set."""
    while not event.wait(timeout=1.0):
        if not thread.is_alive():
            return event.is_set()
    return True


def engine_row(model: torch.nn.Module, rt: Runtime, o: DecodeDeviceOptions, new: int) -> dict:
    """--streams greedy sequences submitted at once to serve.py's BatchEngine (eager, as
    serve.py --dtype=D runs without --compile) after its warm-up: tokens/s in all, per stream,
    and the time to each one's first token."""
    try:
        from engine.serving.batching import BatchEngine, SamplingParams, Sequence
    except ImportError as e:  # pydantic: the server's request models
        return {"status": "skipped", "reason": f"serve.py's engine needs {e.name}: pip install "
                f"{e.name} (gpu_check.sh: carry its wheels, GPU_CHECK_WHEELS=DIR)"}
    engine = BatchEngine(model, model, GPT2Tokenizer(), rt.device, slots=o.streams,
                         max_queue=o.streams, autocast=rt.autocast, empty_cache=False,
                         log=lambda text: print(text, flush=True))
    start = time.perf_counter()
    engine.start()
    if not wait_while_alive(engine.ready, engine.thread):
        return {"status": "failed", "error": "the engine's thread ended in its warm-up (above)"}
    warmup_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    first, finished, lock = {}, threading.Event(), threading.Lock()
    done = []

    def on_event(index: int):
        def handle(event: tuple) -> None:
            with lock:
                if event[0] == "text" and index not in first:
                    first[index] = time.perf_counter()
                if event[0] in ("done", "error"):
                    done.append((index, event))
                    if len(done) == o.streams:
                        finished.set()
        return handle

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    seqs = [Sequence(torch.randint(0, model.config.vocab_size, (o.prompt_tokens,),
                                   generator=gen).tolist(), params, on_event(i))
            for i in range(o.streams)]
    submitted = time.perf_counter()
    engine.submit(seqs)
    if not wait_while_alive(finished, engine.thread):
        return {"status": "failed", "error": "the engine's thread ended while decoding (above)"}
    seconds = time.perf_counter() - submitted
    engine.stop()
    errors = [event[1] for _, event in done if event[0] == "error"]
    if errors:
        return {"status": "failed", "error": errors[0]}
    tokens = sum(s.generated for s in seqs)
    ttft = sorted(first[i] - submitted for i in range(o.streams) if i in first)
    return {"status": "ok", "streams": o.streams, "tokens": tokens, "seconds": seconds,
            "tok_per_s": tokens / seconds, "per_stream_tok_per_s": tokens / seconds / o.streams,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "ttft_max_ms": 1000 * ttft[-1] if ttft else None, "warmup_s": warmup_s}


def batch1_rows(base: torch.nn.Module, rt: Runtime, o: DecodeDeviceOptions, chosen: list[str],
                new: int) -> dict[str, dict]:
    """The batch-1 rows, taking turns after their warm-ups."""
    prompt = torch.randint(0, base.config.vocab_size, (1, o.prompt_tokens), device=rt.device,
                           generator=torch.Generator(rt.device).manual_seed(0))
    rows, runs = {}, {}
    if "eager" in chosen:
        rows["eager"] = {"label": f"batch 1, eager, {o.dtype} autocast (float32 weights)"}
        runs["eager"] = our_generate(base, prompt, rt)
    if "weights" in chosen:
        held = copy.deepcopy(base).to(rt.dtype)  # the residual stream stays float32: autocast
        rows["weights"] = {"label": f"batch 1, eager, {o.dtype} weights"}
        runs["weights"] = our_generate(held, prompt, rt)
    if "compiled" in chosen:
        bucket = 16  # sample.prompt_bucket's default
        runs["compiled"], warm = compiled_run(copy.deepcopy(base), prompt, new, rt, bucket)
        rows["compiled"] = {"label": f"batch 1, compiled, {o.dtype} autocast (float32 weights)",
                            "warmup_s": warm}
    turns = take_turns(runs, new, o.rounds, rt) if runs else {}
    for name, row in rows.items():
        seconds = turns[name]["seconds"]
        row.update(status="ok", seconds=seconds, tok_per_s=new / statistics.median(seconds))
        print(f"  {row['label']}: {row['tok_per_s']:,.1f} tok/s", flush=True)
    return rows


def markdown(report: dict) -> str:
    header = ["row", "tokens/s", "per stream", "time to first token (p50 / max)", "warm-up"]
    cells = []
    for name in ROWS:
        r = report["rows"].get(name)
        if r is None or r.get("status") != "ok":
            why = "not in --rows" if r is None else (
                f"{r['status']}: {r.get('reason') or r.get('error')}")
            cells.append([name, why, "", "", ""])
            continue
        per_stream = f"{r['per_stream_tok_per_s']:,.1f}" if "streams" in r else "-"
        ttft = (f"{r['ttft_p50_ms']:,.0f} / {r['ttft_max_ms']:,.0f} ms"
                if r.get("ttft_p50_ms") is not None else "-")
        warm = f"{r['warmup_s']:.1f} s" if r.get("warmup_s") is not None else "-"
        label = r.get("label") or f"{r['streams']} streams, serve.py's engine, eager"
        cells.append([label, f"{r['tok_per_s']:,.1f}", per_stream, ttft, warm])
    intro = (f"Greedy decoding of {report['model']} on {report['hardware']}, {report['dtype']}: "
             f"a {report['prompt_tokens']}-token prompt then {report['new_tokens']} tokens, the "
             f"batch-1 rows taking turns over {report['rounds']} rounds (medians). "
             f"{report['date']}, `{report['command']}`")
    return "\n".join(section(intro, header, cells))


def run(o: DecodeDeviceOptions, command: str) -> int:
    chosen = checks.check_list(o, "rows", ROWS)
    checks.check(o, {"prompt_tokens": 1, "new_tokens": 1, "rounds": 1, "streams": 1})
    rt = setup(SystemConfig(device=o.device, dtype=o.dtype))
    if rt.device.type == "cpu" and o.dtype != "float32" and "weights" in chosen:
        print("note: the CPU runs 16-bit weights through torch's kernels here, not the packed "
              "ones of --weights (bench.py decode)", flush=True)
    base = random_gpt2(o.model, rt.device)
    new = min(o.new_tokens, base.config.block_size - o.prompt_tokens)
    if new < 1:
        raise ConfigError(f"--prompt-tokens={o.prompt_tokens} leaves no room in the "
                          f"{base.config.block_size}-token context")
    report = {"hardware": machine_line(rt.device), "command": command, "date": utc_now(),
              "model": f"random {o.model}-shaped weights ({base.num_params(False) / 1e6:.1f}M)",
              "dtype": o.dtype, "prompt_tokens": o.prompt_tokens, "new_tokens": new,
              "rounds": o.rounds, "rows": {}}
    stem = "decode_device_" + (o.name or rt.device.type)
    with torch.no_grad():
        report["rows"].update(batch1_rows(base, rt, o, chosen, new))
        write_report(report, markdown(report), o.results, stem)  # kept if the engine fails
        if "engine" in chosen:
            report["rows"]["engine"] = row = engine_row(base, rt, o, new)
            print(f"  engine: {row.get('tok_per_s', 0):,.1f} tok/s ({row['status']})", flush=True)
    text = markdown(report)
    print("\n" + text)
    paths = write_report(report, text, o.results, stem)
    print("wrote " + ", ".join(map(str, paths)))
    return 0 if all(r["status"] in ("ok", "skipped") for r in report["rows"].values()) else 1
