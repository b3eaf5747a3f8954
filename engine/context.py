"""A finetune at a shorter context than its source's (block_size 128 from GPT-2's 1024): the model
trains at block_size, and the source's position rows past it stay with the model, unchanged, as
the buffer transformer.wpe.weight_past_block. Checkpoints store it beside the weights (resume,
merge_lora and generate.py at block_size carry it; engine/loading.py reads it back), and the
Hugging Face export puts the rows back after the trained ones (engine/hf.py), so HF -> finetune
-> HF gives a model of the source's context. A LoRA checkpoint stores its adapters only: its
base, cropped again when loaded, gives the rows.

    fit_context(model, 128)    # rows 0..127 train; 128..1023 kept apart, never trained
    source_context(model)      # 1024
    fit_context(model, 512)    # a later run at 512: rows 128..511 come back from the kept ones
"""
from __future__ import annotations

import torch
import torch.nn as nn

from engine.loading import PAST_BLOCK
from model import GPT


def rows_past_block(model: GPT) -> torch.Tensor | None:
    """The source's position rows past block_size (None: the model has its source's context, or
    no learned positions)."""
    return getattr(model.transformer.wpe, PAST_BLOCK, None) if "wpe" in model.transformer \
        else None


def source_context(model: GPT) -> int:
    """The context of the model a cropped one came from (its own when it was not cropped)."""
    rows = rows_past_block(model)
    return model.config.block_size + (0 if rows is None else rows.size(0))


@torch.no_grad()
def fit_context(model: GPT, block_size: int) -> str:
    """Set the model's context to block_size: shorter, model.crop_block_size keeping the rows it
    drops (before any kept already); longer, up to source_context(model), the kept rows come
    back. The banner's note ("" with no learned positions to keep)."""
    old = model.config.block_size
    if block_size > old:
        return extend(model, block_size)
    if "wpe" in model.transformer:
        wpe, kept = model.transformer.wpe, rows_past_block(model)
        dropped = wpe.weight[block_size:].detach().clone()
        wpe.register_buffer(PAST_BLOCK, dropped if kept is None else torch.cat([dropped, kept]))
    model.crop_block_size(block_size)
    if "wpe" not in model.transformer:
        return ""
    full = source_context(model)
    return (f"note: block_size {block_size} is shorter than the source's context {full}: position "
            f"rows {block_size}-{full - 1} stay as the source has them, untrained, and the "
            f"Hugging Face export has context {full} (docs/gpt2.md)")


def extend(model: GPT, block_size: int) -> str:
    """fit_context to a longer block_size, from the kept rows (ValueError past them)."""
    old, full, rows = model.config.block_size, source_context(model), rows_past_block(model)
    if block_size > full:
        raise ValueError(f"block_size {block_size} is past the source's context {full}")
    wpe = model.transformer.wpe
    grown = torch.cat([wpe.weight.detach(), rows[:block_size - old].to(wpe.weight)])
    wpe.weight = nn.Parameter(grown)
    wpe.num_embeddings = model.config.block_size = block_size
    if block_size < full:
        wpe.register_buffer(PAST_BLOCK, rows[block_size - old:].clone())
    else:
        delattr(wpe, PAST_BLOCK)
    for block in model.transformer.h:  # the causal mask buffer (model.causal_mask=buffer)
        if hasattr(block.attn, "mask"):
            block.attn.mask = torch.ones(block_size, block_size, dtype=torch.bool,
                                         device=block.attn.mask.device).tril()
    return (f"note: block_size {block_size} is longer than the checkpoint's {old}: positions "
            f"{old}-{block_size - 1} are the rows it kept of its source, untrained by its "
            "finetune")
