"""Checkpoints: written atomically, loaded without unsafe pickle.

A checkpoint is a directory `out_dir/ckpt_0001000/` holding
    model.safetensors   the weights (the tied LM head stored once, as transformer.wte.weight)
    config.json         the resolved config of the run, so generate.py needs no flags
    meta.json           step, losses, tokens seen, the tokenizer's metadata
    train_state.pt      optimizer, RNG and data-loader state for resuming (torch.save of plain
                        tensors and containers; read back with torch.load(weights_only=True))
It is written into a hidden temporary directory and renamed into place, so a crash mid-save
never leaves a half-written checkpoint where a loader would find it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import config as config_mod
from model import GPT

CKPT_PATTERN = re.compile(r"^ckpt_(\d+)$")
TIED = "lm_head.weight"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the model."""


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The weights to store: every parameter and persistent buffer, the tied head once."""
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != TIED}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints in out_dir, oldest first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir()
             if p.is_dir() and (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def save(out_dir: str | Path, step: int, model: GPT, cfg: config_mod.Config, meta: dict,
         train_state: dict | None = None, keep: int = 0,
         weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint atomically and keep only the newest `keep` (0 = keep all). `weights`,
    when given, are stored instead of model_state(model) (FSDP gathers them from its shards)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recover(out)
    weights = model_state(model) if weights is None else weights
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"refusing to save step {step}: NaN/inf in {len(bad)} weight "
                              f"tensor(s) ({', '.join(bad[:3])}); the last good checkpoint is "
                              f"{latest_checkpoint(out)}")
    final = out / f"ckpt_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp_ckpt_", dir=out))
    try:
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(cfg.to_json())
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        if train_state is not None:
            torch.save(train_state, tmp / "train_state.pt")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # same step saved again (e.g. eval + end): replace it
            old = out / f".old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(out)[:-keep]:
            _remove(old)
    return final


def _remove(ckpt: Path) -> None:
    """Rename, then delete: a kill mid-delete never leaves half a checkpoint under its name."""
    doomed = ckpt.with_name(f".del_{ckpt.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(ckpt, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def recover(out_dir: str | Path) -> None:
    """Tidy what a save killed part-way leaves in out_dir: unfinished `.tmp_ckpt_*` and
    half-deleted `.del_*` directories go; a `.old_ckpt_*` whose replacement never arrived is put
    back under its name. Only the run's own trainer calls this (from save and on resume)."""
    out = Path(out_dir)
    if not out.is_dir():
        return
    for p in out.iterdir():
        name = p.name
        if name.startswith(".old_") and CKPT_PATTERN.match(name[len(".old_"):]):
            target = out / name[len(".old_"):]
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.rename(p, target)
        elif name.startswith((".tmp_ckpt_", ".del_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if (p / "model.safetensors").is_file():
        return p
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is not None:
            return latest
        raise CheckpointError(f"no checkpoint in {p}; train one first: python train.py "
                              f"--out_dir={p}")
    raise CheckpointError(f"checkpoint {p} does not exist; train one first with python train.py, "
                          "or pass --checkpoint=PATH to an existing one")


def read_config(ckpt: Path) -> config_mod.Config:
    try:
        return config_mod.from_dict(json.loads((ckpt / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}/config.json is unreadable ({e}); the checkpoint is "
                              "incomplete or corrupt") from None


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}/meta.json is unreadable ({e}); the checkpoint is "
                              "incomplete or corrupt") from None


def load_weights(model: GPT, ckpt: Path) -> None:
    """Load model.safetensors into `model`, listing every missing, unexpected or mis-shaped
    tensor in one error."""
    try:
        state = load_file(str(ckpt / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{ckpt}/model.safetensors is unreadable ({e}); the file is "
                              "truncated or corrupt") from None
    load_state(model, state, str(ckpt))


def mismatch_parts(missing: list, unexpected: list, shapes: list) -> list[str]:
    """The pieces of a 'weights do not fit' error: every missing, unexpected, mis-shaped name."""
    named = (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes))
    return [f"{what} {names}" for what, names in named if names]


def load_state(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    expected = model_state(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in expected.items() if k in state and state[k].shape != v.shape)
    if missing or unexpected or shapes:
        parts = mismatch_parts(missing, unexpected, shapes)
        raise CheckpointError(f"weights in {source} do not fit the model ("
                              + "; ".join(parts) + "); the checkpoint is from another "
                              "architecture: use the config it was trained with")
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state.items():
            own[k].copy_(v)


def load_train_state(ckpt: Path) -> dict:
    path = ckpt / "train_state.pt"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: this checkpoint holds weights only and "
                              "cannot be resumed; use init_from=<path> to start from its weights")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the safe unpickler met something other than plain data
        raise CheckpointError(f"refusing to load {path}: it holds Python objects other than "
                              "tensors and plain containers, which could run code when "
                              "unpickled; it was not written by this code (crafted or foreign "
                              "file); resume from another checkpoint") from None
    except Exception as e:  # a truncated zip, a wrong file
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {first}); the file "
                              "is truncated or corrupt; resume from an earlier "
                              "checkpoint") from None


def check_tokenizer(ckpt: Path, data_meta: dict) -> None:
    """The dataset must be tokenized as the checkpoint's model was trained (same ids)."""
    ours, theirs = read_meta(ckpt).get("tokenizer") or {}, data_meta["tokenizer"]
    if ours.get("kind") in (None, "unknown"):
        return  # nothing recorded to compare with
    where = f"dataset {data_meta.get('dir', '')} and checkpoint {ckpt}"
    if ours["kind"] != theirs.get("kind"):
        raise CheckpointError(f"{where} use different tokenizers ('{theirs.get('kind')}' vs "
                              f"'{ours['kind']}'); prepare the data with the checkpoint's "
                              "tokenizer or train from scratch")
    if ours["kind"] == "char" and ours.get("chars") != theirs.get("chars"):
        raise CheckpointError(f"{where} use different char vocabularies "
                              f"({len(theirs.get('chars', []))} vs {len(ours.get('chars', []))} "
                              "characters): token ids would mean different text; prepare the "
                              "data with the checkpoint's vocabulary or train from scratch")


def load_model(path: str | Path, device: torch.device | str = "cpu",
               model_overrides: dict | None = None) -> tuple[GPT, config_mod.Config, dict]:
    """Build the model a checkpoint describes and load its weights. Returns (model, cfg, meta).

    model_overrides may change implementation choices (attention, norm, ...) that do not change
    the weights' shapes.
    """
    ckpt = resolve(path)
    cfg = read_config(ckpt)
    meta = read_meta(ckpt)
    for key, value in (model_overrides or {}).items():
        setattr(cfg.model, key, value)
    model = GPT(cfg.model)
    load_weights(model, ckpt)
    return model.to(device), cfg, meta
