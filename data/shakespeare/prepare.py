"""Tiny Shakespeare in GPT-2 BPE tokens: train.bin / val.bin (90% / 10%) and meta.json.

    python data/shakespeare/prepare.py

The data for finetuning GPT-2 (configs/finetune_shakespeare.toml), split by characters as in
data/shakespeare_char, so both hold out the same text.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.dataset import DATA_DIR, write_text  # noqa: E402
from data.tokenizer import GPT2Tokenizer  # noqa: E402

SOURCE = DATA_DIR / "tinyshakespeare.txt"


def prepare(out_dir: Path = DATA_DIR / "shakespeare", source: Path = SOURCE) -> dict:
    return write_text(out_dir, source, lambda text: GPT2Tokenizer())


if __name__ == "__main__":
    prepare()
