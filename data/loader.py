"""The batch loader: seeded random (B, T) input/target windows of a split, with a position a
checkpoint stores. data.pin_memory and data.prefetch act in to_tensors.

    batches = Batches(meta, "train", batch_size, block_size, seed, device)  # a sharded dataset:
    # data/shard_batches.py's ShardBatches, the same interface
    x, y = batches.next()                      # (B, T) int64 each, on the device
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.dataset import DataError, Tokens, check_vocab, load_meta  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import torch  # imported where batches become tensors: the preparation workers never need it


class Batches:
    """Windows at uniformly random offsets of a single-file split, reproducible from the seed."""

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False):
        if "shards" in meta and type(self) is Batches:
            raise DataError(f"{meta['dir']} is sharded: read it with ShardBatches "
                            "(data/shard_batches.py)")
        self.tokens = Tokens(meta, split, block_size)
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.setup_device(device, pin_memory, prefetch)
        self.rng = np.random.default_rng(seed)  # one stream for every rank: see _starts()

    def setup_device(self, device: torch.device | str, pin_memory: bool, prefetch: bool) -> None:
        import torch

        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pin_memory = (pin_memory or prefetch) and on_cuda
        # data.prefetch: copies on their own stream overlap the kernels queued on the compute one
        self.copy_stream = torch.cuda.Stream(self.device) if prefetch and on_cuda else None
        self.prefetch_note = ("on (side CUDA stream)" if self.copy_stream is not None else
                              "off (needs CUDA: plain copy)" if prefetch else "off")

    def to_tensors(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T+1) token rows -> inputs and targets (B, T) on the device."""
        xy = self.to_device(rows)
        return xy[:, :-1], xy[:, 1:]

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the device: pinned, and on the side stream, if asked."""
        import torch

        xy = torch.from_numpy(array)
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
        return xy

    def windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_tensors(self.tokens.rows(starts))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.draw())

    def _starts(self, rng: np.random.Generator, rows: int | None = None) -> np.ndarray:
        # every rank draws the whole global micro-batch and keeps every world_size-th window:
        # one process with world_size times the batch reads the windows all of them do
        high = int(self.tokens.lengths[0]) - self.block_size
        rows = self.batch_size * self.world_size if rows is None else rows
        return rng.integers(0, high, size=rows)[self.rank::self.world_size]

    def draw(self, rows: int | None = None) -> np.ndarray:
        """The next batch's window starts (advances the position); `rows` of them instead of a
        batch's for a mixture (data/mixture.py)."""
        return self._starts(self.rng, rows)

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """Window starts of n_batches batches from their own seed: the same text every call."""
        rng = np.random.default_rng(seed)
        return [self._starts(rng) for _ in range(n_batches)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if "rng" not in state:
            raise DataError("the stored data position is a sharded dataset's, a mixture's or "
                            "--doc_aligned's, not windows of a train.bin; resume as the run began")
        self.rng.bit_generator.state = state["rng"]

