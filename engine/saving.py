"""Writing checkpoints (engine/checkpoint.py says what one holds): each staged in a hidden
directory, fsynced and renamed into place, so a crash or a full disk never leaves half a one; a
full disk, seen up front or midway, is one error naming the bytes needed and the fix.

    saving.save(out_dir, step, model, cfg, meta, train_state, keep)   # -> the checkpoint's path
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

import config as config_mod
from engine.checkpoint import (ADAPTER_FILE, CKPT_PATTERN, MASK_FILE, MASKS, CheckpointError,
                               latest_checkpoint, list_checkpoints, model_state)
from engine.device import format_bytes
from model import GPT

FULL, QUOTA = "no space left on device", "disk quota exceeded"
DISK_FULL_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: QUOTA}
# a full disk as writers that do not raise OSError report it: safetensors' Rust I/O error text,
# and torch.save's stream writer, which checks the stream and its position but not errno
TORCH_FAILED = "the write failed, most likely because the disk is full"
DISK_FULL_TEXT = {"No space left on device": FULL, "os error 28": FULL, "os error 122": QUOTA,
                  "Disk quota exceeded": QUOTA, "file write failed": TORCH_FAILED,
                  "unexpected pos": TORCH_FAILED, "iostream error": TORCH_FAILED}
BYTES_PER_TENSOR = 128  # its name, header or zip record, alignment


class DiskFullError(CheckpointError):
    """Not enough space (or quota) to write; nothing partial was left behind."""


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """`files` beside a written model.safetensors (or adapter.safetensors), which gets the mode
    open() gives (safetensors writes 0600); all fsynced, so that a rename publishes complete
    files."""
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("model.safetensors", ADAPTER_FILE):
        if (directory / name).is_file():
            os.chmod(directory / name, 0o666 & ~mask)
    for name, payload in files.items():
        (directory / name).write_bytes(payload)
    for f in directory.iterdir():
        if not f.is_file():  # a sharded checkpoint's shards/: DCP fsyncs its own files
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def check_out_dir(out_dir: str | Path, flag: str = "--out_dir") -> None:
    """Refuse, before any work, an output directory that is (or lies under) a file."""
    path = Path(out_dir).absolute()
    for p in (path, *path.parents):
        if p.is_dir():
            return
        if os.path.lexists(p):
            kind = "a file" if p.is_file() else "a broken link" if p.is_symlink() else \
                "a special file"
            problem = f"exists and is {kind}" if p == path else f"cannot be created: {p} is {kind}"
            raise CheckpointError(f"{flag.lstrip('-')} {path} {problem}, not a directory; pass "
                                  f"{flag}=<a new or existing directory>")


def bytes_to_write(*objects) -> int:
    """About how many bytes storing these takes (tensors, nested containers, str, bytes)."""
    total = 0
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size() + BYTES_PER_TENSOR
        elif isinstance(obj, (dict, list, tuple)):
            total += bytes_to_write(*(obj.values() if isinstance(obj, dict) else obj))
        elif isinstance(obj, (str, bytes)):
            total += len(obj)
    return total


def disk_full_cause(e: BaseException) -> str | None:
    """Why a write failed, when the failure is a full disk (or quota); None for anything else."""
    if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
        return DISK_FULL_ERRNOS[e.errno]
    return next((cause for marker, cause in DISK_FULL_TEXT.items() if marker in str(e)), None)


@contextmanager
def staging_dir(parent: Path, prefix: str, what: str, needed: int, flag: str,
                note: str = "") -> Iterator[Path]:
    """A new hidden parent/<prefix><random> to write `what` (~`needed` bytes) in and rename; removed
    on failure, and a full disk (up front or midway) becomes one DiskFullError."""
    try:  # None when unknown: network mounts may report a total of 0
        usage = shutil.disk_usage(parent)
        free = usage.free if usage.total > 0 else None
    except OSError:
        free = None

    def full(cause: str) -> DiskFullError:
        def text(n: int) -> str:
            return f"{n:,} bytes" + (f" ({format_bytes(n)})" if n >= 2**20 else "")
        room = f" and {text(free)} are free there" if free is not None else ""
        return DiskFullError(f"cannot write {what}: {cause}: it needs about {text(needed)}{room};"
                             f" free some space, or pass {flag}=<a directory on a disk with "
                             f"room>{note}")

    if free is not None and free < needed:
        raise full("not enough free space")
    tmp = None
    try:
        while tmp is None:  # not tempfile.mkdtemp: its 0700 would hide the files from others
            path = parent / f"{prefix}{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                path.mkdir()
                tmp = path
        yield tmp
        with contextlib.suppress(OSError):  # make the renames in parent durable
            fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if (cause := disk_full_cause(e)) is None:
            raise
        raise full(cause) from None


def save(out_dir: str | Path, step: int, model: GPT, cfg: config_mod.Config, meta: dict,
         train_state: dict | None = None, keep: int = 0,
         weights: dict[str, torch.Tensor] | None = None, out_flag: str = "--out_dir") -> Path:
    """Write a checkpoint atomically, keeping the newest `keep` (0 = all). `weights` replace
    model_state(model) (FSDP gathers them; a LoRA run: its adapters, which meta's "lora" says
    go to adapter.safetensors); out_flag names out_dir's option in errors."""
    check_out_dir(out_dir, out_flag)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recover(out)
    weights = model_state(model) if weights is None else weights
    latest = latest_checkpoint(out)
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"refusing to save step {step}: NaN/inf in {len(bad)} weight "
                              f"tensor(s) ({', '.join(bad[:3])}); the last good checkpoint is "
                              f"{latest}")
    final = out / f"ckpt_{step:07d}"
    note = f"; the last complete checkpoint, {latest}, is intact" if latest else ""
    needed = bytes_to_write(weights, train_state, getattr(model, MASKS, None)) + 4096
    with staging_dir(out, ".tmp_ckpt_", f"checkpoint {final}", needed, out_flag, note) as tmp:
        save_file(weights, str(tmp / (ADAPTER_FILE if "lora" in meta else "model.safetensors")))
        write_rest(tmp, step, getattr(model, MASKS, None), cfg, meta, train_state)
        publish(tmp, final, keep)
    return final


