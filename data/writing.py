"""Writing a dataset: train.bin and val.bin, then meta.json, each written whole and renamed into
place, so a folder with a meta.json holds a complete dataset (data/dataset.py reads it)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from data.dataset import DataError, token_dtype


def write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_meta(out_dir: Path, tokenizer, splits: dict[str, int], **extra) -> dict:
    """meta.json, written last: a folder that has one holds a complete dataset."""
    meta = {"vocab_size": tokenizer.vocab_size, "dtype": token_dtype(tokenizer.vocab_size).name,
            "tokenizer": tokenizer.meta(), "splits": splits, **extra}
    write_atomic(Path(out_dir) / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def write_dataset(out_dir: Path, tokenizer, train_ids, val_ids, source: str = "") -> dict:
    """Write train.bin, val.bin and then meta.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, ids in (("train", train_ids), ("val", val_ids)):
        arr = np.asarray(ids, dtype=token_dtype(tokenizer.vocab_size))
        write_atomic(out_dir / f"{split}.bin", arr.tobytes())
        counts[split] = int(arr.size)
    return write_meta(out_dir, tokenizer, counts, source=source)


def write_text(out_dir: Path, source: Path, make_tokenizer: Callable, val_fraction=0.1) -> dict:
    """A text file as a dataset, tokenized by make_tokenizer(text): the first 90% of the characters
    train, the rest val, so every tokenizer holds out the same text."""
    text = Path(source).read_text(encoding="utf-8")
    if not text.strip():
        raise DataError(f"{source} has no text to tokenize")
    tok, split = make_tokenizer(text), int(len(text) * (1 - val_fraction))
    # ordinary encoding: a literal "<|endoftext|>" in the text stays text, never the special token
    meta = write_dataset(out_dir, tok, tok.encode_ordinary(text[:split]),
                         tok.encode_ordinary(text[split:]), source=Path(source).name)
    print(f"{out_dir}: {tok.kind} tokens ({meta['vocab_size']:,} ids), "
          f"{meta['splits']['train']:,} train and {meta['splits']['val']:,} val tokens")
    return meta
