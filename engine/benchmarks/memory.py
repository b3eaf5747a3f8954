"""The memory benchmark, `python bench.py memory [--part train,quant,loader,decode]`. train: peak
memory and tokens/s per setting, each in its own process built as train.py builds, beside the
estimate; quant: an int8 model's bytes, decode tok/s, val loss; loader: batches/s; decode:
batch-1 tok/s, ours vs transformers, against the memory-bandwidth limit. RESULTS/memory_NAME.*
"""
from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, from_dict, load_config, opt
from data.loader import Batches, load_meta
from engine import checkpoint, memory, quantize, runtime
from engine.benchmarks import decode, measure, options
from engine.benchmarks.report import MIB, markdown_table, not_measured, section, write_report
from engine.benchmarks.runner import REPO_ROOT, run_worker, take_turns, time_left, timed
from engine.sampling import huge_pages_for, set_matvec, set_weight_layout
from engine.step import evaluate

PARTS = ("train", "quant", "loader", "decode")
TRAIN_ROWS = {  # label -> (overrides, needs CUDA)
    "baseline": ([], False),
    "checkpointing=all": (["--activation_checkpointing=all"], False),
    "checkpointing=attention": (["--activation_checkpointing=attention"], False),
    "checkpointing=mlp": (["--activation_checkpointing=mlp"], False),
    "checkpointing=every:2": (["--activation_checkpointing=every:2"], False),
    "dtype=bfloat16": (["--dtype=bfloat16"], False),
    "dtype+weights_dtype=bfloat16": (["--dtype=bfloat16", "--weights_dtype=bfloat16"], False),
    "empty_cache=off": (["--empty_cache=false"], True),
    "prefetch=on": (["--prefetch=true"], True),
}
TRAIN_HEADER = ["setting", "tokens/s", "step peak MiB (estimate)", "ratio",
                "whole peak MiB (estimate)", "ratio", "reserved MiB"]
DECODE_ROUNDS = 5  # decode: the rows take turns this many times; medians reported
DECODE_ROWS = {  # decode: the rows beside ours, each one change from generate.py's way
    "hf": "transformers generate", "blas": "ours, one F.linear per weight (matvec blas)",
    "row": "ours, row-major weights (as trained)",
    "small_pages": "ours, the same weights in 4 KiB pages"}


@dataclass
class MemoryOptions:
    """bench.py memory's own options (the rest of the command line is the config)."""

    part: str = opt(",".join(PARTS), "the parts to run, a comma list")
    rows: str = opt("", "train: only these rows (" + ", ".join(TRAIN_ROWS) + ")")
    steps: int = opt(3, "train: steps before and after the evaluation")
    loader_batches: int = opt(200, "loader: batches timed")
    checkpoint: str = opt("", "quant: the trained model to quantize")
    quant_steps: int = opt(300, "quant: training steps when no --checkpoint is given")
    quantize_layers: str = opt("attn,mlp", "quant/decode: sample.quantize_layers")
    eval_batches: int = opt(20, "quant: validation batches of 8")
    decode_tokens: int = opt(64, "quant/decode: new tokens per decode run")
    decode_model: str = opt("gpt2", "decode: the shape of the random weights (gpt2: GPT-2 124M)",
                            tuple(decode.DECODE_SHAPES))
    prompt_tokens: int = opt(16, "decode: prompt length")
    time_budget: float = opt(0.0, "train: seconds in all; rows not started then are skipped")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("", "outputs: RESULTS/memory_NAME.{json,md} (default: the device)")


def held(device: torch.device) -> int:
    """Bytes held now (CUDA allocated, or the RSS), with the peak reset to them."""
    memory.reset_peak_memory(device)
    peak = memory.peak_memory(device)
    return peak.get("allocated", peak.get("rss", 0))


