"""Time to a loss, `python bench.py to-loss 1.886 [--nanogpt DIR]`: each recipe in a fresh
train.py process on nanoGPT's CPU recipe (char Shakespeare, 4 x 4 x 128, context 64, batch 12,
lr 1e-3 cosine to 2000 steps), stopped at its first evaluation at or below the target: the time
from launch, a table and a plot of val loss against time, RESULTS/to_loss_NAME.{json,md,png}.
--nanogpt DIR adds nanoGPT's own train.py as a row.

`python bench.py vs-nanogpt DIR [--rounds=2] [--max-iters=2000] [--threads=N]`: whole runs of
nanoGPT's CPU recipe and of ours at the same shape and math, taking turns (A B C C B A): launch
to exit, the median step time, the median of the per-round ratios to nanoGPT,
RESULTS/to_loss_cpu_vs_nanogpt.{json,md}.
"""
from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from config import ConfigError, opt
from engine import runtime
from engine.benchmarks import options
from engine.benchmarks.report import figure, markdown_table, save_figure, utc_now, write_report
from engine.benchmarks.runner import REPO_ROOT

RECIPE = ["--config", "shakespeare_char", "--n_layer=4", "--n_head=4", "--n_embd=128",
          "--block_size=64", "--batch_size=12", "--dropout=0", "--learning_rate=1e-3",
          "--warmup_iters=100", "--min_lr_ratio=0.1", "--beta2=0.99", "--max_iters=2000",
          "--bias=false"]
REFERENCE = ["--attention=scratch", "--causal_mask=buffer", "--norm=scratch",
             "--activation_impl=scratch", "--fused_adamw=false", "--loss=full", "--optimizer=adamw"]
SPEEDUPS = ["--attention=sdpa", "--causal_mask=on_the_fly", "--norm=native",
            "--activation_impl=native", "--fused_adamw=true"]
RECIPES = {  # name -> train.py arguments
    "reference": RECIPE + REFERENCE,
    "every speedup": RECIPE + REFERENCE + SPEEDUPS,
    "+ chunked loss": RECIPE + REFERENCE + SPEEDUPS + ["--loss=chunked"],
    "+ muon": RECIPE + REFERENCE + SPEEDUPS + ["--loss=chunked", "--optimizer=muon"],
    "fast config": ["--config", "shakespeare_char_fast"],
}
NANOGPT = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
           "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           "--dropout=0.0"]
