"""Token files on disk and the batch loader that reads them.

A dataset is a folder with meta.json (dtype, vocab size, tokenizer, token counts), so a mismatch
between data and model is caught before training, and its tokens (flat numpy uint16/uint32 ids),
in one of two layouts:
    train.bin + val.bin        one file per split (small corpora, e.g. data/shakespeare_char)
    train_000000.bin, ...      fixed-size shards listed under meta.json's "shards" (corpora of
                               any size, written by data/shards.py)
Batches(meta, ...) reads either: random (B, T+1) windows through memory maps, seeded, with a
position a checkpoint can store and restore.

torch is imported only where batches become tensors, so the preparation scripts' worker
processes, which use this module's format helpers, start without it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

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

    Batches(meta, ...) returns a ShardBatches when meta.json lists shards, so callers need not
    know the layout. state_dict()/load_state_dict() save and restore the position in the random
    stream, so a resumed run reads exactly the batches an uninterrupted one would. The ranks of
    a distributed run share that stream and each keeps its own share of every global batch (rank
    r: every world_size-th window), so the stream's position is the same on every rank.
    """

    def __new__(cls, meta: dict, *args, **kwargs):
        if cls is Batches and "shards" in meta:
            return super().__new__(ShardBatches)
        return super().__new__(cls)

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False):
        self.data = open_split(meta, split, block_size)
        self._setup(batch_size, block_size, device, pin_memory, rank, world_size, prefetch)
        self.rng = np.random.default_rng(seed)  # one stream for every rank: see next()

    def _setup(self, batch_size: int, block_size: int, device: torch.device | str,
               pin_memory: bool, rank: int, world_size: int, prefetch: bool = False) -> None:
        import torch

        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.batch_size, self.block_size = batch_size, block_size
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pin_memory = (pin_memory or prefetch) and on_cuda
        # data.prefetch: copies run on their own stream, so they overlap the kernels queued on
        # the compute stream instead of waiting behind them
        self.copy_stream = torch.cuda.Stream(self.device) if prefetch and on_cuda else None
        self.prefetch_note = ("on (side CUDA stream)" if self.copy_stream is not None else
                              "off (needs CUDA: plain copy)" if prefetch else "off")
        self.rank, self.world_size = rank, world_size

    def to_tensors(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T+1) token rows -> inputs and targets (B, T) on the device."""
        import torch

        xy = torch.from_numpy(rows)  # (B, T+1)
        if self.pin_memory:
            xy = xy.pin_memory()
        if self.copy_stream is None:
            xy = xy.to(self.device, non_blocking=self.pin_memory)
            return xy[:, :-1], xy[:, 1:]
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            xy = xy.to(self.device, non_blocking=True)
        # work queued on the compute stream from here on waits for the copy; the copy itself
        # overlaps the kernels already queued there (the rest of this step's forward/backward)
        compute.wait_stream(self.copy_stream)
        xy.record_stream(compute)  # its memory is not reused until compute is done with it
        return xy[:, :-1], xy[:, 1:]

    def rows(self, starts: np.ndarray) -> np.ndarray:
        """(B, T+1) int64 token rows starting at `starts`."""
        T = self.block_size
        return np.stack([np.asarray(self.data[s:s + T + 1], dtype=np.int64) for s in starts])

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_tensors(self.rows(starts))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.draw())

    def draw(self) -> np.ndarray:
        """The next batch's window starts (advances the position)."""
        # every rank draws the starts of the whole global micro-batch and keeps every
        # world_size-th: ranks read different windows, and one process with world_size times
        # the batch reads exactly the windows all of them do
        starts = self.rng.integers(0, len(self.data) - self.block_size,
                                   size=self.batch_size * self.world_size)
        return starts[self.rank::self.world_size]

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """Start offsets of n_batches batches drawn from their own seed: the same every call, so
        evaluations at different steps score the same text."""
        rng = np.random.default_rng(seed)
        high = len(self.data) - self.block_size
        size = self.batch_size * self.world_size  # each rank keeps its share, as in next()
        return [rng.integers(0, high, size=size)[self.rank::self.world_size]
                for _ in range(n_batches)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if "rng" not in state:
            raise DataError("the stored data position is for a sharded dataset but this dataset "
                            "is a single train.bin; resume with the dataset the run started on")
        self.rng.bit_generator.state = state["rng"]


def open_shards(meta: dict, split: str) -> list[np.memmap]:
    """Memory maps of a split's shards, each checked against the size meta.json records."""
    folder = Path(meta["dir"])
    entries = meta["shards"].get(split) or []
    if not entries:
        raise DataError(f"{folder / 'meta.json'} lists no {split} shards; prepare the dataset "
                        "again")
    dtype = np.dtype(meta["dtype"])
    maps = []
    for entry in entries:
        path = folder / entry["file"]
        want = int(entry["tokens"]) * dtype.itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            found = "missing" if size is None else f"{size} bytes, not {want}"
            raise DataError(f"shard {path} is {found}; the folder was changed after "
                            f"preparation: delete {folder} and prepare it again")
        maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(int(entry["tokens"]),)))
    return maps


