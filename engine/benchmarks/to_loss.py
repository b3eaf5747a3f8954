"""Time to a loss, `python bench.py to-loss 1.886 [--nanogpt DIR] [--repeat N]`: recipes in fresh
train.py processes on nanoGPT's CPU recipe (char Shakespeare, 4 x 4 x 128, context 64, batch 12,
lr 1e-3 cosine to 2000 steps), each stopped at its first evaluation at or below the target. Rows:
nanoGPT's own train.py (--nanogpt), our code at its math (reference, then every step speedup),
then the chain: each technique added to the best recipe so far, kept only when it reaches the
target sooner beyond the noise (as bench.py's speedup chain), and last the config the chain led
to. The time from launch, a table and a plot of val loss against time,
RESULTS/to_loss_NAME.{json,md,png}.

`python bench.py to-loss [TARGET] --configs gpt2_124m,gpt2_124m_speedrun --steps 100
--args '--dataset=shakespeare'`: whole configs instead, each shortened to --steps (its warmup and
Muon's momentum warm-up scaled in proportion), the first the reference: without a TARGET its
best val is the target, and each other config's time to reach it is set against the
reference's. Both the time from launch and from the end of step 1 (start-up and compile left
out) are reported.

`python bench.py vs-nanogpt DIR [--rounds=2] [--max-iters=2000] [--threads=N]`: whole runs of
nanoGPT's CPU recipe, of ours at the same shape and math, and of configs/
shakespeare_char_speedrun.toml, taking turns (A B C D D C B A): launch to exit, the median step
time, the last val, the median of the per-round ratios to nanoGPT,
RESULTS/to_loss_NAME.{json,md} (--name, default cpu_vs_nanogpt).
"""
from __future__ import annotations

import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from config import (ConfigError, ModelConfig, TrainConfig, gpt2_recipe_flags, load_config, opt,
                    speedup_flags)
from engine.fields import as_flag, facts
from engine.benchmarks import checks
from engine.benchmarks.report import figure, markdown_table, save_figure, utc_now, write_report
from engine.benchmarks.timing import REPO_ROOT
from engine.device import machine_line

# GPT-2's model and nanoGPT's schedule, whatever the default config turns on
RECIPE = ["--config", "shakespeare_char", "--n_layer=4", "--n_head=4", "--n_embd=128",
          "--block_size=64", "--batch_size=12", "--dropout=0", "--learning_rate=1e-3",
          "--warmup_iters=100", "--min_lr_ratio=0.1", "--beta2=0.99", "--max_iters=2000",
          "--bias=false", *gpt2_recipe_flags()]
# the speedups of the same math a step runs faster with (their keys and values: config.py's
# fields), on in the rows compared with nanoGPT; the loss and the optimizer are chain steps
SAME_MATH = ("attention", "causal_mask", "norm_gelu", "fused_adamw")
# this chain's values for the departures whose speedrun value suits a longer run than its 600
DEPARTURE_VALUES = {"muon_momentum_warmup": 100}


def flag_args(names: tuple[str, ...], value: str) -> list[str]:
    """--section.key=... of each speedup flag named, at its reference or fast value."""
    flags = speedup_flags()
    return [f"--{key}={getattr(flags[name], value)}" for name in names for key in flags[name].keys]


def departure_steps() -> dict[str, list[str]]:
    """'+ name=value' -> its argument, for every departure from GPT-2 with a speedrun value
    (config.py's fields, in their order): the chain tries each."""
    steps = {}
    for section in (ModelConfig, TrainConfig):
        for name, value in facts(section, "speedrun").items():
            value = DEPARTURE_VALUES.get(name, value)
            steps[f"+ {name}={as_flag(value)}"] = [f"--{name}={as_flag(value)}"]
    return steps


