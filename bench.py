"""The speedup ablation: what each flag buys here, alone or chained, as one table and one plot;
--memory: what each memory strategy costs and saves (engine/bench_memory.py); --to-loss TARGET:
the wall-clock time each recipe takes to reach a val loss (engine/bench_to_loss.py); --serve:
serve.py under load, batched against one request at a time (engine/bench_serve.py); --decode:
batch-1 decoding per weight format against the memory-read limit (engine/bench_decode.py).

    python bench.py                          # the baseline, then each flag added in turn
    python bench.py --only all               # each flag alone against the baseline
    python bench.py --order attention,compile=max-autotune --config gpt2_124m --time-budget 150
    python bench.py --memory --part train,decode
    python bench.py --to-loss 1.886 [--nanogpt ../nanoGPT]
    python bench.py --serve --checkpoint out/shakespeare_char    # its options: --serve --help
    python bench.py --decode --gguf f32.gguf --llama-python VENV/bin/python   # --decode --help

Each row runs in a fresh process from the same seed; a flag that changes nothing here is skipped
with the reason. The chain puts each flag on the fastest combination so far and carries it on
only when it measured faster beyond the noise (verdict); a row that hurt is shown, dropped, and
the last kept row is the best this machine has. On a CPU the kernel rows follow (threads,
inductor C++, oneDNN bf16: engine/bench_kernels.py). Config: bench_gpu on CUDA, else bench_cpu.
Output: RESULTS/NAME.{json,md,png}.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from config import (BOOL_WORDS, Config, ConfigError, apply_override, load_config, opt,
                    parse_command_line, validate)
from data.loader import DataError
from engine import bench_decode, bench_kernels, bench_memory, bench_serve, bench_to_loss, runtime
from engine.benchmark import ensure_dataset, markdown_table, run_worker, time_left


class BenchError(ValueError):
    """A bench.py argument that cannot be used."""


Flag = collections.namedtuple("Flag", "keys reference fast")  # keys: the config keys it sets
FLAGS = {
    "causal_mask": Flag(("model.causal_mask",), "buffer", "on_the_fly"),
    "tf32": Flag(("system.tf32",), "false", "true"),
    "fused_adamw": Flag(("train.fused_adamw",), "false", "true"),
    "pin_memory": Flag(("data.pin_memory",), "false", "true"),
    "dtype": Flag(("system.dtype",), "float32", "auto"),  # auto: bf16 where supported, else fp16
    "norm_gelu": Flag(("model.norm", "model.gelu"), "scratch", "native"),
    "attention": Flag(("model.attention",), "scratch", "sdpa"),
    "compile": Flag(("system.compile",), "false", "true"),  # a value is the mode
    "vocab_pad": Flag(("model.vocab_pad_multiple",), "1", "64"),
    "batch_size_auto": Flag(("train.batch_size_auto",), "false", "true"),
    "chunked_loss": Flag(("model.loss",), "full", "chunked"),
    "muon": Flag(("train.optimizer",), "adamw", "muon"),  # tokens/s: what its steps cost
}
DEFAULT_ORDER = ",".join(FLAGS)


@dataclasses.dataclass
class BenchOptions:
    """bench.py's own options (the rest of the command line is the config, as for train.py)."""

    order: str = opt(DEFAULT_ORDER, "the chain, in order: FLAG[=VALUE],...")
    only: str = opt("", "all | FLAG,...: each flag alone against the baseline, not the chain")
    warmup_steps: int = opt(2, "untimed steps per row")
    measure_steps: int = opt(5, "timed steps per row")
    repeat: int = opt(1, "runs of each row (fresh processes); tokens/s: the median of all "
                      "their timed steps")
    keep_margin: float = opt(0.03, "chain: a flag is carried into later rows only when its row "
                             "beats the chain so far by more than this share and than twice "
                             "the standard error of the medians' difference (else dropped)")
    kernels: str = opt("auto", "CPU kernel rows after the chain (threads, inductor C++, oneDNN "
                       "bf16; training and batch-1 decoding): auto = on CPU", ("auto", "on", "off"))
    decode_rounds: int = opt(3, "kernels: timed batch-1 decode runs per row (medians)")
    clock: str = opt("wall", "time steps by the wall clock or this process's CPU time (CPU, "
                     "--threads=1)", choices=("wall", "process"))
    time_budget: float = opt(0.0, "seconds in all: a row still running then is stopped "
                             "(failed), rows not started are skipped; 0: no limit")
    ceiling_size: int = opt(0, "N of the ceiling's N^3 matmul (0: 8192 on CUDA, else 2048)")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("", "output file stem (default: the device; memory_NAME with --memory)")
    memory: bool = opt(False, "the memory benchmark instead of the ablation")
    serve: bool = opt(False, "the serving load benchmark instead (engine/bench_serve.py, with "
                      "its own options: python bench.py --serve --help)")
    decode: bool = opt(False, "the decode benchmark of the weight formats instead "
                       "(engine/bench_decode.py, its own options: python bench.py --decode --help)")
    part: str = opt(",".join(bench_memory.PARTS), "memory: the parts to run, a comma list")
    rows: str = opt("", "memory train: only these rows ("
                    + ", ".join(r[0] for r in bench_memory.TRAIN_ROWS) + ")")
    steps: int = opt(3, "memory train: steps before and after the evaluation")
    loader_batches: int = opt(200, "memory loader: batches timed")
    checkpoint: str = opt("", "memory quant: the trained model to quantize")
    quant_steps: int = opt(300, "memory quant: training steps when no --checkpoint is given")
    quantize_layers: str = opt("attn,mlp", "memory quant/decode: sample.quantize_layers")
    eval_batches: int = opt(20, "memory quant: validation batches of 8")
    decode_tokens: int = opt(64, "memory quant/decode: new tokens per decode run")
    decode_model: str = opt("gpt2", "memory decode: the shape of the random weights (gpt2: "
                            "GPT-2 124M)", choices=tuple(bench_memory.DECODE_SHAPES))
    prompt_tokens: int = opt(16, "memory decode: prompt length")
    to_loss: float = opt(0.0, "time to this val loss instead of the ablation: the recipes of "
                         "engine/bench_to_loss.py, each in its own train.py; 0: off")
    recipes: str = opt("", "to-loss: only these recipes, a comma list (default: all)")
    eval_every: int = opt(100, "to-loss: steps between evaluations (the target is checked there)")
    recipe_seconds: float = opt(300.0, "to-loss: a recipe still short of the target after this "
                                "many seconds is stopped (not reached)")
    nanogpt: str = opt("", "to-loss: a nanoGPT checkout with data/shakespeare_char prepared, "
                       "run side by side as a row")


