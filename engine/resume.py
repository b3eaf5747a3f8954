"""Surviving interruption: capture/restore put a run back exactly (optimizer, scaler, counters,
data position, every rank's RNG; FSDP state is saved as one process's, so any world size resumes);
StopRequest saves and exits on SIGINT/SIGTERM."""
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

from config import Config, ConfigError
from engine import checkpoint, pruning
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


def restore_rng_state(state: dict, device: torch.device) -> list[str]:
    """Put every generator back where rng_state() found it; returns notes on what could not be."""
    random.setstate(state["python"])
    s = state["numpy"]
    np.random.set_state((s["bit_generator"], np.asarray(s["key"], dtype=np.uint32), s["pos"],
                         s["has_gauss"], s["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and len(state.get("cuda", ())) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])
    elif device.type in ("cuda", "mps"):  # saved on CPU, another device or device count
        return [f"{device.type.upper()} RNG not restored (saved on another device or count)"]
    return []


def resolve_init(init_from: str, out_dir: str) -> str:
    """init_from with auto made resume or scratch; any other start refuses an out_dir holding
    another run's checkpoints (pruning would delete them, its metrics would be overwritten)."""
    checkpoint.recover(out_dir)  # a save killed part-way: tidy up before looking
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
    optimizer_state = optimizer_state_dict(dist, model, optimizer)
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
    """With init_from=resume, `source`'s state put into this freshly built run: (counters, next
    batch or None, notes). Call it after techniques.apply (which draws random numbers). A pruned
    source's masks are held from here on (pruning.hold_zeros)."""
    held = pruning.hold_zeros(model, optimizer)
    if cfg.train.init_from != "resume":
        return Counters(), None, held + restore_rank_rng(dist, None, cfg.system.seed, 0)
    state = checkpoint.load_train_state(source)
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{source} has train state format {state.get('format')!r}, this "
                              f"code reads format {STATE_FORMAT}; start a new run from its "
                              f"weights with --init_from={source} instead of resuming")
    try:
        load_optimizer_state_dict(dist, model, optimizer, state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"optimizer state in {source} does not fit this model/optimizer "
                              f"({e}); resume with the config the run was started with") from None
    scaler.load_state_dict(state["scaler"])
    batches.load_state_dict(state["data"])
    notes = restore_rng_state(state["rng"], device)
    counters = Counters(**{k: v for k, v in state["counters"].items()
                           if k in Counters.__dataclass_fields__})
    # every rank's rows are saved (rank r's are [r::world]): any world size takes its share
    x, y = state["next_batch"]["x"], state["next_batch"]["y"]
    rank, world = batches.rank, batches.world_size
    if x.shape[0] != batches.batch_size * world or x.shape[1] != batches.block_size:
        notes.append(f"batch shape changed from {tuple(x.shape)}: the next batch is drawn anew")
        next_batch = batches.next()
    else:
        next_batch = (x[rank::world].to(device), y[rank::world].to(device))
    notes += config_changes(checkpoint.read_config(source), cfg,
                            (state.get("world_size", 1), dist.world_size))
    return counters, next_batch, held + notes + restore_rank_rng(dist, state, cfg.system.seed,
                                                                 counters.step)


def restore_rank_rng(dist: Dist, state: dict | None, seed: int, step: int) -> list[str]:
    """Ranks > 0 get their own dropout stream: the saved one at the same world size, else one
    derived from (seed, rank, step)."""
    if not dist.enabled:
        return []
    saved = (state or {}).get("rank_rng")
    if saved is not None and saved["torch"].shape[0] == dist.world_size:
        if not dist.is_main:
            torch.set_rng_state(saved["torch"][dist.rank].clone())  # a row of a stack: copy it
            if "cuda" in saved and torch.device(dist.device).type == "cuda":
                torch.cuda.set_rng_state(saved["cuda"][dist.rank].clone(), dist.device)
        return []
    if not dist.is_main:
        torch.manual_seed(int(np.random.SeedSequence([seed, dist.rank, step])
                              .generate_state(1)[0]))
    return [] if state is None else [
        f"resuming on {dist.world_size} processes, saved on {state.get('world_size', 1)}: "
        "ranks > 0 draw new dropout masks (the same run when dropout is 0)"]


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


def _fsdp_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in param_groups order: how torch.optim's format numbers them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # the root stays gathered after a forward (eval)
        if isinstance(module, FSDPModule):
            module.reshard()
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_state_dict(dist: Dist, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict(); under FSDP gathered onto rank 0 in the same single-process
    format ({} elsewhere; a collective)."""
    if dist.parallel != "fsdp":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)

    index = {name: i for i, name in enumerate(_fsdp_names(model, optimizer))}
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not full:  # ranks > 0
        return {}
    return {"state": {index[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in full["param_groups"]]}


def load_optimizer_state_dict(dist: Dist, model: torch.nn.Module,
                              optimizer: torch.optim.Optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state); under FSDP each rank takes its shards (a collective)."""
    if dist.parallel != "fsdp":
        return optimizer.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_optimizer_state_dict)

    names, groups = _fsdp_names(model, optimizer), state["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if count != len(names) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved state has {count} parameters in {len(groups)} groups, "
                         f"this optimizer {len(names)} in {len(optimizer.param_groups)}")
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))


# settings that may change on resume without the run differing from an uninterrupted one
FREE_ON_RESUME = {"train.init_from", "train.stop_after_iters", "train.max_iters",
                  "train.eval_interval", "train.eval_at_start", "train.log_interval",
                  "train.loss_curve", "train.keep_checkpoints",
                  "train.save_checkpoints", "train.max_nonfinite_steps", "train.out_dir",
                  "system.parallel", "system.dist_timeout", "system.fsdp_reshard"}


def config_changes(stored: Config, cfg: Config,
                   world_sizes: tuple[int, int] = (1, 1)) -> list[str]:
    """Notes naming the train/data/system settings a resumed run changes from its checkpoint's.
    world_sizes (then, now): the micro-batch may change if the global batch stays."""
    then, now = stored.train, cfg.train
    free = set(FREE_ON_RESUME)
    if then.batch_size * world_sizes[0] == now.batch_size * world_sizes[1] and \
            then.grad_accum_steps == now.grad_accum_steps:
        free.add("train.batch_size")
    changed = []
    for section in ("train", "data", "system"):
        old, new = getattr(stored, section), getattr(cfg, section)
        changed += [f"{section}.{key} {getattr(old, key, None)!r} -> {value!r}"
                    for key, value in vars(new).items()
                    if f"{section}.{key}" not in free and getattr(old, key, None) != value]
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
