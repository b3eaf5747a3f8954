"""Where a model comes from, by its name: one of our checkpoints (or a run directory), or a
Hugging Face GPT-2 (a hub id or a local directory), whose converter is loaded only then.

    model, cfg, meta, label = load_source("out/shakespeare_char", cfg)   # or "gpt2"
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import config
from engine.checkpoint import ADAPTER_FILE, latest_checkpoint, read_meta, resolve
from engine.loading import load_model
from model import GPT


def is_ours(source: str | Path) -> bool:
    """Whether source is one of our checkpoints (it has a meta.json, which a Hugging Face
    directory has not) or a run directory holding them."""
    path = Path(source)
    return (path / "meta.json").is_file() or latest_checkpoint(path) is not None


def load_source(source: str, cfg: config.Config, device: torch.device | str = "cpu",
                overrides: dict | None = None, merge_adapters: bool = True
                ) -> tuple[GPT, config.Config, dict, str]:
    """(model, its config, meta with 'tokenizer', a label) of one of our checkpoints (its stored
    config) or a Hugging Face GPT-2 (its shape from config.json, the rest from cfg.model);
    `overrides` apply to both. A source that is neither gets the checkpoint's error. A LoRA
    run's checkpoint comes with its adapters merged, or apart (merge_adapters=False: to resume)."""
    if is_ours(source):
        path = resolve(source)
        recorded = read_meta(path).get("tokenizer") or {}
        if recorded.get("kind") == "bpe":  # an edited one is refused before the weights are read
            from data.train_tokenizer import checkpoint_tokenizer
            checkpoint_tokenizer(recorded, path / "meta.json")
        if (path / ADAPTER_FILE).is_file():  # a LoRA run's: its base, then its adapters
            from engine.lora import load_adapter_checkpoint

            return load_adapter_checkpoint(path, device, overrides, load_source, merge_adapters)
        model, stored, meta = load_model(path, device, overrides)
        return model, stored, meta, str(path)
    from engine import hf  # a GPT-2 from the hub or a Hugging Face directory

    if not hf.is_gpt2_source(source):
        resolve(source)  # raises: no such checkpoint
    used = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **(overrides or {})))
    model, hf_dir = hf.load_hf(source, used.model)
    label = source if Path(source) == hf_dir else f"{source} ({hf_dir})"
    meta = {"tokenizer": hf.tokenizer_meta(model.config.vocab_size, hf_dir), "source": str(hf_dir)}
    return model.to(device), used, meta, label
