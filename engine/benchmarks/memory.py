"""The memory benchmark, `python bench.py memory [--part train,quant,loader,decode]`. train: peak
memory and tokens/s per setting beside the estimate, each in its own process built as train.py
builds; quant: a trained model's bytes, decode tok/s and val loss in float32 and int8; loader:
batches/s; decode: batch-1 tok/s on random weights, ours (with one-change copies and int8) vs
transformers, against the read-bandwidth ceiling. RESULTS/memory_NAME.{json,md}.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, from_dict, load_config, opt
from data.loader import Batches, load_meta
from data.loader_workers import SharedMemoryBatches
from engine.benchmarks import checks, decode, measure
from engine.benchmarks.report import MIB, markdown_table, not_measured, section, write_report
from engine.benchmarks.timing import (peak_memory, reset_peak_memory, run_worker, take_turns,
                                      time_left, timed)
from engine.device import Runtime, machine_line, release_cached, resolve_device, setup
from engine.inference import quantize
from engine.inference.matvec import huge_pages_for, set_matvec, set_weight_layout, weight_layout_for
from engine.training import memory_estimate
from engine.training.optim import lr_at
from engine.training.step import evaluate
from model import GPT

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
DECODE_ROUNDS = 5  # quant and decode: timed runs, the rows taking turns; medians
DECODE_CHANGES = {  # decode: copies of ours beside it, one change each: (label, the change)
    "blas": ("ours, one F.linear per weight (matvec blas)", lambda m: set_matvec(m, "blas")),
    "row": ("ours, row-major weights (as trained)", lambda m: set_weight_layout(m, "row")),
    "small_pages": ("ours, the same weights in 4 KiB pages", lambda m: None),  # a copy's pages
}
LOADER_BATCHES, EVAL_BATCHES = 200, 20  # loader: batches timed; quant: val batches scored


@dataclass
class MemoryOptions:  # the rest of the command line is the config
    part: str = opt(",".join(PARTS), "the parts to run, a comma list")
    rows: str = opt("", "train: only these rows (" + ", ".join(TRAIN_ROWS) + ")")
    steps: int = opt(3, "train: steps before and after the evaluation")
    time_budget: float = opt(0.0, "train: seconds in all; rows not started then are skipped")
    quant_steps: int = opt(300, "quant: steps training the config's model to quantize")
    quantize_layers: str = opt("attn,mlp", "quant/decode: sample.quantize_layers")
    decode_tokens: int = opt(64, "quant/decode: new tokens per decode run")
    decode_model: str = opt("gpt2", "decode: the shape of the random weights (gpt2: GPT-2 124M)",
                            tuple(decode.DECODE_SHAPES))
    prompt_tokens: int = opt(16, "decode: prompt length")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("", "outputs: RESULTS/memory_NAME.{json,md} (default: the device)")


def held(device: torch.device, reset: bool = True) -> int:
    """Bytes held now, or at the peak since the last reset (CUDA allocated, or the RSS)."""
    if reset:
        reset_peak_memory(device)
    peak = peak_memory(device)
    return peak.get("allocated", peak.get("rss", 0))


def train_row(spec: dict) -> dict:
    """In a worker: build as train.py does, one step (AdamW's state appears), `steps` steps, an
    evaluation (then empty_cache as configured), `steps` more: the peak above what was held
    before them (the step's own memory), the peak above start-up, tokens/s after the eval."""
    cfg, steps = from_dict(spec["config"]), spec["steps"]
    start = held(resolve_device(cfg.system.device))
    run, _ = measure.build(cfg, evaluates=True)
    rt, t, val, step = run.rt, cfg.train, run.loaders["val"], measure.stepper(run)
    run.model.train()
    timed(lambda: step(t.learning_rate), rt)
    resident, times = held(rt.device), []
    for i in range(2 * steps):
        if i == steps:
            evaluate(run.model, {"val": val}, {"val": val.fixed(2, seed=1)}, rt)
            release_cached(rt.device, cfg.system.empty_cache)
        times.append(timed(lambda: step(t.learning_rate), rt)[0])
    top, e = held(rt.device, reset=False), memory_estimate.estimate(cfg)
    return {"tokens_per_s": run.tokens_per_step / statistics.median(times[steps:]),
            "step_peak": top - resident, "peak": top - start,
            "estimate_step": e.total - e.weights - e.optimizer, "estimate": e.total,
            **{k: v for k, v in peak_memory(rt.device).items() if k == "reserved"}}


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


def train_part(config_args: list[str], opts: MemoryOptions, device: torch.device,
               done=lambda rows: None) -> list[dict]:
    """Each chosen row in a worker process, within the --time-budget; done(rows so far) after
    each."""
    rows, left = [], time_left(opts.time_budget)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for i, label in enumerate(checks.comma_list(opts.rows) or TRAIN_ROWS):
            overrides, needs_cuda = TRAIN_ROWS[label]
            if needs_cuda and device.type != "cuda":
                row = {"setting": label, "status": "needs CUDA"}
            elif left() <= 0:
                row = {"setting": label, "status": "skipped",
                       "reason": "the --time-budget ran out before this row"}
            else:
                cfg, _ = load_config(config_args + overrides, prog="bench.py memory")
                # large CPU buffers straight from mmap, so freed tensors leave the RSS at once
                # and the peak RSS follows live tensors (glibc keeps freed memory in its heap)
                row = {"setting": label, **run_worker(
                    {"kind": "memory_row", "config": cfg.to_dict(), "steps": opts.steps},
                    Path(tmp), f"train{i}", left(), env={"MALLOC_MMAP_THRESHOLD_": "65536"})}
            cells = [f"{h} {c}" for h, c in zip(TRAIN_HEADER[1:], train_cells(row)[1:])]
            print(f"  train {label}: " + (", ".join(cells) if row["status"] == "ok"
                                          else not_measured(row)), flush=True)
            rows.append(row)
            done(rows)
    return rows


def quant_part(opts: MemoryOptions, config_args: list[str]) -> dict:
    """The config's model trained --quant-steps steps as train.py trains it, then in float32 and
    in int8: weight bytes, batch-1 decode tok/s, val loss."""
    n = opts.quant_steps
    cfg, _ = load_config(config_args + [f"--max_iters={n}", f"--warmup_iters={min(20, n)}",
                                        "--compile=false"], prog="bench.py memory")
    run, _ = measure.build(cfg)
    step = measure.stepper(run)
    for i in range(n):
        step(lr_at(i, cfg))
    model, rt, val = run.raw_model.eval(), run.rt, run.loaders["val"]
    eval_set = {"val": val.fixed(EVAL_BATCHES, seed=1)}
    prompt = torch.zeros((1, 1), dtype=torch.long, device=rt.device)
    new = min(opts.decode_tokens, model.config.block_size - 1)
    rows, chosen = {}, []
    for label in ("float32", "int8"):
        if label == "int8":
            chosen = quantize.quantize_linears(model, opts.quantize_layers)
        run_n = decode.our_generate(model, prompt, rt)
        seconds = take_turns({label: run_n}, new, DECODE_ROUNDS, rt)[label]["seconds"]
        rows[label] = {"weight_bytes": quantize.weight_bytes(model),
                       "decode_tokens_per_s": new / statistics.median(seconds),
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


def loader_part(cfg: Config, train_rows: list[dict] | None) -> dict:
    """Batches/s of the in-process loader and of 1 and 2 shared-memory workers (reading alone),
    beside what the trainer consumes (the baseline train row)."""
    meta, batch, block = load_meta(cfg.data.dataset), cfg.train.batch_size, cfg.model.block_size
    rates = {}
    for workers in (0, 1, 2):
        loader = Batches(meta, "train", batch, block, cfg.system.seed)
        if workers:
            loader = SharedMemoryBatches(loader, meta, "train", workers)
        loader.next()  # the first batch: worker start-up is not throughput
        start = time.perf_counter()
        for _ in range(LOADER_BATCHES):
            loader.next()
        rates[f"{workers} worker(s)" if workers else "in-process"] = \
            LOADER_BATCHES / (time.perf_counter() - start)
        if workers:
            loader.close()
    base = [r for r in train_rows or [] if r["setting"] == "baseline" and r["status"] == "ok"]
    result = {"batch": [batch, block], "batches_per_s": rates, "trainer_batches_per_s":
              base[0]["tokens_per_s"] / (batch * block) if base else None}
    print(f"  loader: {result}", flush=True)
    return result


def loader_markdown(lo: dict) -> list[str]:
    rows = [[k, f"{v:,.0f}"] for k, v in lo["batches_per_s"].items()]
    if lo["trainer_batches_per_s"]:
        rows.append(["trainer consumes (baseline row)", f"{lo['trainer_batches_per_s']:,.1f}"])
    return section(f"Batches of {lo['batch'][0]}x{lo['batch'][1]} tokens produced per second "
                   "(reading alone):", ["producer", "batches/s"], rows)


def decode_models(base: GPT, rt: Runtime, layers: str) -> tuple[dict, dict]:
    """(name -> (label, model, note), notes): ours as generate.py holds base, a copy per
    DECODE_CHANGES where it changes something here, int8 as generate.py --quantize=int8."""
    ours, note = decode.prepared(base, "torch", rt.device)
    models = {"ours": ("ours", ours, note)}
    changes = {"blas": set_matvec(ours, "auto") == "sliced",
               "row": weight_layout_for("auto", rt.device) != "row",
               "small_pages": huge_pages_for(True, rt.device)[0]}
    for name, (label, change) in DECODE_CHANGES.items():
        if changes[name]:
            models[name] = (label, copy.deepcopy(ours), "")
            change(models[name][1])
    int8 = copy.deepcopy(base)  # row-major, as torchao takes it
    try:
        quantize.quantize_linears(int8, layers)
    except ConfigError as e:  # the layer names were checked at start: torchao is missing
        print(f"  decode int8: skipped: {e}", flush=True)
        return models, {"int8_skipped": str(e)}
    set_weight_layout(int8, "auto", huge_pages=True)
    set_matvec(int8, "auto")
    return {**models, "int8": (f"ours, int8 {layers}", int8, "torchao int8 weight-only")}, {}


def decode_part(opts: MemoryOptions, rt: Runtime) -> dict:
    """The rows of decode_models and transformers' generate on the same random weights, batch 1,
    greedy, taking turns, each against the read bandwidth at its size (decode.time_rows)."""
    base = decode.random_gpt2(opts.decode_model, rt.device)
    prompt = torch.randint(0, base.config.vocab_size, (1, opts.prompt_tokens), device=rt.device)
    new = min(opts.decode_tokens, base.config.block_size - opts.prompt_tokens)
    hf_run, result = decode.hf_generate(base, prompt, rt)
    models, skipped = decode_models(base, rt, opts.quantize_layers)
    rows = {name: decode.token_row(label, "int8" if name == "int8" else "float32", model, note)
            for name, (label, model, note) in models.items()}
    runs = {name: decode.our_generate(model, prompt, rt) for name, (_, model, _) in models.items()}
    if hf_run is not None:
        rows["hf"] = decode.token_row("transformers", "float32", base, "GPT2LMHeadModel.generate")
        runs["hf"] = hf_run
    decode.time_rows(rows, runs, new, DECODE_ROUNDS, rt)
    result.update(skipped, device=rt.device.type, params=base.num_params(False),
                  model=f"random {opts.decode_model}-shaped weights "
                        f"({base.num_params(False) / 1e6:.1f}M parameters, seed 0)",
                  prompt_tokens=opts.prompt_tokens, new_tokens=new, rounds=DECODE_ROUNDS,
                  threads=torch.get_num_threads(), rows=rows,
                  bandwidth_limit_tokens_per_s=rows["ours"]["ceiling"],
                  **{f"{name}_tokens_per_s": row["tok_per_s"] for name, row in rows.items()})
    return result


def run(cfg: Config, opts: MemoryOptions, config_args: list[str], command: str) -> int:
    """Every part asked for; the report to stdout and to RESULTS/memory_NAME.{json,md}."""
    chosen = checks.check_list(opts, "part", PARTS)
    if opts.rows:
        checks.check_list(opts, "rows", list(TRAIN_ROWS))
    checks.check(opts, {"steps": 1, "quant_steps": 1, "decode_tokens": 1, "prompt_tokens": 1,
                         "time_budget": 0})
    quantize.quantize_targets(opts.quantize_layers)
    rt = setup(cfg.system)
    report = {"hardware": machine_line(rt.device), "command": command,
              "config": cfg.to_dict()}
    page = [f"Memory benchmark on {report['hardware']} (`{command}`)", ""]
    stem = "memory_" + (opts.name or rt.device.type)

    def train_page(rows: list[dict]) -> list[str]:
        return [markdown_table(TRAIN_HEADER, [train_cells(r) for r in rows]), ""]

    def train_so_far(rows: list[dict]) -> None:  # a run stopped midway keeps its rows
        write_report({**report, "train": rows}, "\n".join(page + train_page(rows)),
                     opts.results, stem)

    parts = {"train": (lambda: train_part(config_args, opts, rt.device, train_so_far),
                       train_page),
             "quant": (lambda: quant_part(opts, config_args), quant_markdown),
             "loader": (lambda: loader_part(cfg, report.get("train")), loader_markdown),
             "decode": (lambda: decode_part(opts, rt), decode.speed_markdown)}
    for part, (measure_part, markdown) in parts.items():
        if part in chosen:
            report[part] = measure_part()
            page += markdown(report[part])
    print("\n" + "\n".join(page))
    paths = write_report(report, "\n".join(page), opts.results, stem)
    print("wrote " + ", ".join(map(str, paths)))
    return 0
