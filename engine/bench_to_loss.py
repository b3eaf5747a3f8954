"""Time to a loss, `python bench.py --to-loss 1.886`: recipes trained one after another, each in a
fresh train.py process on the same data and evaluation schedule; per recipe the wall-clock time
from launch (start-up and evaluations included: what a user waits for) and the step at which the
validation loss first reached the target, and a plot of val loss against wall-clock time.

The recipes share nanoGPT's CPU recipe (char Shakespeare, 4 layers, 4 heads, 128 wide, context
64, batch 12, no dropout, lr 1e-3 cosine to 2000 steps); `--nanogpt DIR` adds a row running
nanoGPT's own train.py from DIR with the same recipe, side by side.
Output: RESULTS/to_loss_NAME.{json,md,png}.
"""
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from config import ConfigError
from engine.benchmark import REPO_ROOT, hardware_name, markdown_table

RECIPE = ["--config", "shakespeare_char", "--n_layer=4", "--n_head=4", "--n_embd=128",
          "--block_size=64", "--batch_size=12", "--dropout=0", "--learning_rate=1e-3",
          "--warmup_iters=100", "--min_lr_ratio=0.1", "--beta2=0.99", "--max_iters=2000",
          "--bias=false"]
REFERENCE = ["--attention=scratch", "--causal_mask=buffer", "--norm=scratch", "--gelu=scratch",
             "--fused_adamw=false", "--loss=full", "--optimizer=adamw"]
SPEEDUPS = ["--attention=sdpa", "--causal_mask=on_the_fly", "--norm=native", "--gelu=native",
            "--fused_adamw=true"]
RECIPES = {  # name -> train.py arguments
    "reference": RECIPE + REFERENCE,
    "every speedup": RECIPE + REFERENCE + SPEEDUPS,
    "+ chunked loss": RECIPE + REFERENCE + SPEEDUPS + ["--loss=chunked"],
    "+ muon": RECIPE + REFERENCE + SPEEDUPS + ["--loss=chunked", "--optimizer=muon"],
    "fast config": ["--config", "shakespeare_char_fast"],
}
NANOGPT = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
           "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
OURS_EVAL = re.compile(r"^eval\s+(\d+) \| train [\d.]+ \| val ([\d.]+)")
EVAL_ITERS = 20  # batches per split at each evaluation, as nanoGPT's recipe
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


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
            if curve[-1][1] <= target:
                reached = curve[-1]
        if reached or time.perf_counter() - start > limit:
            proc.terminate()
            break
    proc.wait()
    status = "ok" if reached else ("not reached" if proc.returncode in (0, -15) else "failed")
    return {"status": status, "curve": curve, "reached": reached,
            "seconds": time.perf_counter() - start, "tail": tail if status == "failed" else []}


def check(opts) -> None:
    """ConfigError on a --to-loss option that cannot be used, before anything runs."""
    unknown = [r for r in opts.recipes.split(",") if r and r not in RECIPES]
    if unknown:
        raise ConfigError(f"--recipes: unknown {', '.join(unknown)}; the recipes are "
                         f"{', '.join(RECIPES)}")
    if opts.to_loss < 0 or opts.eval_every < 1 or opts.recipe_seconds <= 0:
        raise ConfigError("--to-loss must be > 0, --eval-every >= 1, --recipe-seconds > 0")
    if opts.nanogpt and not (Path(opts.nanogpt) / "train.py").is_file():
        raise ConfigError(f"--nanogpt={opts.nanogpt}: no train.py there; give a nanoGPT checkout "
                         "(with data/shakespeare_char prepared)")


def run(opts, command: str) -> int:
    recipes = {k: v for k, v in RECIPES.items()
               if not opts.recipes or k in opts.recipes.split(",")}
    schedule = [f"--eval_interval={opts.eval_every}", f"--eval_iters={EVAL_ITERS}"]
    rows = []
    if opts.nanogpt:  # its own loader and checkpoints: what its users run
        args = NANOGPT + schedule + [f"--log_interval={opts.eval_every}"]
        print(f"to-loss: nanoGPT ({opts.nanogpt}) ...", flush=True)
        rows.append({"recipe": "nanoGPT", "args": args, **follow(
            ["train.py", *args], Path(opts.nanogpt), NANOGPT_EVAL, opts.to_loss,
            opts.recipe_seconds)})
    for name, args in recipes.items():
        with tempfile.TemporaryDirectory() as out:
            full = args + schedule + [f"--out_dir={out}", "--save_checkpoints=false",
                                      f"--log_interval={opts.eval_every}"]
            print(f"to-loss: {name}: python train.py {' '.join(args)} ...", flush=True)
            rows.append({"recipe": name, "args": args, **follow(
                ["train.py", *full], REPO_ROOT, OURS_EVAL, opts.to_loss, opts.recipe_seconds)})
        _, steps, seconds, _, best = cells(rows[-1], rows)
        print(f"  {seconds} (step {steps}; best val {best})", flush=True)
    report = {"target": opts.to_loss, "command": command, "rows": rows,
              "hardware": hardware_name(torch.device("cpu")),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    folder, stem = Path(opts.results), f"to_loss_{opts.name or 'cpu'}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = describe(report)
    (folder / f"{stem}.md").write_text(f"# bench.py --to-loss {opts.to_loss}\n\n{text}\n")
    print("\n" + text)
    plot(report, folder / f"{stem}.png")
    print(f"wrote {folder / stem}.{{json,md,png}}")
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


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in report["rows"]:
        if r["curve"]:
            ax.plot([t for _, _, t in r["curve"]], [v for _, v, _ in r["curve"]], marker=".",
                    label=r["recipe"])
    ax.axhline(report["target"], color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="wall-clock seconds from launch", ylabel="val loss",
           title=f"time to val {report['target']}: {report['hardware']}", ylim=(None, 3.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
