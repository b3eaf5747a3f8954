"""The speedup ablation: what each flag buys on this machine, alone or chained, as one table and
one plot.

    python bench.py                                   # the baseline, then each flag added in turn
    python bench.py --only all                        # each flag alone against the baseline
    python bench.py --order attention,compile,dtype=float16    # your own chain and values
    python bench.py --config gpt2_124m --batch_size=8 # any config and override, as for train.py
    python bench.py --time-budget 150                 # rows not reached in 150 s are skipped

The baseline is the reference path: every flag of the order at its reference value. Each row is
a fresh process (clean peak memory; no compile cache, TF32 or allocator state carried over) that
builds the model from the same seed and trains it on real token data: a few warm-up steps
(compilation happens there), then a few timed steps. The table reports tokens/s (median of the
timed steps), the speedup over the previous row and over the baseline, MFU, peak memory, the loss
after the timed steps and which attention kernel ran. A flag that changes nothing on this device
(TF32 on a CPU) is reported as skipped with the reason. Results go to stdout and to
bench_results/NAME.json, NAME.md and NAME.png.
"""
from __future__ import annotations

import argparse
import collections
import copy
import difflib
import importlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine import runtime
from engine import speedups, techniques
from config import Config, ConfigError, apply_override, from_dict, load_config, validate
from data.loader import Batches, DataError, load_meta
from engine.optim import lr_at, make_optimizer
from engine.runlog import log_line
from engine.sources import build_model
from engine.step import train_step

REPO_ROOT = Path(__file__).resolve().parent
# datasets bench.py may prepare itself: made from the bundled text, no download
LOCAL_DATASETS = ("shakespeare_char", "shakespeare")
BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")


class BenchError(ValueError):
    """A bench.py argument that cannot be used."""


@dataclass(frozen=True)
class Flag:
    name: str
    keys: tuple[str, ...]  # the config keys it sets
    reference: str
    fast: str
    what: str


FLAGS = {f.name: f for f in [
    Flag("causal_mask", ("model.causal_mask",), "buffer", "on_the_fly",
         "causal mask built per call (with SDPA: is_causal=True) instead of a saved (T, T) buffer"),
    Flag("tf32", ("system.tf32",), "false", "true", "TF32 tensor-core matmuls for float32"),
    Flag("fused_adamw", ("train.fused_adamw",), "false", "true",
         "AdamW(fused=True): one kernel over all parameters instead of a loop over them"),
    Flag("pin_memory", ("data.pin_memory",), "false", "true",
         "pinned host batches copied with non_blocking=True"),
    Flag("dtype", ("system.dtype",), "float32", "auto",
         "autocast to bfloat16 (auto: bfloat16 where supported, else float16 + gradient scaler)"),
    Flag("norm_gelu", ("model.norm", "model.gelu"), "scratch", "native",
         "F.layer_norm and F.gelu instead of the written-out formulas"),
    Flag("attention", ("model.attention",), "scratch", "sdpa",
         "F.scaled_dot_product_attention (Flash / memory-efficient kernels)"),
    Flag("compile", ("system.compile",), "false", "true",
         "torch.compile (a value is the mode: compile=max-autotune)"),
    Flag("vocab_pad", ("model.vocab_pad_multiple",), "1", "64",
         "embedding and LM head padded to a multiple of 64 rows (50257 -> 50304)"),
    Flag("batch_size_auto", ("train.batch_size_auto",), "false", "true",
         "the largest micro-batch that fits, same global batch via gradient accumulation"),
]}
DEFAULT_ORDER = ",".join(FLAGS)


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
    """The rows: the baseline (every listed flag at its reference value), then one row per flag,
    added to the previous row (the chain) or to the baseline (only)."""
    base = copy.deepcopy(cfg)
    for name, _ in steps:
        apply_flag(base, name, FLAGS[name].reference)
    rows = [{"flag": None, "value": None, "config": base, "previous": None}]
    for name, value in steps:
        start = base if only else rows[-1]["config"]
        row_cfg = copy.deepcopy(start)
        apply_flag(row_cfg, name, value)
        rows.append({"flag": name, "value": value, "config": row_cfg,
                     "previous": 0 if only else len(rows) - 1})
    return rows


