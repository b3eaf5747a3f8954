"""The speedup ablation, `python bench.py [ablation]`, in one of four modes (MODES):
    chain       the baseline (every flag at its reference value), then each flag put on the
                fastest combination so far and kept only when faster beyond the noise
    cumulative  (--cumulative) the baseline, then each flag added on the last row, kept whatever
                it measured: the running total of every speedup
    only        (--only) each flag alone on the baseline
    without     (--without) the full recipe (every --order flag at its fast value), then each
                flag turned off alone: what that speedup buys in the full recipe
Each row runs in a fresh process from the same seed, and the results are written after every
row (a run stopped midway keeps its rows); on a CPU the kernel rows (kernels.py) follow. The
page: ablation_report.py."""
from __future__ import annotations

import copy
import difflib
import json
import math
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from config import BOOL_WORDS, Config, ConfigError, apply_override, opt, speedup_flags, validate
from data.dataset import load_or_prepare
from engine.benchmarks import ablation_report, checks, kernels
from engine.benchmarks.report import utc_now
from engine.benchmarks.timing import run_worker, time_left
from engine.device import resolve_dtype

# the speedup flags: the fields that state a fast value (config.py), in their order; "dtype"
# (auto: bf16 where native, resolved in the row's process) and "compile" (a value is the mode)
# read their values themselves (with_flag)
FLAGS = speedup_flags()
DEFAULT_ORDER = ",".join(FLAGS)


@dataclass
class AblationOptions:
    """bench.py ablation's own options (the rest of the command line is the config)."""

    order: str = opt(DEFAULT_ORDER, "the chain, in order: FLAG[=VALUE],...")
    only: str = opt("", "all | FLAG,...: each flag alone against the baseline, not the chain")
    without: str = opt("", "all | none | FLAG,...: the full recipe (every --order flag on), then "
                       "each of these turned off alone (none: the full recipe alone)")
    cumulative: bool = opt(False, "the chain keeps every flag, whatever it measured (no "
                           "side-by-side rerun): each row the total of the flags so far")
    ceiling: bool = opt(True, "measure the device's matmul ceiling first (MFU (meas.))")
    in_process: bool = opt(False, "every row in this process, not a fresh one each: a quick dry "
                           "run (memory peaks and compile state carry over between rows)")
    warmup_steps: int = opt(2, "untimed steps per row")
    measure_steps: int = opt(5, "timed steps per row")
    repeat: int = opt(1, "runs of each row, fresh processes, their timed steps pooled")
    keep_margin: float = opt(0.03, "chain: a flag is kept only when faster than the chain so "
                             "far by more than this share and twice the noise")
    kernels: str = opt("auto", "CPU kernel rows after the chain: auto = on CPU",
                       ("auto", "on", "off"))
    clock: str = opt("wall", "the wall clock or this process's CPU time (CPU, --threads=1)",
                     ("wall", "process"))
    time_budget: float = opt(0.0, "seconds in all, then rows are skipped; 0: no limit")
    ceiling_size: int = opt(0, "N of the ceiling's N^3 matmul (0: 8192 on CUDA, else 2048)")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("", "output file stem (default: the device, _only added for --only)")


