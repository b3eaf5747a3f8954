"""Time to a loss, `python bench.py to-loss 1.886`: each recipe in a fresh train.py process on
nanoGPT's CPU recipe (char Shakespeare, 4 x 4 x 128, context 64, batch 12, lr 1e-3 cosine to
2000 steps); per recipe the wall-clock time from launch to the first evaluation at or below the
target, and a plot of val loss against time. --nanogpt DIR adds nanoGPT's own train.py as a row.
RESULTS/to_loss_NAME.{json,md,png}.

`python bench.py vs-nanogpt DIR [--rounds=2] [--max-iters=2000]`: whole runs to their end, taking
turns (A B C C B A): nanoGPT's CPU recipe and ours at the same shape and math; the wall time from
launch to exit, the median logged step time, and the median of the per-round ratios to nanoGPT.
RESULTS/to_loss_cpu_vs_nanogpt.{json,md}.
"""
from __future__ import annotations

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
from engine.benchmarks.report import markdown_table, pyplot, save_figure, utc_now, write_report
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
OURS_EVAL = re.compile(r"^eval\s+(\d+) \| train [\d.]+ \| val ([\d.]+)")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
OURS_STEP_MS = re.compile(r"^step\s+\d+ \| loss .* \| (\d+) ms \|")
NANOGPT_STEP_MS = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")


@dataclass
class ToLossOptions:
    positional: ClassVar[str] = "target"
    target: float = opt(0.0, "the val loss to reach (also the first bare argument)")
    recipes: str = opt("", "only these recipes, a comma list (default: all)")
    eval_every: int = opt(100, "steps between evaluations (the target is checked there)")
    recipe_seconds: float = opt(300.0, "a recipe short of the target by then is stopped")
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


def follow(command: list[str], cwd: Path, pattern: re.Pattern, target: float,
           limit: float) -> dict:
    """Run command, reading its evaluations as they are printed; stop it at the target."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", *command], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    curve, reached, tail = [], None, []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-5:]
        if m := pattern.match(line):
            curve.append([int(m.group(1)), float(m.group(2)), time.perf_counter() - start])
            reached = curve[-1] if curve[-1][1] <= target else None
        if reached or time.perf_counter() - start > limit:
            proc.terminate()
            break
    proc.wait()
    status = "ok" if reached else ("not reached" if proc.returncode in (0, -15) else "failed")
    return {"status": status, "curve": curve, "reached": reached,
            "seconds": time.perf_counter() - start, "tail": tail if status == "failed" else []}


def programs(opts: ToLossOptions) -> dict[str, tuple[Path, list[str], re.Pattern]]:
    """recipe -> (working directory, train.py arguments, its evaluation line)."""
    chosen = options.comma_list(opts.recipes)
    if unknown := [r for r in chosen if r not in RECIPES]:
        raise ConfigError(f"--recipes: unknown {', '.join(unknown)}; the recipes are "
                          f"{', '.join(RECIPES)}")
    schedule = [f"--eval_interval={opts.eval_every}", f"--eval_iters={EVAL_ITERS}",
                f"--log_interval={opts.eval_every}"]
    out = {"nanoGPT": (Path(opts.nanogpt), NANOGPT + ["--max_iters=2000",
                                                      "--lr_decay_iters=2000"] + schedule,
                       NANOGPT_EVAL)} if opts.nanogpt else {}
    return out | {name: (REPO_ROOT, args + schedule, OURS_EVAL) for name, args in RECIPES.items()
                  if not chosen or name in chosen}


def run(opts: ToLossOptions, command: str) -> int:
    """Each recipe to the target in turn; the page to stdout and RESULTS/to_loss_NAME.*."""
    options.check(opts, {"eval_every": 1, "recipe_seconds": 1e-9})
    if opts.target <= 0:
        raise ConfigError(f"the target loss must be > 0 (got {opts.target}): bench.py to-loss "
                          "1.886")
    if opts.nanogpt:
        check_nanogpt(opts.nanogpt)
    rows = []
    for name, (cwd, args, pattern) in programs(opts).items():
        with tempfile.TemporaryDirectory() as out:  # its own loader and checkpoints: nanoGPT's
            ours = [f"--out_dir={out}", "--save_checkpoints=false"] * (cwd == REPO_ROOT)
            print(f"to-loss: {name}: python train.py {' '.join(args)} ...", flush=True)
            rows.append({"recipe": name, "args": args, **follow(
                ["train.py", *args, *ours], cwd, pattern, opts.target, opts.recipe_seconds)})
        _, steps, seconds, _, best = cells(rows[-1], rows)
        print(f"  {seconds} (step {steps}; best val {best})", flush=True)
    report = {"target": opts.target, "command": command, "rows": rows, "date": utc_now(),
              "hardware": runtime.machine_line(torch.device("cpu"))}
    text, stem = describe(report), f"to_loss_{opts.name}"
    print("\n" + text)
    write_report(report, f"# bench.py to-loss {opts.target}\n\n{text}", opts.results, stem)
    plot(report, Path(opts.results) / f"{stem}.png")
    print(f"wrote {Path(opts.results) / stem}.{{json,md,png}}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def cells(row: dict, rows: list[dict]) -> list[str]:
    """[recipe, steps, time to target, vs the reference, best val]."""
    best = min((v for _, v, _ in row["curve"]), default=float("nan"))
    if not row["reached"]:
        return [row["recipe"], "-", f"{row['status']} ({row['seconds']:.0f} s)", "-", f"{best:.4f}"]
    step, _, seconds = row["reached"]
    base = next((r["reached"][2] for r in rows if r["recipe"] == "reference" and r["reached"]),
                None)
    return [row["recipe"], f"{step}", f"{seconds:.1f} s", f"{seconds / base:.2f}x" if base else "-",
            f"{best:.4f}"]


def describe(report: dict) -> str:
    rows = [cells(r, report["rows"]) for r in report["rows"]]
    lines = [f"- target: val loss <= {report['target']}, checked at each evaluation; time from "
             "launch (start-up and evaluations included)", f"- {report['hardware']}",
             f"- {report['date']}: `{report['command']}`", "",
             markdown_table(["recipe", "steps", "time to target", "vs reference", "best val"],
                            rows), "", "Arguments:", ""]
    return "\n".join(lines + [f"- {r['recipe']}: `{' '.join(r['args'])}`"
                              for r in report["rows"]])


def plot(report: dict, path: Path) -> Path | None:
    if (plt := pyplot()) is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in filter(lambda r: r["curve"], report["rows"]):
        ax.plot([t for _, _, t in r["curve"]], [v for _, v, _ in r["curve"]], marker=".",
                label=r["recipe"])
    ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="wall-clock seconds from launch", ylabel="val loss",
           title=f"time to val {report['target']}: {report['hardware']}", ylim=(None, 3.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def side_programs(opts: VsNanoGPTOptions, out: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (working directory, train.py arguments) of the whole runs compared."""
    n, schedule = opts.max_iters, ["--eval_interval=250", "--eval_iters=20", "--log_interval=1"]
    ours = [a for a in RECIPE if a != "--max_iters=2000"] + REFERENCE + SPEEDUPS + [
        f"--max_iters={n}", *schedule]  # nanoGPT's recipe with every speedup: the same math
    return {"nanoGPT": (Path(opts.nanogpt), NANOGPT + [f"--max_iters={n}", f"--lr_decay_iters={n}",
                                                       f"--out_dir={out / 'nanogpt'}", *schedule]),
            "ours, every speedup (tanh GELU)": (REPO_ROOT, ours + [f"--out_dir={out / 'tanh'}"]),
            "ours, nanoGPT's math (erf GELU)": (REPO_ROOT, ours + [
                "--activation=gelu_erf", f"--out_dir={out / 'erf'}"])}


