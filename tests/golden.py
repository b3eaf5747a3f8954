"""The golden runs behind tests/test_golden.py, and the two commands that keep their file true.

    python tests/golden.py record            # add (or replace) this machine's record of each run
    python tests/golden.py spread --jobs 2   # run each one under every kernel choice this CPU
                                             # offers; the tolerances come from the spread
    python tests/golden.py spread --runs shipped   # only these runs' entries are replaced; the
                                             # others keep theirs (each names its machine)

A record is bit for bit on its own kind of machine: the same torch, CPU model and vector ISA,
and no environment variable that changes which kernels run. On any other machine the losses
and norms may round differently, and `spread` measures by how much: it reruns each golden run
under every combination of the three kernel choices a CPU can be told to narrow (torch's own
kernels by ATEN_CPU_CAPABILITY, oneDNN's by ONEDNN_MAX_CPU_ISA, MKL's by
MKL_ENABLE_INSTRUCTIONS), adds the records stored from other machines, and writes the largest
relative difference per quantity into golden_spread.json, or the spread another machine measured
for the run before where that is larger (kept in the run's entry, under "earlier"). The test
allows SAFETY times that.
`spread` also runs small real changes of the math (the canaries) and reports how far outside
the tolerance each lands, so a tolerance that would hide them is seen at once.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from config import gpt2_recipe_flags  # noqa: E402
from engine import device

GOLDEN = Path(__file__).with_name("golden_losses.json")
SPREAD = Path(__file__).with_name("golden_spread.json")
SAFETY = 4  # the tolerance is this many times the largest difference measured across kernels
RUNS = {
    # the shipped recipe as `python train.py` runs it (Muon, wsd, rotary, QK-norm, relu^2,
    # soft-capped logits, U-net skips, smear), shortened to a few steps and evaluations
    "shipped": ["--max_iters=6", "--eval_interval=3", "--eval_iters=2"],
    # the default config with GPT-2's model and schedule (the speedrun flags it turns on off),
    # at the batch, weight decay and evaluations its record was made with
    "default": ["--config", "shakespeare_char", "--max_iters=6", "--eval_interval=3",
                "--eval_iters=2", *gpt2_recipe_flags(), "--batch_size=32",
                "--eval_at_start=true", "--weight_decay=0.1"],
    "every_cpu_flag": ["--config", "tiny", "--max_iters=6", "--eval_interval=3", "--eval_iters=2",
                       "--attention=sdpa", "--causal_mask=on_the_fly", "--norm=native",
                       "--activation_impl=native", "--vocab_pad_multiple=64", "--fused_adamw=true",
                       "--dtype=bfloat16", "--weights_dtype=bfloat16",
                       "--activation_checkpointing=all", "--dropout=0.1", "--grad_accum_steps=2",
                       "--pin_memory=true", "--prefetch=true", "--loader_workers=1",
                       "--compile=true"],
}
# what each row holds after [kind, step]; lr is computed in Python and must match exactly
COLUMNS = {"train": ("loss", "norm", "lr"), "eval": ("train", "val")}
EXACT = {"train.lr"}
# quantities a run holds in bfloat16 (the norm of bf16 gradients): one unit in the last place is
# within tolerance, since any difference upstream, however small, can round them either way
BF16_VALUES = {"every_cpu_flag": {"train.norm"}}
KERNEL_ENV = device.KERNEL_ENV
# the CPU features the kernels choose by (a virtual machine's model name can hide the generation)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_bf16", "amx_int8")
# small, real changes of the math: each must land outside the tolerance
# (a run without an entry skips that canary)
CANARIES = {"learning rate x1.01": {"shipped": ["--learning_rate=0.00404"],
                                    "default": ["--learning_rate=0.00404"],
                                    "every_cpu_flag": ["--learning_rate=0.00303"]},
            "AdamW beta1 0.9 -> 0.91": {"shipped": ["--beta1=0.91"], "default": ["--beta1=0.91"],
                                        "every_cpu_flag": ["--beta1=0.91"]},
            "seed 1337 -> 1338": {"shipped": ["--seed=1338"], "default": ["--seed=1338"],
                                  "every_cpu_flag": ["--seed=1338"]},
            # the two above reach only AdamW's parameters; Muon's lr is muon_lr, not x1.01
            "Muon lr x1.01": {"shipped": ["--muon_lr=0.0101"]}}


def machine(env: dict | None = None) -> dict:
    """What decides the bits: torch, the CPU, the ISA torch dispatches to, kernel overrides."""
    env = os.environ if env is None else env
    flags = set(device.cpu_info().get("flags", "").split())
    return {"torch": torch.__version__, "cpu": device.cpu_model(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "kernel_env": {k: env[k] for k in KERNEL_ENV if env.get(k)}}


def prepared_dataset(folder: Path) -> Path:
    from data.shakespeare_char.prepare import prepare
    prepare(out_dir=folder)
    return folder


def run_rows(run: str, dataset: Path, out_dir: Path, extra: list[str] = (),
             env: dict | None = None) -> list[list]:
    """[kind, step, numbers...] for every logged step and evaluation of one golden run."""
    # in a fresh process: what earlier tests left behind (compile caches, thread pools) stays out
    proc = subprocess.run([sys.executable, "train.py", *RUNS[run], *extra, f"--dataset={dataset}",
                           f"--out_dir={out_dir}", "--device=cpu", "--threads=1",
                           "--log_interval=1"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"golden run {run} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r["kind"], r["step"], *(r[k] for k in COLUMNS[r["kind"]])]
            for r in rows if r["kind"] in COLUMNS]


def quantities(rows: list[list]) -> dict[str, list[float]]:
    """{'train.loss': [every step's value], ...}: the rows by what they measure."""
    out: dict[str, list[float]] = {}
    for kind, _, *values in rows:
        for name, value in zip(COLUMNS[kind], values):
            out.setdefault(f"{kind}.{name}", []).append(value)
    return out


def relative_spread(results: list[list[list]]) -> dict[str, float]:
    """Per quantity, the largest (max - min) / |min| over the runs at any one row."""
    per_run = [quantities(rows) for rows in results]
    spread = {}
    for name in per_run[0]:
        widest = 0.0
        for values in zip(*(q[name] for q in per_run)):
            low, high = min(values), max(values)
            widest = max(widest, (high - low) / abs(low) if low else float(high != low))
        spread[name] = widest
    return spread


def tolerance(spread: dict[str, float]) -> dict[str, float]:
    """Relative tolerance per quantity: SAFETY times the measured spread, exact where exact."""
    return {name: 0.0 if name in EXACT else SAFETY * value for name, value in spread.items()}


def bf16_ulp(value: float) -> float:
    """One unit in the last place of a bfloat16 number of this size (8 significant bits)."""
    return math.ldexp(torch.finfo(torch.bfloat16).eps, math.frexp(abs(value))[1] - 1) \
        if value else 0.0


def outside(run: str, got: list[list], want: list[list], tol: dict[str, float]
            ) -> dict[str, float]:
    """Per quantity, the largest |got - want| / what is allowed (> 1: outside the tolerance)."""
    worst: dict[str, float] = {}
    for name, values in quantities(got).items():
        for g, w in zip(values, quantities(want)[name]):
            allowed = tol[name] * abs(w)
            if name in BF16_VALUES.get(run, ()):
                allowed = max(allowed, bf16_ulp(w))
            error = abs(g - w)
            ratio = error / allowed if allowed else (float("inf") if error else 0.0)
            worst[name] = max(worst.get(name, 0.0), ratio)
    return worst


def largest_difference(a: list[list], b: list[list]) -> float:
    """The largest relative difference between two runs over every quantity and row."""
    return max(relative_spread([a, b]).values())


def load() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def write_golden(stored: dict) -> None:
    """One row per line, so a re-record is a reviewable diff."""
    runs = []
    for name, records in stored.items():
        parts = [f'  {{"machine": {json.dumps(rec["machine"])}, "rows": [\n   '
                 + ",\n   ".join(json.dumps(r) for r in rec["rows"]) + "]}"
                 for rec in records]
        runs.append(f' "{name}": [\n' + ",\n".join(parts) + "]")
    GOLDEN.write_text("{\n" + ",\n".join(runs) + "\n}\n")


def record(args: argparse.Namespace) -> None:
    stored = load()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = prepared_dataset(Path(tmp) / "data")
        for run in args.runs:
            rows = run_rows(run, dataset, Path(tmp) / run)
            here = machine()
            stored[run] = [r for r in stored.get(run, []) if r["machine"] != here]
            stored[run].append({"machine": here, "rows": rows})
            print(f"recorded {run} on {here}")
    write_golden(stored)


def kernel_choices() -> list[dict]:
    """Every combination of kernel narrowing this CPU offers ({}: the machine's own choice).
    A narrowing to what the CPU already uses repeats its own result, which costs only time."""
    flags = set(device.cpu_info().get("flags", "").split())
    aten = ["", "default", "avx2"]
    onednn = ["", "AVX2"] + (["AVX512_CORE"] if "avx512f" in flags else []) \
        + (["AVX512_CORE_BF16"] if "avx512_bf16" in flags else [])
    mkl = ["", "AVX2"]
    return [{k: v for k, v in zip(KERNEL_ENV, values) if v}
            for values in itertools.product(aten, onednn, mkl)]


def earlier_spreads(entry: dict | None) -> list[dict]:
    """What other machines measured for a run ({measured_on, date, spread}), from its entry in
    golden_spread.json: their kernels may differ by more than this machine's do."""
    if entry is None:
        return []
    own = {"measured_on": entry["measured_on"], "date": entry["date"],
           "spread": entry.get("spread_here", entry["spread"])}
    return [e for e in [own, *entry.get("earlier", [])] if e["measured_on"] != machine({})]


def measure(run: str, dataset: Path, work: Path, stored: dict,
            pool: concurrent.futures.Executor, earlier: list[dict]) -> dict:
    """One run under every kernel choice, beside the other machines' records; the spread is the
    larger of this and the earlier measurements'; the canaries."""
    jobs = {pool.submit(run_rows, run, dataset, work / f"{run}_{i}", env=env): env
            for i, env in enumerate(kernel_choices())}
    results = [(jobs[j], j.result()) for j in concurrent.futures.as_completed(jobs)]
    base = next(rows for env, rows in results if not env)  # the machine's own choice
    others = [rec for rec in stored.get(run, []) if rec["machine"] != machine({})]
    here = relative_spread([rows for _, rows in results] + [r["rows"] for r in others])
    measured = {q: max([value] + [e["spread"].get(q, 0.0) for e in earlier])
                for q, value in here.items()}
    tol = tolerance(measured)
    canaries = {}
    for i, (name, extra) in enumerate(CANARIES.items()):
        if run not in extra:
            continue
        rows = run_rows(run, dataset, work / f"{run}_canary{i}", extra[run])
        canaries[name] = {q: round(r, 1) for q, r in outside(run, rows, base, tol).items()
                          if q not in EXACT}
    print(f"{run}: spread {here}, with earlier machines' {measured}\n"
          f"  canaries (x tolerance): {canaries}")
    return {"kernel_choices": [{"env": env, "largest_difference": largest_difference(rows, base)}
                               for env, rows in results],
            "other_machines": [{"machine": r["machine"],
                                "largest_difference": largest_difference(r["rows"], base)}
                               for r in others],
            "spread_here": here, "spread": measured, "tolerance": tol,
            "canaries_in_tolerances": canaries, "earlier": earlier}


def spread(args: argparse.Namespace) -> None:
    """Measure the runs asked for and replace only their entries: the other runs keep theirs,
    which may come from another machine (each entry says where and when it was measured), and
    a run measured again keeps the larger spread of each quantity (see earlier_spreads)."""
    stored = load()
    report = json.loads(SPREAD.read_text()) if SPREAD.exists() else {"runs": {}}
    report.update(safety=SAFETY, command="python tests/golden.py spread --runs ...")
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        dataset = prepared_dataset(Path(tmp) / "data")
        for run in args.runs:
            earlier = earlier_spreads(report["runs"].get(run))
            report["runs"][run] = {"measured_on": machine({}),
                                   "date": datetime.date.today().isoformat(),
                                   **measure(run, dataset, Path(tmp), stored, pool, earlier)}
    SPREAD.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {SPREAD} ({', '.join(args.runs)}; other runs' entries as they were)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tests/golden.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("record", "spread"))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--jobs", type=int, default=1, help="spread: runs at once (1 thread each)")
    args = parser.parse_args()
    {"record": record, "spread": spread}[args.command](args)


if __name__ == "__main__":
    main()