def load_bench_config(rest: list[str]) -> Config:
    """The config from --config and overrides; by default bench_gpu on CUDA, else bench_cpu."""
    cfg, _ = load_config(["--config", "bench_cpu", *rest], prog="bench.py")
    device = runtime.resolve_device(cfg.system.device)
    if device.type == "cuda" and not any(a == "--config" or a.startswith("--config=")
                                         for a in rest):
        cfg, _ = load_config(["--config", "bench_gpu", *rest], prog="bench.py")
    cfg.system.device = str(device)
    cfg.train.init_from = "scratch"  # every row starts from the same seeded weights
    return cfg


def ensure_dataset(cfg: Config) -> dict:
    try:
        return load_meta(cfg.data.dataset)
    except DataError:
        if cfg.data.dataset not in LOCAL_DATASETS:
            raise
    print(f"preparing {cfg.data.dataset} (from the bundled text) ...")
    importlib.import_module(f"data.{cfg.data.dataset}.prepare").prepare()
    return load_meta(cfg.data.dataset)


def resolve_auto_dtype(cfg: Config) -> None:
    if cfg.system.dtype != "auto":
        return
    device = runtime.resolve_device(cfg.system.device)
    bf16 = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
    cfg.system.dtype = "bfloat16" if bf16 else "float16"


def no_change_reason(values: dict, notes: list[str], previous: dict) -> str:
    changed = [f"{k}={v}" for k, v in values.items() if v != previous["settings"].get(k)]
    new_notes = [n for n in notes if n not in previous.get("notes", [])]
    return "changes nothing here: " + "; ".join(changed + new_notes or ["same settings"])


def time_steps(parts: dict, cfg: Config, rt: runtime.Runtime, warmup: int, measure: int,
               clock: str = "wall") -> dict:
    """warmup untimed steps, then measure timed ones (device synced around each). The process
    clock counts only the CPU time this process ran, not time it waited for the cores."""
    now = time.process_time if clock == "process" else time.perf_counter
    t = cfg.train
    tokens_per_step = t.batch_size * t.grad_accum_steps * cfg.model.block_size
    batch = parts["batches"].next()
    times, losses, first_step_s = [], [], 0.0

    def step(i: int):
        r = train_step(parts["model"], parts["raw_model"], parts["optimizer"], parts["scaler"],
                       parts["batches"], batch, rt, lr_at(i, cfg), t.grad_accum_steps,
                       t.grad_clip)
        return r.loss_sum / t.grad_accum_steps, r.norm, r.next_batch

    for i in range(warmup + measure):
        if i == warmup:
            speedups.reset_peak_memory(rt.device)
        rt.synchronize()
        t0, wall0 = now(), time.perf_counter()
        loss, norm, batch = step(i)
        loss_value = loss.item()
        rt.synchronize()
        dt = now() - t0
        first_step_s = first_step_s or time.perf_counter() - wall0  # compiling: wall time
        if i >= warmup:
            times.append(dt)
            losses.append(loss_value)
        kind = "warm-up" if i < warmup else "timed  "
        print(f"{kind} " + log_line(i + 1, loss_value, lr_at(i, cfg), norm.item(), 1000 * dt,
                                    tokens_per_step / dt, None), flush=True)
    memory = speedups.peak_memory(rt.device)
    kernels = speedups.attention_kernels(lambda: step(warmup + measure))  # one more, untimed
    return {"tokens_per_step": tokens_per_step, "step_s": times, "losses": losses,
            "loss": losses[-1], "tokens_per_s": tokens_per_step / statistics.median(times),
            "first_step_s": first_step_s, "memory": memory, "kernels": kernels}


