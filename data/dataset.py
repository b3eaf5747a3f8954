"""A dataset on disk: meta.json and flat token ids, train.bin + val.bin or the shards meta.json
lists (data/shards.py). numpy only: worker processes import this without torch.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent
INSTRUCTION_SUFFIXES = (".json", ".jsonl")  # data.dataset naming instruction data: data/instruct.py


class DataError(ValueError):
    """A dataset that is missing, malformed or does not fit the model."""


def is_instruction_file(name: str) -> bool:
    return name.lower().endswith(INSTRUCTION_SUFFIXES)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def prepare_command(name: str) -> str:
    if (DATA_DIR / name / "prepare.py").is_file():
        return f"python data/{name}/prepare.py"
    return f"a prepare script (none found at data/{name}/prepare.py)"


def load_meta(name: str) -> dict:
    """Read and check a dataset's meta.json; errors say which prepare command to run."""
    path = Path(name)  # a bare name is a folder under data/, anything else a path
    folder = DATA_DIR / name if len(path.parts) == 1 and not path.is_absolute() else path
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"dataset '{name}' is not prepared: {meta_path} is missing; "
                        f"run {prepare_command(name)}")
    try:
        meta = json.loads(meta_path.read_text())
        vocab_size, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
        meta["tokenizer"]["kind"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path} is malformed ({e!r}); re-run "
                        f"{prepare_command(name)}") from None
    if dtype != token_dtype(vocab_size) and dtype != np.uint32:
        raise DataError(f"{meta_path}: dtype {dtype} cannot hold a vocabulary of {vocab_size}")
    meta["dir"] = str(folder)
    return meta


def load_or_prepare(name: str) -> dict:
    """load_meta, but a dataset folder whose package says PREPARE_ON_FIRST_USE (made from a file
    in the repository, no download: tiny Shakespeare) is prepared the first time it is used."""
    try:
        return load_meta(name)
    except DataError:
        folder = len(Path(name).parts) == 1 and (DATA_DIR / name / "__init__.py").is_file()
        if not (folder and getattr(importlib.import_module(f"data.{name}"),
                                   "PREPARE_ON_FIRST_USE", False)):
            raise
    print(f"preparing {name} (from the bundled text) ...", flush=True)
    # its own script in a process of its own, as a user would run it: a run never loads it
    done = subprocess.run([sys.executable, str(DATA_DIR / name / "prepare.py")])
    if done.returncode:
        raise DataError(f"preparing {name} failed (exit {done.returncode}, its words above); "
                        f"run {prepare_command(name)} to try again")
    return load_meta(name)


def open_files(meta: dict, split: str, block_size: int) -> list[np.memmap]:
    """Memory maps of a split: its train.bin / val.bin, at least one window long, or the shards
    meta.json lists, each checked against the size recorded there."""
    folder, dtype = Path(meta["dir"]), np.dtype(meta["dtype"])
    if "shards" not in meta:
        path = folder / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"{path} is missing; re-run the dataset's prepare script")
        n = path.stat().st_size // dtype.itemsize
        if n == 0:
            raise DataError(f"{path} is empty; re-run the dataset's prepare script")
        if n < block_size + 1:
            raise DataError(f"{path} has {n} tokens, fewer than one block of block_size+1 = "
                            f"{block_size + 1}; use a smaller --block_size or more data")
        return [np.memmap(path, dtype=dtype, mode="r", shape=(n,))]
    maps = []
    for entry in meta["shards"][split]:  # a split without shards fails in ShardBatches: 0 tokens
        path, tokens = folder / entry["file"], int(entry["tokens"])
        size = path.stat().st_size if path.is_file() else None
        if size != tokens * dtype.itemsize:
            found = "missing" if size is None else f"{size} bytes, not {tokens * dtype.itemsize}"
            raise DataError(f"shard {path} is {found}; the folder was changed after "
                            f"preparation: delete {folder} and prepare it again")
        maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(tokens,)))
    return maps


class Tokens:
    """A split's token files numbered as one sequence; rows(starts) reads (B, T+1) windows."""

    def __init__(self, meta: dict, split: str, block_size: int):
        self.files = open_files(meta, split, block_size)
        self.lengths = np.array([len(m) for m in self.files], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # global start of file i
        self.block_size = block_size

    def rows(self, starts: np.ndarray) -> np.ndarray:
        """(B, T+1) int64 token rows starting at the global offsets `starts`."""
        T = self.block_size
        file = np.searchsorted(self.offsets, starts, side="right") - 1
        local = np.asarray(starts) - self.offsets[file]
        return np.stack([np.asarray(self.files[i][j:j + T + 1], dtype=np.int64)
                         for i, j in zip(file, local)])


def token_bytes(meta: dict) -> np.ndarray:
    """The bytes of text each id stands for (special tokens: none): bits per byte divides by it."""
    tok = meta["tokenizer"]
    if tok["kind"] == "char":  # no tokenizer to build: its alphabet is right here
        return np.array([len(c.encode()) for c in tok["chars"]] + [0] * bool(tok.get("eot")))
    from data.tokenizer import from_meta

    enc = from_meta(tok).enc  # GPT-2's BPE or a trained one: tiktoken's
    special = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    return np.array([0 if i in special else len(enc.decode_single_token_bytes(i))
                     for i in range(enc.n_vocab)])


def check_vocab(meta: dict, model_vocab: int, tokenizer_kind: str | None = None) -> None:
    """The data's ids must fit the model's embedding; the tokenizer must be the model's."""
    if meta["vocab_size"] > model_vocab:
        raise DataError(f"dataset {meta['dir']} has vocab_size {meta['vocab_size']} but the model "
                        f"has {model_vocab}; train on data made with the model's tokenizer")
    kind = meta["tokenizer"]["kind"]
    if tokenizer_kind is not None and kind != tokenizer_kind:
        raise DataError(f"dataset {meta['dir']} was tokenized with '{kind}' but the model uses "
                        f"'{tokenizer_kind}'; prepare the data with the model's tokenizer")
