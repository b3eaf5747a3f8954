"""The measuring half of bench.py (an ablation row, a batch-1 decode run, the matmul ceiling)
and what the benchmarks share: each row runs in a fresh process (`python -m engine.benchmark
SPEC.json`), so its peak memory and compile state are its own; the timing, the hardware name
(the machine line), the markdown table."""
from __future__ import annotations

import collections
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from config import Config, from_dict
from data.loader import Batches, DataError, load_meta
from engine import memory, runtime, sampling, techniques
from engine.distributed import Dist
from engine.optim import lr_at, make_optimizer
from engine.runlog import log_line
from engine.sources import build_model
from engine.step import train_step

REPO_ROOT = Path(__file__).resolve().parents[1]


def ensure_dataset(cfg: Config) -> dict:
    """The dataset's meta; one made from the bundled text (no download) is prepared if missing."""
    try:
        return load_meta(cfg.data.dataset)
    except DataError:
        if cfg.data.dataset not in ("shakespeare_char", "shakespeare"):
            raise
    print(f"preparing {cfg.data.dataset} (from the bundled text) ...")
    importlib.import_module(f"data.{cfg.data.dataset}.prepare").prepare()
    return load_meta(cfg.data.dataset)


def hardware_name(device: torch.device) -> str:
    """The machine line: 'CPU AMD EPYC (family 25), ISA AVX2, bf16 emulated (...), 2 threads
    of 2 CPUs', after 'GPU NVIDIA H200 (140 GiB, compute 9.0, bf16 native) | ' on CUDA."""
    return runtime.machine_line(device)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def time_left(budget: float) -> Callable[[], float]:
    """A clock of the seconds left of budget from now (inf: no budget)."""
    deadline = time.monotonic() + budget if budget else math.inf
    return lambda: deadline - time.monotonic()


def timed(fn: Callable[[], object], rt: runtime.Runtime, clock: str = "wall"
          ) -> tuple[float, object]:
    """(seconds, fn()) with the device synced around it; the process clock counts only this
    process's CPU time, not its waits for the cores."""
    now = time.process_time if clock == "process" else time.perf_counter
    rt.synchronize()
    start = now()
    out = fn()
    rt.synchronize()
    return now() - start, out


