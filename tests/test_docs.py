"""The docs' generated sections are current (scripts/docs.py), and a fact stated at a field
reaches every list made from it: a throwaway field, added here in a subclass of a config section,
shows in the start-up banner, the resume check and bench.py ablation's plan."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import torch

from config import Config, SystemConfig, opt, speedup_flags
from conftest import ROOT
from engine import device as machine
from engine.benchmarks import ablation
from engine.training import restore, speedups


def test_the_generated_sections_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@dataclass
class ThrowawaySystem(SystemConfig):
    sparkle: bool = opt(False, "a speedup declared only here", fast=True)
    shine: int = opt(0, "a setting a resumed run may change", resume=True)


def throwaway_config(**values) -> Config:
    cfg = Config()
    cfg.system = ThrowawaySystem(device="cpu", **values)
    return cfg


def test_a_new_fields_facts_reach_the_banner_the_resume_check_and_the_ablation():
    cfg = throwaway_config()
    assert speedup_flags(cfg)["sparkle"].keys == ("system.sparkle",)
    rt = machine.Runtime(torch.device("cpu"), torch.float32, False, [])
    values = speedups.settings(cfg, rt, speedups.Notes(batch="8x1"))
    assert values["sparkle"] == "off" and list(values)[-3:] == ["sparkle", "batch", "recipe"]
    stored = throwaway_config()
    assert restore.config_changes(stored, throwaway_config(shine=5)) == []  # resume=True
    changed = restore.config_changes(stored, throwaway_config(sparkle=True))
    assert changed and "system.sparkle False -> True" in changed[0]
    rows = ablation.plan(cfg, ablation.parse_steps("attention,sparkle", speedup_flags(cfg)),
                         "only")
    assert [r["flag"] for r in rows] == [None, "attention", "sparkle"]
    assert rows[2]["config"].system.sparkle and not rows[0]["config"].system.sparkle
    assert ablation.label(rows[2], "only") == "only sparkle"
