"""Where a model comes from: a fresh one, one of our checkpoints, or a Hugging Face GPT-2, decided
in one place for training (build_model); and the dataset a run reads (dataset_meta).
"""
from __future__ import annotations

from pathlib import Path

import torch

import load_gpt2_weights
from config import Config, ConfigError
from data.loader import DataError, check_vocab, load_meta
from engine import checkpoint
from model import GPT

DEFAULT_DATASET = "shakespeare_char"
# model-section keys that fix the weights' shapes; the others (attention, norm, ...) are free to
# change when starting from a checkpoint
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "vocab_pad_multiple",
              "layer_norm_eps")


def dataset_meta(cfg: Config) -> dict:
    """The dataset's metadata; the default dataset is prepared on first use."""
    try:
        return load_meta(cfg.data.dataset)
    except DataError:
        if cfg.data.dataset != DEFAULT_DATASET:
            raise
    from data.shakespeare_char.prepare import prepare
    print(f"preparing the default dataset ({DEFAULT_DATASET}) ...")
    prepare()
    return load_meta(cfg.data.dataset)


def build_model(cfg: Config, meta: dict, device: torch.device) -> tuple[GPT, Path | None]:
    """A fresh model, or one whose weights (and shape) come from a checkpoint."""
    source = None
    init = cfg.train.init_from
    if init == "resume":
        source = checkpoint.latest_checkpoint(cfg.train.out_dir)
        if source is None:
            raise checkpoint.CheckpointError(f"init_from=resume but {cfg.train.out_dir} has no "
                                             "checkpoint; use init_from=scratch to start")
    elif load_gpt2_weights.is_gpt2_source(init):
        return gpt2_model(cfg, meta, device)
    elif init != "scratch":
        source = checkpoint.resolve(init)
    if source is not None:
        checkpoint.check_tokenizer(source, meta)
        stored = checkpoint.read_config(source).model
        for key in SHAPE_KEYS:
            setattr(cfg.model, key, getattr(stored, key))
        if cfg.model.block_size > stored.block_size:
            raise ConfigError(f"block_size {cfg.model.block_size} is larger than the "
                              f"checkpoint's context {stored.block_size}; use a block_size "
                              f"<= {stored.block_size}")
    elif cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    check_vocab(meta, cfg.model.vocab_size)
    if source is None:
        return GPT(cfg.model).to(device), None
    stored_block = checkpoint.read_config(source).model.block_size
    block = cfg.model.block_size
    cfg.model.block_size = stored_block
    model = GPT(cfg.model)
    checkpoint.load_weights(model, source)
    if block < stored_block:
        crop_block_size(model, block)
    return model.to(device), source


def crop_block_size(model: GPT, block_size: int) -> None:
    """Shorten the context (e.g. 1024 -> 256) by keeping the first position embeddings."""
    model.config.block_size = block_size
    wpe = model.transformer.wpe
    wpe.weight = torch.nn.Parameter(wpe.weight.data[:block_size].clone())
    wpe.num_embeddings = block_size
    for block in model.transformer.h:
        if hasattr(block.attn, "mask"):
            block.attn.mask = block.attn.mask[:block_size, :block_size]


def gpt2_model(cfg: Config, meta: dict, device: torch.device) -> tuple[GPT, Path]:
    """A Hugging Face GPT-2 (hub id or local directory) as the starting point: its shape comes
    from its config.json, the context is cropped to cfg.model.block_size when that is shorter."""
    block = cfg.model.block_size
    model, hf_dir = load_gpt2_weights.load_hf(cfg.train.init_from, cfg.model)
    kind = load_gpt2_weights.tokenizer_meta(cfg.model.vocab_size)["kind"]
    check_vocab(meta, cfg.model.vocab_size, kind if kind == "gpt2" else None)
    if block > model.config.block_size:
        raise ConfigError(f"block_size {block} is larger than {cfg.train.init_from}'s context "
                          f"{model.config.block_size}; use a block_size <= "
                          f"{model.config.block_size}")
    if block < model.config.block_size:
        crop_block_size(model, block)
    return model.to(device), hf_dir
