"""How much memory a training process takes, estimated before anything is allocated: weights,
gradients, optimizer state, the activations kept for backward, the LM head and loss at their
peak, and what activation checkpointing rebuilds (the start-up banner, and
`python train.py --estimate-memory` without building anything). tests/test_memory_measured.py
holds it to what autograd keeps and what a real step holds.

Precision policy: under autocast the matmuls run in bf16/fp16; float32 always are the residual
stream, LayerNorm, softmax statistics, logits -> loss, and the optimizer state (with bf16
weights, a float32 master copy: master_weights.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from config import Config
from engine.device import format_bytes, resolve_device, resolve_dtype
from engine.training.optim import STATE_TENSORS
from model import ACTIVATIONS, GPT, ModelConfig


@dataclass
class MemoryEstimate:
    """Bytes per process for one training micro-step (an upper estimate)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # kept for backward, over the whole micro-batch
    logits: int  # the LM head + loss at its peak (loss_bytes)
    recompute: int  # one checkpointed part's activations, rebuilt during backward
    weight_copies: int = 0  # autocast's 16-bit copies of the matrices, kept for backward

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits
                + self.recompute + self.weight_copies)


def meta_model(m: ModelConfig) -> GPT:
    """The model as configured, on the meta device: its parameters' shapes, no memory."""
    with torch.device("meta"):  # (vocab_size 0, still to be read from the data: counted as 1)
        return GPT(dataclasses.replace(m, activation_checkpointing="none", loss="full",
                                       vocab_size=m.vocab_size or 1))


def block_saved_bytes(cfg: ModelConfig, act: int) -> dict[str, int]:
    """Bytes per token one block keeps for backward, per part (each with its LayerNorm); act:
    the matmul inputs' bytes per element (4, or 2 under autocast)."""
    C, T, nh = cfg.n_embd, cfg.block_size, cfg.n_head
    ln = layer_norm_bytes(cfg)
    if cfg.attention == "sdpa":  # q, k, v, the output, and the c_attn / c_proj inputs
        attention = 3 * act * C + act * C
    else:  # q, k, v, the float32 softmax output and its cast copy for att @ v
        attention = 3 * act * C + (4 + act) * nh * T
        attention += nh * T if cfg.dropout > 0 else 0
    if cfg.qk_norm or cfg.position == "rotary":  # new q and k tensors, kept by attention
        attention += 2 * act * C
    attn = ln + act * C + attention + act * C
    activation = ACTIVATIONS[cfg.activation].saved_tensors(cfg.activation_impl == "native")
    mlp = ln + act * C + activation * 4 * C * act + 4 * act * C  # + the c_fc and c_proj inputs
    if cfg.dropout > 0:  # one byte per element for each dropout mask
        attn, mlp = attn + C, mlp + C
    return {"attention": attn, "mlp": mlp}


def layer_norm_bytes(cfg: ModelConfig) -> int:
    """Bytes per token a LayerNorm keeps: native, its float32 input; written out, x - mean
    twice (for the variance, and for x-hat) and x-hat."""
    return 4 * cfg.n_embd if cfg.norm == "native" else 12 * cfg.n_embd


def trunk_bytes(cfg: ModelConfig, act: int) -> int:
    """Bytes per token kept outside the blocks' own count: the float32 tensors the speedrun's
    additions multiply by learned weights (the previous tokens' embeddings, each value table's
    embeddings, the middle block's output a U-net skip reuses), the values a value embedding
    makes anew in each block it joins (SDPA keeps them beside q and k; written-out attention
    keeps a contiguous v either way), ln_f, and the LM head's input (the chunked loss keeps its
    gradient instead, counted with the loss)."""
    C = cfg.n_embd
    kept = 4 * C * (cfg.smear + cfg.value_embeds + (cfg.unet_skips and cfg.n_layer % 2 == 0))
    kept += act * C * 2 * cfg.value_embeds * (cfg.attention == "sdpa")
    return kept + layer_norm_bytes(cfg) + (0 if cfg.loss == "chunked" else act * C)


def activation_bytes(m: ModelConfig, tokens: int, act: int) -> tuple[int, int]:
    """(kept for backward, largest recomputed part) bytes for `tokens` tokens, checkpointed."""
    parts = block_saved_bytes(m, act)
    kept_input = 4 * m.n_embd  # a checkpointed part keeps only its float32 input
    plan = [""] * m.n_layer
    if m.activation_checkpointing.strip().lower() != "none":
        from engine.training.recompute import checkpoint_plan

        plan = checkpoint_plan(m.activation_checkpointing, m.n_layer)
    kept, recompute = 0, 0
    for part in plan:
        if part == "block":
            kept += kept_input
            recompute = max(recompute, parts["attention"] + parts["mlp"])
        elif part in parts:
            other = "mlp" if part == "attention" else "attention"
            kept += kept_input + parts[other]
            recompute = max(recompute, parts[part])
        else:
            kept += parts["attention"] + parts["mlp"]
    return (kept + trunk_bytes(m, act)) * tokens, recompute * tokens


