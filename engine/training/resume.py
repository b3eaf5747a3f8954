"""Surviving interruption: capture() takes what a checkpoint must hold to put a run back exactly
(optimizer, scaler, counters, data position, every rank's RNG; FSDP state saved as one
process's, so any world size resumes), and restore.py puts it back; StopRequest saves and exits
on SIGINT/SIGTERM; resolve_init decides whether a run starts fresh or resumes."""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from config import ConfigError
from engine import checkpoint, saving
from engine.training.processes import SIGNALS, Dist

STATE_FORMAT = 2  # bump when the layout of train_state.pt changes


@dataclass
class Counters:
    """The training loop's own state, saved with every checkpoint."""

    step: int = 0  # optimizer steps done; also the position in the learning-rate schedule
    best_val: float = math.inf
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall-clock spent in this run, summed over every resume
    eval_step: int = -1  # step of the latest evaluation
    losses: dict = field(default_factory=dict)  # the latest evaluation's losses
    skipped_steps: int = 0  # non-finite steps skipped, in total
    wandb_id: str = ""  # the Weights & Biases run to continue, when logging there

    def record_eval(self, step: int, losses: dict[str, float]) -> None:
        self.losses, self.eval_step = losses, step
        if math.isfinite(losses["val"]):
            self.best_val = min(self.best_val, losses["val"])


def rng_state(device: torch.device) -> dict:
    """Every random number generator the run may draw from, as a weights_only load accepts it."""
    bit_generator, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"bit_generator": bit_generator,
                       "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    if device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def resolve_init(init_from: str, out_dir: str) -> str:
    """init_from with auto made resume or scratch; any other start refuses an out_dir holding
    another run's checkpoints (pruning would delete them, its metrics would be overwritten)."""
    saving.recover(out_dir)  # a save killed part-way: tidy up before looking
    latest = checkpoint.latest_checkpoint(out_dir)
    if init_from == "auto":
        init_from = "resume" if latest is not None else "scratch"
    if init_from != "resume" and latest is not None:
        raise ConfigError(f"{out_dir} already holds a run (latest checkpoint {latest.name}); "
                          "continue it with --init_from=resume, or start a new run in another "
                          "--out_dir (or delete that one)")
    return init_from


def capture(dist: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, batches, next_batch: tuple[torch.Tensor, torch.Tensor],
            counters: Counters, device: torch.device, optimizer_too: bool = True) -> dict | None:
    """train_state.pt's contents on rank 0, None elsewhere (every rank calls it: they gather).
    next_batch, already fetched (the loader is past it), is stored with every rank's rows;
    optimizer_too=False leaves the optimizer to a sharded checkpoint's shards."""
    (x, y), rank_rng = next_batch, None
    if dist.enabled:  # rank r's rows are global[r::W]: (B, W, T) -> (W*B, T)
        x, y = (torch.stack(dist.all_gather(t), dim=1).flatten(0, 1) for t in next_batch)
        rngs = {"torch": torch.get_rng_state()}  # each rank's dropout stream
        if device.type == "cuda":
            rngs["cuda"] = torch.cuda.get_rng_state(device)
        rank_rng = {key: torch.stack(dist.all_gather(rng)) for key, rng in rngs.items()}
    optimizer_state = {"optimizer": dist.optimizer_state(model, optimizer)} if optimizer_too \
        else {}
    if not dist.is_main:
        return None
    state = {"format": STATE_FORMAT, **optimizer_state,
             "scaler": scaler.state_dict(), "data": batches.state_dict(),
             "next_batch": {"x": x.detach().cpu(), "y": y.detach().cpu()},
             "rng": rng_state(device), "counters": asdict(counters),
             "world_size": dist.world_size}
    return state if rank_rng is None else {**state, "rank_rng": rank_rng}


def weights_finite(model: torch.nn.Module, dist: Dist | None = None) -> bool:
    """No NaN/inf in any parameter, on any rank (each checks its own shard under FSDP)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all())
    return dist.all_true(finite) if dist is not None else finite


class StopRequest:
    """Why the loop should stop early. In a `with`, SIGINT/SIGTERM (a preemption notice) ask for a
    save and exit at the next step boundary; a second one stops at once. synced: a signal reaches
    ranks at different moments, so it stays pending until Dist.sync_step commits it everywhere."""

    def __init__(self, synced: bool = False) -> None:
        self.synced = synced
        self.reason: str | None = None
        self.pending: str | None = None  # a signal not yet shared (synced only)
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def request(self, reason: str) -> None:
        if self.synced and reason in SIGNALS:
            self.pending = self.pending or reason
        else:  # stop_after_iters, nonfinite: every rank reaches these at the same step
            self.commit(reason)

    def commit(self, reason: str) -> None:
        self.reason = self.reason or reason

    def __bool__(self) -> bool:
        return self.reason is not None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self.request(name)
            print(f"\n{name} received: saving a checkpoint after this step, then exiting "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)
            return
        self.__exit__()  # the second one: the previous handlers act on it
        print(f"\n{name} again: stopping now without saving", file=sys.stderr, flush=True)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)

    def __enter__(self) -> "StopRequest":
        # handlers can only be installed from the main thread; elsewhere signals act as usual
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
