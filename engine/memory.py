"""How much memory a run takes: estimated before anything is allocated, measured after.

    estimate / format_estimate / describe   bytes per process of weights, gradients, AdamW
                                 state, activations (`train.py --estimate-memory`)
    reset_peak_memory / peak_memory   measured peak: CUDA allocated/reserved, or CPU peak RSS
    release_cached               system.empty_cache, at phase boundaries

Precision policy: under autocast the matmuls run in bf16/fp16; float32 always are the residual
stream, LayerNorm, softmax statistics, logits -> loss, and the optimizer state (with bf16
weights, a float32 master copy: optim.MasterWeights).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass

import torch

from config import Config, ModelConfig, checkpoint_plan
from engine import optim, runtime
from model import block_saved_bytes, loss_chunk_rows, padded_vocab_size

GIB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes per process for one training micro-step (an upper estimate)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # kept for backward, over the whole micro-batch
    logits: int  # the LM head + loss at its peak (loss_bytes)
    recompute: int  # one checkpointed part's activations, rebuilt during backward

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits
                + self.recompute)


def parameter_count(m: ModelConfig) -> int:
    """GPT parameters, counted once (a tied LM head is the token embedding)."""
    C, L = m.n_embd, m.n_layer
    bias = 1 if m.bias else 0
    per_block = (2 * (C + bias * C)  # two LayerNorms
                 + C * 3 * C + bias * 3 * C + C * C + bias * C  # attention in/out projections
                 + C * 4 * C + bias * 4 * C + 4 * C * C + bias * C)  # MLP
    vocab = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple) * C
    positions = m.block_size * C if m.position == "learned" else 0
    embeddings = vocab * (1 if m.tie_embeddings else 2) + positions
    return embeddings + L * per_block + C + bias * C  # + final LayerNorm


def activation_bytes(m: ModelConfig, tokens: int, act: int) -> tuple[int, int]:
    """(kept for backward, largest recomputed part) bytes for `tokens` tokens, checkpointed."""
    parts = block_saved_bytes(m, act)
    kept_input = 4 * m.n_embd  # a checkpointed part keeps only its float32 input
    kept, recompute = 0, 0
    for part in checkpoint_plan(m.activation_checkpointing, m.n_layer):
        if part == "block":
            kept += kept_input
            recompute = max(recompute, parts["attention"] + parts["mlp"])
        elif part in parts:
            other = "mlp" if part == "attention" else "attention"
            kept += kept_input + parts[other]
            recompute = max(recompute, parts[part])
        else:
            kept += parts["attention"] + parts["mlp"]
    final = 4 * m.n_embd + act * m.n_embd  # ln_f input, lm_head input
    return (kept + final) * tokens, recompute * tokens


def loss_bytes(m: ModelConfig, tokens: int, act: int) -> int:
    """The LM head + loss at its peak. full: the (padded) logits, their float32 log-softmax kept
    for backward and its float32 gradient. chunked: one chunk's float32 logits (turned into their
    gradient in place; + a 16-bit copy under autocast), and the input and float32 head gradients
    it makes in forward (measured: docs/memory.md)."""
    C, V = m.n_embd, m.vocab_size
    capped = 4 * V if m.logit_softcap else 0  # the float32 tanh, kept (a chunk: a second buffer)
    if m.loss == "chunked":
        chunk = loss_chunk_rows(tokens, V) * (V * (4 if act == 4 else 4 + act) + capped)
        return chunk + act * tokens * C + 4 * V * C
    return tokens * (act * padded_vocab_size(m.vocab_size, m.vocab_pad_multiple) + 8 * V + capped)


def estimate(cfg: Config, world_size: int = 1) -> MemoryEstimate:
    """Memory of one training process (model.vocab_size set); FSDP splits the states."""
    m, t = cfg.model, cfg.train
    params = parameter_count(m)
    shards = world_size if world_size > 1 and cfg.system.parallel == "fsdp" else 1
    act = 4 if cfg.system.dtype == "float32" else 2
    tokens = t.batch_size * m.block_size
    activations, recompute = activation_bytes(m, tokens, act)
    weight = 2 if cfg.system.weights_dtype == "bfloat16" else 4
    master = params if weight == 2 else 0  # the float32 master copy
    matrices = 12 * m.n_embd ** 2 * m.n_layer  # the blocks' Linear weights
    state_floats = optim.state_floats(t.optimizer, params, matrices) + master
    return MemoryEstimate(weights=weight * params // shards, gradients=weight * params // shards,
                          optimizer=state_floats * 4 // shards,
                          activations=activations, logits=loss_bytes(m, tokens, act),
                          recompute=recompute)


def size_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def format_estimate(e: MemoryEstimate, cfg: Config) -> str:
    parts = [("weights", e.weights), ("grads", e.gradients), (cfg.train.optimizer, e.optimizer),
             ("activations", e.activations), ("logits+loss", e.logits),
             ("recompute", e.recompute)]
    body = " + ".join(f"{name} {size_text(b)}" for name, b in parts if b)
    return (f"memory estimate: {body} = {size_text(e.total)} per process "
            f"(micro-batch {cfg.train.batch_size}x{cfg.model.block_size}, {cfg.system.dtype}, "
            f"checkpointing={cfg.model.activation_checkpointing})")


def describe(cfg: Config, world_size: int) -> str:
    """`python train.py --estimate-memory`: the estimate, without building the model."""
    dtype, _ = runtime.resolve_dtype(cfg.system.dtype, runtime.resolve_device(cfg.system.device))
    cfg = dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, dtype=dtype))
    return (f"model: {parameter_count(cfg.model) / 1e6:.2f}M parameters, {world_size} "
            f"process(es)\n" + format_estimate(estimate(cfg, world_size), cfg))


def release_cached(device: torch.device, enabled: bool) -> bool:
    """system.empty_cache: hand cached CUDA blocks back, between phases only (inside a step it
    would only force new cudaMallocs). Returns whether it ran."""
    if not enabled or device.type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # resets VmHWM (peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak bytes since the last reset: CUDA allocated/reserved, else the process's peak RSS."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"rss": int(line.split()[1]) * 1024}
    try:
        import resource
    except ImportError:  # Windows: no peak RSS without extra packages
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss": peak if sys.platform == "darwin" else peak * 1024}
