"""Shared fixtures: tiny configs and a char dataset prepared once per session in a temp dir."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from config import ModelConfig  # noqa: E402


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory) -> Path:
    """tiny Shakespeare prepared char-level into a temp folder (the repo's data/ is untouched)."""
    from data.shakespeare_char.prepare import prepare
    out = tmp_path_factory.mktemp("shakespeare_char")
    prepare(out_dir=out)
    return out


def tiny_model_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
