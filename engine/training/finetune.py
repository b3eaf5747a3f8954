"""Finetuning on instruction data (data.dataset a .json/.jsonl file): the examples encoded in the
tokens of the model the run starts from, with its chat template (data/instruct.py,
data/chat_template.py). engine/training/build.py calls this before building the model, which
engine/training/init_from.py then grows by the end-of-text token if it is new to it.

    meta = instruction_data(cfg)   # a dataset's meta, its examples in meta["instruction"]
"""
from __future__ import annotations

from config import Config, ConfigError
from data.chat_template import TEMPLATES
from data.instruct import InstructionData
from data.tokenizer import from_meta
from engine import checkpoint, sources


def source_tokenizer(init_from: str, out_dir: str) -> dict:
    """The tokenizer metadata of the model train.init_from names (read before loading it)."""
    if init_from == "scratch":
        raise ConfigError("instruction data finetunes a trained model: pass --init_from=<a "
                          "checkpoint> or --init_from=gpt2 (or another Hugging Face GPT-2)")
    path = checkpoint.latest_checkpoint(out_dir) if init_from == "resume" else init_from
    if path is not None and sources.is_ours(path):
        return checkpoint.read_meta(checkpoint.resolve(path)).get("tokenizer") or {}
    return {"kind": "gpt2"}  # a Hugging Face GPT-2 (init_from.py checks its vocabulary)


def instruction_data(cfg: Config) -> dict:
    """The run's instruction examples, both splits, as a dataset's meta."""
    d = cfg.data
    if d.loader_workers:
        raise ConfigError("data.loader_workers reads token files; instruction data is read in "
                          "the training process: drop --loader_workers")
    tokenizer = from_meta(source_tokenizer(cfg.train.init_from, cfg.train.out_dir)).with_eot()
    template = TEMPLATES[d.template]
    data = InstructionData.read(d.dataset, tokenizer, template, cfg.model.block_size,
                                d.val_file, d.val_fraction, d.overlength,
                                every_token=d.loss_on == "all")
    print(data.summary())
    for note in data.notes:
        print(f"note: {note}")
    return data.meta(tokenizer, template)