REFERENCE = flag_args(SAME_MATH + ("chunked_loss", "muon"), "reference")
SPEEDUPS = flag_args(SAME_MATH, "fast")
BASE = RECIPE + REFERENCE + SPEEDUPS  # nanoGPT's math on our code, every step speedup on
ROWS = {"reference": RECIPE + REFERENCE, "every speedup": BASE}  # name -> train.py arguments
CHAIN = {  # name -> arguments added to the best recipe so far, in this order
    "+ chunked loss": flag_args(("chunked_loss",), "fast"),
    "+ muon": [*flag_args(("muon",), "fast"), "--learning_rate=4e-3", "--warmup_iters=50",
               "--max_iters=600"],
    **departure_steps(),
    "+ 380 steps (60% cooldown)": ["--max_iters=380", "--cooldown_frac=0.6"],
}
CONFIG = {"speedrun config": ["--config", "shakespeare_char_speedrun"]}  # the chain's result
RECIPES = {**ROWS, **CHAIN, **CONFIG}
NANOGPT = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
           "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           "--dropout=0.0"]
EVAL_ITERS = 20  # batches per split at each evaluation, as nanoGPT's recipe
RECIPE_SECONDS = 300  # a recipe short of the target by then is stopped
EVAL = re.compile(r"^eval\s+(\d+) \| train [\d.]+ \| val ([\d.]+)"  # ours, then nanoGPT's
                  r"|^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
BPB = re.compile(r"\| val bpb ([\d.]+)")  # ours; nanoGPT's char data is a byte a token: loss/ln 2
STEP_MS = re.compile(r"^step\s+\d+ \| loss .* \| (\d+) ms \||^iter [1-9]\d*: loss [\d.]+, "
                     r"time ([\d.]+)ms")  # nanoGPT's iter 0 holds an evaluation: not a step


@dataclass
class ToLossOptions:
    positional: ClassVar[str] = "target"
    target: float = opt(0.0, "the val loss to reach (also the first bare argument)")
    metric: str = opt("loss", "what the target is in: val loss (nats per token), or bpb (val "
                      "bits per byte, which compares runs whatever their tokenizer)",
                      ("loss", "bpb"))
    recipes: str = opt("", "only these recipes, a comma list (default: all)")
    eval_every: int = opt(100, "steps between evaluations (the target is checked there)")
    nanogpt: str = opt("", "a nanoGPT checkout (data/shakespeare_char prepared): a row")
    repeat: int = opt(1, "runs of each recipe; the time is their median, their spread the noise")
    configs: str = opt("", "whole configs instead of the CPU recipes, a comma list; the first "
                       "is the reference, whose best val is the target when none is given")
    steps: int = opt(0, "--configs: steps of each run (0: the config's max_iters), warmup "
                     "scaled in proportion")
    args: str = opt("", "--configs: train.py arguments for every run, e.g. "
                    "'--dataset=shakespeare --batch_size=8'")
    seconds: float = opt(RECIPE_SECONDS, "a run short of the target by then is stopped")
    keep_margin: float = opt(0.05, "chain: a technique is kept only when it reaches the target "
                             "sooner than the best so far by more than this share and twice "
                             "the noise")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("cpu", "outputs: RESULTS/to_loss_NAME.{json,md,png}")


@dataclass
class VsNanoGPTOptions:
    positional: ClassVar[str] = "nanogpt"
    nanogpt: str = opt("", "a nanoGPT checkout, data/shakespeare_char prepared (or bare)")
    rounds: int = opt(2, "rounds; each runs every program once, in turn")
    max_iters: int = opt(2000, "steps per run (nanoGPT's recipe: 2000)")
    threads: int = opt(0, "OMP_NUM_THREADS for every program; 0 = torch's default")
    programs: str = opt("", "only these of ours beside nanoGPT: a comma list of 'every "
                        "speedup', 'erf', 'speedrun' (default: all)")
    results: str = opt("bench_results", "folder for the outputs")
    name: str = opt("cpu_vs_nanogpt", "outputs: RESULTS/to_loss_NAME.{json,md}")


def check_nanogpt(folder: str) -> None:
    if not (Path(folder) / "train.py").is_file():
        raise ConfigError(f"--nanogpt={folder!r}: no train.py there; give a nanoGPT checkout "
                          "(with data/shakespeare_char prepared)")


def follow(cwd: Path, args: list[str], target: float = 0.0, limit: float = math.inf,
           threads: int = 0, metric: str = "loss") -> dict:
    """Run `python train.py ARGS` in cwd, reading its evaluations and step times as they are
    printed; stopped at the first evaluation at or below target, or after limit seconds. The
    curve [[step, val, seconds], ...] (val in `metric`), the median step time, the last val."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", "train.py", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    curve, step_ms, tail, reached, first_step = [], [], [], None, None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if m := EVAL.match(line):
            step, val = (g for g in m.groups() if g is not None)
            if metric == "bpb":
                bpb = BPB.search(line)
                val = float(bpb.group(1)) if bpb else float(val) / math.log(2)
            curve.append([int(step), float(val), time.perf_counter() - start])
            reached = curve[-1] if curve[-1][1] <= target else None
        elif m := STEP_MS.match(line):
            step_ms.append(float(m.group(1) or m.group(2)))
            first_step = first_step or time.perf_counter() - start
        if reached or time.perf_counter() - start > limit:
            proc.terminate()
            break
    returncode = proc.wait()
    status = "ok" if reached else ("not reached" if returncode in (0, -15) else "failed")
    return {"status": status, "returncode": 0 if reached else returncode, "curve": curve,
            "reached": reached, "seconds": time.perf_counter() - start,
            "first_step_s": first_step,  # from launch to the first step line
            "step_ms": statistics.median(step_ms) if step_ms else None,
            "val": curve[-1][1] if curve else None, "tail": tail if status == "failed" else []}


def page(report: dict, about: list[str], header: list[str], rows: list[list],
         args: dict[str, list[str]]) -> str:
    """Bullets (what was measured, the machine, the command), the table, each program's args."""
    lines = [*(f"- {line}" for line in about), f"- {report['hardware']}",
             f"- {report['date']}: `{report['command']}`", "", markdown_table(header, rows), "",
             "Arguments:", ""]
    return "\n".join(lines + [f"- {name}: `{' '.join(a)}`" for name, a in args.items()])


def schedule(opts: ToLossOptions) -> list[str]:
    return [f"--eval_interval={opts.eval_every}", f"--eval_iters={EVAL_ITERS}",
            f"--log_interval={opts.eval_every}"]


def measure(name: str, cwd: Path, args: list[str], opts: ToLossOptions,
            target: float | None = None) -> dict:
    """One recipe, opts.repeat runs, each in a fresh process stopped at the target (default
    opts.target): its row (the first run's curve and step; the median time; the runs' times)."""
    runs = []
    for _ in range(opts.repeat):
        with tempfile.TemporaryDirectory() as out:  # its own checkpoints: nanoGPT's stay its own
            ours = [f"--out_dir={out}", "--save_checkpoints=false"] * (cwd == REPO_ROOT)
            print(f"to-loss: {name}: python train.py {' '.join(args)} ...", flush=True)
            runs.append(follow(cwd, args + ours, opts.target if target is None else target,
                               opts.seconds, metric=opts.metric))
    row = {"recipe": name, "args": args, **runs[0], "chain": "",
           "times": [r["reached"][2] for r in runs if r["reached"]]}
    if len(row["times"]) < len(runs):
        row.update(status="not reached", reached=None)
    return row


def relative_spread(times: list[float]) -> float:
    """Half the range of a recipe's times over their median (0 for one run)."""
    return (max(times) - min(times)) / 2 / statistics.median(times) if len(times) > 1 else 0.0


def verdict(candidate: dict, head: dict, margin: float) -> tuple[bool, str]:
    """(keep, why not): kept when it reaches the target sooner than the head by more than the
    noise, the larger of margin and twice the two recipes' spreads combined."""
    if not candidate["reached"]:
        return False, f"dropped: {candidate['status']}"
    if not head["reached"]:
        return True, "kept"
    gain = statistics.median(head["times"]) / statistics.median(candidate["times"]) - 1
    noise = max(margin, 2 * math.hypot(relative_spread(candidate["times"]),
                                       relative_spread(head["times"])))
    if gain > noise:
        return True, "kept"
    how = "slower here" if gain < -noise else "not sooner beyond the noise"
    return False, f"dropped: {how} ({100 * gain:+.0f}%, noise {100 * noise:.0f}%)"


def run_chain(opts: ToLossOptions, chosen: list[str]) -> list[dict]:
    """nanoGPT, the fixed rows, then each technique on the best recipe so far (kept when
    sooner beyond the noise), then the config the chain led to."""
    rows = [measure("nanoGPT", Path(opts.nanogpt), NANOGPT + ["--max_iters=2000",
                    "--lr_decay_iters=2000"] + schedule(opts), opts)] if opts.nanogpt else []
    head, head_args = None, BASE
    for name, args in ROWS.items():
        if not chosen or name in chosen:
            rows.append(measure(name, REPO_ROOT, args + schedule(opts), opts))
            head = rows[-1] if name == "every speedup" else head
    for name, extra in CHAIN.items():
        if chosen and name not in chosen:
            continue
        if why := invalid(head_args + extra):  # e.g. a zero-init head whose untying was dropped
            rows.append({"recipe": name, "args": head_args + extra, "status": "not run",
                         "curve": [], "reached": None, "seconds": 0.0, "times": [],
                         "chain": f"dropped: {why}"})
            print(f"  {rows[-1]['chain']}", flush=True)
            continue
        rows.append(measure(name, REPO_ROOT, head_args + extra + schedule(opts), opts))
        keep, rows[-1]["chain"] = verdict(rows[-1], head or {"reached": None}, opts.keep_margin)
        head, head_args = (rows[-1], head_args + extra) if keep else (head, head_args)
        print(f"  {rows[-1]['chain']}", flush=True)
    for name, args in CONFIG.items():
        if not chosen or name in chosen:
            rows.append(measure(name, REPO_ROOT, args + schedule(opts), opts))
    return rows


def shortened(name: str, opts: ToLossOptions) -> list[str]:
    """train.py's arguments for config `name` run --steps steps: its warmup and Muon's momentum
    warm-up scaled in proportion (the schedule's shape kept), HellaSwag off, --args last."""
    extra = shlex.split(opts.args)
    cfg, _ = load_config(["--config", name, *extra], prog="bench.py to-loss")
    t, args = cfg.train, ["--config", name, "--hellaswag_interval=0"]
    if opts.steps:
        scale = opts.steps / max(1, t.max_iters)
        args += [f"--max_iters={opts.steps}", f"--warmup_iters={round(t.warmup_iters * scale)}",
                 f"--muon_momentum_warmup={round(t.muon_momentum_warmup * scale)}"]
    return args + extra


def run_configs(opts: ToLossOptions, done=lambda rows: None) -> list[dict]:
    """The reference config (the first) to its end, or to the target when given; then each other
    config, stopped at the target: the reference's best val when none was given. done(rows so
    far) after each."""
    rows, target = [], opts.target or None
    schedule_args = [f"--eval_interval={opts.eval_every}", f"--eval_iters={EVAL_ITERS}",
                     "--log_interval=1", "--eval_at_start=false"]
    for i, name in enumerate(checks.comma_list(opts.configs)):
        row = measure(name, REPO_ROOT, schedule_args + shortened(name, opts), opts,
                      target if i else (target or 0.0))
        if not i and target is None and row["curve"]:  # the reference's best val: the target
            best = min(row["curve"], key=lambda point: point[1])
            target = best[1]
            row.update(status="ok", reached=best, times=[best[2]])
            print(f"to-loss: the target is {name}'s best val, {target:.4f} at step {best[0]}",
                  flush=True)
        rows.append({**row, "target": target, "chain": "reference" if not i else ""})
        done(rows)
    return rows


def configs_page(report: dict) -> str:
    """The table of --configs: time to the target from launch and from the end of step 1."""
    rows, unit = report["rows"], "val loss" if report["metric"] == "loss" else "val bpb"
    reference = rows[0] if rows and rows[0]["reached"] else None

    def after_step1(r: dict) -> float | None:
        return r["reached"][2] - r["first_step_s"] if r["reached"] and r["first_step_s"] else None

    cells = []
    for r in rows:
        best = min((v for _, v, _ in r["curve"]), default=math.nan)
        if not r["reached"]:
            cells.append([r["recipe"], f"{r['status']} ({r['seconds']:.0f} s)", "-", "-", "-",
                          f"{best:.4f}", "-"])
            continue
        mine, ref = after_step1(r), reference and after_step1(reference)
        vs = f"{ref / mine:.2f}x" if mine and ref else "-"
        cells.append([r["recipe"], f"step {r['reached'][0]}", f"{r['reached'][2]:.1f}",
                      f"{mine:.1f}" if mine is not None else "-", vs, f"{best:.4f}",
                      f"{r['step_ms']:.0f}" if r["step_ms"] else "-"])
    target = rows[0].get("target") if rows else None
    source = "given" if report["target"] else "the reference config's best val"
    about = [f"target: {unit} <= {target:.4f}" if target else "target: none reached",
             f"({source}), checked "
             f"every {report['eval_every']} steps; seconds from launch, and from the end of "
             "step 1 (start-up and compile left out); speedup: the reference's time from step 1 "
             "over the config's"]
    return page(report, [" ".join(about)], ["config", "reached", "s from launch",
                                            "s from step 1", "speedup", f"best {unit}",
                                            "median step ms"],
                cells, {r["recipe"]: r["args"] for r in rows})


def invalid(args: list[str]) -> str:
    """Why train.py would refuse these arguments ('' when it takes them)."""
    try:
        load_config(args, prog="train.py")
    except ConfigError as e:
        return str(e).splitlines()[-1].strip()
    return ""


def run(opts: ToLossOptions, command: str) -> int:
    """The chain to the target (or --configs); the page to stdout and RESULTS/to_loss_NAME.*."""
    checks.check(opts, {"eval_every": 1, "repeat": 1, "keep_margin": 0, "steps": 0,
                        "seconds": 1})
    if opts.configs:
        return run_configs_report(opts, command)
    if opts.target <= 0:
        raise ConfigError(f"the target loss must be > 0 (got {opts.target}): bench.py to-loss "
                          "1.886")
    chosen = checks.comma_list(opts.recipes)
    if unknown := [r for r in chosen if r not in RECIPES]:
        raise ConfigError(f"--recipes: unknown {', '.join(unknown)}; the recipes are "
                          f"{', '.join(RECIPES)}")
    if opts.nanogpt:
        check_nanogpt(opts.nanogpt)
    rows = run_chain(opts, chosen)
    report = {"target": opts.target, "metric": opts.metric, "command": command, "rows": rows,
              "date": utc_now(), "hardware": machine_line(torch.device("cpu"))}
    unit = "val loss" if opts.metric == "loss" else "val bits per byte"
    text = page(report, [f"target: {unit} <= {opts.target}, checked every {opts.eval_every} "
                         "steps; time from launch (start-up and evaluations included), the "
                         f"median of {opts.repeat} run(s); each + row adds its technique to "
                         "the best recipe so far, kept only when it reaches the target sooner "
                         f"by more than {100 * opts.keep_margin:.0f}% and twice the noise"],
                ["recipe", "chain", "steps", "time to target", "vs nanoGPT", "vs reference",
                 f"best {'val' if opts.metric == 'loss' else 'bpb'}"],
                [cells(r, rows) for r in rows],
                {r["recipe"]: r["args"] for r in rows})
    print("\n" + text)
    stem = f"to_loss_{opts.name}"
    write_report(report, f"# bench.py to-loss {opts.target}\n\n{text}", opts.results, stem)
    plot(report, Path(opts.results) / f"{stem}.png")
    print(f"wrote {Path(opts.results) / stem}.{{json,md,png}}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def run_configs_report(opts: ToLossOptions, command: str) -> int:
    if opts.target < 0:
        raise ConfigError(f"the target loss must be >= 0 (got {opts.target}; 0: the first "
                          "config's best val)")
    if len(checks.comma_list(opts.configs)) < 2:
        raise ConfigError(f"--configs={opts.configs!r}: give two configs or more, the reference "
                          "first (e.g. gpt2_124m,gpt2_124m_speedrun)")
    report = {"target": opts.target, "metric": opts.metric, "command": command, "rows": [],
              "eval_every": opts.eval_every, "date": utc_now(),
              "hardware": machine_line(torch.device("cuda" if torch.cuda.is_available()
                                                    else "cpu")), "configs": opts.configs}
    stem = f"to_loss_{opts.name}"

    def save(rows: list[dict]) -> str:  # after each config: a stopped run keeps its rows
        report["rows"] = rows
        text = configs_page(report)
        write_report(report, f"# bench.py to-loss --configs {opts.configs}\n\n{text}",
                     opts.results, stem)
        return text

    rows = run_configs(opts, save)
    print("\n" + save(rows))
    plot({**report, "target": rows[0].get("target") or 0.0}, Path(opts.results) / f"{stem}.png")
    print(f"wrote {Path(opts.results) / stem}.{{json,md,png}}")
    return 0 if rows and all(r["reached"] for r in rows) else 1


def cells(row: dict, rows: list[dict]) -> list[str]:
    """[recipe, chain verdict, steps, time to target, vs nanoGPT, vs reference, best val]."""
    best = f"{min((v for _, v, _ in row['curve']), default=math.nan):.4f}"
    if not row["reached"]:
        return [row["recipe"], row["chain"], "-", f"{row['status']} ({row['seconds']:.0f} s)",
                "-", "-", best]
    seconds = statistics.median(row["times"])
    spread = f" +-{100 * relative_spread(row['times']):.0f}%" if len(row["times"]) > 1 else ""

    def versus(name: str) -> str:
        base = next((r for r in rows if r["recipe"] == name and r["reached"]), None)
        return f"{seconds / statistics.median(base['times']):.2f}x" if base else "-"

    return [row["recipe"], row["chain"], f"{row['reached'][0]}", f"{seconds:.1f} s{spread}",
            versus("nanoGPT"), versus("reference"), best]


def plot(report: dict, path: Path) -> Path | None:
    if (fig := figure(figsize=(8, 4.5))) is None:
        return None
    import matplotlib  # figure() found it

    ax, colors = fig.subplots(), matplotlib.colormaps["tab20"]  # 20 colors: one a row
    for i, r in enumerate(filter(lambda r: r["curve"], report["rows"])):
        ax.plot([t for _, _, t in r["curve"]], [v for _, v, _ in r["curve"]], marker=".",
                label=r["recipe"], color=colors(i % 20), linestyle="-" if i < 20 else "--")
    ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1)
    unit = "val bits per byte" if report.get("metric") == "bpb" else "val loss"
    top = None if report.get("configs") else 3.0 / (math.log(2) if report.get("metric") == "bpb"
                                                    else 1)  # the CPU chain's char-level losses
    ax.set(xlabel="wall-clock seconds from launch", ylabel=unit, ylim=(None, top))
    ax.set_title(f"time to {unit} {report['target']}\n{report['hardware']}", fontsize=9)
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
            "ours, nanoGPT's math (erf GELU)": (REPO_ROOT, ours + ["--activation=gelu_erf"]),
            # the speedrun recipe's whole run, its own schedule: when its last val is at or below
            # nanoGPT's, its time is the time to nanoGPT's result
            "ours, speedrun config": (REPO_ROOT, CONFIG["speedrun config"])}