def parse_steps(text: str) -> list[tuple[str, str]]:
    """'attention,compile=max-autotune' -> [('attention', 'sdpa'), ('compile', 'max-autotune')]."""
    steps: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in FLAGS:
            close = difflib.get_close_matches(name, list(FLAGS), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise BenchError(f"unknown flag '{name}'{hint} (flags: {', '.join(FLAGS)})")
        if name in (s for s, _ in steps):
            raise BenchError(f"flag '{name}' appears twice; list each flag once")
        steps.append((name, value or FLAGS[name].fast))
    if not steps:
        raise BenchError(f"no flags given; e.g. --order {DEFAULT_ORDER}")
    return steps


def apply_flag(cfg: Config, name: str, value: str) -> None:
    """Set one flag's config keys, checked like any other override."""
    problems: list[str] = []
    if name == "dtype" and value == "auto":
        cfg.system.dtype = "auto"  # resolved in the row's process, where the device is known
    elif name == "compile" and value.lower() not in BOOL_WORDS:
        apply_override(cfg, "system.compile", "true", problems)
        apply_override(cfg, "system.compile_mode", value, problems)
    else:
        for key in FLAGS[name].keys:
            apply_override(cfg, key, value, problems)
    check = copy.deepcopy(cfg)
    if check.system.dtype == "auto":
        check.system.dtype = "float32"
    problems += validate(check)
    if problems:
        raise ConfigError(f"{name}={value}: " + "; ".join(problems))


def plan(cfg: Config, steps: list[tuple[str, str]], only: bool) -> list[dict]:
    """The baseline (every listed flag at its reference value), then a row per flag: on the
    baseline (only), or on the chain's best combination when it runs (chain: config None here;
    each flag is checked on the baseline now, so a bad value stops the bench before it runs)."""
    base = copy.deepcopy(cfg)
    for name, _ in steps:
        apply_flag(base, name, FLAGS[name].reference)
    rows = [{"flag": None, "value": None, "config": base, "previous": None}]
    for name, value in steps:
        row_cfg = with_flag(base, name, value)
        rows.append({"flag": name, "value": value, "config": row_cfg if only else None,
                     "previous": 0 if only else None})
    return rows


def with_flag(cfg: Config, name: str, value: str) -> Config:
    """A copy of cfg with one flag set."""
    row_cfg = copy.deepcopy(cfg)
    apply_flag(row_cfg, name, value)
    return row_cfg


def spread(step_s: list[float]) -> float:
    """The relative spread of a row's timed steps: interquartile range / median (0 for one)."""
    if len(step_s) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(step_s, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(step_s)


def median_error(step_s: list[float]) -> float:
    """The relative standard error of a row's median step: 1.25 sigma / sqrt(n), sigma from
    the interquartile range (IQR / 1.35 for a normal spread), robust to a few stalled steps."""
    return 1.2533 * spread(step_s) / 1.349 / math.sqrt(len(step_s)) if step_s else 0.0


def verdict(candidate: dict, head: dict, margin: float) -> tuple[bool, str]:
    """Whether the chain keeps a row's flag: (keep, why not). Kept when its tokens/s beats the
    chain's head (the fastest combination so far) by more than the noise: the larger of margin
    and twice the standard error of the difference of the two medians. A pure function of the
    two rows' timings."""
    if candidate["status"] != "ok":
        return False, "" if candidate["status"] == "skipped" else "dropped: failed"
    if head["status"] != "ok":
        return True, ""  # nothing measured before it: it starts the chain
    gain = candidate["tokens_per_s"] / head["tokens_per_s"] - 1
    noise = max(margin, 2 * math.hypot(median_error(candidate["step_s"]),
                                       median_error(head["step_s"])))
    if gain > noise:
        return True, ""
    how = "slower here" if gain < -noise else "not faster beyond the noise"
    return False, f"dropped: {how} ({100 * gain:+.1f}%, noise {100 * noise:.1f}%)"


def label(row: dict, only: bool) -> str:
    """'baseline', '+ tf32', '+ attention=sdpa', '+ dtype=bfloat16' ('only ...' alone)."""
    if row["flag"] is None:
        return "baseline"
    value = row["value"]
    if row["flag"] == "dtype" and value == "auto" and "dtype" in row:
        value = f"auto ({row['dtype']})"
    shown = "" if value.lower() in ("true", "on", "yes", "1") else f"={value}"
    return ("only " if only else "+ ") + row["flag"] + shown


def derive(rows: list[dict], ceiling: dict) -> None:
    """Speedups against the previous measured row (its runs alongside this one's, in the chain)
    and the baseline, and MFU, in place."""
    base = rows[0] if rows[0]["status"] == "ok" else None
    flops_per_token = next((r["flops_per_token"] for r in rows if "flops_per_token" in r), 0)
    for i, row in enumerate(rows):
        if row["status"] != "ok":
            continue
        prev = row["previous"]
        while prev is not None and rows[prev]["status"] != "ok":
            prev = rows[prev]["previous"]
        speed = row["tokens_per_s"]
        # against the previous row's steps measured alongside this row's, where there are some
        reference = row.get("alongside", rows[prev] if prev is not None else {})
        row["vs_previous"] = speed / reference["tokens_per_s"] if prev is not None else None
        row["vs_baseline"] = speed / base["tokens_per_s"] if base and i else None
        row["model_flops_per_s"] = achieved = speed * flops_per_token
        row["mfu"] = achieved / ceiling["datasheet"] if ceiling.get("datasheet") else None
        row["mfu_measured"] = achieved / ceiling["measured"] if ceiling.get("measured") else None


def merge_pass(first: dict, again: dict) -> None:
    """Fold a later pass of a row into its first: all timed steps count toward the median."""
    if again["status"] != "ok":
        first.setdefault("later_pass_errors", []).append(again.get("error", again["status"]))
        return
    first["step_s"] += again["step_s"]
    first["tokens_per_s"] = first["tokens_per_step"] / statistics.median(first["step_s"])
    first["memory"] = {k: max(v, again["memory"].get(k, 0)) for k, v in first["memory"].items()}


def run_once(config: Config, prev: dict | None, opts: BenchOptions, tmp: Path, left,
             name: str) -> dict:
    """One run of a row's config in a fresh process (skipped once the time budget is spent)."""
    if left() <= 0:
        why = f"the --time-budget of {opts.time_budget:g} s ran out"
        print(f"    skipped: {why}", flush=True)
        return {"status": "skipped", "reason": why + " before this row"}
    spec = {"kind": "row", "config": config.to_dict(), "clock": opts.clock,
            "warmup": opts.warmup_steps, "measure": opts.measure_steps,
            "previous": prev if prev and "settings" in prev else None}
    return run_worker("engine.benchmark", spec, tmp, name, left())


def pooled(first: dict | None, again: dict) -> dict:
    if not first:
        return again
    merge_pass(first, again)
    return first


def measure(row: dict, i: int, n_rows: int, prev: dict | None, opts: BenchOptions,
            tmp: Path, left, only: bool, head: dict | None = None) -> tuple[dict, dict | None]:
    """One row, run --repeat times in fresh processes, its timed steps pooled; with a head (the
    chain), each run is followed by one of the head's config, A B A B, so that the verdict
    compares steps measured side by side, not minutes apart under another load."""
    first, alongside = None, None
    for run in range(opts.repeat):
        runs = f" (run {run + 1}/{opts.repeat})" if opts.repeat > 1 else ""
        print(f"[{i + 1}/{n_rows}] {label(row, only)}{runs}", flush=True)
        first = pooled(first, run_once(row["config"], prev, opts, tmp, left, f"row{i}"))
        if first["status"] != "ok":
            break  # skipped and failed rows are not retried
        if head is not None:
            print(f"[{i + 1}/{n_rows}] row {row['previous']} again, alongside{runs}", flush=True)
            alongside = pooled(alongside, run_once(head["config"], None, opts, tmp, left,
                                                   f"row{i}head"))
    return first, alongside


def run_all(rows: list[dict], cfg: Config, opts: BenchOptions, only: bool, command: str) -> dict:
    """The ceiling, then every row; in the chain each flag goes onto the fastest combination so
    far (the head), which it replaces only when it measured faster beyond the noise (verdict)."""
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results: list[dict] = []
    left, head = time_left(opts.time_budget), 0
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        print(f"measuring the matmul ceiling on {cfg.system.device} ...", flush=True)
        ceiling = run_worker("engine.benchmark", {
            "kind": "ceiling", "config": cfg.to_dict(), "clock": opts.clock,
            "matmul_n": opts.ceiling_size}, Path(tmp), "ceiling", left())
        for i, row in enumerate(rows):
            if i and not only:
                row["previous"] = head
                row["config"] = with_flag(rows[head]["config"], row["flag"], row["value"])
            prev = results[row["previous"]] if row["previous"] is not None else None
            chained = i and not only and prev["status"] == "ok"
            result, alongside = measure(row, i, len(rows), prev, opts, Path(tmp), left, only,
                                        rows[head] if chained else None)
            result.update(flag=row["flag"], value=row["value"], previous=row["previous"],
                          previous_notes=prev.get("notes", []) if prev else [])
            result["label"] = label(result, only)
            if alongside and alongside["status"] == "ok":
                result["alongside"] = {k: alongside[k] for k in ("tokens_per_s", "step_s")}
            if i and not only:
                keep, why = verdict(result, {"status": "ok", **result["alongside"]}
                                    if "alongside" in result else results[head],
                                    opts.keep_margin)
                result["chain"] = "kept" if keep else why
                if keep:
                    head = i
                if why or keep:
                    print(f"    chain: {result['chain']}", flush=True)
            results.append(result)
        kernels = bench_kernels.run(rows[head]["config"], opts, Path(tmp), left) \
            if kernel_rows_wanted(opts, cfg) else []
    if ceiling["status"] != "ok":
        print(f"matmul ceiling not measured: {ceiling.get('error')}")
    derive(results, ceiling)
    return {"mode": "only" if only else "chain", "device": cfg.system.device.split(":")[0],
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average": [load_start, os.getloadavg()[0]] if load_start is not None else None,
            "command": command, "warmup": opts.warmup_steps, "measure": opts.measure_steps,
            "repeat": opts.repeat, "clock": opts.clock, "time_budget": opts.time_budget,
            "keep_margin": opts.keep_margin, "ceiling": ceiling, "config": cfg.to_dict(),
            "rows": results, "best": None if only else head, "kernels": kernels}


def kernel_rows_wanted(opts: BenchOptions, cfg: Config) -> bool:
    return opts.kernels == "on" or (opts.kernels == "auto" and cfg.system.device == "cpu")


def row_note(r: dict, kernels: str = "", bf16_units: tuple = ()) -> str:
    """The table's note: the chain's verdict, the micro-batch picked, compile time and kernels,
    bf16 kernels, spread of steps, new notes."""
    note = [r["chain"]] if r.get("chain", "").startswith("dropped") else []
    if r["flag"] == "batch_size_auto":
        note.append(f"micro-batch {r['micro_batch']}x{r['grad_accum_steps']}")
    if r["settings"].get("compile", "off") != "off":
        note.append(f"built and compiled in {r['build_s']:.0f} s")
        if r["flag"] == "compile" and kernels:
            note.append(kernels)
    if r["flag"] == "dtype" and r["dtype"] == "bfloat16" and r["settings"]["device"] == "cpu":
        note.append("oneDNN bf16 " + (f"on {', '.join(bf16_units)}" if bf16_units else
                                      "not native here: emulated"))
    fastest, slowest = (r["tokens_per_step"] / s for s in (min(r["step_s"]), max(r["step_s"])))
    if fastest > 1.2 * slowest:  # say so when the timed steps disagree
        note.append(f"steps ranged {slowest:,.0f}-{fastest:,.0f} tok/s")
    note += [f"a later pass failed: {e}" for e in r.get("later_pass_errors", [])]
    note += [n for n in r.get("notes", []) if r["previous"] is None or
             n not in r.get("previous_notes", [])]
    return "; ".join(note)


def table(rows: list[dict], ceiling: dict | None = None) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    times = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    gib = lambda n: f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"  # noqa: E731
    memory = lambda m: (f"{gib(m['allocated'])} / {gib(m['reserved'])} GiB" if "allocated" in m
                        else f"{gib(m['rss'])} GiB RSS" if "rss" in m else "-")  # noqa: E731
    out = []
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            why = r.get("reason") or r.get("error", "")
            out.append([str(i), r["label"], *["-"] * 9, f"{r['status']}: {why}"])
            continue
        step_ms = 1000 * statistics.median(r["step_s"])
        ms = lambda x: f"{x:,.0f}" if x >= 10 else f"{x:.2g}"  # noqa: E731
        estimate = f"{ms(step_ms)} ({ms(1000 * r['estimate_step_s'])})" \
            if "estimate_step_s" in r else ms(step_ms)
        note = row_note(r, (ceiling or {}).get("compile_kernels", ""),
                        tuple((ceiling or {}).get("bf16_units", ())))
        if "chain" in r and r["previous"] not in (None, i - 1):  # the head it was tried on
            note = f"on row {r['previous']}" + (f"; {note}" if note else "")
        out.append([str(i), r["label"], f"{r['tokens_per_s']:,.0f}", times(r["vs_previous"]),
                    times(r["vs_baseline"]), estimate, pct(r["mfu"]), pct(r["mfu_measured"]),
                    memory(r["memory"]), f"{r['loss']:.4f}", ", ".join(r["kernels"]) or "-",
                    note])
    return markdown_table(["#", "step", "tok/s", "vs prev", "vs base", "ms/step (est.)", "MFU",
                           "MFU (meas.)", "peak memory", "loss", "attention kernel", "note"], out)


def best_line(report: dict) -> str:
    """The chain's outcome: the best combination this machine has, and what it left out."""
    rows, best = report["rows"], report.get("best")
    if best is None or rows[best]["status"] != "ok":
        return ""
    kept = [r["label"].removeprefix("+ ") for r in rows[1:best + 1] if r.get("chain") == "kept"]
    dropped = [f"{r['label'].removeprefix('+ ')}: {r['chain'].removeprefix('dropped: ')}"
               for r in rows if r.get("chain", "").startswith("dropped")]
    vs = f", {rows[best]['vs_baseline']:.2f}x the baseline" if best else ""
    return (f"best here: row {best} = baseline + {', '.join(kept) or 'nothing'}: "
            f"{rows[best]['tokens_per_s']:,.0f} tok/s{vs}"
            + (f" | dropped: {'; '.join(dropped)}" if dropped else ""))


def describe(report: dict) -> str:
    """The lines above the table: hardware, model, batch, steps, MFU denominators."""
    c, ceiling, r = report["config"], report["ceiling"], report
    m, t = c["model"], c["train"]
    first = next((row for row in r["rows"] if "params" in row), {})
    datasheet = (f"{ceiling['datasheet'] / 1e12:.0f} TFLOP/s (dense bf16, datasheet)"
                 if ceiling.get("datasheet") else "no datasheet peak for this device")
    measured = (f"{ceiling['measured'] / 1e12:.2f} TFLOP/s measured ({ceiling['measured_dtype']} "
                f"{ceiling['matmul_n']}^3 matmul)" if ceiling.get("measured") else "not measured")
    load = r.get("load_average")
    shared = (f" | load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (other "
              "processes shared the machine)" if load and max(load) > 0.5 * os.cpu_count() else "")
    passes = f" x {r['repeat']} runs" if r.get("repeat", 1) > 1 else ""
    clock = ", timed by the process's CPU time (--clock=process)" * (r.get("clock") == "process")
    vocab = first.get("settings", {}).get("vocab", m["vocab_size"])
    ratios = [statistics.median(row["step_s"]) / row["estimate_step_s"] for row in r["rows"]
              if row["status"] == "ok" and row.get("estimate_step_s")]
    estimate = ("ms/step (est.): the median step, and in brackets train.py's start-up estimate "
                "(FLOPs per step at the matmul rate measured in the row's dtype); measured / "
                f"estimate {min(ratios):.1f}-{max(ratios):.1f}x" if ratios else "")
    chain = ("chain: each flag is tried on the best combination so far and kept only when "
             f"faster by more than {100 * r.get('keep_margin', 0):.0f}% and than twice the "
             "standard error of the two medians' difference (from each row's interquartile "
             "range); a dropped row is shown, the chain goes on without it"
             if r["mode"] == "chain" else "")
    return "\n".join([
        f"hardware: {ceiling.get('hardware', r['device'])} | torch {r['torch']} | {r['date']}"
        + shared,
        f"model: {m['n_layer']} layers, {m['n_head']} heads, {m['n_embd']} wide, context "
        f"{m['block_size']}, vocab {vocab} ({first.get('params', 0) / 1e6:.1f}M parameters) | "
        f"data: {c['data']['dataset']} | {t['batch_size'] * t['grad_accum_steps']} sequences "
        f"({t['batch_size']} x {t['grad_accum_steps']} accumulated) per step | {r['warmup']} "
        f"warm-up + {r['measure']} timed steps per row{passes}, each row in a fresh process{clock}",
        f"MFU: {first.get('flops_per_token', 0) / 1e6:,.1f}M FLOPs per token (6N + 12*L*H*Q*T) "
        f"x tokens/s, against {datasheet}; MFU (meas.) against {measured}",
        *filter(None, [estimate, chain]), f"command: {r['command']}"])


def results_text(report: dict) -> str:
    """The table, the chain's best line, and the CPU kernel rows when they ran."""
    text = table(report["rows"], report["ceiling"])
    if line := best_line(report):
        text += "\n\n" + line
    if report.get("kernels"):
        text += "\n\n" + bench_kernels.markdown(report["kernels"], report["ceiling"])
    return text


def plot(report: dict, path: Path) -> bool:
    """Bar chart of tokens/s and peak memory per row; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["rows"]
    speed = [r.get("tokens_per_s", 0.0) for r in rows]
    memory = [r.get("memory", {}).get("allocated", r.get("memory", {}).get("rss", 0)) / 2**30
              for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.42 * len(rows)), sharey=True)
    ax1.barh(range(len(rows)), speed, color=["#9a9a9a" if r.get("chain", "").startswith(
        "dropped") else "#3b75af" for r in rows])
    ax2.barh(range(len(rows)), memory, color="#c6843a")
    for i, r in enumerate(rows):
        ok = r["status"] == "ok"
        vs = f"  ({r['vs_baseline']:.2f}x)" if r.get("vs_baseline") else ""
        if "chain" in r and r.get("vs_previous"):  # the side-by-side ratio decided the chain
            vs = f"  ({r['vs_previous']:.2f}x row {r['previous']}, " + (
                "kept)" if r["chain"] == "kept" else "dropped)")
        ax1.text(speed[i], i, f" {speed[i]:,.0f}{vs}" if ok else f" {r['status']}",
                 va="center", fontsize=8)
        ax2.text(memory[i], i, f" {memory[i]:.2f}" if ok else "", va="center", fontsize=8)
    ax1.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax1.invert_yaxis()
    cuda = rows and "allocated" in rows[0].get("memory", {})
    for ax, what in ((ax1, "tokens/s (median of timed steps)"), (ax2, "peak memory, GiB ("
                     + ("CUDA max allocated" if cuda else "peak RSS") + ")")):
        ax.set_xlabel(what)
        ax.margins(x=0.25)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"bench.py {report['mode']}: {report['ceiling'].get('hardware', '')}"
                 + ("\nin brackets: against the row it was tried on, measured alongside; grey: "
                    "dropped" if report["mode"] == "chain" else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(report: dict, folder: Path, stem: str) -> list[Path]:
    """NAME.json, .md and .png; NAME by default the device (cpu, nvidia-h200), _only for --only."""
    if not stem:
        hardware = report["ceiling"].get("hardware", report["device"])
        stem = report["device"] if report["device"] == "cpu" else re.sub(
            r"[^a-z0-9]+", "-", hardware.removeprefix("GPU ").split(" (")[0].lower()).strip("-")
        stem += "_only" if report["mode"] == "only" else ""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.json", folder / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(f"# bench.py ({report['mode']})\n\n"
                        + "\n".join(f"- {line}" for line in describe(report).splitlines())
                        + "\n\n" + results_text(report) + "\n")
    if plot(report, folder / f"{stem}.png"):
        paths.append(folder / f"{stem}.png")
    else:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
    return paths


def load_bench_config(argv: list[str]) -> tuple[Config, BenchOptions, list[str]]:
    """(config, options, the config's own arguments, for a train.py subprocess to rebuild it);
    by default bench_gpu on CUDA, else bench_cpu."""
    line = parse_command_line(argv, BenchOptions)
    given = any(a == "--config" or a.startswith("--config=") for a in argv)
    name = line.config_name if given else "bench_cpu"
    cfg, opts = load_config(["--config", name, *argv], prog="bench.py", script=BenchOptions)
    device = runtime.resolve_device(cfg.system.device)
    if device.type == "cuda" and not given:
        name = "bench_gpu"
        cfg, opts = load_config(["--config", name, *argv], prog="bench.py", script=BenchOptions)
    cfg.system.device = str(device)
    return cfg, opts, ["--config", name, *(f"--{k}={v}" for k, v in line.overrides)]


def check_options(opts: BenchOptions, cfg: Config) -> None:
    """Raises BenchError on an option that cannot be used (the loader checks only the config)."""
    if opts.warmup_steps < 0 or opts.measure_steps < 1 or opts.repeat < 1:
        raise BenchError("--warmup-steps must be >= 0, --measure-steps and --repeat >= 1")
    if opts.keep_margin < 0 or opts.decode_rounds < 1:
        raise BenchError(f"--keep-margin must be >= 0 (got {opts.keep_margin}) and "
                         f"--decode-rounds >= 1 (got {opts.decode_rounds})")
    if opts.time_budget < 0 or opts.ceiling_size < 0:
        raise BenchError("--time-budget and --ceiling-size must be >= 0 (0: no limit, "
                         "the default size)")
    for f in dataclasses.fields(opts):
        if f.metadata["choices"] and getattr(opts, f.name) not in f.metadata["choices"]:
            raise BenchError(f"--{f.name.replace('_', '-')}={getattr(opts, f.name)!r}: use "
                             + " or ".join(f.metadata["choices"]))
    if opts.clock == "process" and not opts.memory and (cfg.system.device != "cpu"
                                                        or cfg.system.threads != 1):
        raise BenchError("--clock=process times this process's CPU time: it needs "
                         "--device=cpu and --threads=1 (the CPU time of several threads "
                         "adds up, and a GPU's work is not CPU time)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv or "--serve=true" in argv:  # its options are not the ablation's
        return bench_serve.main([a for a in argv if a not in ("--serve", "--serve=true")])
    if "--decode" in argv or "--decode=true" in argv:  # its own options too
        return bench_decode.main([a for a in argv if a not in ("--decode", "--decode=true")])
    command = ("python bench.py " + shlex.join(argv)).strip()
    try:
        cfg, opts, config_args = load_bench_config(argv)
        check_options(opts, cfg)
        if opts.memory:
            bench_memory.check(opts)
        elif opts.to_loss:
            bench_to_loss.check(opts)
        else:
            cfg.train.init_from = "scratch"  # every row starts from the same seeded weights
            only = bool(opts.only)
            rows = plan(cfg, parse_steps(opts.order if opts.only in ("", "all") else opts.only),
                        only)
        ensure_dataset(cfg)
    except (BenchError, ConfigError, DataError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.memory:
        return bench_memory.run(cfg, opts, config_args, command)
    if opts.to_loss:
        return bench_to_loss.run(opts, command)
    print(f"bench: {len(rows)} rows on {cfg.system.device}, each {opts.warmup_steps} warm-up + "
          f"{opts.measure_steps} timed steps in its own process" + (
              f", {opts.repeat} runs of each" if opts.repeat > 1 else ""), flush=True)
    report = run_all(rows, cfg, opts, only, command)
    print("\n" + describe(report) + "\n\n" + results_text(report))
    paths = write_outputs(report, Path(opts.results), opts.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
