"""Sharded checkpoints (train.checkpoint_format=sharded; auto picks it under parallel=fsdp): each
process writes its own part of the weights and optimizer state with torch.distributed.checkpoint
(DCP), nothing passes through one process, and any number of processes reads them back (DCP
reshards on load). train.checkpoint_async writes them in the background while training goes on.

    ckpt_0001000/shards/         DCP's .metadata and one __RANK_0.distcp per process:
                                 "model.NAME" (the tied head once) and "optim.state.NAME.KEY"
    ckpt_0001000/train_state.pt  the rest of what a resume needs (rank 0 writes it; small)
    ckpt_0001000/meta.json, config.json, mask.safetensors: as in a full checkpoint

A save is staged in a hidden out_dir/.tmp_ckpt_shards_STEP and renamed into place by rank 0 only
after every process's files and DCP's .metadata are on disk (fsynced): a crash during a save
never leaves a checkpoint that loads as complete. Readers: read_weights (generate.py, serve.py,
the HF export, init_from: the full weights in one process), load_optimizer (a resume: each
rank its own shards of the state).
"""
from __future__ import annotations

import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import config as config_mod
from config import ConfigError
from engine import checkpoint, saving
from engine.checkpoint import SHARDS, TIED, CheckpointError
from engine.device import format_bytes
from model import GPT

if TYPE_CHECKING:
    from engine.training.processes import Dist

STAGING = ".tmp_ckpt_shards_"  # + the step; recover() clears a killed save's
# one process reading or writing shards is what no_dist=True asks for, not a mistake to warn of
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent")


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDS / ".metadata").is_file()


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every weight of a sharded checkpoint, whole, read by this process alone."""
    return {name.removeprefix("model."): t for name, t in read_tensors(ckpt, "model.").items()}


def read_tensors(ckpt: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor stored under a name starting with prefix, whole, by DCP's flat names
    ("model.transformer.wte.weight", "optim.state.transformer.wte.weight.exp_avg", ...)."""
    reader = dcp.FileSystemReader(str(ckpt / SHARDS))
    try:
        stored = reader.read_metadata().state_dict_metadata
        tensors = {name: torch.empty(m.size, dtype=m.properties.dtype)
                   for name, m in stored.items()
                   if name.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
        dcp.load(tensors, storage_reader=reader, no_dist=True,
                 planner=DefaultLoadPlanner(flatten_state_dict=False))
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"{ckpt}/{SHARDS} is unreadable ({failure(e)}); the checkpoint is "
                              "incomplete or corrupt") from None
    return tensors


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optim": ...} as DCP saves and loads them: keyed by parameter name,
    DTensors (this rank's shards) under FSDP, the tied head once."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # the root stays gathered after a forward (eval)
        if isinstance(module, FSDPModule):
            module.reshard()
    weights = get_model_state_dict(model)
    if model.lm_head.weight is model.transformer.wte.weight:
        weights.pop(TIED, None)
    return {"model": weights, "optim": get_optimizer_state_dict(model, optimizer)}


def load_optimizer(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   dist: Dist) -> None:
    """A sharded checkpoint's optimizer state into this run's optimizer, each rank reading its
    own shards whatever the number of processes that saved it (a collective)."""
    state = {"optim": state_dicts(model, optimizer)["optim"]}
    try:
        dcp.load(state, checkpoint_id=str(ckpt / SHARDS), no_dist=not dist.enabled)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"optimizer state in {ckpt}/{SHARDS} does not fit this model and "
                              f"optimizer ({failure(e)}); resume with the config the run was "
                              "started with") from None
    set_optimizer_state_dict(model, optimizer, state["optim"])


def failure(e: BaseException) -> str:
    """The first line of the error behind a DCP failure (it wraps each rank's)."""
    for inner in getattr(e, "failures", {}).values():  # rank -> (exception, traceback)
        return checkpoint.first_line(inner[0] if isinstance(inner, tuple) else inner)
    return checkpoint.first_line(e)


@dataclass
class Pending:
    """A save under way: DCP's future, and what rank 0 adds once the shards are on disk."""

    step: int
    tmp: Path
    future: Future
    train_state: dict | None
    meta: dict
    cfg: config_mod.Config
    masks: dict | None  # a pruned model's
    published: bool = False
    error: str = ""  # rank 0's, publishing in poll(): raised at wait(), where every rank is


