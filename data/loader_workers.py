"""data.loader_workers: processes read batches into a shared-memory ring ahead of the trainer,
which still draws the window starts (so batches and data position are the in-process loader's).
"""
from __future__ import annotations

import collections
import copy
import multiprocessing as mp
import weakref
from multiprocessing import shared_memory

import numpy as np

from data.dataset import DataError, Tokens
from data.loader import Batches

WAIT_S = 1.0  # how often a waiting trainer checks that the workers are alive


def _work(meta: dict, split: str, block_size: int, shm_name: str, shape: tuple,
          tasks: mp.Queue, ready: list) -> None:
    """Worker loop: (slot, starts) in, rows written into the slot, then its event set."""
    shm = shared_memory.SharedMemory(name=shm_name)
    ring = np.ndarray(shape, dtype=np.int64, buffer=shm.buf)  # (slots, B, T+1)
    reader = Tokens(meta, split, block_size)
    try:
        while (task := tasks.get()) is not None:
            slot, starts = task
            ring[slot] = reader.rows(starts)
            ready[slot].set()
    finally:
        del ring
        shm.close()


def _shutdown(procs: list, tasks: mp.Queue, shm: shared_memory.SharedMemory) -> None:
    for _ in procs:
        tasks.put(None)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    shm.close()
    shm.unlink()


class SharedMemoryBatches:
    """The loader `batches`, with `workers` processes reading `depth` batches ahead of next()."""

    def __init__(self, batches: Batches, meta: dict, split: str, workers: int):
        self.batches, self.depth = batches, 2 * workers
        shape = (self.depth, batches.batch_size, batches.block_size + 1)
        self.shm = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 8)
        self.ring = np.ndarray(shape, dtype=np.int64, buffer=self.shm.buf)
        ctx = mp.get_context("spawn")  # no fork of a process holding torch's threads
        self.tasks, self.ready = ctx.Queue(), [ctx.Event() for _ in range(self.depth)]
        self.procs = [ctx.Process(target=_work, daemon=True,
                                  args=(meta, split, batches.block_size, self.shm.name, shape,
                                        self.tasks, self.ready)) for _ in range(workers)]
        for p in self.procs:
            p.start()
        self._close = weakref.finalize(self, _shutdown, self.procs, self.tasks, self.shm)
        self.pending: collections.deque = collections.deque()  # (slot, loader state before it)
        for slot in range(self.depth):
            self._request(slot)

    def __getattr__(self, name: str):  # windows, fixed, prefetch_note, ...: the loader's own
        return getattr(self.__dict__["batches"], name)

    def _request(self, slot: int) -> None:
        state = copy.deepcopy(self.batches.state_dict())
        self.ready[slot].clear()
        self.tasks.put((slot, self.batches.draw()))
        self.pending.append((slot, state))

    def _wait(self, slot: int) -> None:
        while not self.ready[slot].wait(WAIT_S):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead:
                raise DataError(f"a data loader worker died (exit code {dead[0]}); run "
                                "with --loader_workers=0 to see the error in-process")

    def next(self):
        slot, _ = self.pending[0]
        self._wait(slot)
        self.pending.popleft()
        rows = self.ring[slot].copy()  # the trainer's own copy: the slot is refilled now
        self._request(slot)
        return self.batches.to_tensors(rows)

    def state_dict(self) -> dict:
        """The position before the oldest batch not handed out yet, as in-process."""
        return self.pending[0][1]

    def load_state_dict(self, state: dict) -> None:
        for slot, _ in self.pending:  # let the workers finish what they were given
            self._wait(slot)
        self.pending.clear()
        self.batches.load_state_dict(state)
        for slot in range(self.depth):
            self._request(slot)

    def close(self) -> None:
        self._close()