def train_row(spec: dict) -> dict:
    """In a worker: build as train.py does, one step (AdamW's state appears), `steps` steps, an
    evaluation (then empty_cache as configured), `steps` more: the peak above what was held
    before them (the step's own memory), the peak above start-up, tokens/s after the eval."""
    cfg, steps = from_dict(spec["config"]), spec["steps"]
    start = held(runtime.resolve_device(cfg.system.device))
    run, _ = measure.build(cfg)
    rt, t, val, step = run.rt, cfg.train, run.loaders["val"], measure.stepper(run)
    run.model.train()
    timed(lambda: step(t.learning_rate), rt)
    resident, times = held(rt.device), []
    for i in range(2 * steps):
        if i == steps:
            evaluate(run.model, {"val": val}, {"val": val.fixed(2, seed=1)}, rt)
            memory.release_cached(rt.device, cfg.system.empty_cache)
        times.append(timed(lambda: step(t.learning_rate), rt)[0])
    peak = memory.peak_memory(rt.device)
    top, e = peak.get("allocated", peak.get("rss", 0)), memory.estimate(cfg)
    return {"tokens_per_s": run.tokens_per_step / statistics.median(times[steps:]),
            "step_peak": top - resident, "peak": top - start,
            "estimate_step": e.total - e.weights - e.optimizer, "estimate": e.total,
            **{k: v for k, v in peak.items() if k == "reserved"}}


def train_cells(r: dict) -> list[str]:
    """A train row as the cells of TRAIN_HEADER."""
    if r["status"] != "ok":
        return [r["setting"], not_measured(r), *[""] * 5]
    return [r["setting"], f"{r['tokens_per_s']:,.0f}",
            f"{r['step_peak'] / MIB:,.0f} ({r['estimate_step'] / MIB:,.0f})",
            f"{r['step_peak'] / r['estimate_step']:.2f}",
            f"{r['peak'] / MIB:,.0f} ({r['estimate'] / MIB:,.0f})",
            f"{r['peak'] / r['estimate']:.2f}",
            f"{r['reserved'] / MIB:,.0f}" if "reserved" in r else "-"]


def train_part(config_args: list[str], opts: MemoryOptions, device: torch.device) -> list[dict]:
    """Each chosen row in a worker process, within the --time-budget."""
    rows, left = [], time_left(opts.time_budget)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for i, label in enumerate(options.comma_list(opts.rows) or TRAIN_ROWS):
            overrides, needs_cuda = TRAIN_ROWS[label]
            if needs_cuda and device.type != "cuda":
                rows.append({"setting": label, "status": "needs CUDA"})
            elif left() <= 0:
                rows.append({"setting": label, "status": "skipped",
                             "reason": "the --time-budget ran out before this row"})
            else:
                cfg, _ = load_config(config_args + overrides, prog="bench.py memory")
                # large CPU buffers straight from mmap, so freed tensors leave the RSS at once
                # and the peak RSS follows live tensors (glibc keeps freed memory in its heap)
                result = run_worker({"kind": "memory_row", "config": cfg.to_dict(),
                                     "steps": opts.steps}, Path(tmp), f"train{i}", left(),
                                    env={"MALLOC_MMAP_THRESHOLD_": "65536"})
                rows.append({"setting": label, **result})
            cells = train_cells(rows[-1])
            print(f"  train {label}: " + (", ".join(f"{h} {c}" for h, c in zip(
                TRAIN_HEADER[1:], cells[1:])) if rows[-1]["status"] == "ok" else cells[1]),
                flush=True)
    return rows


def decode_rate(model, prompt: torch.Tensor, new: int, rt: runtime.Runtime
                ) -> tuple[float, list[int]]:
    """(tokens/s after the prompt, the tokens) of our batch-1 greedy decoding."""
    turns = take_turns({"ours": decode.our_generate(model, prompt, rt)}, new, DECODE_ROUNDS, rt)
    return new / statistics.median(turns["ours"]["seconds"]), turns["ours"]["tokens"]