def loss_bytes(m: ModelConfig, padded_vocab: int, tokens: int, act: int) -> int:
    """The LM head + loss at its peak. full: the (padded) logits, their float32 log-softmax kept
    for backward and its float32 gradient. chunked: one chunk's float32 logits (turned into their
    gradient in place; + a 16-bit copy under autocast), and the input and float32 head gradients
    it makes in forward (measured: docs/memory.md); its head is the padded one, multiplied whole."""
    C, V = m.n_embd, m.vocab_size
    capped = 4 * V if m.logit_softcap else 0  # the float32 tanh, kept (a chunk: a second buffer)
    if m.loss == "chunked":
        from engine.training.chunked_loss import loss_chunk_rows

        Vp, capped = padded_vocab, capped and 4 * padded_vocab
        chunk = loss_chunk_rows(tokens, Vp) * (Vp * (4 if act == 4 else 4 + act) + capped)
        return chunk + act * tokens * C + 4 * Vp * C
    return tokens * (act * padded_vocab + 8 * V + capped)


def estimate(cfg: Config, world_size: int = 1) -> MemoryEstimate:
    """Memory of one training process (model.vocab_size set); FSDP splits the states."""
    m, t = cfg.model, cfg.train
    model = meta_model(m)
    params = model.num_params(non_embedding=False)
    matrices = sum(p.numel() for p in model.transformer.h.parameters() if p.dim() == 2)
    shards = world_size if world_size > 1 and cfg.system.parallel == "fsdp" else 1
    act = 4 if cfg.system.dtype == "float32" else 2
    tokens = t.batch_size * m.block_size
    activations, recompute = activation_bytes(m, tokens, act)
    weight = 2 if cfg.system.weights_dtype == "bfloat16" else 4
    masters = params if weight == 2 else 0  # bf16 weights: float32 masters and their gradients
    hidden, rest = STATE_TENSORS[t.optimizer]
    state_floats = hidden * matrices + rest * (params - matrices) + masters
    copies = act < 4 and weight == 4  # autocast keeps a 16-bit copy of each float32 matrix
    if cfg.lora.rank:  # adapters train: gradients and AdamW state only for them
        return lora_estimate(cfg, model, activations, recompute, act)
    return MemoryEstimate(weights=weight * params // shards,
                          gradients=(weight * params + 4 * masters) // shards,
                          optimizer=state_floats * 4 // shards,
                          activations=activations,
                          logits=loss_bytes(m, model.padded_vocab, tokens, act),
                          recompute=recompute,
                          weight_copies=copies * act * (matrices + model.lm_head.weight.numel()))


def lora_estimate(cfg: Config, model: GPT, activations: int, recompute: int, act: int
                  ) -> MemoryEstimate:
    """lora.rank > 0: the frozen base (its target Linears in lora.base_dtype), the adapters'
    float32 weights, gradients and AdamW state; the activations as full finetuning's (an upper
    estimate: frozen weights need no inputs kept for their own gradients)."""
    from engine.lora import target_names

    lora, m = cfg.lora, cfg.model
    targets = [model.get_submodule(name) for name in target_names(model, lora.targets)]
    frozen = sum(t.weight.numel() for t in targets)
    adapters = sum(lora.rank * (t.in_features + t.out_features) for t in targets)
    base = 4 * model.num_params(non_embedding=False) - (
        2 * frozen if lora.base_dtype == "bfloat16" else 0)
    copies = act < 4 and lora.base_dtype == "float32"  # autocast's 16-bit copies of them
    return MemoryEstimate(weights=base + 4 * adapters, gradients=4 * adapters,
                          optimizer=2 * 4 * adapters, activations=activations,
                          logits=loss_bytes(m, model.padded_vocab, cfg.train.batch_size
                                            * m.block_size, act), recompute=recompute,
                          weight_copies=copies * act * frozen)


def format_estimate(e: MemoryEstimate, cfg: Config) -> str:
    optimizer = "adamw (adapters)" if cfg.lora.rank else cfg.train.optimizer
    parts = [("weights", e.weights), ("grads", e.gradients), (optimizer, e.optimizer),
             ("activations", e.activations), ("logits+loss", e.logits),
             ("recompute", e.recompute), ("weight copies", e.weight_copies)]
    body = " + ".join(f"{name} {format_bytes(b)}" for name, b in parts if b)
    return (f"memory estimate: {body} = {format_bytes(e.total)} per process "
            f"(micro-batch {cfg.train.batch_size}x{cfg.model.block_size}, {cfg.system.dtype}, "
            f"checkpointing={cfg.model.activation_checkpointing})")


def describe(cfg: Config, world_size: int) -> str:
    """`python train.py --estimate-memory`: the estimate, without building the model."""
    dtype, _ = resolve_dtype(cfg.system.dtype, resolve_device(cfg.system.device))
    cfg = dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, dtype=dtype))
    params = meta_model(cfg.model).num_params(non_embedding=False)
    return (f"model: {params / 1e6:.2f}M parameters, {world_size} process(es)\n"
            + format_estimate(estimate(cfg, world_size), cfg))
