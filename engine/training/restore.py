"""Putting a resumed run back as it was saved (resume.capture's train_state.pt): the optimizer
and scaler, the counters, the data position, the next batch, every generator; and each rank's
own dropout stream in a job of several processes. Loaded to resume, or with several processes.

    counters, next_batch, notes = restore(source, cfg, dist, model, optimizer, scaler, batches,
                                          device)
"""
from __future__ import annotations

import random

import numpy as np
import torch

from config import Config
from engine import loading
from engine.checkpoint import CheckpointError
from engine.fields import facts
from engine.training.processes import Dist
from engine.training.resume import STATE_FORMAT, Counters


def restore(source, cfg: Config, dist: Dist, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, batches,
            device: torch.device) -> tuple[Counters, tuple | None, list[str]]:
    """With init_from=resume, `source`'s state put into this freshly built run: (counters, next
    batch or None, notes). Call it after speedups.apply (which draws random numbers)."""
    if cfg.train.init_from != "resume":
        return Counters(), None, restore_rank_rng(dist, None, cfg.system.seed, 0)
    state = loading.load_train_state(source)
    if state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{source} has train state format {state.get('format')!r}, this "
                              f"code reads format {STATE_FORMAT}; start a new run from its "
                              f"weights with --init_from={source} instead of resuming")
    try:
        if "optimizer" in state:
            dist.load_optimizer_state(model, optimizer, state["optimizer"])
        else:  # a sharded checkpoint: each rank reads its own shards of it
            from engine.sharded import load_optimizer

            load_optimizer(source, model, optimizer, dist)
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
    length_changed = x.shape[1] > batches.block_size if getattr(batches, "ragged", False) \
        else x.shape[1] != batches.block_size  # instruction data: each batch its own length
    if x.shape[0] != batches.batch_size * world or length_changed:
        notes.append(f"batch shape changed from {tuple(x.shape)}: the next batch is drawn anew")
        next_batch = batches.next()
    else:
        next_batch = (x[rank::world].to(device), y[rank::world].to(device))
    notes += config_changes(loading.read_config(source), cfg,
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


def config_changes(stored: Config, cfg: Config,
                   world_sizes: tuple[int, int] = (1, 1)) -> list[str]:
    """Notes naming the train/data/system settings a resumed run changes from its checkpoint's,
    but for those whose field says they may (resume=True). world_sizes (then, now): the
    micro-batch may change if the global batch stays."""
    then, now = stored.train, cfg.train
    same_batch = then.batch_size * world_sizes[0] == now.batch_size * world_sizes[1] and \
        then.grad_accum_steps == now.grad_accum_steps
    changed = []
    for section in ("train", "data", "system"):
        old, new = getattr(stored, section), getattr(cfg, section)
        free = set(facts(type(new), "resume")) | ({"batch_size"} if same_batch else set())
        changed += [f"{section}.{key} {getattr(old, key, None)!r} -> {value!r}"
                    for key, value in vars(new).items()
                    if key not in free and getattr(old, key, None) != value]
    if not changed:
        return []
    return ["resuming with changed settings (the run will differ from an uninterrupted one): "
            + ", ".join(changed)]


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
