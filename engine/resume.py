"""What lets a long run survive interruption.

    resolve_init       init_from=auto -> resume or scratch; refuses an out_dir holding another run
    capture / restore  all a resumed run needs to continue as if it had never stopped: optimizer,
                       scaler, Counters, the loader's position and the batch already fetched,
                       every RNG (every rank's). FSDP shards are gathered onto rank 0, so a
                       checkpoint has the single-process format and any world size resumes it.
    StopRequest        SIGINT/SIGTERM (or a step budget): save and exit at the next step boundary
    NonFiniteGuard     a NaN/inf loss or gradient norm skips the update; `limit` in a row stop
"""
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

from config import Config, ConfigError, TrainConfig
from engine import checkpoint
from engine.checkpoint import CheckpointError
from engine.distributed import SIGNALS, Dist, full_tensor

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
    """Every random number generator the run may draw from, as plain tensors and numbers."""
    np_state = np.random.get_state(legacy=False)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"bit_generator": np_state["bit_generator"],
                       "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                       "pos": int(np_state["state"]["pos"]),
                       "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    if device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict, device: torch.device) -> list[str]:
    """Put every generator back where rng_state() found it; returns notes on what could not be."""
    notes = []
    random.setstate(_as_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": np_state["bit_generator"],
                         "state": {"key": np_state["key"].numpy().astype(np.uint32),
                                   "pos": np_state["pos"]},
                         "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]})
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        saved = state.get("cuda")
        if saved is not None and len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            notes.append("CUDA RNG not restored (saved on another device count or on CPU)")
    if device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])
    elif device.type == "mps":
        notes.append("MPS RNG not restored (saved on another device)")
    return notes


def _as_tuples(value):
    """random.setstate wants tuples where a loader may give lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def restore_train_state(state: dict, optimizer: torch.optim.Optimizer,
                        scaler: torch.amp.GradScaler, batches, device: torch.device,
                        source: str) -> tuple[Counters, tuple, list[str]]:
    """Load a capture() dict into a freshly built run: (counters, next batch, notes)."""
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{source} has train state format {state.get('format')!r}, this "
                              f"code reads format {STATE_FORMAT}; start a new run from its "
                              f"weights with --init_from={source} instead of resuming")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"optimizer state in {source} does not fit this model/optimizer "
                              f"({e}); resume with the config the run was started with") from None
    scaler.load_state_dict(state["scaler"])
    batches.load_state_dict(state["data"])
    notes = restore_rng_state(state["rng"], device)
    known = set(Counters.__dataclass_fields__)
    counters = Counters(**{k: v for k, v in state["counters"].items() if k in known})
    # every rank's rows are saved (rank r's are [r::world]): any world size takes its share
    x, y = state["next_batch"]["x"], state["next_batch"]["y"]
    rank, world = getattr(batches, "rank", 0), getattr(batches, "world_size", 1)
    if x.shape[0] != batches.batch_size * world or x.shape[1] != batches.block_size:
        notes.append(f"batch shape changed from {tuple(x.shape)}: the next batch is drawn anew")
        next_batch = batches.next()
    else:
        next_batch = (x[rank::world].to(device), y[rank::world].to(device))
    return counters, next_batch, notes


def resolve_init(t: TrainConfig) -> None:
    """init_from=auto becomes resume or scratch; any other start refuses an out_dir holding
    another run's checkpoints (pruning would delete them, its metrics would be overwritten)."""
    checkpoint.recover(t.out_dir)  # a save killed part-way: tidy up before looking
    latest = checkpoint.latest_checkpoint(t.out_dir)
    if t.init_from == "auto":
        t.init_from = "resume" if latest is not None else "scratch"
    if t.init_from != "resume" and latest is not None:
        raise ConfigError(f"{t.out_dir} already holds a run (latest checkpoint {latest.name}); "
                          "continue it with --init_from=resume, or start a new run in another "
                          "--out_dir (or delete that one)")


def capture(dist: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, batches, next_batch: tuple[torch.Tensor, torch.Tensor],
            counters: Counters, device: torch.device) -> dict | None:
    """train_state.pt's contents on rank 0, None elsewhere (every rank calls it: they gather).
    next_batch, already fetched (the loader is past it), is stored with every rank's rows."""
    (x, y), rank_rng = next_batch, None
    if dist.enabled:  # rank r's rows are global[r::W]: (B, W, T) -> (W*B, T)
        x, y = (torch.stack(dist.all_gather(t), dim=1).flatten(0, 1) for t in next_batch)
        rngs = {"torch": torch.get_rng_state()}  # each rank's dropout stream
        if device.type == "cuda":
            rngs["cuda"] = torch.cuda.get_rng_state(device)
        rank_rng = {key: torch.stack(dist.all_gather(rng)) for key, rng in rngs.items()}
    optimizer_state = full_state(dist, model, optimizer).state_dict()
    if not dist.is_main:
        return None
    state = {"format": STATE_FORMAT, "optimizer": optimizer_state,
             "scaler": scaler.state_dict(), "data": batches.state_dict(),
             "next_batch": {"x": x.detach().cpu(), "y": y.detach().cpu()},
             "rng": rng_state(device), "counters": asdict(counters),
             "world_size": dist.world_size}
    return state if rank_rng is None else {**state, "rank_rng": rank_rng}