def vs_nanogpt(opts: VsNanoGPTOptions, command: str) -> int:
    """Every program to its end, in turn, round after round; the page after every round."""
    check_nanogpt(opts.nanogpt)
    checks.check(opts, {"rounds": 1, "max_iters": 1, "threads": 0})
    programs, runs = side_programs(opts), {}
    if chosen := checks.comma_list(opts.programs):
        keys = {"every speedup": "ours, every speedup (tanh GELU)",
                "erf": "ours, nanoGPT's math (erf GELU)", "speedrun": "ours, speedrun config"}
        if unknown := [c for c in chosen if c not in keys]:
            raise ConfigError(f"--programs: unknown {', '.join(unknown)}; choose from "
                              f"{', '.join(keys)}")
        programs = {k: v for k, v in programs.items()
                    if k == "nanoGPT" or k in {keys[c] for c in chosen}}
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
        report = {"command": command, "hardware": machine_line(torch.device("cpu")),
                  "date": utc_now(), "runs": runs,
                  "programs": {k: {"cwd_is_nanogpt": cwd != REPO_ROOT, "args": args}
                               for k, (cwd, args) in programs.items()}}
        text = describe_side_by_side(report)  # written after every round: a stop keeps them
        write_report(report, "# Our whole run against nanoGPT's, at its CPU recipe\n\n" + text,
                     opts.results, f"to_loss_{opts.name}")
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