EVAL_ITERS = 20  # batches per split at each evaluation, as nanoGPT's recipe
RECIPE_SECONDS = 300  # a recipe short of the target by then is stopped
EVAL = re.compile(r"^eval\s+(\d+) \| train [\d.]+ \| val ([\d.]+)"  # ours, then nanoGPT's
                  r"|^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
STEP_MS = re.compile(r"^step\s+\d+ \| loss .* \| (\d+) ms \||^iter [1-9]\d*: loss [\d.]+, "
                     r"time ([\d.]+)ms")  # nanoGPT's iter 0 holds an evaluation: not a step


@dataclass
class ToLossOptions:
    positional: ClassVar[str] = "target"
    target: float = opt(0.0, "the val loss to reach (also the first bare argument)")
    recipes: str = opt("", "only these recipes, a comma list (default: all)")
    eval_every: int = opt(100, "steps between evaluations (the target is checked there)")
    nanogpt: str = opt("", "a nanoGPT checkout (data/shakespeare_char prepared): a row")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("cpu", "outputs: RESULTS/to_loss_NAME.{json,md,png}")


@dataclass
class VsNanoGPTOptions:
    positional: ClassVar[str] = "nanogpt"
    nanogpt: str = opt("", "a nanoGPT checkout, data/shakespeare_char prepared (or bare)")
    rounds: int = opt(2, "rounds; each runs every program once, in turn")
    max_iters: int = opt(2000, "steps per run (nanoGPT's recipe: 2000)")
    threads: int = opt(0, "OMP_NUM_THREADS for every program; 0 = torch's default")
    results: str = opt("bench_results", "folder for the outputs")


def check_nanogpt(folder: str) -> None:
    if not (Path(folder) / "train.py").is_file():
        raise ConfigError(f"--nanogpt={folder!r}: no train.py there; give a nanoGPT checkout "
                          "(with data/shakespeare_char prepared)")


def follow(cwd: Path, args: list[str], target: float = 0.0, limit: float = math.inf,
           threads: int = 0) -> dict:
    """Run `python train.py ARGS` in cwd, reading its evaluations and step times as they are
    printed; stopped at the first evaluation at or below target, or after limit seconds. The
    curve [[step, val, seconds], ...], the median step time, the last val."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", "train.py", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    curve, step_ms, tail, reached = [], [], [], None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if m := EVAL.match(line):
            step, val = (g for g in m.groups() if g is not None)
            curve.append([int(step), float(val), time.perf_counter() - start])
            reached = curve[-1] if curve[-1][1] <= target else None
        elif m := STEP_MS.match(line):
            step_ms.append(float(m.group(1) or m.group(2)))
        if reached or time.perf_counter() - start > limit:
            proc.terminate()
            break
    returncode = proc.wait()
    status = "ok" if reached else ("not reached" if returncode in (0, -15) else "failed")
    return {"status": status, "returncode": 0 if reached else returncode, "curve": curve,
            "reached": reached, "seconds": time.perf_counter() - start,
            "step_ms": statistics.median(step_ms) if step_ms else None,
            "val": curve[-1][1] if curve else None, "tail": tail if status == "failed" else []}


def page(report: dict, about: list[str], header: list[str], rows: list[list],
         args: dict[str, list[str]]) -> str:
    """Bullets (what was measured, the machine, the command), the table, each program's args."""
    lines = [*(f"- {line}" for line in about), f"- {report['hardware']}",
             f"- {report['date']}: `{report['command']}`", "", markdown_table(header, rows), "",
             "Arguments:", ""]
    return "\n".join(lines + [f"- {name}: `{' '.join(a)}`" for name, a in args.items()])


def programs(opts: ToLossOptions) -> dict[str, tuple[Path, list[str]]]:
    """recipe -> (working directory, train.py arguments)."""
    chosen = options.comma_list(opts.recipes)
    if unknown := [r for r in chosen if r not in RECIPES]:
        raise ConfigError(f"--recipes: unknown {', '.join(unknown)}; the recipes are "
                          f"{', '.join(RECIPES)}")
    schedule = [f"--eval_interval={opts.eval_every}", f"--eval_iters={EVAL_ITERS}",
                f"--log_interval={opts.eval_every}"]
    nanogpt = NANOGPT + ["--max_iters=2000", "--lr_decay_iters=2000"] + schedule
    out = {"nanoGPT": (Path(opts.nanogpt), nanogpt)} if opts.nanogpt else {}
    return out | {name: (REPO_ROOT, args + schedule) for name, args in RECIPES.items()
                  if not chosen or name in chosen}


def run(opts: ToLossOptions, command: str) -> int:
    """Each recipe to the target in turn; the page to stdout and RESULTS/to_loss_NAME.*."""
    options.check(opts, {"eval_every": 1})
    if opts.target <= 0:
        raise ConfigError(f"the target loss must be > 0 (got {opts.target}): bench.py to-loss "
                          "1.886")
    if opts.nanogpt:
        check_nanogpt(opts.nanogpt)
    rows = []
    for name, (cwd, args) in programs(opts).items():
        with tempfile.TemporaryDirectory() as out:  # its own checkpoints: nanoGPT's stay its own
            ours = [f"--out_dir={out}", "--save_checkpoints=false"] * (cwd == REPO_ROOT)
            print(f"to-loss: {name}: python train.py {' '.join(args)} ...", flush=True)
            rows.append({"recipe": name, "args": args,
                         **follow(cwd, args + ours, opts.target, RECIPE_SECONDS)})
        print("  " + " | ".join(cells(rows[-1], rows)[1:]), flush=True)
    report = {"target": opts.target, "command": command, "rows": rows, "date": utc_now(),
              "hardware": runtime.machine_line(torch.device("cpu"))}
    text = page(report, [f"target: val loss <= {opts.target}, checked at each evaluation; time "
                         "from launch (start-up and evaluations included)"],
                ["recipe", "steps", "time to target", "vs reference", "best val"],
                [cells(r, rows) for r in rows], {r["recipe"]: r["args"] for r in rows})
    print("\n" + text)
    stem = f"to_loss_{opts.name}"
    write_report(report, f"# bench.py to-loss {opts.target}\n\n{text}", opts.results, stem)
    plot(report, Path(opts.results) / f"{stem}.png")
    print(f"wrote {Path(opts.results) / stem}.{{json,md,png}}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def cells(row: dict, rows: list[dict]) -> list[str]:
    """[recipe, steps, time to target, vs the reference, best val]."""
    best = f"{min((v for _, v, _ in row['curve']), default=math.nan):.4f}"
    if not row["reached"]:
        return [row["recipe"], "-", f"{row['status']} ({row['seconds']:.0f} s)", "-", best]
    step, _, seconds = row["reached"]
    base = next((r["reached"][2] for r in rows if r["recipe"] == "reference" and r["reached"]),
                None)
    vs = f"{seconds / base:.2f}x" if base else "-"
    return [row["recipe"], f"{step}", f"{seconds:.1f} s", vs, best]


def plot(report: dict, path: Path) -> Path | None:
    if (fig := figure(figsize=(8, 4.5))) is None:
        return None
    ax = fig.subplots()
    for r in filter(lambda r: r["curve"], report["rows"]):
        ax.plot([t for _, _, t in r["curve"]], [v for _, v, _ in r["curve"]], marker=".",
                label=r["recipe"])
    ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="wall-clock seconds from launch", ylabel="val loss",
           title=f"time to val {report['target']}: {report['hardware']}", ylim=(None, 3.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def side_programs(opts: VsNanoGPTOptions) -> dict[str, tuple[Path, list[str]]]:
    """name -> (working directory, train.py arguments) of the whole runs compared."""
    n, schedule = opts.max_iters, ["--eval_interval=250", "--eval_iters=20", "--log_interval=1"]
    ours = [a for a in RECIPE if a != "--max_iters=2000"] + REFERENCE + SPEEDUPS + [
        f"--max_iters={n}", *schedule]  # nanoGPT's recipe with every speedup: the same math
    return {"nanoGPT": (Path(opts.nanogpt), NANOGPT + [f"--max_iters={n}",
                                                       f"--lr_decay_iters={n}", *schedule]),
            "ours, every speedup (tanh GELU)": (REPO_ROOT, ours),
            "ours, nanoGPT's math (erf GELU)": (REPO_ROOT, ours + ["--activation=gelu_erf"])}


def vs_nanogpt(opts: VsNanoGPTOptions, command: str) -> int:
    """Every program to its end, in turn, round after round; the page after every round."""
    check_nanogpt(opts.nanogpt)
    options.check(opts, {"rounds": 1, "max_iters": 1, "threads": 0})
    programs, runs = side_programs(opts), {}
    for round_ in range(opts.rounds):
        for name in programs if round_ % 2 == 0 else reversed(programs):
            with tempfile.TemporaryDirectory() as out:  # a fresh out_dir for every run
                cwd, args = programs[name]
                result = follow(cwd, args + [f"--out_dir={out}"], threads=opts.threads)
            runs.setdefault(name, []).append(result)
            print(f"round {round_ + 1}: {name}: {result['seconds']:.1f} s, step "
                  f"{result['step_ms']} ms, val {result['val']}", flush=True)
            if result["returncode"]:
                print("\n".join(result["tail"]), file=sys.stderr)
                return 1
        report = {"command": command, "hardware": runtime.machine_line(torch.device("cpu")),
                  "date": utc_now(), "runs": runs,
                  "programs": {k: {"cwd_is_nanogpt": cwd != REPO_ROOT, "args": args}
                               for k, (cwd, args) in programs.items()}}
        text = describe_side_by_side(report)  # written after every round: a stop keeps them
        write_report(report, "# Our whole run against nanoGPT's, at its CPU recipe\n\n" + text,
                     opts.results, "to_loss_cpu_vs_nanogpt")
    print("\n" + text)
    return 0


def describe_side_by_side(report: dict) -> str:
    base, rows = report["runs"]["nanoGPT"], []
    for name, runs in report["runs"].items():
        ratios = [r["seconds"] / b["seconds"] for r, b in zip(runs, base)]
        step_ratios = [r["step_ms"] / b["step_ms"] for r, b in zip(runs, base)
                       if r["step_ms"] and b["step_ms"]]
        rows.append([name, " / ".join(f"{r['seconds']:.1f}" for r in runs),
                     f"{statistics.median(ratios):.2f}x",
                     " / ".join(f"{r['step_ms']:.1f}" for r in runs if r["step_ms"]),
                     f"{statistics.median(step_ratios):.2f}x" if step_ratios else "-",
                     " / ".join(f"{r['val']:.4f}" for r in runs if r["val"] is not None)])
    about = ["each round runs every program once, in turn, the order reversed every round; "
             "whole run: launch to exit; step: the median logged step time; ratios: per round, "
             "then the median"]
    return page(report, about, ["program", "whole run s (per round)", "vs nanoGPT (median)",
                                "step ms (per round)", "step vs nanoGPT", "last val"], rows,
                {name: p["args"] for name, p in report["programs"].items()})
