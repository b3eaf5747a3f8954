"""bench.py rl: reinforcement learning's gain on held-out problems, measured. A character model
(the default run's) is finetuned on one built-in task's training split until the task is partly
solved, then rl.py runs from it for a fixed wall budget, over seeds, on full weights and on LoRA;
each run's greedy pass@1 on the held-out problems before and after, paired problem by problem.

    python bench.py rl                                   # reverse, 2 seeds, full and LoRA
    python bench.py rl --seconds 600 --seeds 3 --modes full --jobs 1 --name zen3

Every run is its own process (train.py, rl.py) and is kept in --work, so a stopped bench picks up
where it was; the page is written after each run. `--jobs 2` runs two RL runs at a time, each on
--threads threads: on a 2-core machine their step times are each one core's.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from config import ConfigError, opt
from engine.benchmarks.report import figure, markdown_table, save_figure, utc_now, write_report
from engine.benchmarks.timing import REPO_ROOT, run_script
from engine.device import machine_line
from engine.evaluation.stats import paired_difference


@dataclass
class RLBenchOptions:
    task: str = opt("reverse", "a built-in word task (reverse, sort): SFT on its training "
                    "words, RL on them, both measured on its 200 held-out words")
    base: str = opt("out/shakespeare_char", "the pretrained model (made with python train.py "
                    "when missing)")
    sft_steps: int = opt(450, "SFT steps (configs/instruct_cpu.toml's schedule over them): "
                         "where the held-out pass@1 is partway")
    seconds: float = opt(900.0, "each RL run's wall budget (rl.py --max_seconds)")
    seeds: int = opt(2, "RL runs per mode (system.seed 0, 1, ...)")
    modes: str = opt("full,lora", "full weights, LoRA, or both (comma-separated)")
    lora_rank: int = opt(8, "LoRA's rank")
    lora_lr: float = opt(1e-3, "LoRA runs' learning rate (full runs: configs/rl_cpu.toml's)")
    eval_samples: int = opt(8, "sampled pass@1 too, from this many completions per held-out "
                            "problem at the RL temperature (0: greedy only)")
    jobs: int = opt(2, "RL runs at a time")
    threads: int = opt(1, "threads of each run (0: torch's default)")
    extra: str = opt("", "more rl.py arguments for every RL run, space-separated")
    work: str = opt("out/bench_rl", "where the runs go")
    results: str = opt("bench_results", "folder for rl_TASK_NAME.{json,md,png}")
    name: str = opt("cpu", "NAME in the result files")


def done(out: Path) -> dict | None:
    summary = out / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        if s.get("stop_reason") in ("done", "max_seconds"):
            return s
    return None


def sft(o: RLBenchOptions, work: Path) -> Path:
    """The starting model: the base (trained if missing), finetuned on the task's training
    words for sft_steps."""
    from data.instruct_tasks import TASKS, write_task

    if o.task not in TASKS:
        raise ConfigError(f"--task={o.task!r}: one of {', '.join(TASKS)} (a word task: its "
                          "held-out words are the SFT data's own)")
    if not Path(REPO_ROOT, o.base).exists():
        run_script([sys.executable, "train.py", f"--out_dir={o.base}"], "pretraining")
    train_file, val_file = write_task(o.task, work / "tasks")
    out = work / f"sft_{o.task}_{o.sft_steps}"
    if not (out / "summary.json").is_file():
        run_script([sys.executable, "train.py", "--config", "instruct_cpu",
                     f"--init_from={o.base}", f"--out_dir={out}", f"--dataset={train_file}",
                     f"--val_file={val_file}", f"--max_iters={o.sft_steps}",
                     "--loss_curve=false"], "SFT")
    return out


def rl_args(o: RLBenchOptions, start: Path, mode: str, seed: int, out: Path) -> list[str]:
    lora = [f"--lora.rank={o.lora_rank}", f"--learning_rate={o.lora_lr}"] if mode == "lora" \
        else []
    return [sys.executable, "rl.py", "--config", "rl_cpu", f"--init_from={start}",
            f"--out_dir={out}", f"--task={o.task}", f"--seed={seed}",
            f"--max_seconds={o.seconds}", f"--threads={o.threads}",
            f"--eval_samples={o.eval_samples}", *lora, *o.extra.split()]


def run(o: RLBenchOptions, command: str) -> int:
    modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"full", "lora"} or o.seeds < 1 or o.jobs < 1:
        raise ConfigError(f"--modes={o.modes!r} (full, lora), --seeds={o.seeds} and "
                          f"--jobs={o.jobs} (>= 1)")
    work = Path(o.work)
    start = sft(o, work)
    plan = [(mode, seed, work / f"rl_{o.task}_{mode}_{seed}") for seed in range(o.seeds)
            for mode in modes]
    todo = [p for p in plan if done(p[2]) is None]
    print(f"SFT model {start}; {len(plan) - len(todo)} of {len(plan)} RL runs done, "
          f"{len(todo)} to run, {o.jobs} at a time, {o.seconds:g} s each")
    running: list[tuple[subprocess.Popen, tuple]] = []
    while todo or running:
        while todo and len(running) < o.jobs:
            mode, seed, out = todo.pop(0)
            log = open(work / f"{out.name}.log", "w")
            args = rl_args(o, start, mode, seed, out)
            running.append((subprocess.Popen(args, cwd=REPO_ROOT, stdout=log,
                                             stderr=subprocess.STDOUT), (mode, seed, out)))
        process, (mode, seed, out) = running.pop(0)
        if process.wait() != 0:
            raise ConfigError(f"RL run {out} failed; see {work / (out.name + '.log')}")
        print(f"{out.name}: done")
        report(o, plan, start, command)
    report(o, plan, start, command)
    return 0


def row_of(mode: str, seed: int, s: dict) -> dict:
    first, last = s["first_eval"], s["last_eval"]
    gain = paired_difference(first["per_problem"], last["per_problem"])
    row = {"mode": mode, "seed": seed, "steps": s["steps"], "rl_seconds": round(s["seconds"], 1),
           "sample_share": s["sample_seconds"] / s["seconds"],
           "before": first["pass@1"], "before_ci95": first["ci95"],
           "after": last["pass@1"], "after_ci95": last["ci95"], "gain": gain,
           "curve": [(e["step"], e["pass@1"], e.get("sampled_pass@1")) for e in s["evals"]],
           "before_per_problem": first["per_problem"], "after_per_problem": last["per_problem"]}
    if "sampled_pass@1" in last:
        row.update(sampled_before=first["sampled_pass@1"], sampled_after=last["sampled_pass@1"],
                   sampled_gain=paired_difference(first["sampled_per_problem"],
                                                  last["sampled_per_problem"]))
    return row


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def span(v: tuple) -> str:
    return f"{100 * v[0]:+.1f} [{100 * v[1]:+.1f}, {100 * v[2]:+.1f}]"


def report(o: RLBenchOptions, plan: list, start: Path, command: str) -> None:
    rows = [row_of(mode, seed, s) for mode, seed, out in plan if (s := done(out))]
    machine = machine_line(torch.device("cpu"))
    table = [[r["mode"], r["seed"], r["steps"], f"{r['rl_seconds']:.0f}",
              pct(r["sample_share"]),
              f"{pct(r['before'])} [{pct(r['before_ci95'][0])}, {pct(r['before_ci95'][1])}]",
              f"{pct(r['after'])} [{pct(r['after_ci95'][0])}, {pct(r['after_ci95'][1])}]",
              span(r["gain"]),
              (f"{pct(r['sampled_before'])} -> {pct(r['sampled_after'])} "
               f"({span(r['sampled_gain'])})") if "sampled_gain" in r else "-"] for r in rows]
    pooled = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        gain = paired_difference(sum((r["before_per_problem"] for r in mine), []),
                                 sum((r["after_per_problem"] for r in mine), []))
        pooled.append([mode, len(mine), span(gain)])
    lines = [f"# Reinforcement learning: held-out pass@1 before and after ({utc_now()})", "",
             machine + f"; each run at --threads="
             f"{o.threads}, {o.jobs} at a time", "",
             f"`{command}`: {start} (the default run's model finetuned with configs/"
             f"instruct_cpu.toml for {o.sft_steps} steps on {o.task}'s training words), then "
             f"`rl.py --config rl_cpu` from it for {o.seconds:g} s of sampling and updates "
             "(evaluation and saving not counted), on each seed and mode. pass@1: greedy "
             f"replies to the task's 200 held-out words (never in SFT or RL data), Wilson 95% "
             "intervals; the gain is after - before on the same words, with a paired normal "
             "95% interval (percentage points). Sampled: pass@1 from "
             f"{o.eval_samples} completions per word at the RL temperature.", "",
             markdown_table(["mode", "seed", "RL steps", "RL s", "sampling share",
                             "greedy before", "greedy after", "gain (points)",
                             "sampled before -> after (gain)"], table), "",
             "Pooled over seeds (each seed's 200 paired words together):", "",
             markdown_table(["mode", "seeds", "greedy gain (points)"], pooled), ""]
    png = plot(rows, Path(o.results) / f"rl_{o.task}_{o.name}.png")
    if png:
        lines += [f"![held-out pass@1 during RL]({png.name})", ""]
    record = {"command": command, "machine": machine,
              "options": o.__dict__, "start": str(start), "rows": rows, "pooled": pooled}
    write_report(record, "\n".join(lines), o.results, f"rl_{o.task}_{o.name}")


def plot(rows: list[dict], path: Path) -> Path | None:
    fig = figure(figsize=(7, 4))
    if fig is None or not rows:
        return None
    ax = fig.subplots()
    for r in rows:
        steps, greedy, sampled = zip(*r["curve"])
        line, = ax.plot(steps, [100 * g for g in greedy], marker="o", ms=3,
                        label=f"{r['mode']}, seed {r['seed']}: greedy")
        if sampled[0] is not None:
            ax.plot(steps, [100 * s for s in sampled], linestyle="--", color=line.get_color(),
                    label=f"{r['mode']}, seed {r['seed']}: sampled")
    ax.set(xlabel="RL step", ylabel="held-out pass@1 (%)", title="held-out pass@1 during RL")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)