def write_rest(tmp: Path, step: int, masks: dict | None, cfg: config_mod.Config, meta: dict,
               train_state: dict | None) -> None:
    """All but the weights, fsynced: masks, train_state.pt, config.json and meta.json."""
    if masks:
        save_file({name: mask.cpu() for name, mask in masks.items()}, str(tmp / MASK_FILE))
    if train_state is not None:
        torch.save(train_state, tmp / "train_state.pt")
    write_files(tmp, {"config.json": cfg.to_json().encode(),
                      "meta.json": json.dumps({"step": step, **meta}, indent=1).encode()})


def publish(tmp: Path, final: Path, keep: int) -> None:
    """A complete staged checkpoint renamed into place (replacing the same step's: eval + end),
    then all but the newest `keep` (0 = all) removed, each renamed first: a kill mid-delete
    never leaves half a checkpoint by its name."""
    old = final.with_name(f".old_{final.name}")  # recover() cleared any leftover
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(final.parent)[:-keep] if keep > 0 else ():
        hidden = stale.with_name(f".del_{stale.name}")
        os.rename(stale, hidden)
        shutil.rmtree(hidden, ignore_errors=True)


def recover(out_dir: str | Path) -> None:
    """Tidy what a killed save leaves: `.tmp_ckpt_*` and `.del_*` go; a `.old_ckpt_*` whose
    replacement never arrived is put back. Only the run's own trainer calls this."""
    out = Path(out_dir)
    for p in out.iterdir() if out.is_dir() else ():
        target = out / p.name.removeprefix(".old_")
        if p.name.startswith(".old_") and CKPT_PATTERN.match(target.name):
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.rename(p, target)
        elif p.name.startswith((".tmp_ckpt_", ".del_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
