"""Golden runs: the first steps of the shipped recipe as `python train.py` runs it, of the default
config with GPT-2's model and schedule, and of a config with every CPU-capable flag on, give the
losses and gradient norms recorded in tests/golden_losses.json. Moving code around
must not change the math; this is what says so.

Bit for bit on a kind of machine a record was made on (the same torch, CPU and ISA, no kernel
overrides: tests/golden.py). Elsewhere each quantity must lie within SAFETY times the largest
relative difference measured across the kernels a CPU can be told to use, of every record
(tests/golden_spread.json, written by `python tests/golden.py spread`); the learning rate stays
exact, and a value held in bfloat16 may move by one unit in its last place. Re-record only when
the math is meant to change: `python tests/golden.py record` (it adds this machine's record).
"""
from __future__ import annotations

import json

import pytest

import golden


@pytest.mark.parametrize("run", golden.RUNS)
def test_golden_run(run, char_dataset, tmp_path):
    records = golden.load()[run]
    got = golden.run_rows(run, char_dataset, tmp_path / run)
    for rec in records:
        assert [r[:2] for r in got] == [r[:2] for r in rec["rows"]], rec["machine"]
    here = golden.machine()
    same = [rec["rows"] for rec in records if rec["machine"] == here]
    if same:
        assert got == same[0]  # bit for bit
        return
    tol = golden.tolerance(json.loads(golden.SPREAD.read_text())["runs"][run]["spread"])
    for rec in records:
        worst = golden.outside(run, got, rec["rows"], tol)
        assert max(worst.values()) <= 1, (
            f"{run} on {here} is outside the tolerance of the record from {rec['machine']}: "
            f"largest error / tolerance per quantity {worst}; tolerances {tol}")
