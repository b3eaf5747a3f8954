"""Tiny Shakespeare in GPT-2 BPE tokens: train.bin / val.bin (90% / 10%) and meta.json.

    python data/shakespeare/prepare.py

The data for finetuning GPT-2 (configs/finetune_shakespeare.toml), split by characters as in
data/shakespeare_char, so both hold out the same text.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from data.dataset import write_dataset  # noqa: E402
from engine.tokenizer import GPT2Tokenizer  # noqa: E402

SOURCE = REPO_ROOT / "data" / "tinyshakespeare.txt"
OUT_DIR = Path(__file__).resolve().parent
VAL_FRACTION = 0.1


def prepare(out_dir: Path = OUT_DIR, source: Path = SOURCE) -> dict:
    text = Path(source).read_text(encoding="utf-8")
    tok = GPT2Tokenizer()
    split = int(len(text) * (1 - VAL_FRACTION))
    # ordinary encoding: a literal "<|endoftext|>" in the text stays text, never the special token
    meta = write_dataset(out_dir, tok, tok.encode_ordinary(text[:split]),
                         tok.encode_ordinary(text[split:]), source=Path(source).name)
    print(f"{out_dir}: GPT-2 BPE ({meta['vocab_size']:,} ids), {meta['splits']['train']:,} train "
          f"and {meta['splits']['val']:,} val tokens")
    return meta


if __name__ == "__main__":
    prepare()