class ShardBatches(Batches):
    """(B, T) windows from a sharded split, each token read once per epoch, in shuffled order.

    An epoch cuts every shard into windows of T+1 tokens starting at offset + k*T (so every token
    is an input once), with an offset in [0, T) drawn per epoch, and reads them in one random
    permutation over all shards: no shard-by-shard drift in the loss, no repeats within an epoch.
    Rank r of world_size takes every world_size-th window of the permutation, so ranks read
    disjoint data. The position is (epoch, cursor): two integers a checkpoint stores; the order
    is recomputed from (seed, epoch).
    """

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False):
        self.shards = open_shards(meta, split)
        self.lengths = np.array([len(m) for m in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # global start of shard i
        self._setup(batch_size, block_size, device, pin_memory, rank, world_size, prefetch)
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, this rank's window starts)
        usable = int(((self.lengths - 1) // block_size).sum()) // world_size
        if usable < batch_size:
            raise DataError(f"the {split} split of {meta['dir']} holds {int(self.lengths.sum()):,} "
                            f"tokens: {usable} windows of block_size+1 = {block_size + 1} per "
                            f"rank, fewer than batch_size {batch_size}; use a smaller "
                            "--batch_size or --block_size, or prepare more data")

    def _window_starts(self, shift: int, index: np.ndarray) -> np.ndarray:
        """Global token offsets of windows (numbered across shards) cut at `shift`."""
        counts = np.maximum(0, (self.lengths - 1 - shift) // self.block_size)
        ends = np.cumsum(counts)
        shard = np.searchsorted(ends, index, side="right")
        first = ends[shard] - counts[shard]
        return self.offsets[shard] + shift + (index - first) * self.block_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            shift = int(rng.integers(self.block_size))
            total = int(np.maximum(0, (self.lengths - 1 - shift) // self.block_size).sum())
            mine = rng.permutation(total)[self.rank::self.world_size][:total // self.world_size]
            self._order = (epoch, self._window_starts(shift, mine))
        return self._order[1]

    def rows(self, starts: np.ndarray) -> np.ndarray:
        T = self.block_size
        shard = np.searchsorted(self.offsets, starts, side="right") - 1
        local = np.asarray(starts) - self.offsets[shard]
        return np.stack([np.asarray(self.shards[i][j:j + T + 1], dtype=np.int64)
                         for i, j in zip(shard, local)])  # windows never cross a shard's end

    def draw(self) -> np.ndarray:
        B = self.batch_size
        order = self._epoch_order(self.epoch)
        if self.cursor + B > len(order):  # the rest is less than a batch: start a new epoch
            self.epoch, self.cursor = self.epoch + 1, 0
            order = self._epoch_order(self.epoch)
        starts = order[self.cursor:self.cursor + B]
        self.cursor += B
        return starts

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """n_batches batches of window starts from their own seed (the same every call), drawn
        without repeats while the split has enough windows; each rank gets its own."""
        rng = np.random.default_rng(seed)
        total = int(((self.lengths - 1) // self.block_size).sum())
        need = n_batches * self.batch_size * self.world_size
        picks = rng.choice(total, size=need, replace=need > total)
        mine = self._window_starts(0, picks[self.rank::self.world_size])
        return list(mine.reshape(n_batches, self.batch_size))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if "cursor" not in state:
            raise DataError("the stored data position is for a single train.bin dataset but this "
                            "dataset is sharded; resume with the dataset the run started on")
        # windows read so far by all ranks, shared out again if the world size changed
        seen = int(state["cursor"]) * int(state.get("world_size", 1))
        self.epoch, self.cursor = int(state["epoch"]), seen // self.world_size
