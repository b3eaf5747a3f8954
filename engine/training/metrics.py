"""What a run shows: the log line, and in out_dir metrics.jsonl / metrics.csv (one row per event:
kind=train every log_interval steps, on CUDA with its peak memory; eval, skip for a non-finite
step, hellaswag), loss_curve.png (redrawn at every evaluation), summary.json (also printed), and
Weights & Biases if asked. A resumed run drops the rows after its checkpoint: one run's files.
Before step 1, estimate_line: what the run will cost at the device's matmul rate, measured in about
0.2 s, and peak_flops, the datasheet peak MFU is counted against."""
from __future__ import annotations

import collections
import contextlib
import csv
import functools
import json
import math
import os
import time
from pathlib import Path

import torch

from config import Config
from engine.device import Runtime
from engine.training.resume import Counters
from model import GPT

CSV_COLUMNS = ("kind", "step", "time_s", "loss", "lr", "norm", "ms", "tok_per_s", "mfu", "peak_mib",
               "reserved_mib", "train", "val", "val_bpb")
ETA_WINDOW = 20  # progress marks the ETA is averaged over
PLOT_EVERY_S = 60.0  # the loss curve is redrawn at most this often, and at the end


def format_duration(seconds: float) -> str:
    """45s, 12m03s, 3h05m, 2d04h."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    for unit, small, names in ((86400, 3600, "dh"), (3600, 60, "hm"), (60, 1, "ms")):
        if s >= unit:
            return f"{s // unit}{names[0]}{s % unit // small:02d}{names[1]}"
    return f"{s}s"


def peak_flops(rt: Runtime, override: float = 0.0) -> float:
    """Peak FLOP/s at the precision in use; 0 when unknown (no MFU)."""
    if override:
        return override
    if rt.device.type != "cuda":
        return 0.0
    from engine.gpu_peaks import PEAK_FLOPS  # the datasheets' table

    name = torch.cuda.get_device_name(rt.device)
    for key, (half, tf32, fp32) in PEAK_FLOPS:
        if key in name:
            return half if rt.dtype != torch.float32 else tf32 if rt.tf32 else fp32
    return 0.0


@functools.cache
def matmul_rate(device: torch.device, dtype: torch.dtype, seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls in dtype on device, measured in about `seconds` (once per
    process): the size doubles from 256 (2048 on CUDA) while a product takes under a quarter of
    that (small ones measure overheads, not the rate), then the fastest of the repeats counts."""
    cuda = device.type == "cuda"
    n, limit = (2048, 8192) if cuda else (256, 2048)
    rt = Runtime(device=device, dtype=dtype, tf32=False, notes=[])

    def product_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        rt.synchronize()
        start = time.perf_counter()
        a @ b
        rt.synchronize()
        return time.perf_counter() - start

    begin = time.perf_counter()
    while True:
        a, b = (torch.ones(n, n, device=device, dtype=dtype) for _ in range(2))  # no RNG draws
        product_seconds(a, b)  # the first call sets up the kernel
        best = product_seconds(a, b)
        if best > seconds / 4 or n >= limit or time.perf_counter() - begin > seconds:
            break
        n *= 2
    while time.perf_counter() - begin < seconds:
        best = min(best, product_seconds(a, b))
    return 2 * n**3 / best


def time_estimate(flops_per_step: float, steps: int, eval_flops: float, rate: float) -> dict:
    """Seconds per step and for the run (steps + eval_flops of evaluation) at `rate` FLOP/s.
    Every FLOP counted at the matmul rate: real steps add memory-bound work on top."""
    step_s = flops_per_step / rate
    return {"step_s": step_s, "run_s": step_s * steps + eval_flops / rate, "rate": rate}


def format_seconds(seconds: float) -> str:
    """format_duration with sub-minute precision: '850 ms', '12.3 s', '4m05s', '3h12m'."""
    if seconds < 1:
        return f"{1000 * seconds:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