def restore(source, cfg: Config, dist: Dist, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, batches,
            device: torch.device) -> tuple[Counters, tuple | None, list[str]]:
    """With init_from=resume, `source`'s state put back into this freshly built run:
    (counters, next batch or None, notes). Call it after techniques.apply (it draws from the
    RNG) and before the first step."""
    state, counters, next_batch, notes = None, Counters(), None, []
    if cfg.train.init_from == "resume":
        state = checkpoint.load_train_state(source)
        counters, next_batch, notes = restore_train_state(
            state, full_state(dist, model, optimizer), scaler, batches, device, str(source))
        notes += config_changes(checkpoint.read_config(source), cfg,
                                (state.get("world_size", 1), dist.world_size))
    return counters, next_batch, notes + restore_rank_rng(dist, state, cfg.system.seed,
                                                          counters.step)


def restore_rank_rng(dist: Dist, state: dict | None, seed: int, step: int) -> list[str]:
    """Ranks > 0 get their own dropout stream: the saved one at the same world size, else one
    derived from (seed, rank, step)."""
    if not dist.enabled:
        return []
    saved = (state or {}).get("rank_rng")
    if saved is not None and saved["torch"].shape[0] == dist.world_size:
        if not dist.is_main:
            torch.set_rng_state(saved["torch"][dist.rank])
            if "cuda" in saved and torch.device(dist.device).type == "cuda":
                torch.cuda.set_rng_state(saved["cuda"][dist.rank], dist.device)
        return []
    if not dist.is_main:
        torch.manual_seed(int(np.random.SeedSequence([seed, dist.rank, step])
                              .generate_state(1)[0]))
    if state is None:
        return []
    return [f"resuming on {dist.world_size} processes, saved on {state.get('world_size', 1)}: "
            "ranks > 0 draw new dropout masks (the same run when dropout is 0)"]


def full_state(dist: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """The optimizer as saved and loaded: under FSDP a full-state view, else itself."""
    return FullStateOptimizer(model, optimizer) if dist.parallel == "fsdp" else optimizer


def full_weights(dist: Dist, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full weights on rank 0 (gathered from the shards under FSDP); None elsewhere."""
    if dist.parallel != "fsdp":
        return checkpoint.model_state(model) if dist.is_main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if not dist.is_main:
        return None
    return {k: v.contiguous() for k, v in full.items() if k != checkpoint.TIED}


class FullStateOptimizer:
    """An FSDP-sharded optimizer seen as a single process's (torch.optim's format, parameters
    numbered in param_groups order): state_dict gathers onto rank 0, load_state_dict shards.
    Both are collectives."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        from torch.distributed.fsdp import FSDPModule

        self.model, self.optimizer = model, optimizer
        for module in model.modules():  # the root stays gathered after a forward (eval)
            if isinstance(module, FSDPModule):
                module.reshard()
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        full = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if not full:  # ranks > 0
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[n]: s for n, s in full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                 for g in full["param_groups"]]}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        groups = state["param_groups"]
        count = sum(len(g["params"]) for g in groups)
        if count != len(self.names) or len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved state has {count} parameters in {len(groups)} groups, "
                             f"this optimizer {len(self.names)} in "
                             f"{len(self.optimizer.param_groups)}")
        by_name = {"state": {self.names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                    for g in groups]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))


# settings that may change on resume without the run differing from an uninterrupted one
FREE_ON_RESUME = {"train.init_from", "train.stop_after_iters", "train.max_iters",
                  "train.eval_interval", "train.log_interval", "train.keep_checkpoints",
                  "train.save_checkpoints", "train.max_nonfinite_steps", "train.out_dir",
                  "system.parallel", "system.dist_timeout", "system.fsdp_reshard"}


def config_changes(stored: Config, cfg: Config,
                   world_sizes: tuple[int, int] = (1, 1)) -> list[str]:
    """Notes naming the train/data/system settings a resumed run changes from its checkpoint's.
    world_sizes (then, now): the micro-batch may change if the global batch stays."""
    free = set(FREE_ON_RESUME)
    then, now = stored.train, cfg.train
    if then.batch_size * world_sizes[0] == now.batch_size * world_sizes[1] and \
            then.grad_accum_steps == now.grad_accum_steps:
        free.add("train.batch_size")
    changed = []
    for section in ("train", "data", "system"):
        old, new = getattr(stored, section), getattr(cfg, section)
        for key in vars(new):
            name = f"{section}.{key}"
            if name not in free and getattr(old, key, None) != getattr(new, key):
                changed.append(f"{name} {getattr(old, key, None)!r} -> {getattr(new, key)!r}")
    if not changed:
        return []
    return ["resuming with changed settings (the run will differ from an uninterrupted one): "
            + ", ".join(changed)]


def weights_finite(model: torch.nn.Module, dist: Dist | None = None) -> bool:
    """No NaN/inf in any parameter, on any rank (each checks its own shard under FSDP)."""
    finite = bool(torch.stack([torch.isfinite(full_tensor(p, local=True)).all()
                               for p in model.parameters()]).all())
    return dist.all_true(finite) if dist is not None else finite


class StopRequest:
    """Why the loop should stop early. As a context manager SIGINT/SIGTERM (a preemption notice)
    request a save and exit at the next step boundary; a second one stops at once. synced: a
    signal reaches ranks at different moments, so it stays pending until Dist.sync_step
    commits it on every rank at the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

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
        if self.signum is not None:
            self._restore()
            print(f"\n{name} again: stopping now without saving", file=sys.stderr, flush=True)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self.request(name)
        print(f"\n{name} received: saving a checkpoint after this step, then exiting "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        # handlers can only be installed from the main thread; elsewhere signals act as usual
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()


class NonFiniteGuard:
    """Counts steps whose loss or gradient norm is not finite (check() syncs the device)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        good = bool(torch.isfinite(torch.stack([loss.float(), grad_norm.float()])).all())
        self.in_a_row = 0 if good else self.in_a_row + 1
        return good

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit
