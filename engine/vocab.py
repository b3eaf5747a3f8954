"""Growing a model's vocabulary for tokens its training never saw: the end-of-text token a chat
template needs in a character vocabulary (data/tokenizer.py, data/chat_template.py).

    added = grow_vocab(model, 66)   # a 65-character model gets id 65, its row the mean embedding

New rows start at the mean of the trained rows (in the embedding, an untied head and the value
embeddings alike): a token the model has no opinion on yet, rather than a random one; the same
every time, so a LoRA checkpoint rebuilds them from its base (engine/lora.py). Padded rows
(model.vocab_pad_multiple) are used first; only past them are the tables reallocated.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from model import GPT


@torch.no_grad()
def _grown(table: torch.Tensor, old: int, vocab_size: int, rows: int) -> torch.Tensor:
    """table with `rows` rows: its first `old` kept, old..vocab_size-1 their mean, the rest 0."""
    out = torch.zeros(rows, table.size(1), dtype=table.dtype, device=table.device)
    out[:old] = table[:old]
    out[old:vocab_size] = table[:old].float().mean(0).to(table.dtype)
    return out


@torch.no_grad()
def grow_vocab(model: GPT, vocab_size: int) -> int:
    """Make model take ids up to vocab_size - 1; returns how many ids were added (0: it did)."""
    old, cfg = model.vocab_size, model.config
    if vocab_size <= old:
        return 0
    rows = -(-vocab_size // cfg.vocab_pad_multiple) * cfg.vocab_pad_multiple
    rows = max(rows, model.padded_vocab)
    wte = model.transformer.wte
    tied = model.lm_head.weight is wte.weight
    wte.weight = nn.Parameter(_grown(wte.weight, old, vocab_size, rows))
    wte.num_embeddings = rows
    if tied:
        model.lm_head.weight = wte.weight
    else:
        model.lm_head.weight = nn.Parameter(_grown(model.lm_head.weight, old, vocab_size, rows))
    model.lm_head.out_features = rows
    for table in getattr(model, "value_embeds", []):
        table.weight = nn.Parameter(_grown(table.weight, old, vocab_size, rows))
        table.num_embeddings = rows
    cfg.vocab_size = model.vocab_size = vocab_size
    model.padded_vocab, model.grown_from = rows, old  # LoRA trains the rows from grown_from on
    return vocab_size - old
