"""What a worker process measures: a training row (built by engine/training/build.py as train.py
builds it, then timed steps), a batch-1 decode run, and the device's matmul ceiling."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from config import Config, from_dict
from data.dataset import load_or_prepare
from engine import compiling
from engine.benchmarks.timing import peak_memory, reset_peak_memory, timed
from engine.device import Runtime, cpu_bf16_units, cpu_has_native_bf16, machine_line, setup
from engine.inference import sampling
from engine.training import speedups
from engine.training.build import Run, build_model, build_training
from engine.training.metrics import matmul_rate, peak_flops
from engine.training.metrics import log_line
from engine.training.optim import lr_at
from engine.training.processes import Dist
from engine.training.step import train_step


def build(cfg: Config, evaluates: bool = False) -> tuple[Run, dict]:
    """(the run as train.py builds it, without resume or run log; the banner's settings);
    compiled, its eval step too only when it evaluates."""
    run = build_training(cfg, Dist(), evaluates)
    values = speedups.settings(cfg, run.rt, run.notes)
    print(speedups.banner(values, run.rt.notes), flush=True)
    return run, values


def stepper(run: Run) -> Callable[[float], tuple[float, torch.Tensor]]:
    """step(lr) -> (mean loss, the gradient norm): one train.py step."""
    t, state, trainer = run.cfg.train, {"batch": run.batches.next()}, run.trainer()

    def step(lr: float) -> tuple[float, torch.Tensor]:
        r = train_step(trainer, state["batch"], lr)
        state["batch"] = r.next_batch
        return r.loss_sum.item() / t.grad_accum_steps, r.norm

    return step


def time_steps(run: Run, warmup: int, measure: int, clock: str = "wall") -> dict:
    """warmup untimed steps, measure timed ones, then one more for the attention kernels; the
    loss after them all, and the first step's time (one a compile missed would be slow)."""
    cfg, rt, step = run.cfg, run.rt, stepper(run)
    times, losses, first_step = [], [], None
    for i in range(warmup + measure):
        if i == warmup:
            reset_peak_memory(rt.device)
        dt, (loss, norm) = timed(lambda: step(lr_at(i, cfg)), rt, clock)
        first_step = dt if first_step is None else first_step
        if i >= warmup:
            times.append(dt)
            losses.append(loss)
        print(("warm-up " if i < warmup else "timed   ") + log_line(
            i + 1, loss, lr_at(i, cfg), norm.item(), 1000 * dt, run.tokens_per_step / dt, None),
            flush=True)
    peak = peak_memory(rt.device)
    # compiled code calls its kernels out of a dispatch mode's sight: the profiler reads those
    read = profiled_attention_kernels if cfg.system.compile else speedups.attention_kernels
    kernels = read(lambda: step(lr_at(warmup + measure, cfg)))
    return {"tokens_per_step": run.tokens_per_step, "step_s": times, "losses": losses,
            "loss": losses[-1], "steps": warmup + measure, "first_step_s": first_step,
            "tokens_per_s": run.tokens_per_step / statistics.median(times),
            "memory": peak, "kernels": kernels}


def time_row(spec: dict) -> dict:
    """Build, then time the steps; skipped when its settings here are the previous row's."""
    cfg, start = from_dict(spec["config"]), time.perf_counter()
    run, values = build(cfg)  # compiles here, when asked
    model, t, rt = run.raw_model, cfg.train, run.rt
    # the model's useful FLOPs: padded vocabulary rows are extra work, not extra model
    padding = (model.padded_vocab - model.vocab_size) * cfg.model.n_embd
    result = {"settings": values, "notes": rt.notes, "dtype": cfg.system.dtype,
              "micro_batch": t.batch_size, "grad_accum_steps": t.grad_accum_steps,
              "params": model.num_params(False), "build_s": time.perf_counter() - start,
              "compile_s": run.notes.compile_s,
              "flops_per_token": model.flops_per_token() - 6 * padding,
              "peak_flops": peak_flops(rt, cfg.system.peak_flops),  # its precision's; 0: unknown
              "peak_precision": precision(rt)}
    previous = spec.get("previous")
    if previous and speedups.effective(values) == speedups.effective(previous["settings"]):
        changed = [f"{k}={v}" for k, v in values.items() if v != previous["settings"].get(k)]
        changed += [n for n in rt.notes if n not in previous.get("notes", [])]
        return {**result, "status": "skipped",
                "reason": "changes nothing here: " + "; ".join(changed or ["same settings"])}
    model.train()
    timing = time_steps(run, spec["warmup"], spec["measure"], spec["clock"])
    rate = matmul_rate(rt.device, rt.dtype)  # train.py's start-up estimate, the same way
    work = model.flops_per_token() * timing["tokens_per_step"]  # padded rows included
    return {**result, **timing, "matmul_rate": rate, "estimate_step_s": work / rate}


def precision(rt: Runtime) -> str:
    """The precision a run's matmuls take, whose peak its MFU is against."""
    if rt.dtype != torch.float32:
        return str(rt.dtype).removeprefix("torch.")
    return "tf32" if rt.tf32 else "float32"


def decode_row(spec: dict) -> dict:
    """Batch-1 greedy decoding with the KV cache, as generate.py does it (random weights):
    tokens/s, the median of spec["rounds"] runs of spec["new_tokens"] after a warm-up."""
    cfg = from_dict(spec["config"])
    rt = setup(cfg.system)
    model, _ = build_model(cfg, load_or_prepare(cfg.data.dataset), rt.device)
    model.eval()
    new, start = min(spec["new_tokens"], cfg.model.block_size - 1), time.perf_counter()
    runner, note = compiling.compile_model(model, cfg.system, rt)
    bucket = cfg.sample.prompt_bucket if cfg.system.compile else 0
    if cfg.system.compile:
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


def ceiling(spec: dict) -> dict:
    """The device's dense matmul ceiling (the best of its fast dtypes) and its datasheet peak."""
    system = from_dict(spec["config"]).system
    rt = setup(system)
    cuda, measured = rt.device.type == "cuda", {}
    n, iters = spec.get("matmul_n") or (8192 if cuda else 2048), 30 if cuda else 5
    dtypes = ([torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16] if cuda else
              [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else []))
    for dtype in dtypes:
        a, b = (torch.randn(n, n, device=rt.device, dtype=dtype) for _ in range(2))
        [a @ b for _ in range(2)]  # warm-up
        seconds, _ = timed(lambda: [a @ b for _ in range(iters)], rt, spec["clock"])
        measured[str(dtype).removeprefix("torch.")] = 2 * n**3 * iters / seconds
    best = max(measured, key=measured.get)
    half = Runtime(device=rt.device, dtype=torch.bfloat16, tf32=False, notes=[])
    return {"hardware": machine_line(rt.device), "device": rt.device.type,
            "isa": torch.backends.cpu.get_cpu_capability(), "bf16_units": cpu_bf16_units(),
            "compile_kernels": compiling.compile_kernels(rt.device),
            "measured": measured[best], "measured_dtype": best, "measured_all": measured,
            "matmul_n": n, "datasheet": peak_flops(half, system.peak_flops),
            "torch": torch.__version__}


def profiled_attention_kernels(run: Callable[[], object]) -> list[str]:
    """The SDPA kernels `run` dispatched to, compiled code too: under torch.profiler, whose
    first start costs seconds (train.py reads eager code's cheaply: speedups.attention_kernels)."""
    prof = profile(activities=[ProfilerActivity.CPU])  # aten calls are recorded on the host
    with quiet_stderr():
        prof.start()
    try:
        run()
    finally:
        with quiet_stderr():
            prof.stop()
    names = {e.name for e in prof.events()}
    return sorted({speedups.SDPA_KERNELS[n] for n in names if n in speedups.SDPA_KERNELS})


@contextlib.contextmanager
def quiet_stderr():
    """Silence C-level stderr (the profiler's chatter)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
