"""Golden runs: the first steps of the default config, and of a config with every CPU-capable flag
on, give exactly the losses and gradient norms recorded in tests/golden_losses.json. Moving code
around must not change the math; this is what says so.

Bit for bit on the kind of machine the values were recorded on (the same torch version and CPU
vector ISA); on another, floating-point kernels may round differently, so there the values must
agree to 1e-5 relative. Re-record (only when the math is meant to change) with
    GOLDEN_RECORD=1 python -m pytest -q tests/test_golden.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden_losses.json")
RUNS = {
    "default": ["--config", "shakespeare_char", "--max_iters=6", "--eval_interval=3",
                "--eval_iters=2"],
    "every_cpu_flag": ["--config", "tiny", "--max_iters=6", "--eval_interval=3", "--eval_iters=2",
                       "--attention=sdpa", "--causal_mask=on_the_fly", "--norm=native",
                       "--gelu=native", "--vocab_pad_multiple=64", "--fused_adamw=true",
                       "--dtype=bfloat16", "--weights_dtype=bfloat16",
                       "--activation_checkpointing=all", "--dropout=0.1", "--grad_accum_steps=2",
                       "--pin_memory=true", "--prefetch=true", "--loader_workers=1",
                       "--compile=true"],
}


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def record_of(run: str, char_dataset, out_dir: Path) -> list[list]:
    """[kind, step, loss-like numbers...] for every logged step and evaluation."""
    # in a fresh process: what earlier tests left behind (compile caches, thread pools) stays out
    proc = subprocess.run([sys.executable, "train.py", *RUNS[run], f"--dataset={char_dataset}",
                           f"--out_dir={out_dir}", "--device=cpu", "--threads=1",
                           "--log_interval=1"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {"train": ("loss", "norm", "lr"), "eval": ("train", "val")}
    return [[r["kind"], r["step"], *(r[k] for k in keys[r["kind"]])]
            for r in rows if r["kind"] in keys]


@pytest.mark.parametrize("run", RUNS)
def test_golden_run(run, char_dataset, tmp_path):
    got = record_of(run, char_dataset, tmp_path / run)
    if os.environ.get("GOLDEN_RECORD"):
        stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        stored[run] = {"machine": machine(), "rows": got}
        GOLDEN.write_text("{\n" + ",\n".join(  # one row per line: reviewable diffs
            f' "{name}": {{"machine": {json.dumps(v["machine"])}, "rows": [\n  '
            + ",\n  ".join(json.dumps(r) for r in v["rows"]) + "]}"
            for name, v in stored.items()) + "\n}\n")
        pytest.skip(f"recorded {run} into {GOLDEN.name}")
    want = json.loads(GOLDEN.read_text())[run]
    assert [r[:2] for r in got] == [r[:2] for r in want["rows"]]
    if want["machine"] == machine():
        assert got == want["rows"]  # bit for bit
    else:  # another torch or vector ISA: kernels may round differently
        for g, w in zip(got, want["rows"]):
            assert g[2:] == pytest.approx(w[2:], rel=1e-5), (g, w, want["machine"])