def run_row(spec: dict) -> dict:
    """Build everything as train.py does, then time the steps (in the row's own process)."""
    cfg = from_dict(spec["config"])
    resolve_auto_dtype(cfg)
    rt = runtime.setup(cfg.system)
    meta = load_meta(cfg.data.dataset)
    raw_model, _ = build_model(cfg, meta, rt.device)
    batch_note = speedups.auto_micro_batch(cfg, raw_model, rt)
    optimizer, fused_note = make_optimizer(raw_model, cfg, rt.device)
    t = cfg.train
    parts = {"raw_model": raw_model, "optimizer": optimizer,
             "scaler": torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16),
             "batches": Batches(meta, "train", t.batch_size, cfg.model.block_size,
                                cfg.system.seed, rt.device, cfg.data.pin_memory,
                                prefetch=cfg.data.prefetch)}
    parts["model"], compile_note = techniques.compile_model(raw_model, cfg.system, rt)
    values = speedups.settings(cfg, rt, fused_note, compile_note, batch_note)
    print(speedups.banner(values, rt.notes), flush=True)
    # the model's useful FLOPs: padded vocabulary rows are extra work, not extra model
    padding = (raw_model.padded_vocab - raw_model.vocab_size) * cfg.model.n_embd
    result = {"settings": values, "notes": rt.notes, "dtype": cfg.system.dtype,
              "micro_batch": t.batch_size, "grad_accum_steps": t.grad_accum_steps,
              "params": raw_model.num_params(False),
              "flops_per_token": raw_model.flops_per_token() - 6 * padding}
    previous = spec.get("previous")
    if previous and speedups.effective(values) == speedups.effective(previous["settings"]):
        return {**result, "status": "skipped",
                "reason": no_change_reason(values, rt.notes, previous)}
    raw_model.train()
    timing = time_steps(parts, cfg, rt, spec["warmup"], spec["measure"], spec["clock"])
    return {**result, **timing, "status": "ok"}


def matmul_flops(n: int, dtype: torch.dtype, device: torch.device, iters: int,
                 clock: str = "wall") -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.process_time if clock == "process" else time.perf_counter
    sync()
    t0 = now()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (now() - t0)


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"CPU: {model}, {threads} thread{'s' if threads > 1 else ''}"


def measure_ceiling(spec: dict) -> dict:
    """The device's dense matmul ceiling (the best of its fast dtypes) and its datasheet peak."""
    system = from_dict(spec["config"]).system
    rt = runtime.setup(system)
    device = rt.device
    if device.type == "cuda":
        dtypes = [torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16]
        n, iters = 8192, 30
    else:
        dtypes = [torch.float32] + ([torch.bfloat16] if runtime.cpu_has_native_bf16() else [])
        n, iters = 2048, 5
    n = spec.get("matmul_n") or n
    measured = {str(d).removeprefix("torch."): matmul_flops(n, d, device, iters, spec["clock"])
                for d in dtypes}
    best = max(measured, key=measured.get)
    half = runtime.Runtime(device=device, dtype=torch.bfloat16, tf32=False, notes=[])
    return {"status": "ok", "hardware": hardware_name(device), "device": device.type,
            "measured": measured[best], "measured_dtype": best, "measured_all": measured,
            "matmul_n": n, "datasheet": runtime.peak_flops(half, system.peak_flops),
            "torch": torch.__version__}


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = measure_ceiling(spec) if spec["kind"] == "ceiling" else run_row(spec)
    except Exception as e:  # noqa: BLE001 - the row is reported failed, the chain goes on
        traceback.print_exc()
        first_line = (str(e).strip().splitlines() or [""])[0]
        result = {"status": "failed", "error": f"{type(e).__name__}: {first_line}"[:300]}
    Path(spec["result"]).write_text(json.dumps(result))
    return 0 if result["status"] != "failed" else 1


