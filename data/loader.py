"""Token files on disk and the batch loader that reads them.

A dataset is a folder with train.bin and val.bin (flat numpy uint16/uint32 token ids) and
meta.json (dtype, vocab size, tokenizer, token counts), so a mismatch between data and model is
caught before training. Batches are random (B, T+1) windows read through a memory map, seeded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

DATA_DIR = Path(__file__).resolve().parent
SPLITS = ("train", "val")


class DataError(ValueError):
    """A dataset that is missing, malformed or does not fit the model."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_dataset(out_dir: Path, tokenizer, train_ids, val_ids, source: str = "") -> dict:
    """Write train.bin, val.bin and meta.json (written last, so a dataset is complete when its
    meta.json exists)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    counts = {}
    for split, ids in (("train", train_ids), ("val", val_ids)):
        arr = np.asarray(ids, dtype=dtype)
        _write_atomic(out_dir / f"{split}.bin", arr.tobytes())
        counts[split] = int(arr.size)
    meta = {"vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
            "tokenizer": tokenizer.meta(), "splits": counts, "source": source}
    _write_atomic(out_dir / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def dataset_dir(name: str) -> Path:
    """A bare dataset name is a folder under data/; anything else is a path to the folder."""
    path = Path(name)
    if len(path.parts) == 1 and not path.is_absolute():
        return DATA_DIR / name
    return path


def prepare_command(name: str) -> str:
    script = DATA_DIR / name / "prepare.py"
    if script.is_file():
        return f"python data/{name}/prepare.py"
    return f"a prepare script (none found at data/{name}/prepare.py)"


def load_meta(name: str) -> dict:
    """Read and check a dataset's meta.json; errors say which prepare command to run."""
    folder = dataset_dir(name)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"dataset '{name}' is not prepared: {meta_path} is missing; "
                        f"run {prepare_command(name)}")
    try:
        meta = json.loads(meta_path.read_text())
        vocab_size, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
        meta["tokenizer"]["kind"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path} is malformed ({e!r}); re-run {prepare_command(name)}") from None
    if dtype != token_dtype(vocab_size) and dtype != np.uint32:
        raise DataError(f"{meta_path}: dtype {dtype} cannot hold a vocabulary of {vocab_size}")
    meta["dir"] = str(folder)
    return meta


def open_split(meta: dict, split: str, block_size: int) -> np.memmap:
    path = Path(meta["dir"]) / f"{split}.bin"
    if not path.is_file():
        raise DataError(f"{path} is missing; re-run the dataset's prepare script")
    dtype = np.dtype(meta["dtype"])
    n = path.stat().st_size // dtype.itemsize
    if n == 0:
        raise DataError(f"{path} is empty; re-run the dataset's prepare script")
    if n < block_size + 1:
        raise DataError(f"{path} has {n} tokens, fewer than one block of block_size+1 = "
                        f"{block_size + 1}; use a smaller --block_size or more data")
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def check_vocab(meta: dict, model_vocab: int, tokenizer_kind: str | None = None) -> None:
    """The data's ids must fit the model's embedding; the tokenizer must be the model's."""
    if meta["vocab_size"] > model_vocab:
        raise DataError(f"dataset {meta['dir']} has vocab_size {meta['vocab_size']} but the model "
                        f"has {model_vocab}; train on data made with the model's tokenizer")
    kind = meta["tokenizer"]["kind"]
    if tokenizer_kind is not None and kind != tokenizer_kind:
        raise DataError(f"dataset {meta['dir']} was tokenized with '{kind}' but the model uses "
                        f"'{tokenizer_kind}'; prepare the data with the model's tokenizer")


class Batches:
    """Random (B, T) input/target windows from one split, reproducible from the seed.

    state_dict()/load_state_dict() save and restore the position in the random stream, so a
    resumed run reads exactly the batches an uninterrupted one would.
    """

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False):
        self.data = open_split(meta, split, block_size)
        self.batch_size, self.block_size = batch_size, block_size
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cuda"
        self.rng = np.random.default_rng(seed)

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        rows = np.stack([np.asarray(self.data[s:s + T + 1], dtype=np.int64) for s in starts])
        xy = torch.from_numpy(rows)  # (B, T+1)
        if self.pin_memory:
            xy = xy.pin_memory()
        xy = xy.to(self.device, non_blocking=self.pin_memory)
        return xy[:, :-1], xy[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.data) - self.block_size, size=self.batch_size)
        return self.windows(starts)

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """Start offsets of n_batches batches drawn from their own seed: the same every call, so
        evaluations at different steps score the same text."""
        rng = np.random.default_rng(seed)
        high = len(self.data) - self.block_size
        return [rng.integers(0, high, size=self.batch_size) for _ in range(n_batches)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
