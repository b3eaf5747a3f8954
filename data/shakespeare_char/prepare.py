"""Tiny Shakespeare, one token per character: train.bin / val.bin (90% / 10%) and meta.json.

    python data/shakespeare_char/prepare.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.dataset import DATA_DIR  # noqa: E402
from data.writing import write_text  # noqa: E402
from data.tokenizer import CharTokenizer  # noqa: E402

SOURCE = DATA_DIR / "tinyshakespeare.txt"


def prepare(out_dir: Path = DATA_DIR / "shakespeare_char", source: Path = SOURCE) -> dict:
    return write_text(out_dir, source, CharTokenizer.from_text)


if __name__ == "__main__":
    prepare()