class ShardedWriter:
    """train.py's checkpoints as shards. save() returns once this rank's state is copied (in the
    background) or written; poll() publishes a finished background save on rank 0; wait(), at
    the next save and at the end, lets every rank see it finish (or its error)."""

    @classmethod
    def for_run(cls, cfg: config_mod.Config, dist: Dist, sharded: bool) -> "ShardedWriter":
        """train.checkpoint_format and checkpoint_async checked; sharded: the format resolved
        (auto shards under FSDP with several processes)."""
        t = cfg.train
        if not sharded:
            raise ConfigError("--checkpoint_async=true writes sharded checkpoints in the "
                              "background: add --checkpoint_format=sharded (auto shards only "
                              "under --parallel=fsdp with several processes)")
        refused = "--checkpoint_format=sharded saves the model's parameters and their optimizer "
        if cfg.lora.rank:
            raise ConfigError(refused + "state; a LoRA run saves its adapters: use "
                              "--checkpoint_format=full")
        if cfg.system.weights_dtype == "bfloat16":
            raise ConfigError(refused + "state; with --weights_dtype=bfloat16 the optimizer holds "
                              "float32 copies: use --checkpoint_format=full")
        return cls(dist, t.out_dir, t.keep_checkpoints, t.checkpoint_async)

    def __init__(self, dist: Dist, out_dir: str, keep: int, background: bool) -> None:
        self.dist, self.out, self.keep = dist, Path(out_dir), keep
        self.background = background
        self.pending: Pending | None = None
        self.group = None  # background saves talk over their own gloo group, beside training's
        if background and dist.enabled:
            import torch.distributed as torch_dist

            self.group = torch_dist.new_group(backend="gloo")

    def save(self, step: int, model: GPT, optimizer: torch.optim.Optimizer,
             cfg: config_mod.Config, meta: dict, train_state: dict | None) -> None:
        """Every rank calls it; train_state and meta matter on rank 0 only."""
        self.wait()
        state, tmp = state_dicts(model, optimizer), self.out / f"{STAGING}{step:07d}"
        problem = None
        if self.dist.is_main:  # tidy, then make room: before any rank writes
            saving.recover(self.out)
            problem = self.room_error(saving.bytes_to_write(state, train_state))
            if problem is None:
                tmp.mkdir(parents=True, exist_ok=True)
        if not self.dist.all_true(not self.dist.is_main or problem is None):
            raise problem if self.dist.is_main else CheckpointError(
                "rank 0 could not start the checkpoint save (its error says why)")
        meta = {**meta, "shards": {"world_size": self.dist.world_size,
                                   "parallel": self.dist.parallel}}
        where = {"checkpoint_id": str(tmp / SHARDS), "no_dist": not self.dist.enabled}
        if self.background:
            future = dcp.async_save(state, process_group=self.group, **where)
        else:
            future = Future()
            try:
                future.set_result(dcp.save(state, **where))
            except (Exception, dcp.api.CheckpointException) as e:
                future.set_exception(e)
        self.pending = Pending(step, tmp, future, train_state, meta, cfg,
                               getattr(model, checkpoint.MASKS, None))
        if not self.background:
            self.wait()

    def room_error(self, needed: int) -> CheckpointError | None:
        """Not enough free space for the whole checkpoint (every rank's shards), said up front."""
        try:
            usage = shutil.disk_usage(self.out)
        except OSError:
            return None
        if usage.total == 0 or usage.free >= needed:  # 0: unknown (network mounts)
            return None
        def text(n: int) -> str:
            return f"{n:,} bytes" + (f" ({format_bytes(n)})" if n >= 2**20 else "")
        return saving.DiskFullError(
            f"cannot write a sharded checkpoint in {self.out}: it needs about {text(needed)} "
            f"and {text(usage.free)} are free there; free some space, or pass "
            f"--out_dir=<a directory on a disk with room>{self.note()}")

    def note(self) -> str:
        latest = checkpoint.latest_checkpoint(self.out)
        return f"; the last complete checkpoint, {latest}, is intact" if latest else ""

    def poll(self) -> None:
        """Rank 0 publishes a background save that has finished (DCP's future completes on rank
        0 after every rank's files and the metadata are written)."""
        p = self.pending
        if p and self.dist.is_main and not p.published and not p.error and p.future.done() \
                and p.future.exception() is None:
            try:
                self.publish(p)
            except OSError as e:
                shutil.rmtree(p.tmp, ignore_errors=True)
                p.error = saving.disk_full_cause(e) or checkpoint.first_line(e)

    def wait(self) -> None:
        """Block until the save under way is on disk, published; a failed one raises."""
        p, self.pending = self.pending, None
        if p is None:
            return
        try:
            p.future.result()
            if p.error:
                raise OSError(p.error)
        except (Exception, dcp.api.CheckpointException) as e:
            if self.dist.is_main:
                shutil.rmtree(p.tmp, ignore_errors=True)
            why = failure(e)
            if cause := saving.disk_full_cause(Exception(why)):
                why = f"{cause}; free some space, or pass --out_dir=<a directory with room>"
            raise CheckpointError(f"saving the sharded checkpoint of step {p.step} failed "
                                  f"({why}){self.note()}") from None
        if self.dist.is_main and not p.published:
            self.publish(p)

    def publish(self, p: Pending) -> None:
        """The shards are complete: add the rest, rename into place, drop the oldest."""
        saving.write_rest(p.tmp, p.step, p.masks, p.cfg, p.meta, p.train_state)
        saving.publish(p.tmp, self.out / f"ckpt_{p.step:07d}", self.keep)
        fd = os.open(self.out, os.O_RDONLY)  # the rename made durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        p.published = True
