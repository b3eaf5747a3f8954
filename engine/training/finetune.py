"""Finetuning on instruction data (data.dataset a .json/.jsonl file): the examples encoded in the
tokens of the model the run starts from, with its chat template (data/instruct.py,
data/chat_template.py). engine/training/build.py calls this before building the model, which
engine/training/init_from.py then grows by the end-of-text token if it is new to it.

    meta = instruction_data(cfg)   # a dataset's meta, its examples in meta["instruction"]
    note = head_at_counted_positions(model)   # the LM head only where the loss counts
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from config import Config, ConfigError
from data.chat_template import TEMPLATES
from data.instruct import InstructionData
from data.tokenizer import TokenizerError, from_meta
from engine import checkpoint, sources
from engine.device import resolve_device
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
    row = data.mean_row_length(cfg.train.batch_size, cfg.model.block_size)
    for note in data.notes + [busy_machine_note(cfg)]:
        if note:
            print(f"note: {note}")
    if row < cfg.model.block_size:
        print(f"note: rows are padded to their batch's longest example: {row:.0f} of block_size "
              f"{cfg.model.block_size} tokens on average here, which the time estimate counts")
    return {**data.meta(tokenizer, template), "row_tokens": row}


def cpus_busy_elsewhere(seconds: float = 0.25) -> float | None:
    """How many CPUs other processes kept busy over the next `seconds`: /proc/stat's busy time
    (a VM's stolen time included) less this process's own; None where there is no /proc/stat."""
    def busy_and_own() -> tuple[float, float]:
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(cpu) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK"), sum(os.times()[:2])

    try:
        (busy, own), start = busy_and_own(), time.monotonic()
        time.sleep(seconds)
        (busy_end, own_end), end = busy_and_own(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (busy_end - busy - (own_end - own)) / (end - start))


def busy_machine_note(cfg: Config) -> str:
    """A CPU run's warning when other processes hold CPUs its threads want ("" when they do
    not): the time estimate assumes the threads have their cores to themselves, and on a 2-core
    machine one more busy process can make steps several times slower."""
    if resolve_device(cfg.system.device).type != "cpu" or (others := cpus_busy_elsewhere()) \
            is None:
        return ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    if others <= cpus - threads + 0.5:
        return ""
    return (f"the machine is busy: other processes kept {others:.1f} of its {cpus} CPUs busy "
            f"just now, and this run wants {threads} for its threads; the time estimate below "
            "assumes it has them and may be several times short (the log's ms per step and eta "
            "are measured)")


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