def estimate_line(cfg: Config, raw_model: GPT, rt: Runtime, world_size: int, meta: dict) -> str:
    """About the time a step and the whole run take: their FLOPs (instruction rows: meta's
    row_tokens) at the matmul rate measured now (0.2 s; bench.py sets it against measured)."""
    t, block = cfg.train, meta.get("row_tokens", cfg.model.block_size)
    tokens = t.tokens_per_step or t.batch_size * t.grad_accum_steps * block * world_size
    per_token = raw_model.flops_per_token()  # training: forward + backward
    evaluations = t.max_iters // t.eval_interval + 1 + (t.max_iters % t.eval_interval > 0)
    eval_tokens = evaluations * 2 * t.eval_iters * t.batch_size * block  # both splits
    rate = matmul_rate(rt.device, rt.dtype)
    est = time_estimate(per_token * tokens / world_size, t.max_iters, per_token / 3 * eval_tokens,
                        rate)
    line = (f"estimate: ~{format_seconds(est['step_s'])} per step, ~"
            f"{format_seconds(est['run_s'])} for {t.max_iters} steps and {evaluations} "
            f"evaluations ({per_token * tokens / world_size / 1e9:,.1f} GFLOP per step at "
            f"{rate / 1e9:,.1f} GFLOP/s, the {str(rt.dtype).removeprefix('torch.')} matmul rate "
            "measured here; other work adds to it, a busy machine's probe reads low)")
    if est["step_s"] > 60:
        line += "\nnote: this recipe is far too big for this device; on a CPU try --config " \
                "shakespeare_char, or a smaller model, batch or --max_iters"
    return line