def parse_steps(text: str, flags: dict = FLAGS) -> list[tuple[str, str]]:
    """'attention,compile=max-autotune' -> [('attention', 'sdpa'), ('compile', 'max-autotune')]."""
    steps: list[tuple[str, str]] = []
    for item in checks.comma_list(text):
        name, _, value = item.partition("=")
        if name not in flags:
            close = difflib.get_close_matches(name, list(flags), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown flag '{name}'{hint} (flags: {', '.join(flags)})")
        if name in (s for s, _ in steps):
            raise ConfigError(f"flag '{name}' appears twice; list each flag once")
        steps.append((name, value or flags[name].fast))
    if not steps:
        raise ConfigError(f"no flags given; e.g. --order {DEFAULT_ORDER}")
    return steps


def with_flag(cfg: Config, name: str, value: str) -> Config:
    """A copy of cfg with one flag's config keys set, checked like any other override."""
    cfg, problems = copy.deepcopy(cfg), []
    if name == "dtype" and value == "auto":
        cfg.system.dtype = "auto"  # resolved in the row's process, where the device is known
    elif name == "compile" and value.lower() not in BOOL_WORDS:
        apply_override(cfg, "system.compile", "true", problems)
        apply_override(cfg, "system.compile_mode", value, problems)
    else:
        for key in speedup_flags(cfg)[name].keys:
            apply_override(cfg, key, value, problems)
    check_cfg = copy.deepcopy(cfg)
    if check_cfg.system.dtype == "auto":
        check_cfg.system.dtype = "float32"
    problems += validate(check_cfg)
    if problems:
        raise ConfigError(f"{name}={value}: " + "; ".join(problems))
    return cfg


MODES = ("chain", "cumulative", "only", "without")


def plan(cfg: Config, steps: list[tuple[str, str]], mode: str,
         without: list[str] | None = None) -> list[dict]:
    """The first row, then a row per flag, every flag checked now, before anything runs. chain
    and cumulative: the baseline, then each flag on the head when it runs (config None until
    then); only: each flag alone on the baseline; without: the full recipe (every step's flag
    at its value), then each flag of `without` (default: every step's) at its reference."""
    if mode == "without":
        full = cfg
        for name, value in steps:
            full = with_flag(full, name, value)
        rows = [{"flag": None, "value": None, "config": full, "previous": None}]
        named = dict(steps)
        for name in named if without is None else without:
            if name not in named:
                raise ConfigError(f"--without: {name} is not in --order, so it is not part of "
                                  f"the full recipe (--order {','.join(named)})")
            reference = speedup_flags(cfg)[name].reference
            rows.append({"flag": name, "value": reference, "config":
                         with_flag(full, name, reference), "previous": 0})
        return rows
    base = cfg
    for name, _ in steps:
        base = with_flag(base, name, speedup_flags(cfg)[name].reference)
    rows = [{"flag": None, "value": None, "config": base, "previous": None}]
    for name, value in steps:
        row_cfg = with_flag(base, name, value)
        rows.append({"flag": name, "value": value, "config": row_cfg if mode == "only" else None,
                     "previous": 0 if mode == "only" else None})
    return rows


def spread(step_s: list[float]) -> float:
    """The relative spread of a row's timed steps: interquartile range / median (0 for one)."""
    if len(step_s) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(step_s, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(step_s)


def median_error(step_s: list[float]) -> float:
    """The relative standard error of the median step: 1.25 sigma / sqrt(n), sigma = IQR / 1.35."""
    return 1.2533 * spread(step_s) / 1.349 / math.sqrt(len(step_s)) if step_s else 0.0


def verdict(candidate: dict, head: dict, margin: float) -> tuple[bool, str]:
    """(keep, why not): kept when its tokens/s beats the head's by more than the noise, the
    larger of margin and twice the standard error of the difference of the two medians."""
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


def merge_pass(first: dict | None, again: dict) -> dict:
    """Fold a later run of a row into its first (if any): all timed steps count toward the
    median -> the row."""
    if first is None:
        return again
    if again["status"] != "ok":
        first.setdefault("later_pass_errors", []).append(again.get("error", again["status"]))
        return first
    first["step_s"] += again["step_s"]
    first["tokens_per_s"] = first["tokens_per_step"] / statistics.median(first["step_s"])
    first["memory"] = {k: max(v, again["memory"].get(k, 0)) for k, v in first["memory"].items()}
    return first


class Measurer:
    """Runs specs in fresh processes within the --time-budget."""

    def __init__(self, opts: AblationOptions, workdir: Path):
        self.opts, self.workdir, self.left = opts, workdir, time_left(opts.time_budget)

    def once(self, spec: dict, name: str) -> dict:
        """The spec's result, or skipped once the time budget is spent."""
        if self.left() <= 0:
            why = f"the --time-budget of {self.opts.time_budget:g} s ran out"
            print(f"    skipped: {why}", flush=True)
            return {"status": "skipped", "reason": why + " before this row"}
        if self.opts.in_process:
            from engine.benchmarks.worker import run_spec

            return json.loads(json.dumps(run_spec(spec)))  # as a worker's file would hand it
        return run_worker(spec, self.workdir, name, self.left())

    def train(self, config: Config, previous: dict | None, name: str, clock: str = "") -> dict:
        """A training row (skipped when its settings are previous's)."""
        o, previous = self.opts, previous if previous and "settings" in previous else None
        return self.once({"kind": "train_row", "config": config.to_dict(), "previous": previous,
                          "clock": clock or o.clock, "warmup": o.warmup_steps,
                          "measure": o.measure_steps}, name)

    def row(self, config: Config, previous: dict | None, i: int,
            head: Config | None) -> tuple[dict, dict | None]:
        """A row, --repeat times, steps pooled; each run followed by one of the head's config
        (A B A B), so that the verdict compares steps measured side by side."""
        first, alongside = None, None
        for run in range(self.opts.repeat):
            if self.opts.repeat > 1:
                print(f"    run {run + 1}/{self.opts.repeat}", flush=True)
            first = merge_pass(first, self.train(config, previous, f"row{i}"))
            if first["status"] != "ok":
                break  # skipped and failed rows are not retried
            if head is not None:
                print("    and the row it is tried on, alongside", flush=True)
                alongside = merge_pass(alongside, self.train(head, None, f"row{i}head"))
        return first, alongside


def run_chain(rows: list[dict], mode: str, measurer: Measurer,
              done: Callable[[list[dict]], None] = lambda results: None) -> tuple[list[dict], int]:
    """Every row -> (results, head), done(results so far) after each. In the chain each flag
    goes onto the head, the fastest combination so far, which it replaces only when faster
    beyond the noise; cumulative: onto the last row, which it always replaces."""
    results: list[dict] = []
    head = 0
    for i, row in enumerate(rows):
        chained = bool(i) and mode in ("chain", "cumulative")
        if chained:
            row["previous"] = head
            row["config"] = with_flag(rows[head]["config"], row["flag"], row["value"])
        prev = results[row["previous"]] if row["previous"] is not None else None
        print(f"[{i + 1}/{len(rows)}] {label(row, mode)}", flush=True)
        beside = rows[head]["config"] if (mode == "chain" and chained
                                          and prev["status"] == "ok") else None
        if why := unchanged(row, rows):  # no process needed to know
            result, alongside = {"status": "skipped", "reason": why}, None
            print(f"    skipped: {why}", flush=True)
        else:
            result, alongside = measurer.row(row["config"], prev, i, beside)
        result.update(flag=row["flag"], value=row["value"], previous=row["previous"],
                      previous_notes=prev.get("notes", []) if prev else [])
        result["label"] = label(result, mode)
        if alongside and alongside["status"] == "ok":
            result["alongside"] = {k: alongside[k] for k in ("tokens_per_s", "step_s")}
        if chained and mode == "cumulative":
            head = i if result["status"] != "failed" else head
        elif chained:
            against = {"status": "ok", **result["alongside"]} if "alongside" in result else prev
            keep, why = verdict(result, against, measurer.opts.keep_margin)
            result["chain"] = "kept" if keep else why
            head = i if keep else head
            if result["chain"]:
                print(f"    chain: {result['chain']}", flush=True)
        results.append(result)
        done(results)
    return results, head


def unchanged(row: dict, rows: list[dict]) -> str:
    """Why a row would change nothing here, known without running it ('' when it may): a flag
    that needs CUDA off CUDA, or the same config as the row it is set against (dtype=auto
    resolved, on a CPU, as its process would)."""
    device = row["config"].system.device
    if row["flag"] and speedup_flags(row["config"])[row["flag"]].cuda and \
            not device.startswith("cuda"):
        return f"needs CUDA: {row['flag']} changes nothing on {device}"
    if row["previous"] is None:
        return ""

    def settled(cfg: Config) -> dict:
        values = cfg.to_dict()
        if device == "cpu":  # on CUDA only the row's own process asks the GPU
            values["system"]["dtype"] = resolve_dtype(cfg.system.dtype, torch.device("cpu"))[0]
        return values

    if settled(row["config"]) == settled(rows[row["previous"]]["config"]):
        return f"changes nothing here: the same settings as row {row['previous']}"
    return ""


def label(row: dict, mode: str) -> str:
    """'baseline', '+ tf32', '+ attention=sdpa', '+ dtype=auto (bfloat16)', 'only ...',
    'full recipe', 'without compile (false)'."""
    if row["flag"] is None:
        return "full recipe" if mode == "without" else "baseline"
    value = row["value"]
    if row["flag"] == "dtype" and value == "auto" and "dtype" in row:
        value = f"auto ({row['dtype']})"
    if mode == "without":
        return f"without {row['flag']} ({value})"
    shown = "" if value.lower() in ("true", "on", "yes", "1", row["flag"]) else f"={value}"
    return ("only " if mode == "only" else "+ ") + row["flag"] + shown


def derive(rows: list[dict], ceiling: dict, mode: str = "chain") -> None:
    """In place: speedups against the row each was tried on (measured alongside, in the chain)
    and against the first row (without: what the flag buys, the full recipe over the row), and
    MFU against the row's own datasheet peak (its precision's: bf16, TF32 or float32) and the
    measured ceiling."""
    base = rows[0] if rows[0]["status"] == "ok" else None
    flops_per_token = next((r["flops_per_token"] for r in rows if "flops_per_token" in r), 0)
    for row in filter(lambda r: r["status"] == "ok", rows):
        prev = rows[row["previous"]] if row["previous"] is not None else {}  # the head: ok
        reference = row.get("alongside") or (prev if prev.get("status") == "ok" else None)
        speed = row["tokens_per_s"]
        row["vs_previous"] = speed / reference["tokens_per_s"] if reference else None
        row["vs_baseline"] = speed / base["tokens_per_s"] if base and row is not base else None
        if mode == "without":
            row["buys"] = 1 / row["vs_baseline"] if row["vs_baseline"] else None
        row["model_flops_per_s"] = achieved = speed * flops_per_token
        peak = row.get("peak_flops") or (0 if "peak_flops" in row else ceiling.get("datasheet"))
        row["mfu"] = achieved / peak if peak else None
        row["mfu_measured"] = achieved / ceiling["measured"] if ceiling.get("measured") else None


def run_all(rows: list[dict], cfg: Config, opts: AblationOptions, mode: str,
            command: str, save: Callable[[dict], None] = lambda report: None) -> dict:
    """The ceiling, every row, then the kernel rows on the best combination -> the report;
    save(report so far) after the ceiling and after every row."""
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else None
    report = {"mode": mode, "device": cfg.system.device.split(":")[0],
              "torch": torch.__version__, "python": platform.python_version(), "date": utc_now(),
              "load_average": None, "command": command, "warmup": opts.warmup_steps,
              "measure": opts.measure_steps, "repeat": opts.repeat, "clock": opts.clock,
              "time_budget": opts.time_budget, "keep_margin": opts.keep_margin,
              "ceiling": {"status": "skipped", "reason": "--ceiling=false"},
              "config": cfg.to_dict(), "rows": [], "best": None, "kernels": []}

    def done(results: list[dict]) -> None:
        report["rows"] = results
        derive(results, report["ceiling"], mode)
        save(report)

    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        measurer = Measurer(opts, Path(tmp))
        if opts.ceiling:
            print(f"measuring the matmul ceiling on {cfg.system.device} ...", flush=True)
            report["ceiling"] = measurer.once({"kind": "ceiling", "config": cfg.to_dict(),
                                               "clock": opts.clock,
                                               "matmul_n": opts.ceiling_size}, "ceiling")
            save(report)
        results, head = run_chain(rows, mode, measurer, done)
        wanted = opts.kernels == "on" or (opts.kernels == "auto" and cfg.system.device == "cpu")
        report["kernels"] = kernels.run(rows[head]["config"], measurer) if wanted else []
    if opts.ceiling and report["ceiling"]["status"] != "ok":
        print(f"matmul ceiling not measured: {report['ceiling'].get('error')}")
    derive(results, report["ceiling"], mode)
    report["best"] = head if mode in ("chain", "cumulative") else None
    report["load_average"] = load + [os.getloadavg()[0]] if load else None
    return report


def chosen_mode(opts: AblationOptions) -> tuple[str, str, list[str] | None]:
    """(mode, the flags to run, --without's flags) from --only, --without and --cumulative."""
    given = [name for name, on in (("--only", opts.only), ("--without", opts.without),
                                   ("--cumulative", opts.cumulative)) if on]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} are different modes: give one of them")
    if opts.only:
        return "only", opts.order if opts.only == "all" else opts.only, None
    if opts.without:
        without = None if opts.without == "all" else [] if opts.without == "none" else [
            name for name, _ in parse_steps(opts.without)]
        return "without", opts.order, without
    return ("cumulative" if opts.cumulative else "chain"), opts.order, None


def run(cfg: Config, opts: AblationOptions, command: str) -> int:
    """Plan (every flag checked first), measure, print and write RESULTS/NAME.{json,md,png},
    the json and md after every row."""
    checks.check(opts, {"warmup_steps": 0, "measure_steps": 1, "repeat": 1, "keep_margin": 0,
                         "time_budget": 0, "ceiling_size": 0})
    if opts.clock == "process" and (cfg.system.device != "cpu" or cfg.system.threads != 1):
        raise ConfigError("--clock=process times this process's CPU time: it needs "
                          "--device=cpu and --threads=1 (several threads' CPU time adds up)")
    cfg.train.init_from = "scratch"  # every row starts from the same seeded weights
    mode, order, without = chosen_mode(opts)
    rows = plan(cfg, parse_steps(order, speedup_flags(cfg)), mode, without)
    load_or_prepare(cfg.data.dataset)  # prepared once here, not in every row's process
    print(f"bench: {len(rows)} rows ({mode}) on {cfg.system.device}, each {opts.warmup_steps} "
          f"warm-up + {opts.measure_steps} timed steps in its own process, {opts.repeat} run(s) "
          "each", flush=True)
    folder = Path(opts.results)
    report = run_all(rows, cfg, opts, mode, command,
                     save=lambda partial: ablation_report.write(partial, folder, opts.name,
                                                                plot_too=False))
    print("\n" + ablation_report.describe(report) + "\n\n" + ablation_report.results(report))
    paths = ablation_report.write(report, folder, opts.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in report["rows"]) else 1
