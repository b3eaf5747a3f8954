"""Each measurement in a fresh process, so that its peak memory and compile state are its own
(run_worker runs `python -m engine.benchmarks.worker SPEC.json`), and the clocks and the peak
memory they read."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from config import ConfigError
from engine.device import Runtime

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], what: str) -> subprocess.CompletedProcess:
    """One of the project's scripts in its own process from the repository root; when it fails,
    ConfigError with its last line of output and the command to run it alone."""
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise ConfigError(f"{what} failed ({last}); run it alone to see why: "
                          + shlex.join(["python", *args[1:]]))
    return done


def time_left(budget: float) -> Callable[[], float]:
    """A clock of the seconds left of budget from now (inf: no budget)."""
    deadline = time.monotonic() + budget if budget else math.inf
    return lambda: deadline - time.monotonic()


def timed(fn: Callable[[], object], rt: Runtime, clock: str = "wall"
          ) -> tuple[float, object]:
    """(seconds, fn()) with the device synced around it; clock "process": this process's CPU
    time, not its waits for the cores."""
    now = time.process_time if clock == "process" else time.perf_counter
    rt.synchronize()
    start = now()
    out = fn()
    rt.synchronize()
    return now() - start, out


def take_turns(runs: dict[str, Callable[[int], torch.Tensor]], new: int, rounds: int,
               rt: Runtime) -> dict[str, dict]:
    """name -> {each round's seconds, the last `new` tokens} of each run(n) generating n tokens,
    timed in turns (A B C A B C: load on the machine hits each alike) after a warm-up run(4)."""
    for run in runs.values():
        run(4)
    out: dict[str, dict] = {name: {"seconds": []} for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds, tokens = timed(lambda: run(new), rt)
            out[name]["seconds"].append(seconds)
            out[name]["tokens"] = tokens[0, -new:].tolist()
    return out


def run_worker(spec: dict, workdir: Path, name: str, timeout: float = math.inf,
               env: dict | None = None) -> dict:
    """Run spec["kind"] in a fresh worker process (its output shown as it runs) and return the
    result it wrote; stop it after timeout seconds (what is left of --time-budget)."""
    spec_path, result_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    limit = max(timeout, 1.0)
    try:
        proc = subprocess.run([sys.executable, "-m", "engine.benchmarks.worker", str(spec_path)],
                              cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                  **(env or {})},
                              timeout=None if limit == math.inf else limit)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"stopped after {limit:.0f} s: the --time-budget "
                "ran out"}
    if result_path.is_file():
        return json.loads(result_path.read_text())
    return {"status": "failed", "error": f"the row's process exited with {proc.returncode} "
            "and wrote no result"}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # resets VmHWM (peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak bytes since the last reset: CUDA allocated/reserved, else the process's peak RSS."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"rss": int(line.split()[1]) * 1024}
    try:
        import resource
    except ImportError:  # Windows: no peak RSS without extra packages
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss": peak if sys.platform == "darwin" else peak * 1024}
