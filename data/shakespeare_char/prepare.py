"""Tiny Shakespeare, one token per character: train.bin / val.bin (90% / 10%) and meta.json.

    python data/shakespeare_char/prepare.py
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from data.dataset import write_dataset  # noqa: E402
from engine.tokenizer import CharTokenizer  # noqa: E402

SOURCE = REPO_ROOT / "data" / "tinyshakespeare.txt"
OUT_DIR = Path(__file__).resolve().parent
VAL_FRACTION = 0.1


def prepare(out_dir: Path = OUT_DIR, source: Path = SOURCE) -> dict:
    text = Path(source).read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    split = int(len(text) * (1 - VAL_FRACTION))
    meta = write_dataset(out_dir, tok, tok.encode(text[:split]), tok.encode(text[split:]),
                         source=Path(source).name)
    print(f"{out_dir}: {meta['vocab_size']} characters, {meta['splits']['train']:,} train and "
          f"{meta['splits']['val']:,} val tokens")
    return meta


if __name__ == "__main__":
    prepare()