def run_to_end(cwd: Path, args: list[str], threads: int) -> dict:
    """One whole run: wall time from launch to exit, the median logged step time, the last val."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-u", "train.py", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)
    seconds, lines = time.perf_counter() - start, proc.stdout.splitlines()
    step_ms = [float(m.group(m.lastindex)) for line in lines
               if (m := OURS_STEP_MS.match(line) or NANOGPT_STEP_MS.match(line))
               and not (m.re is NANOGPT_STEP_MS and m.group(1) == "0")]  # its step 0 holds an eval
    vals = [float(m.group(2)) for line in lines if (m := OURS_EVAL.match(line)
                                                    or NANOGPT_EVAL.match(line))]
    return {"seconds": seconds, "returncode": proc.returncode,
            "step_ms": statistics.median(step_ms) if step_ms else None,
            "val": vals[-1] if vals else None,
            "tail": [] if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]}


def vs_nanogpt(opts: VsNanoGPTOptions, command: str) -> int:
    """Every program to its end, in turn, round after round; the page after every round."""
    check_nanogpt(opts.nanogpt)
    options.check(opts, {"rounds": 1, "max_iters": 1, "threads": 0})
    runs: dict[str, list[dict]] = {}
    names = list(side_programs(opts, Path("OUT")))
    for round_ in range(opts.rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            with tempfile.TemporaryDirectory() as out:  # a fresh out_dir for every run
                result = run_to_end(*side_programs(opts, Path(out))[name], opts.threads)
            runs.setdefault(name, []).append(result)
            print(f"round {round_ + 1}: {name}: {result['seconds']:.1f} s, step "
                  f"{result['step_ms']} ms, val {result['val']}", flush=True)
            if result["returncode"]:
                print(result["tail"], file=sys.stderr)
                return 1
        report = {"command": command, "hardware": runtime.machine_line(torch.device("cpu")),
                  "date": utc_now(), "runs": runs,
                  "programs": {k: {"cwd_is_nanogpt": v[0] != REPO_ROOT, "args": v[1]}
                               for k, v in side_programs(opts, Path("OUT")).items()}}
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
    lines = [f"- {report['hardware']}", f"- {report['date']}: `{report['command']}`",
             "- each round runs every program once, in turn (the order reverses every round); "
             "whole run: launch to exit (start-up, 9 evaluations of 2 x 20 batches, checkpoints, "
             "a log line per step); step: the median logged step time; ratios: per round, "
             "then the median", "",
             markdown_table(["program", "whole run s (per round)", "vs nanoGPT (median)",
                             "step ms (per round)", "step vs nanoGPT", "last val"], rows),
             "", "Arguments:", ""]
    return "\n".join(lines + [f"- {name}: `{' '.join(p['args'])}`"
                              for name, p in report["programs"].items()])
