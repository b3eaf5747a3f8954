"""The batch loader: seeded random (B, T) input/target windows of a split, with a position a
checkpoint stores. data.pin_memory and data.prefetch act in to_tensors.

    batches = open_batches(meta, "train", batch_size, block_size, seed, device)
    x, y = batches.next()                      # (B, T) int64 each, on the device
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.dataset import (DataError, Tokens, check_vocab, load_meta,  # noqa: F401 (re-exported)
                          write_dataset)

if TYPE_CHECKING:
    import torch  # imported where batches become tensors: the preparation workers never need it


class Batches:
    """Windows at uniformly random offsets of a single-file split, reproducible from the seed."""

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False):
        import torch

        if "shards" in meta and type(self) is Batches:
            raise DataError(f"{meta['dir']} is sharded: read it with open_batches(meta, ...), "
                            "which picks ShardBatches")
        self.tokens = Tokens(meta, split, block_size)
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pin_memory = (pin_memory or prefetch) and on_cuda
        # data.prefetch: copies on their own stream overlap the kernels queued on the compute one
        self.copy_stream = torch.cuda.Stream(self.device) if prefetch and on_cuda else None
        self.prefetch_note = ("on (side CUDA stream)" if self.copy_stream is not None else
                              "off (needs CUDA: plain copy)" if prefetch else "off")
        self.rng = np.random.default_rng(seed)  # one stream for every rank: see _starts()

    def to_tensors(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T+1) token rows -> inputs and targets (B, T) on the device."""
        import torch

        xy = torch.from_numpy(rows)  # (B, T+1)
        if self.pin_memory:
            xy = xy.pin_memory()
        if self.copy_stream is None:
            xy = xy.to(self.device, non_blocking=self.pin_memory)
        else:
            with torch.cuda.stream(self.copy_stream):
                xy = xy.to(self.device, non_blocking=True)
            # later compute work waits for the copy, which overlaps the kernels already queued
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            xy.record_stream(compute)  # its memory is not reused until compute is done with it
        return xy[:, :-1], xy[:, 1:]

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_tensors(self.tokens.rows(starts))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.draw())

    def _starts(self, rng: np.random.Generator) -> np.ndarray:
        # every rank draws the whole global micro-batch and keeps every world_size-th window:
        # one process with world_size times the batch reads the windows all of them do
        high = int(self.tokens.lengths[0]) - self.block_size
        starts = rng.integers(0, high, size=self.batch_size * self.world_size)
        return starts[self.rank::self.world_size]

    def draw(self) -> np.ndarray:
        """The next batch's window starts (advances the position)."""
        return self._starts(self.rng)

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """Window starts of n_batches batches from their own seed: the same text every call."""
        rng = np.random.default_rng(seed)
        return [self._starts(rng) for _ in range(n_batches)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if "rng" not in state:
            raise DataError("the stored data position is for a sharded dataset but this dataset "
                            "is a single train.bin; resume with the dataset the run started on")
        self.rng.bit_generator.state = state["rng"]


class ShardBatches(Batches):
    """Windows of a sharded split, each token an input once per epoch: T+1 tokens at shift + k*T
    (shift per epoch), in one permutation over all shards; rank r takes every world_size-th.
    The position is (epoch, cursor); the order is recomputed from (seed, epoch)."""

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 *args, **kwargs):
        super().__init__(meta, split, batch_size, block_size, seed, *args, **kwargs)
        self.epoch, self.cursor = 0, 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, this rank's window starts)
        lengths = self.tokens.lengths
        usable = int(((lengths - 1) // block_size).sum()) // self.world_size
        if usable < batch_size:
            raise DataError(f"the {split} split of {meta['dir']} holds {int(lengths.sum()):,} "
                            f"tokens: {usable} windows of block_size+1 = {block_size + 1} per "
                            f"rank, fewer than batch_size {batch_size}; use a smaller "
                            "--batch_size or --block_size, or prepare more data")

    def _window_counts(self, shift: int) -> np.ndarray:
        return np.maximum(0, (self.tokens.lengths - 1 - shift) // self.block_size)

    def _window_starts(self, shift: int, index: np.ndarray) -> np.ndarray:
        """Global token offsets of windows (numbered across shards) cut at `shift`."""
        counts = self._window_counts(shift)
        ends = np.cumsum(counts)
        shard = np.searchsorted(ends, index, side="right")
        first = ends[shard] - counts[shard]
        return self.tokens.offsets[shard] + shift + (index - first) * self.block_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            shift = int(rng.integers(self.block_size))
            total = int(self._window_counts(shift).sum())
            mine = rng.permutation(total)[self.rank::self.world_size][:total // self.world_size]
            self._order = (epoch, self._window_starts(shift, mine))
        return self._order[1]

    def draw(self) -> np.ndarray:
        B = self.batch_size
        if self.cursor + B > len(self._epoch_order(self.epoch)):  # less than a batch left
            self.epoch, self.cursor = self.epoch + 1, 0
        self.cursor += B
        return self._epoch_order(self.epoch)[self.cursor - B:self.cursor]

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """As Batches.fixed, without repeats while the split has enough windows."""
        rng = np.random.default_rng(seed)
        total = int(self._window_counts(0).sum())
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


def open_batches(meta: dict, split: str, *args, **kwargs) -> Batches:
    """The loader for the dataset's layout (Batches' arguments): ShardBatches for shards."""
    return (ShardBatches if "shards" in meta else Batches)(meta, split, *args, **kwargs)
