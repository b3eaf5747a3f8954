"""Batches of a sharded dataset (data/shards.py): every token an input once per epoch, in an order
recomputed from (seed, epoch), so a checkpoint stores only (epoch, cursor). Training reads a
dataset whose meta.json lists shards with this loader (engine/training/build.py).
"""
from __future__ import annotations

import numpy as np

from data.dataset import DataError
from data.loader import Batches


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

    def draw(self, rows: int | None = None) -> np.ndarray:
        B = self.batch_size if rows is None else rows
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
            raise DataError("the stored data position is a train.bin's, a mixture's or "
                            "--doc_aligned's, not windows of shards; resume as the run began")
        # windows read so far by all ranks, shared out again if the world size changed
        seen = int(state["cursor"]) * int(state.get("world_size", 1))
        self.epoch, self.cursor = int(state["epoch"]), seen // self.world_size