def run_worker(module: str, spec: dict, workdir: Path, name: str, timeout: float = math.inf,
               env: dict | None = None) -> dict:
    """Run `python -m module SPEC` in a fresh process, streaming its output, and return the
    result it wrote; stop it after timeout seconds (what is left of --time-budget)."""
    spec_path, result_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    proc = subprocess.Popen([sys.executable, "-m", module, str(spec_path)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail: collections.deque[str] = collections.deque(maxlen=5)

    def relay() -> None:  # a thread, so that the wait below can time out
        for line in proc.stdout:
            print("    " + line, end="", flush=True)
            if line.strip():
                tail.append(line.strip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    limit = max(timeout, 1.0)
    try:
        rc = proc.wait(timeout=None if limit == math.inf else limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        return {"status": "failed", "error": f"stopped after {limit:.0f} s: the --time-budget "
                "ran out"}
    reader.join()
    if result_path.is_file():
        return json.loads(result_path.read_text())
    last = tail[-1] if tail else "no output"
    return {"status": "failed", "error": f"the row's process exited with {rc} ({last})"[:300]}


def serve(spec_path: str, kinds: dict[str, Callable[[dict], dict]]) -> int:
    """The worker's side of run_worker: run spec["kind"], write its result (or its error)."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = {"status": "ok", **kinds[spec["kind"]](spec)}
    except Exception as e:  # noqa: BLE001 - the row is reported failed, the others go on
        traceback.print_exc()
        first_line = (str(e).strip().splitlines() or [""])[0]
        result = {"status": "failed", "error": f"{type(e).__name__}: {first_line}"[:300]}
    Path(spec["result"]).write_text(json.dumps(result))
    return 0 if result["status"] != "failed" else 1


def build(cfg: Config, rt: runtime.Runtime) -> tuple[dict, dict]:
    """(model, optimizer, scaler, batches as train.py builds them; the banner's settings)."""
    meta = load_meta(cfg.data.dataset)
    raw_model, _ = build_model(cfg, meta, rt.device)
    model, notes = techniques.apply(raw_model, cfg, rt, Dist())
    optimizer, notes.fused_adamw = make_optimizer(raw_model, cfg, rt.device)
    t = cfg.train
    parts = {"raw_model": raw_model, "model": model, "optimizer": optimizer, "meta": meta,
             "scaler": torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16),
             "batches": Batches(meta, "train", t.batch_size, cfg.model.block_size,
                                cfg.system.seed, rt.device, cfg.data.pin_memory,
                                prefetch=cfg.data.prefetch)}
    values = techniques.settings(cfg, rt, notes)
    print(techniques.banner(values, rt.notes), flush=True)
    return parts, values


def stepper(parts: dict, cfg: Config, rt: runtime.Runtime) -> Callable:
    """step(lr) -> (mean loss, a float; the gradient norm): one train.py step on parts."""
    t, state = cfg.train, {"batch": parts["batches"].next()}

    def step(lr: float) -> tuple[float, torch.Tensor]:
        r = train_step(parts["model"], parts["raw_model"], parts["optimizer"], parts["scaler"],
                       parts["batches"], state["batch"], rt, lr, t.grad_accum_steps, t.grad_clip)
        state["batch"] = r.next_batch
        return r.loss_sum.item() / t.grad_accum_steps, r.norm

    return step


def time_steps(parts: dict, cfg: Config, rt: runtime.Runtime, warmup: int, measure: int,
               clock: str = "wall") -> dict:
    """warmup untimed steps, then measure timed ones, then one more for the attention kernels."""
    t, step = cfg.train, stepper(parts, cfg, rt)
    tokens_per_step = t.batch_size * t.grad_accum_steps * cfg.model.block_size
    times, losses = [], []
    for i in range(warmup + measure):
        if i == warmup:
            memory.reset_peak_memory(rt.device)
        dt, (loss, norm) = timed(lambda: step(lr_at(i, cfg)), rt, clock)
        if i >= warmup:
            times.append(dt)
            losses.append(loss)
        print(("warm-up " if i < warmup else "timed   ") + log_line(
            i + 1, loss, lr_at(i, cfg), norm.item(), 1000 * dt, tokens_per_step / dt, None),
            flush=True)
    peak = memory.peak_memory(rt.device)
    kernels = techniques.attention_kernels(lambda: step(lr_at(warmup + measure, cfg)))
    return {"tokens_per_step": tokens_per_step, "step_s": times, "losses": losses,
            "loss": losses[-1], "tokens_per_s": tokens_per_step / statistics.median(times),
            "memory": peak, "kernels": kernels}


def run_row(spec: dict) -> dict:
    """Build, then time the steps; skipped when its settings here are the previous row's."""
    cfg = from_dict(spec["config"])
    rt = runtime.setup(cfg.system)  # resolves dtype=auto as train.py does
    start = time.perf_counter()
    parts, values = build(cfg, rt)  # compiles here, when asked: techniques.warm_up
    raw_model, t = parts["raw_model"], cfg.train
    # the model's useful FLOPs: padded vocabulary rows are extra work, not extra model
    padding = (raw_model.padded_vocab - raw_model.vocab_size) * cfg.model.n_embd
    result = {"settings": values, "notes": rt.notes, "dtype": cfg.system.dtype,
              "micro_batch": t.batch_size, "grad_accum_steps": t.grad_accum_steps,
              "params": raw_model.num_params(False), "build_s": time.perf_counter() - start,
              "flops_per_token": raw_model.flops_per_token() - 6 * padding}
    previous = spec.get("previous")
    if previous and techniques.effective(values) == techniques.effective(previous["settings"]):
        changed = [f"{k}={v}" for k, v in values.items() if v != previous["settings"].get(k)]
        changed += [n for n in rt.notes if n not in previous.get("notes", [])]
        return {**result, "status": "skipped",
                "reason": "changes nothing here: " + "; ".join(changed or ["same settings"])}
    raw_model.train()
    timing = time_steps(parts, cfg, rt, spec["warmup"], spec["measure"], spec["clock"])
    rate = runtime.matmul_rate(rt.device, rt.dtype)  # train.py's start-up estimate, the same way
    work = raw_model.flops_per_token() * timing["tokens_per_step"]  # padded rows included
    return {**result, **timing, "matmul_rate": rate, "estimate_step_s": work / rate}


def run_decode(spec: dict) -> dict:
    """Batch-1 greedy decoding with the KV cache, as generate.py does it, on the config's model
    (random weights from the seed): tokens/s, the median of spec["rounds"] timed runs of
    spec["new_tokens"] tokens after a warm-up (compiled first, when asked)."""
    cfg = from_dict(spec["config"])
    rt = runtime.setup(cfg.system)
    model, _ = build_model(cfg, load_meta(cfg.data.dataset), rt.device)
    model.eval()
    new, bucket, start = min(spec["new_tokens"], cfg.model.block_size - 1), 0, time.perf_counter()
    runner, note = techniques.compile_model(model, cfg.system, rt)
    if cfg.system.compile:
        bucket = cfg.sample.prompt_bucket
        sampling.warm_up(runner, 1, new, bucket, rt.autocast)
    prompt = torch.zeros((1, 1), dtype=torch.long, device=rt.device)

    def generate() -> torch.Tensor:
        return sampling.generate_tokens(runner, prompt, new, temperature=0, autocast=rt.autocast,
                                        prompt_bucket=bucket)

    generate()
    build_s = time.perf_counter() - start
    seconds = [timed(generate, rt)[0] for _ in range(spec["rounds"])]
    print(f"decode: {new} tokens, runs of {', '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    return {"dtype": cfg.system.dtype, "notes": rt.notes, "compile": note, "build_s": build_s,
            "threads": torch.get_num_threads(), "new_tokens": new, "run_s": seconds,
            "tokens_per_s": new / statistics.median(seconds)}


def measure_ceiling(spec: dict) -> dict:
    """The device's dense matmul ceiling (the best of its fast dtypes) and its datasheet peak."""
    system = from_dict(spec["config"]).system
    rt = runtime.setup(system)
    if rt.device.type == "cuda":
        dtypes = [torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16]
        n, iters = 8192, 30
    else:
        dtypes = [torch.float32] + ([torch.bfloat16] if runtime.cpu_has_native_bf16() else [])
        n, iters = 2048, 5
    n, measured = spec.get("matmul_n") or n, {}
    for dtype in dtypes:
        a, b = (torch.randn(n, n, device=rt.device, dtype=dtype) for _ in range(2))
        [a @ b for _ in range(2)]  # warm-up
        seconds, _ = timed(lambda: [a @ b for _ in range(iters)], rt, spec["clock"])
        measured[str(dtype).removeprefix("torch.")] = 2 * n**3 * iters / seconds
    best = max(measured, key=measured.get)
    half = runtime.Runtime(device=rt.device, dtype=torch.bfloat16, tf32=False, notes=[])
    return {"hardware": hardware_name(rt.device), "device": rt.device.type,
            "isa": torch.backends.cpu.get_cpu_capability(), "bf16_units": runtime.cpu_bf16_units(),
            "compile_kernels": techniques.compile_kernels(rt.device),
            "measured": measured[best], "measured_dtype": best, "measured_all": measured,
            "matmul_n": n, "datasheet": runtime.peak_flops(half, system.peak_flops),
            "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], {"row": run_row, "decode": run_decode,
                                 "ceiling": measure_ceiling}))
