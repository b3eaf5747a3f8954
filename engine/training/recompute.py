"""model.activation_checkpointing: blocks (or one half of each) that keep only their input in
forward and recompute the rest in backward (torch.utils.checkpoint): about a third more compute
for the activations they would have kept. GPT loads this module when its config asks for it;
the memory estimate reads the same plan.

    recompute_blocks(model, "every:2")   # blocks 0, 2, 4, ... recompute in backward
"""
from __future__ import annotations

import functools
import re

import torch
from torch.utils.checkpoint import checkpoint

PARTS = {"none": "", "all": "block", "attention": "attention", "mlp": "mlp"}


def checkpoint_plan(spec: str, n_layer: int) -> list[str]:
    """model.activation_checkpointing -> what each block recomputes in backward: '' (nothing),
    'block', 'attention' (ln_1 + attention) or 'mlp' (ln_2 + MLP). Raises ValueError."""
    spec = spec.strip().lower()
    if spec in PARTS:
        return [PARTS[spec]] * n_layer
    kind, _, arg = spec.partition(":")
    listed = re.fullmatch(r"\s*-?\d+\s*(,\s*-?\d+\s*)*", arg)
    numbers = [int(a) for a in arg.split(",")] if listed else []
    bad = [b for b in numbers if not 0 <= b < n_layer]
    if kind == "every" and len(numbers) == 1 and numbers[0] > 0:
        return ["block" if i % numbers[0] == 0 else "" for i in range(n_layer)]
    if kind == "blocks" and numbers and not bad:
        return ["block" if i in numbers else "" for i in range(n_layer)]
    where = f"model.activation_checkpointing={spec!r}"
    if kind == "blocks" and bad:
        raise ValueError(f"{where} names blocks {bad}, but the model has blocks 0..{n_layer - 1}")
    raise ValueError(f"{where} is not understood; use none, all, attention, mlp, every:K "
                     "(K >= 1) or blocks:I,J,...")


def recompute_blocks(model: torch.nn.Module, spec: str) -> None:
    """Give each block the plan names its own forward (the weights and their names stay)."""
    blocks = model.transformer.h
    for block, part in zip(blocks, checkpoint_plan(spec, len(blocks))):
        if part:
            plain = type(block).forward.__get__(block)  # Block.forward, bound to this block
            block.forward = functools.partial(recomputed_forward, block, plain, part)


def recomputed_forward(block: torch.nn.Module, plain, part: str, x: torch.Tensor, kv_cache=None,
                       *inputs) -> torch.Tensor:
    """Block.forward with `part` recomputed in backward, in training only (autograd on and no
    KV cache); dropout replays the same masks, since checkpoint restores the RNG state. `inputs`
    are Block.forward's arguments after the cache (positions, a technique's own, such as
    model.value_embeds'), passed on to the attention as given."""
    if kv_cache is not None or not torch.is_grad_enabled():
        return plain(x, kv_cache, *inputs)
    if part == "block":
        return checkpoint(plain, x, None, *inputs, use_reentrant=False)

    def attn(x: torch.Tensor, *inputs) -> torch.Tensor:
        return block.attn(block.ln_1(x), None, *inputs)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return block.mlp(block.ln_2(x))

    if part == "attention":
        x = x + checkpoint(attn, x, *inputs, use_reentrant=False)
    else:
        x = x + attn(x, *inputs)
    if part == "mlp":
        return x + checkpoint(mlp, x, use_reentrant=False)
    return x + mlp(x)
