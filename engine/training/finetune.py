"""Finetuning on instruction data (data.dataset a .json/.jsonl file): the examples encoded in the
tokens of the model the run starts from, with its chat template (data/instruct.py,
data/chat_template.py). engine/training/build.py calls this before building the model, which
engine/training/init_from.py then grows by the end-of-text token if it is new to it.

    meta = instruction_data(cfg)   # a dataset's meta, its examples in meta["instruction"]
    note = head_at_counted_positions(model)   # the LM head only where the loss counts
"""
from __future__ import annotations

import torch

from config import Config, ConfigError
from data.chat_template import TEMPLATES
from data.instruct import InstructionData
from data.tokenizer import TokenizerError, from_meta
from engine import checkpoint, sources
from engine.training.chunked_loss import chunked_cross_entropy
from model import GPT


def source_tokenizer(init_from: str, out_dir: str) -> dict:
    """The tokenizer metadata of the model train.init_from names (read before loading it)."""
    if init_from == "scratch":
        raise ConfigError("instruction data finetunes a trained model: pass --init_from=<a "
                          "checkpoint> or --init_from=gpt2 (or another Hugging Face GPT-2)")
    path = checkpoint.latest_checkpoint(out_dir) if init_from == "resume" else init_from
    if path is not None and sources.is_ours(path):
        ckpt = checkpoint.resolve(path)
        recorded = checkpoint.read_meta(ckpt).get("tokenizer") or {}
        if recorded.get("kind") == "bpe":  # an edited one gets the checkpoint's fix
            from data.train_tokenizer import checkpoint_tokenizer
            checkpoint_tokenizer(recorded, ckpt / "meta.json")
        return recorded
    return {"kind": "gpt2"}  # a Hugging Face GPT-2 (init_from.py checks its vocabulary)


def instruction_data(cfg: Config) -> dict:
    """The run's instruction examples, both splits, as a dataset's meta."""
    d = cfg.data
    if d.loader_workers:
        raise ConfigError("data.loader_workers reads token files; instruction data is read in "
                          "the training process: drop --loader_workers")
    try:
        tokenizer = from_meta(source_tokenizer(cfg.train.init_from, cfg.train.out_dir))
    except TokenizerError as e:
        raise ConfigError(f"{cfg.train.init_from}: {e}") from None
    tokenizer = tokenizer.with_eot()
    template = TEMPLATES[d.template]
    data = InstructionData.read(d.dataset, tokenizer, template, cfg.model.block_size,
                                d.val_file, d.val_fraction, d.overlength,
                                every_token=d.loss_on == "all")
    print(data.summary())
    for note in data.notes:
        print(f"note: {note}")
    return data.meta(tokenizer, template)


def counted_positions_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           cap: float, ignore_index: int, vocab_size: int = 0) -> torch.Tensor:
    """The LM head and its loss at the positions the loss counts (the responses) only: the same
    mean loss and gradients as at every position, without the logits of prompts and padding."""
    keep = (targets != ignore_index).reshape(-1)
    rows = x.reshape(-1, x.size(-1))[keep]  # (counted, C)
    return chunked_cross_entropy(rows, weight, targets.reshape(-1)[keep], cap, ignore_index,
                                 vocab_size)


def head_at_counted_positions(model: GPT) -> str:
    """Make model's training loss counted_positions_loss (GPT.forward calls it in place of the
    full head); the banner's note."""
    model.chunked_loss = torch.compiler.disable(counted_positions_loss)  # shapes vary per batch
    return "loss: the LM head runs at the response tokens only (instruction data)"
