"""train.init_from: the model a run starts from when not from scratch: one of our checkpoints,
out_dir's latest to resume, or a Hugging Face GPT-2 (engine/training/build.py loads this then).

    model, source = load_for_training(cfg, data_meta, device)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from config import Config, ConfigError
from data.dataset import check_vocab
from engine.checkpoint import CheckpointError, latest_checkpoint
from engine.context import fit_context, source_context
from engine.fields import facts
from engine.loading import check_tokenizer
from engine.sources import load_source
from model import GPT, ModelConfig


def load_for_training(cfg: Config, meta: dict, target: torch.device
                      ) -> tuple[GPT, Path]:
    """train.init_from's model (a checkpoint, out_dir's latest to resume, or a GPT-2) and where
    it came from. What the weights fix (their fields say fixed) comes from the source; the
    other options (attention, norm, ...) stay the run's; a shorter block_size crops the context."""
    init, block = cfg.train.init_from, cfg.model.block_size
    if init == "resume":
        init = latest_checkpoint(cfg.train.out_dir)
        if init is None:
            raise CheckpointError(f"init_from=resume but {cfg.train.out_dir} has no checkpoint; "
                                  "use init_from=scratch to start")
    fixed = {name for name, is_fixed in facts(ModelConfig, "fixed").items() if is_fixed}
    switches = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in fixed}
    model, _, source_meta, label = load_source(str(init), cfg, "cpu", switches,
                                               merge_adapters=cfg.train.init_from != "resume")
    context = model.config.block_size
    if "source" in source_meta:  # a Hugging Face GPT-2
        source, what = Path(source_meta["source"]), f"{init}'s"
    else:
        source, what = Path(label), "the checkpoint's"
        check_tokenizer(source, meta)  # the same ids, or a clear refusal
    if "instruction" in meta:  # its end-of-text token may be new to a character model
        from engine.vocab import grow_vocab

        if added := grow_vocab(model, meta["vocab_size"]):
            print(f"note: the vocabulary grew by {added} for the chat template's end-of-text "
                  "token (its row starts at the mean embedding)")
    kind = source_meta.get("tokenizer", {}).get("kind")
    check_vocab(meta, model.config.vocab_size, kind if kind == "gpt2" else None)
    if block > (longest := source_context(model)):
        kept = f", {longest} with the position rows it kept of its source" \
            if longest > context else ""
        raise ConfigError(f"block_size {block} is larger than {what} context {context}{kept}; "
                          f"use a block_size <= {longest}")
    for f in dataclasses.fields(cfg.model):  # cfg.model stays the object the run holds
        setattr(cfg.model, f.name, getattr(model.config, f.name))
    model.config = cfg.model
    if block != context:  # shorter: the rows past it kept for the export; longer: given back
        if note := fit_context(model, block):
            print(note)
    return model.to(target), source
