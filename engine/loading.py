"""Reading back what engine/checkpoint.py wrote: a model (its config, weights and a pruned model's
masks) and a run's training state, without unsafe pickle (safetensors; torch.load with
weights_only=True); every mismatch between the weights and the model is named in one error.

    model, cfg, meta = load_model("out/shakespeare_char")   # a run's latest checkpoint
"""
from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import config
from engine.checkpoint import (MASK_FILE, MASKS, SHARDS, CheckpointError, first_line,
                               model_state, read_meta, resolve)
from model import GPT

PAST_BLOCK = "weight_past_block"  # wpe's buffer: a longer source's rows (engine/context.py)


def read_config(ckpt: Path) -> config.Config:
    return config.from_dict(read_meta(ckpt, "config.json"))


def load_weights(model: GPT, ckpt: Path) -> None:
    """Load model.safetensors (or shards/) into `model`; every mismatch is listed in one error."""
    try:
        if (ckpt / SHARDS).is_dir():  # written by every process of the run (engine/sharded.py)
            from engine.sharded import read_weights

            state = read_weights(ckpt)
        else:
            state = load_file(str(ckpt / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{ckpt}/model.safetensors is unreadable ({e}); the file is "
                              "truncated or corrupt") from None
    load_state(model, state, str(ckpt))
    if not (ckpt / MASK_FILE).is_file():
        return
    try:  # a pruned checkpoint: its masks come with it (engine/pruning.py)
        attach_masks(model, load_file(str(ckpt / MASK_FILE)))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}/{MASK_FILE} is unusable ({e}); the checkpoint is "
                              "corrupt: prune its source again with prune.py") from None


def attach_masks(model: GPT, masks: dict[str, torch.Tensor]) -> None:
    """Set loaded masks on the model; ValueError when they do not fit its weights."""
    weights = model.state_dict()
    misfits = [name for name, mask in masks.items() if name not in weights or mask.dtype !=
               torch.bool or mask.shape != weights[name].shape]
    if misfits:
        raise ValueError(f"the masks do not fit the model's weights ({', '.join(misfits[:3])})")
    unpruned = [name for name, mask in masks.items() if weights[name][~mask].any()]
    if unpruned:
        raise ValueError(f"weights are non-zero where the masks prune them "
                         f"({', '.join(unpruned[:3])})")
    setattr(model, MASKS, masks)


def mismatch_parts(missing: list, unexpected: list, shapes: list) -> list[str]:
    """The pieces of a 'weights do not fit' error: every missing, unexpected, mis-shaped name."""
    named = (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes))
    return [f"{what} {names}" for what, names in named if names]


def load_state(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    wpe = getattr(model.transformer, "wpe", None)  # a finetune's kept rows: their buffer first
    if wpe is not None and (rows := state.get(f"transformer.wpe.{PAST_BLOCK}")) is not None:
        wpe.register_buffer(PAST_BLOCK, wpe.weight.new_empty(len(rows), wpe.weight.size(1)))
    expected = model_state(model)
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in expected.items() if k in state and state[k].shape != v.shape)
    if parts := mismatch_parts(sorted(set(expected) - set(state)),
                               sorted(set(state) - set(expected)), shapes):
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
        raise CheckpointError(f"{path} is unreadable ({first_line(e)}); the file is "
                              "truncated or corrupt; resume from an earlier checkpoint") from None


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
    if ours["kind"] == "bpe" and ours.get("sha256") != theirs.get("sha256"):
        raise CheckpointError(f"{where} use different trained tokenizers ('{theirs.get('name')}' "
                              f"sha256 {str(theirs.get('sha256'))[:12]} vs '{ours.get('name')}' "
                              f"{str(ours.get('sha256'))[:12]}): token ids would mean different "
                              "text; prepare the data with the checkpoint's tokenizer (--tokenizer "
                              "FOLDER) or train from scratch")


def load_model(path: str | Path, device: torch.device | str = "cpu",
               model_overrides: dict | None = None) -> tuple[GPT, config.Config, dict]:
    """(model, cfg, meta) of a checkpoint or run directory; model_overrides may change choices
    that keep the weights' shapes (attention, norm, ...)."""
    ckpt = resolve(path)
    cfg, meta = read_config(ckpt), read_meta(ckpt)
    cfg.model = dataclasses.replace(cfg.model, **(model_overrides or {}))
    model = GPT(cfg.model)
    load_weights(model, ckpt)
    return model.to(device), cfg, meta
