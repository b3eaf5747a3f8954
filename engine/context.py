"""A finetune at a shorter context than its source's (block_size 128 from GPT-2's 1024): the model
trains at block_size, and the source's position rows past it stay with the model, unchanged, as
the buffer transformer.wpe.weight_past_block. Checkpoints store it beside the weights (resume,
merge_lora and generate.py at block_size carry it; engine/loading.py reads it back), and the
Hugging Face export puts the rows back after the trained ones (engine/hf.py), so HF -> finetune
-> HF gives a model of the source's context. A LoRA checkpoint stores its adapters only: its
base, cropped again when loaded, gives the rows.

    crop_context(model, 128)   # rows 0..127 train; 128..1023 kept apart, never trained
    source_context(model)      # 1024
"""
from __future__ import annotations

import torch

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
def crop_context(model: GPT, block_size: int) -> str:
    """model.crop_block_size(block_size), keeping the position rows it drops after any kept
    before; the note for the banner ("" when there are no learned positions to keep)."""
    if "wpe" in model.transformer:
        wpe, kept = model.transformer.wpe, rows_past_block(model)
        dropped = wpe.weight[block_size:].detach().clone()
        wpe.register_buffer(PAST_BLOCK, dropped if kept is None else torch.cat([dropped, kept]))
    model.crop_block_size(block_size)
    if "wpe" not in model.transformer:
        return ""
    full = source_context(model)
    return (f"note: block_size {block_size} is shorter than the source's context {full}: position "
            f"rows {block_size}-{full - 1} stay as the source has them, untrained, in every "
            f"checkpoint, so the Hugging Face export has context {full} (docs/gpt2.md)")