def trained_model(opts: MemoryOptions, config_args: list[str], rt: runtime.Runtime):
    """The checkpoint to score, or a small model train.py trains for --quant-steps steps."""
    if opts.checkpoint:
        return checkpoint.load_model(opts.checkpoint, rt.device)[:2]
    n = opts.quant_steps
    print(f"  quant: training {n} steps to have a model to quantize ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_memory_", ignore_cleanup_errors=True) as out:
        proc = subprocess.run([sys.executable, "train.py", *config_args, f"--out_dir={out}",
                               f"--max_iters={n}", f"--eval_interval={n}", f"--log_interval={n}",
                               f"--warmup_iters={min(20, n)}", "--init_from=scratch",
                               "--compile=false"], cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("train.py failed: " + (proc.stderr or proc.stdout)[-500:])
        return checkpoint.load_model(out, rt.device)[:2]


def quant_part(opts: MemoryOptions, config_args: list[str], rt: runtime.Runtime) -> dict:
    """The trained model in float32, then int8: weight bytes, decode tok/s, val loss."""
    model, stored = trained_model(opts, config_args, rt)
    model.eval()
    val = Batches(load_meta(stored.data.dataset), "val", 8, model.config.block_size, 0, rt.device)
    eval_set = {"val": val.fixed(opts.eval_batches, seed=1)}
    prompt = torch.zeros((1, 1), dtype=torch.long, device=rt.device)
    new = min(opts.decode_tokens, model.config.block_size - 1)
    rows, chosen = {}, []
    for label in ("float32", "int8"):
        if label == "int8":
            chosen = quantize.quantize_linears(model, opts.quantize_layers)
        rows[label] = {"weight_bytes": quantize.weight_bytes(model),
                       "decode_tokens_per_s": decode_rate(model, prompt, new, rt)[0],
                       "val_loss": evaluate(model, {"val": val}, eval_set, rt)["val"]}
        print(f"  quant {label}: {rows[label]}", flush=True)
    return {"layers": opts.quantize_layers, "quantized": len(chosen),
            "params": model.num_params(False), "rows": rows}


def quant_markdown(q: dict) -> list[str]:
    rows = [[label, f"{r['weight_bytes'] / MIB:,.2f} MiB", f"{r['decode_tokens_per_s']:,.0f}",
             f"{r['val_loss']:.4f}"] for label, r in q["rows"].items()]
    return section(f"int8 weight-only ({q['layers']}, {q['quantized']} Linears, "
                   f"{q['params'] / 1e6:.2f}M-parameter model):",
                   ["weights", "bytes", "decode tok/s (batch 1)", "val loss"], rows)


def loader_part(cfg: Config, opts: MemoryOptions, train_rows: list[dict] | None) -> dict:
    """Batches/s the in-process loader and the shared-memory workers produce (data reading
    alone, nothing else running), beside what the trainer consumes (the baseline train row)."""
    from data.workers import SharedMemoryBatches

    meta, t = load_meta(cfg.data.dataset), cfg.train

    def rate(loader) -> float:
        loader.next()  # first batch: worker start-up is not throughput
        start = time.perf_counter()
        for _ in range(opts.loader_batches):
            loader.next()
        return opts.loader_batches / (time.perf_counter() - start)

    make = lambda: Batches(meta, "train", t.batch_size, cfg.model.block_size,  # noqa: E731
                           cfg.system.seed)
    rows = {"in-process": rate(make())}
    for workers in (1, 2):
        shared = SharedMemoryBatches(make(), meta, "train", workers)
        try:
            rows[f"{workers} worker(s)"] = rate(shared)
        finally:
            shared.close()
    baseline = next((r for r in train_rows or [] if r.get("setting") == "baseline"
                     and r["status"] == "ok"), None)
    result = {"batch": [t.batch_size, cfg.model.block_size], "batches_per_s": rows,
              "trainer_batches_per_s": baseline["tokens_per_s"] / (
                  t.batch_size * cfg.model.block_size) if baseline else None}
    print(f"  loader: {result}", flush=True)
    return result


def loader_markdown(lo: dict) -> list[str]:
    rows = [[k, f"{v:,.0f}"] for k, v in lo["batches_per_s"].items()]
    if lo["trainer_batches_per_s"]:
        rows.append(["trainer consumes (baseline row)", f"{lo['trainer_batches_per_s']:,.1f}"])
    return section(f"Batches of {lo['batch'][0]}x{lo['batch'][1]} tokens produced per second "
                   "(reading alone):", ["producer", "batches/s"], rows)


def int8_decode(ours, prompt: torch.Tensor, new: int, rt: runtime.Runtime, layers: str,
                our_tokens: list[int]) -> dict:
    """Our decoding again with the chosen block Linears in int8 (torchao) and the rest in the
    auto weight layout, as generate.py --quantize=int8 runs; changes `ours`."""
    try:
        quantize.quantize_linears(ours, layers)
    except ConfigError as e:  # the layer names were checked at start: torchao is missing
        print(f"  decode int8: skipped: {e}", flush=True)
        return {"int8_skipped": str(e), "int8_layers": layers}
    set_weight_layout(ours, "auto", huge_pages=True)
    rate, tokens = decode_rate(ours, prompt, new, rt)
    return {"int8_tokens_per_s": rate, "int8_layers": layers,
            "int8_weight_bytes_per_token": decode.token_bytes(ours),
            "int8_same_tokens": sum(a == b for a, b in zip(tokens, our_tokens))}


def decode_variants(ours, rt: runtime.Runtime) -> tuple[dict, dict]:
    """ours as generate.py holds it, and beside it copies with one change each (DECODE_ROWS)
    -> (name -> model, notes)."""
    huge, huge_note = huge_pages_for(True, rt.device)
    layout = set_weight_layout(ours, "auto", huge_pages=True)
    matvec = set_matvec(ours, "auto")
    models = {"ours": ours}
    if matvec == "sliced":
        models["blas"] = copy.deepcopy(ours)
        set_matvec(models["blas"], "blas")
    if layout != "row":
        models["row"] = copy.deepcopy(ours)  # a deep copy: 4 KiB pages
        set_weight_layout(models["row"], "row")
    if huge:
        models["small_pages"] = copy.deepcopy(ours)
    return models, {"huge_pages": huge_note, "matvec": matvec, "weight_layout": layout}


def decode_part(opts: MemoryOptions, rt: runtime.Runtime) -> dict:
    """Ours (and its variants) vs transformers' generate on the same random weights, batch 1,
    greedy, taking turns, against the copy bandwidth / the weight bytes a token reads."""
    ours = decode.random_gpt2(opts.decode_model, rt.device)
    prompt = torch.randint(0, ours.config.vocab_size, (1, opts.prompt_tokens), device=rt.device)
    new = min(opts.decode_tokens, ours.config.block_size - opts.prompt_tokens)
    src = torch.empty(256 * MIB // 4, device=rt.device)  # copy bandwidth: read + write, best of 5
    dst, weight = torch.empty_like(src), decode.token_bytes(ours)
    bandwidth = max(2 * src.numel() * 4 / timed(lambda: dst.copy_(src), rt)[0] for _ in range(5))
    hf_run, result = decode.hf_generate(ours, prompt, rt)
    models, notes = decode_variants(ours, rt)
    runs = {name: decode.our_generate(m, prompt, rt) for name, m in models.items()}
    turns = take_turns({**runs, **({"hf": hf_run} if hf_run else {})}, new, DECODE_ROUNDS, rt)
    for name, t in turns.items():  # tok/s, and ours' speed-up: the median of the rounds' ratios
        result[f"{name}_tokens_per_s"] = new / statistics.median(t["seconds"])
        if name != "ours":
            result[f"over_{name}"] = statistics.median(
                b / a for a, b in zip(turns["ours"]["seconds"], t["seconds"]))
    result.update(notes, model=opts.decode_model, device=rt.device.type,
                  params=ours.num_params(False), weight_bytes_per_token=weight,
                  copy_bandwidth=bandwidth, bandwidth_limit_tokens_per_s=bandwidth / weight,
                  same_tokens=all(t["tokens"] == turns["ours"]["tokens"] for t in turns.values()),
                  prompt_tokens=opts.prompt_tokens, new_tokens=new, rounds=DECODE_ROUNDS,
                  **int8_decode(models.get("row", ours), prompt, new, rt, opts.quantize_layers,
                                turns["ours"]["tokens"]))
    print(f"  decode: {result}", flush=True)
    return result


def decode_markdown(d: dict) -> list[str]:
    limit = d["bandwidth_limit_tokens_per_s"]

    def row(name: str, key: str, limit: float = limit, of: str = "") -> list[str]:
        if key not in d:
            return [name, f"skipped: {d.get(key.split('_')[0] + '_skipped', '')}", ""]
        return [name, f"{d[key]:,.1f}", f"{100 * d[key] / limit:.0f}%{of}"]

    rows = [row(f"ours (KV cache, {d['weight_layout']} weight layout, huge pages "
                f"{d['huge_pages']}, matvec {d['matvec']})", "ours_tokens_per_s")]
    rows += [row(label, f"{name}_tokens_per_s") for name, label in DECODE_ROWS.items()
             if name == "hf" or f"{name}_tokens_per_s" in d]
    if "int8_tokens_per_s" in d:
        per_token = d["int8_weight_bytes_per_token"]
        own = d["copy_bandwidth"] / per_token
        rows.append(row(f"ours, int8 {d['int8_layers']} ({per_token / MIB:,.0f} MiB/token; "
                        f"{d['int8_same_tokens']}/{d['new_tokens']} greedy tokens as float)",
                        "int8_tokens_per_s", own, f" of its own {own:,.1f}"))
    else:
        rows.append(row(f"ours, int8 {d['int8_layers']}", "int8_tokens_per_s"))
    rows.append([f"limit: {d['copy_bandwidth'] / 1e9:.1f} GB/s copy bandwidth / "
                 f"{d['weight_bytes_per_token'] / MIB:,.0f} MiB of weights per token",
                 f"{limit:,.1f}", "100%"])
    shape = "GPT-2 124M shape" if d["model"] == "gpt2" else \
        f"{d['params'] / 1e6:.1f}M-parameter '{d['model']}' shape"
    versus = "".join(f", {d[f'over_{name}']:.2f}x {label}" for name, label in DECODE_ROWS.items()
                     if f"over_{name}" in d)
    versus = f"; ours, the median ratio of the rounds' times{versus}" if versus else ""
    return section(f"Batch-1 greedy decode, {shape}, {d['prompt_tokens']}-token prompt, "
                   f"{d['new_tokens']} new tokens, medians of {d['rounds']} runs each taking "
                   f"turns (the same tokens from all: {d['same_tokens']}{versus}):",
                   ["implementation", "tokens/s", "share of the bandwidth limit"], rows)


def run(cfg: Config, opts: MemoryOptions, config_args: list[str], command: str) -> int:
    """Every part asked for; the report to stdout and to RESULTS/memory_NAME.{json,md}."""
    chosen = options.check_list(opts, "part", PARTS)
    if opts.rows:
        options.check_list(opts, "rows", list(TRAIN_ROWS))
    options.check(opts, {"steps": 1, "loader_batches": 1, "quant_steps": 1, "eval_batches": 1,
                         "decode_tokens": 1, "prompt_tokens": 1, "time_budget": 0})
    quantize.quantize_targets(opts.quantize_layers)
    rt = runtime.setup(cfg.system)
    report = {"hardware": runtime.machine_line(rt.device), "command": command,
              "config": cfg.to_dict()}
    page = [f"Memory benchmark on {report['hardware']} (`{command}`)", ""]
    parts = {"train": (lambda: train_part(config_args, opts, rt.device), lambda rows: [
                 markdown_table(TRAIN_HEADER, [train_cells(r) for r in rows]), ""]),
             "quant": (lambda: quant_part(opts, config_args, rt), quant_markdown),
             "loader": (lambda: loader_part(cfg, opts, report.get("train")), loader_markdown),
             "decode": (lambda: decode_part(opts, rt), decode_markdown)}
    for part, (measure_part, markdown) in parts.items():
        if part in chosen:
            report[part] = measure_part()
            page += markdown(report[part])
    print("\n" + "\n".join(page))
    paths = write_report(report, "\n".join(page), opts.results,
                         "memory_" + (opts.name or rt.device.type))
    print("wrote " + ", ".join(map(str, paths)))
    return 0