def plot_losses(records: list[dict], path: Path, title: str) -> None:
    """Logged train loss and evaluated train/val loss as a PNG (matplotlib Figure: no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for kind, key, style, color, label in (
            ("train", "loss", dict(lw=0.8, alpha=0.45), "tab:blue", "train (logged steps)"),
            ("eval", "train", dict(marker="o", ms=3), "tab:blue", "train (eval)"),
            ("eval", "val", dict(marker="o", ms=3), "tab:orange", "val (eval)")):
        points = [(r["step"], r[key]) for r in records
                  if r.get("kind") == kind and isinstance(r.get(key), (int, float))
                  and math.isfinite(r[key])]
        if points:
            ax.plot(*zip(*points), color=color, label=label, **style)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)  # a viewer never sees a half-written image


class RunLog:
    """The run's metrics files, loss curve, optional wandb run, progress/ETA and summary."""

    def __init__(self, cfg: Config, start_step: int, resumed: bool, train_seconds: float = 0.0,
                 wandb_id: str = "", files: bool = True):
        self.files = files  # False on ranks > 0: counts and summary, nothing written
        self.draws = cfg.train.loss_curve
        self.out_dir = Path(cfg.train.out_dir)
        self.jsonl, self.csv = self.out_dir / "metrics.jsonl", self.out_dir / "metrics.csv"
        self.title = f"{self.out_dir.name}: {cfg.model.n_layer} layers, {cfg.model.n_embd} wide"
        self.max_iters = cfg.train.max_iters
        self.records = []
        if files:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._append(self._earlier_records(start_step) if resumed else [], rewrite=True)
        self.clock_start = time.perf_counter()
        self.seconds_before = train_seconds  # spent by the earlier parts of a resumed run
        self.marks = collections.deque([(self.clock_start, start_step)], maxlen=ETA_WINDOW)
        self.plot_note = ""
        self.plotted = time.perf_counter()  # the loss curve's last redraw (none yet: the start)
        self.unplotted = False  # evaluations since then
        self.wandb = None
        if cfg.wandb.enabled and files:  # Weights & Biases, on rank 0
            from engine.training.wandb_log import start_wandb

            self.wandb = start_wandb(cfg, self.out_dir, wandb_id)
        self.wandb_id = self.wandb.id if self.wandb is not None else ""

    @property
    def train_seconds(self) -> float:
        """Wall-clock of the whole run so far, resumed parts included."""
        return self.seconds_before + time.perf_counter() - self.clock_start

    def _earlier_records(self, start_step: int) -> list[dict]:
        kept = []
        for line in self.jsonl.read_text().splitlines() if self.jsonl.is_file() else []:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
                kept.append(json.loads(line))
        return [r for r in kept if isinstance(r, dict) and r.get("step", math.inf) <= start_step]

    def _append(self, records: list[dict], rewrite: bool = False) -> None:
        """Add records to metrics.jsonl and .csv; rewrite: replace both (jsonl atomically)."""
        self.records += records
        if not self.files:
            return
        jsonl = self.jsonl.with_name(self.jsonl.name + ".tmp") if rewrite else self.jsonl
        with open(jsonl, "w" if rewrite else "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        if rewrite:
            os.replace(jsonl, self.jsonl)
        with open(self.csv, "w" if rewrite else "a", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
            if rewrite:
                writer.writeheader()
            writer.writerows(records)

    def write(self, **record) -> None:
        """Append one event (it must have `kind` and `step`) to every sink."""
        record.setdefault("time_s", round(self.train_seconds, 3))
        self._append([record])
        if self.wandb is not None:  # only where files are written
            values = {f"{record['kind']}/{k}": v for k, v in record.items()
                      if k not in ("kind", "step") and isinstance(v, (int, float))}
            self.wandb.log(values, step=record["step"])

    def eval(self, step: int, losses: dict[str, float]) -> None:
        """Print and record an evaluation; redraw the loss curve at most every PLOT_EVERY_S
        (a redraw, and matplotlib's first above all, is time a short run does not train)."""
        val = losses["val"]
        bpb = f" | val bpb {losses['val_bpb']:.4f}" if "val_bpb" in losses else ""
        print(f"eval {step:5d} | train {losses['train']:.4f} | val {val:.4f} | val ppl "
              f"{math.exp(min(val, 700)):.2f}{bpb}")
        self.write(kind="eval", step=step, **losses)
        self.unplotted = True
        if time.perf_counter() - self.plotted >= PLOT_EVERY_S:
            self.plot()

    def plot(self) -> None:
        """Redraw loss_curve.png from every record so far."""
        self.plotted, self.unplotted = time.perf_counter(), False
        try:
            if self.files and self.draws:
                plot_losses(self.records, self.out_dir / "loss_curve.png", self.title)
        except ImportError:
            self.plot_note = ("no loss_curve.png: matplotlib is not installed "
                              "(pip install matplotlib)")

    def progress(self, step: int) -> str:
        """' | 42.0% | eta 3m12s', from the pace over the last few log lines."""
        now = time.perf_counter()
        then, then_step = self.marks[0]
        self.marks.append((now, step))
        if step <= then_step or self.max_iters == 0:
            return ""
        eta = (now - then) / (step - then_step) * max(0, self.max_iters - step)
        return f" | {100 * step / self.max_iters:.1f}% | eta {format_duration(eta)}"

    def finish(self, counters: Counters, reason: str, start_step: int,
               ckpt: Path | None) -> dict:
        """Print the summary, write summary.json, close wandb; returns the summary (stop_reason:
        done | stop_after_iters | SIGINT | SIGTERM | nonfinite)."""
        if self.unplotted:
            self.plot()
        peaks = [r for r in self.records if "peak_mib" in r]  # on CUDA, each log line's
        summary = {"stop_reason": reason, "step": counters.step,
                   "steps": counters.step - start_step,
                   "seconds": time.perf_counter() - self.clock_start,
                   "train_seconds": self.train_seconds, "final": counters.losses,
                   "best_val": counters.best_val, "tokens_seen": counters.tokens_seen,
                   "skipped_steps": counters.skipped_steps,
                   "checkpoint": str(ckpt) if ckpt is not None else None,
                   **({"cuda_peak_mib": {k: max(r[k] for r in peaks) for k in (
                       "peak_mib", "reserved_mib")}} if peaks else {})}
        label = "done" if reason == "done" else f"stopped ({reason})"
        print(f"{label}: step {counters.step} of {self.max_iters} | "
              f"{summary['steps']} steps in {format_duration(summary['seconds'])} "
              f"({format_duration(summary['train_seconds'])} in all) | "
              f"{counters.tokens_seen:,} tokens seen | "
              f"val {counters.losses.get('val', math.nan):.4f} (best {counters.best_val:.4f}) | "
              f"checkpoint {summary['checkpoint']}")
        if counters.skipped_steps:
            print(f"skipped {counters.skipped_steps} non-finite step(s) in all")
        if self.plot_note:
            print(self.plot_note)
        clean = _strict_json(summary)
        if self.files:
            (self.out_dir / "summary.json").write_text(json.dumps(clean, indent=1) + "\n")
        for key in ("best_val", "tokens_seen", "train_seconds", "checkpoint", "stop_reason"):
            if self.wandb is not None and clean.get(key) is not None:
                self.wandb.summary[key] = clean[key]
        self.__exit__(None if reason != "nonfinite" else RuntimeError)
        return summary

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if exc_type else 0)
            self.wandb = None


def _strict_json(value):
    """NaN/inf become null, so summary.json is JSON that any parser reads."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def log_line(step: int, loss: float, lr: float, norm: float, ms: float, tok_s: float,
             mfu: float | None, tail: str = "") -> str:
    line = (f"step {step:5d} | loss {loss:.4f} | lr {lr:.1e} | norm {norm:.2f} | {ms:.0f} ms | "
            f"{tok_s:,.0f} tok/s")
    return line + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "") + tail