def relay(stream, tail: collections.deque) -> None:
    for line in stream:
        print("    " + line, end="", flush=True)
        if line.strip():
            tail.append(line.strip())


def run_worker(spec: dict, workdir: Path, label: str, timeout: float | None = None) -> dict:
    """Run one row (or the ceiling) in a fresh Python process, streaming its output; stop it
    after timeout seconds (what is left of --time-budget)."""
    spec_path, result_path = workdir / f"{label}.spec.json", workdir / f"{label}.result.json"
    spec["result"] = str(result_path)
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "bench.py"), "--worker",
                             str(spec_path)], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail: collections.deque[str] = collections.deque(maxlen=5)
    reader = threading.Thread(target=relay, args=(proc.stdout, tail), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=None if timeout is None else max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        return {"status": "failed",
                "error": f"stopped after {max(timeout, 1.0):.0f} s: the --time-budget ran out"}
    reader.join()
    if result_path.is_file():
        return json.loads(result_path.read_text())
    last = tail[-1] if tail else "no output"
    return {"status": "failed", "error": f"the row's process exited with {rc} ({last})"[:300]}


def label(row: dict, only: bool) -> str:
    """'baseline', '+ tf32', '+ attention=sdpa', '+ dtype=bfloat16' ('only ...' alone)."""
    if row["flag"] is None:
        return "baseline"
    name, value = row["flag"], row["value"]
    if name == "dtype":
        value = row.get("dtype", value)  # what auto became
    shown = name if value.lower() in ("true", "on", "yes", "1") else f"{name}={value}"
    return ("only " if only else "+ ") + shown


def derive(rows: list[dict], ceiling: dict) -> None:
    """Speedups against the previous measured row and the baseline, and MFU, in place."""
    base = rows[0] if rows[0]["status"] == "ok" else None
    flops_per_token = next((r["flops_per_token"] for r in rows if "flops_per_token" in r), 0)
    for i, row in enumerate(rows):
        if row["status"] != "ok":
            continue
        prev = row["previous"]
        while prev is not None and rows[prev]["status"] != "ok":
            prev = rows[prev]["previous"]
        speed = row["tokens_per_s"]
        row["vs_previous"] = speed / rows[prev]["tokens_per_s"] if prev is not None else None
        row["vs_baseline"] = speed / base["tokens_per_s"] if base and i else None
        achieved = speed * flops_per_token
        row["model_flops_per_s"] = achieved
        row["mfu"] = achieved / ceiling["datasheet"] if ceiling.get("datasheet") else None
        row["mfu_measured"] = achieved / ceiling["measured"] if ceiling.get("measured") else None


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"


def memory_text(mem: dict) -> str:
    if "allocated" in mem:
        return f"{gib(mem['allocated'])} / {gib(mem['reserved'])} GiB"
    return f"{gib(mem['rss'])} GiB RSS" if "rss" in mem else "-"


def memory_bytes(row: dict) -> float:
    mem = row.get("memory", {})
    return mem.get("allocated", mem.get("rss", 0))


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = ["#", "step", "tok/s", "vs prev", "vs base", "MFU", "MFU (meas.)", "peak memory",
           "loss", "attention kernel", "note"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            why = r.get("reason") or r.get("error", "")
            out.append([str(i), r["label"], "-", "-", "-", "-", "-", "-", "-", "-",
                        f"{r['status']}: {why}"])
            continue
        note = [f"micro-batch {r['micro_batch']}x{r['grad_accum_steps']}"] \
            if r["flag"] == "batch_size_auto" else []
        if r["settings"].get("compile", "off") != "off":
            note.append(f"first step {r['first_step_s']:.0f} s (compiling)")
        fastest, slowest = (r["tokens_per_step"] / s for s in (min(r["step_s"]),
                                                                max(r["step_s"])))
        if fastest > 1.2 * slowest:  # say so when the timed steps disagree
            note.append(f"steps ranged {slowest:,.0f}-{fastest:,.0f} tok/s")
        note += [f"a later pass failed: {e}" for e in r.get("later_pass_errors", [])]
        note += [n for n in r.get("notes", []) if r["previous"] is None or
                 n not in r.get("previous_notes", [])]
        out.append([str(i), r["label"], f"{r['tokens_per_s']:,.0f}", times(r["vs_previous"]),
                    times(r["vs_baseline"]), pct(r["mfu"]), pct(r["mfu_measured"]),
                    memory_text(r["memory"]), f"{r['loss']:.4f}",
                    ", ".join(r["kernels"]) or "-", "; ".join(note)])
    return out


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
             for line in [COLUMNS, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def describe(report: dict) -> str:
    """The lines above the table: hardware, model, batch, steps, MFU denominators."""
    c, ceiling = report["config"], report["ceiling"]
    m, t = c["model"], c["train"]
    first = next((r for r in report["rows"] if "params" in r), {})
    flops = first.get("flops_per_token", 0)
    datasheet = (f"{ceiling['datasheet'] / 1e12:.0f} TFLOP/s (dense bf16, datasheet)"
                 if ceiling.get("datasheet") else "no datasheet peak for this device")
    measured = (f"{ceiling['measured'] / 1e12:.2f} TFLOP/s measured ({ceiling['measured_dtype']} "
                f"{ceiling['matmul_n']}^3 matmul)" if ceiling.get("measured") else "not measured")
    load = report.get("load_average")
    shared = (f" | load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (other "
              "processes shared the machine)" if load and max(load) > 0.5 * os.cpu_count() else "")
    return "\n".join([
        f"hardware: {ceiling.get('hardware', report['device'])} | torch {report['torch']} | "
        f"{report['date']}{shared}",
        f"model: {m['n_layer']} layers, {m['n_head']} heads, {m['n_embd']} wide, context "
        f"{m['block_size']}, vocab {first.get('settings', {}).get('vocab', m['vocab_size'])} "
        f"({first.get('params', 0) / 1e6:.1f}M parameters) | data: {c['data']['dataset']} | "
        f"{t['batch_size'] * t['grad_accum_steps']} sequences "
        f"({t['batch_size']} x {t['grad_accum_steps']} accumulated) per step | "
        f"{report['warmup']} warm-up + {report['measure']} timed steps per row"
        + (f" in each of {report['repeat']} passes" if report.get("repeat", 1) > 1 else "")
        + ", each row in a fresh process"
        + (", timed by the process's CPU time (--clock=process)"
           if report.get("clock") == "process" else ""),
        f"MFU: {flops / 1e6:,.1f}M FLOPs per token (6N + 12*L*H*Q*T) x tokens/s, against "
        f"{datasheet}; MFU (meas.) against {measured}",
        f"command: {report['command']}",
    ])


def plot(report: dict, path: Path) -> bool:
    """Bar chart of tokens/s and peak memory per row; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["rows"]
    labels = [r["label"] for r in rows]
    speed = [r.get("tokens_per_s", 0.0) for r in rows]
    memory = [memory_bytes(r) / 2**30 for r in rows]
    y = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.42 * len(rows)), sharey=True)
    ax1.barh(y, speed, color="#3b75af")
    ax2.barh(y, memory, color="#c6843a")
    for i, r in enumerate(rows):
        text = (f" {r['tokens_per_s']:,.0f}" + (f"  ({r['vs_baseline']:.2f}x)"
                                                if r.get("vs_baseline") else "")
                if r["status"] == "ok" else f" {r['status']}")
        ax1.text(speed[i], i, text, va="center", fontsize=8)
        ax2.text(memory[i], i, f" {memory[i]:.2f}" if r["status"] == "ok" else "", va="center",
                 fontsize=8)
    ax1.set_yticks(y, labels)
    ax1.invert_yaxis()
    ax1.set_xlabel("tokens/s (median of timed steps)")
    mem_kind = "CUDA max allocated" if rows and "allocated" in rows[0].get("memory", {}) \
        else "peak RSS"
    ax2.set_xlabel(f"peak memory, GiB ({mem_kind})")
    for ax in (ax1, ax2):
        ax.margins(x=0.25)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"bench.py {report['mode']}: {report['ceiling'].get('hardware', '')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def output_stem(args: argparse.Namespace, report: dict) -> str:
    if args.name:
        return args.name
    hardware = report["ceiling"].get("hardware", report["device"])
    stem = report["device"] if report["device"] == "cpu" else \
        re.sub(r"[^a-z0-9]+", "-", hardware.split(" (")[0].lower()).strip("-")
    return stem + ("_only" if report["mode"] == "only" else "")


def write_outputs(report: dict, folder: Path, stem: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    table = table_rows(report["rows"])
    paths = [folder / f"{stem}.json", folder / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    title = f"# bench.py ({report['mode']})\n\n"
    paths[1].write_text(title + "\n".join(f"- {line}" for line in describe(report).splitlines())
                        + "\n\n" + markdown_table(table) + "\n")
    png = folder / f"{stem}.png"
    if plot(report, png):
        paths.append(png)
    else:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
    return paths


def merge_pass(first: dict, again: dict) -> None:
    """Fold a later pass of a row into its first: all timed steps count toward the median."""
    if again["status"] != "ok":
        first.setdefault("later_pass_errors", []).append(again.get("error", again["status"]))
        return
    first["step_s"] += again["step_s"]
    first["tokens_per_s"] = first["tokens_per_step"] / statistics.median(first["step_s"])
    first["memory"] = {k: max(v, again["memory"].get(k, 0)) for k, v in first["memory"].items()}


def run_all(rows: list[dict], cfg: Config, opts: argparse.Namespace, only: bool,
            command: str) -> dict:
    """The ceiling, then every row (each pass runs all rows again, so a burst of load on a shared
    machine lands on different rows in different passes)."""
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results: list[dict] = []
    deadline = time.monotonic() + opts.time_budget if opts.time_budget else None

    def left() -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        workdir = Path(tmp)
        print(f"measuring the matmul ceiling on {cfg.system.device} ...", flush=True)
        ceiling = run_worker({"kind": "ceiling", "config": cfg.to_dict(), "clock": opts.clock,
                              "matmul_n": opts.ceiling_size}, workdir, "ceiling", left())
        for repeat in range(opts.repeat):
            for i, row in enumerate(rows):
                if repeat and results[i]["status"] != "ok":
                    continue  # skipped and failed rows are not retried
                prev = results[row["previous"]] if row["previous"] is not None else None
                passes = f" (pass {repeat + 1}/{opts.repeat})" if opts.repeat > 1 else ""
                print(f"[{i + 1}/{len(rows)}] {label(row, only)}{passes}", flush=True)
                spec = {"kind": "row", "config": row["config"].to_dict(),
                        "warmup": opts.warmup_steps, "measure": opts.measure_steps,
                        "clock": opts.clock,
                        "previous": prev if prev and "settings" in prev else None}
                if left() is not None and left() <= 0:
                    if repeat:
                        continue  # a later pass only adds samples
                    print(f"    skipped: the --time-budget of {opts.time_budget:g} s ran out",
                          flush=True)
                    result = {"status": "skipped", "reason": f"the --time-budget of "
                              f"{opts.time_budget:g} s ran out before this row"}
                else:
                    result = run_worker(spec, workdir, f"row{i}", left())
                if repeat:
                    merge_pass(results[i], result)
                    continue
                result.update(flag=row["flag"], value=row["value"], previous=row["previous"],
                              previous_notes=prev.get("notes", []) if prev else [])
                result["label"] = label(result, only)
                results.append(result)
    if ceiling["status"] != "ok":
        print(f"matmul ceiling not measured: {ceiling.get('error')}")
    derive(results, ceiling)
    return {"mode": "only" if only else "chain", "device": cfg.system.device.split(":")[0],
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average": [load_start, os.getloadavg()[0]] if load_start is not None else None,
            "command": command, "warmup": opts.warmup_steps, "measure": opts.measure_steps,
            "repeat": opts.repeat, "clock": opts.clock, "time_budget": opts.time_budget,
            "ceiling": ceiling,
            "config": cfg.to_dict(), "rows": results}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="bench.py", allow_abbrev=False,
        description="The speedup ablation: baseline, then each flag added in turn.",
        epilog="Every other argument is a config override as for train.py (--config NAME, "
               "--key=value; python train.py --help lists them). Default config: bench_gpu on "
               "CUDA, bench_cpu otherwise. Flags: " +
               "; ".join(f"{f.name} ({f.what})" for f in FLAGS.values()))
    p.add_argument("--order", default=DEFAULT_ORDER, metavar="FLAG[=VALUE],...",
                   help=f"the chain, in order (default: {DEFAULT_ORDER})")
    p.add_argument("--only", default="", metavar="all|FLAG,...",
                   help="each flag alone against the baseline instead of the chain")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per row")
    p.add_argument("--measure-steps", type=int, default=5, help="timed steps per row")
    p.add_argument("--repeat", type=int, default=1,
                   help="passes over all rows; each row's tokens/s is the median of the timed "
                        "steps of every pass (steadier on a shared machine)")
    p.add_argument("--clock", default="wall", choices=("wall", "process"),
                   help="time steps by the wall clock, or by this process's CPU time (CPU "
                        "with --threads=1 only: steadier when other jobs share the cores)")
    p.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                   help="stop after this many seconds in all: a row still running is stopped "
                        "(reported failed), rows not started are reported skipped; the table "
                        "and files are written either way (default: no limit)")
    p.add_argument("--ceiling-size", type=int, default=0, metavar="N",
                   help="size of the N^3 matmul that measures the ceiling (default: 8192 on "
                        "CUDA, 2048 elsewhere)")
    p.add_argument("--results", default="bench_results", help="folder for the outputs")
    p.add_argument("--name", default="", help="output file stem (default: the device)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--memory" in argv:  # the memory strategies' benchmark: bench_memory.py
        from engine import bench_memory
        return bench_memory.main([a for a in argv if a != "--memory"])
    args, rest = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    try:
        if args.warmup_steps < 0 or args.measure_steps < 1 or args.repeat < 1:
            raise BenchError("--warmup-steps must be >= 0, --measure-steps and --repeat >= 1")
        if args.time_budget < 0 or args.ceiling_size < 0:
            raise BenchError("--time-budget and --ceiling-size must be >= 0 (0: no limit, "
                             "the default size)")
        cfg = load_bench_config(rest)
        if args.clock == "process" and (cfg.system.device != "cpu" or cfg.system.threads != 1):
            raise BenchError("--clock=process times this process's CPU time: it needs "
                             "--device=cpu and --threads=1 (the CPU time of several threads "
                             "adds up, and a GPU's work is not CPU time)")
        only = bool(args.only)
        steps = parse_steps(args.order if args.only in ("", "all") else args.only)
        rows = plan(cfg, steps, only)
        ensure_dataset(cfg)
    except (BenchError, ConfigError, DataError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python bench.py " + shlex.join(argv)
    print(f"bench: {len(rows)} rows on {cfg.system.device}, each {args.warmup_steps} warm-up + "
          f"{args.measure_steps} timed steps in its own process"
          + (f", {args.repeat} passes" if args.repeat > 1 else ""), flush=True)
    report = run_all(rows, cfg, args, only, command.strip())
    print("\n" + describe(report) + "\n\n" + text_table(table_rows(report["rows"])))
    paths = write_outputs(report, Path(args.results), output_stem(args, report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
