"""Checkpoints on disk: `out_dir/ckpt_0001000/` holds model.safetensors, config.json (resolved),
meta.json and train_state.pt (optimizer, RNG, data position); a pruned model's masks in
mask.safetensors (engine/pruning.py); a sharded one, shards/ in place of the weights and the
optimizer state (engine/sharded.py). Their names and errors, and how one is found (resolve,
latest_checkpoint) are here; written by engine/saving.py, read back by engine/loading.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from model import GPT

CKPT_PATTERN = re.compile(r"^ckpt_(\d+)$")
TIED = "lm_head.weight"
MASK_FILE = "mask.safetensors"  # a pruned model's masks, True = kept
ADAPTER_FILE = "adapter.safetensors"  # a LoRA run's adapters, in place of model.safetensors
SHARDS = "shards"  # a sharded checkpoint's weights and optimizer state (engine/sharded.py)
MASKS = "prune_masks"  # the model attribute engine/pruning.py keeps them in


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, does not fit the model, or cannot be written."""


def first_line(e: BaseException) -> str:
    """'TypeName: the first line of its message', for errors quoted inside ours."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def model_state(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, the tied head once."""
    tied = model.lm_head.weight is model.transformer.wte.weight
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
            if k != TIED or not tied}


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints in out_dir, oldest first."""
    out = Path(out_dir)
    found = [(int(m.group(1)), p) for p in (out.iterdir() if out.is_dir() else ())
             if p.is_dir() and (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    return ([None] + list_checkpoints(out_dir))[-1]


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if any((p / name).is_file() for name in ("model.safetensors", ADAPTER_FILE,
                                              f"{SHARDS}/.metadata")):
        return p
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist; train one first with python "
                              "train.py, or pass --checkpoint=PATH to an existing one")
    if latest := latest_checkpoint(p):
        return latest
    raise CheckpointError(f"no checkpoint in {p}; train one first: python train.py --out_dir={p}")


def read_meta(ckpt: Path, name: str = "meta.json") -> dict:
    try:
        return json.loads((ckpt / name).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}/{name} is unreadable ({e}); the checkpoint is "
                              "incomplete or corrupt") from None
