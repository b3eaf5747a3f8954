"""The GPT-2 model, self-contained: config, blocks, one KV cache, init, context cropping and
optimizer groups; each part switches between a written-out reference and a fast implementation.

    logits, loss = GPT(ModelConfig(vocab_size=65))(idx, targets)   # (B, T, vocab), float32 loss
"""
import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -1


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field: its default, one line of help, and optionally the allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    """The GPT's shape and which implementation each part uses. The model sees only this."""

    block_size: int = opt(256, "context length in tokens")
    vocab_size: int = opt(0, "vocabulary size; 0 = take it from the dataset's meta.json")
    n_layer: int = opt(6, "transformer blocks")
    n_head: int = opt(6, "attention heads per block")
    n_embd: int = opt(384, "embedding width")
    dropout: float = opt(0.0, "dropout probability (0 for pretraining, ~0.1 for finetuning)")
    bias: bool = opt(True, "biases in Linear and LayerNorm layers, as GPT-2")
    layer_norm_eps: float = opt(1e-5, "LayerNorm epsilon")
    attention: str = opt("scratch", "softmax(QK^T/sqrt(d))V by hand, or "
                         "F.scaled_dot_product_attention (Flash kernels)", ("scratch", "sdpa"))
    causal_mask: str = opt("buffer", "causal mask: a (block, block) buffer, or built per call",
                           ("buffer", "on_the_fly"))
    norm: str = opt("scratch", "LayerNorm: written out, or F.layer_norm", ("scratch", "native"))
    activation: str = opt("gelu_tanh", "the MLP's activation: GPT-2's tanh GELU, the exact (erf) "
                          "GELU (nanoGPT's nn.GELU; about 2x faster than tanh on AVX2 CPUs), or "
                          "relu(x)^2", ("gelu_tanh", "gelu_erf", "relu2"))
    activation_impl: str = opt("scratch", "the activation written out by hand, or torch's kernel "
                               "(F.gelu; for relu2 a backward of one product)",
                               ("scratch", "native"))
    vocab_pad_multiple: int = opt(1, "pad the embedding/LM head rows to a multiple of this "
                                  "(64: 50257 -> 50304); padded logits never win")
    activation_checkpointing: str = opt("none", "recompute in backward (less memory, ~1/3 more "
                                        "compute): none|all|attention|mlp|every:K|blocks:0,3,5")
    loss: str = opt("full", "LM head + cross-entropy: the whole (tokens, vocab) logits, or in "
                    "chunks of tokens so they never exist (same loss and gradients)",
                    ("full", "chunked"))
    # the speedrun's techniques (docs/speedrun.md): each off by default, and with every one off
    # the model is GPT-2
    position: str = opt("learned", "positions: GPT-2's learned embedding added to the tokens, or "
                        "rotary (RoPE: each head's queries and keys rotated by their position)",
                        ("learned", "rotary"))
    rope_base: float = opt(10000.0, "position=rotary: the base of the rotation frequencies")
    qk_norm: bool = opt(False, "RMS-normalize each head's queries and keys before attention "
                        "(no weights): attention logits stay bounded at high learning rates")
    attn_scale: float = opt(0.0, "attention logits = scale x q.k; 0 = 1/sqrt(head size) "
                            "(GPT-2). With qk_norm the logits lie within +-scale x head size: "
                            "0.3 trained better than 1/sqrt at head size 32 (docs/speedrun.md); "
                            "the speedrun uses 0.12 at 128")
    tie_embeddings: bool = opt(True, "the LM head is the token embedding (GPT-2); false: an "
                               "LM head of its own")
    zero_init_head: bool = opt(False, "an untied LM head starts at zero (uniform first logits)")
    zero_init_proj: bool = opt(False, "the blocks' output projections (attn.c_proj, mlp.c_proj) "
                               "start at zero: each block starts as the identity")
    logit_softcap: float = opt(0.0, "logits = cap * tanh(logits / cap) (Gemma 2; the speedrun "
                               "uses 30 or 15); 0 = off")
    unet_skips: bool = opt(False, "U-net skips: block i's output, times a learned weight that "
                           "starts at 0, is added to the input of block n_layer-1-i, for each "
                           "i in the first half")
    smear: bool = opt(False, "each token's embedding gets the previous token's added, times a "
                      "learned per-channel weight that starts at 0 (the speedrun's smear: a "
                      "bigram the first block sees directly)")


SPEEDRUN_FIELDS = ("position", "qk_norm", "attn_scale", "tie_embeddings", "zero_init_head",
                   "zero_init_proj", "logit_softcap", "unet_skips", "smear")


def departures(cfg: ModelConfig) -> list[str]:
    """The speedrun techniques this config turns on ('position=rotary', ...; [] = GPT-2)."""
    default = ModelConfig()
    return [f"{name}={getattr(cfg, name)}" for name in SPEEDRUN_FIELDS
            if getattr(cfg, name) != getattr(default, name)]


def checkpoint_plan(spec: str, n_layer: int) -> list[str]:
    """model.activation_checkpointing -> what each block recomputes in backward: '' (nothing),
    'block', 'attention' (ln_1 + attention) or 'mlp' (ln_2 + MLP). Raises ValueError."""
    parts = {"none": "", "all": "block", "attention": "attention", "mlp": "mlp"}
    spec = spec.strip().lower()
    if spec in parts:
        return [parts[spec]] * n_layer
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


def float32(x: torch.Tensor | None) -> torch.Tensor | None:
    """x in float32; float32 x itself (a decoded token runs ~1,000 small ops: each one counts)."""
    return x if x is None or x.dtype == torch.float32 else x.float()


def run(module: nn.Module, *args: Any) -> Any:
    """A block's part, module(*args); in inference (autograd off) its forward directly. Each
    nn.Module call costs a few microseconds of hook checks, and a decoded token of the default
    model makes 54 of them inside its blocks: ~5% of the token. The blocks themselves are
    always called as modules (FSDP's hooks sit there), and training keeps every hook."""
    return module(*args) if torch.is_grad_enabled() else module.forward(*args)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias: the math written out (scratch), or F.layer_norm (native)."""

    def __init__(self, dim: int, bias: bool, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.impl == "native" and x.dtype == w.dtype == torch.float32:  # one call, no casts
            return F.layer_norm(x, w.shape, w, b, self.eps)
        # precision policy: statistics and affine in float32 whatever the weights' dtype
        w, b, x32 = float32(w), float32(b), float32(x)
        if self.impl == "native":
            y = F.layer_norm(x32, w.shape, w, b, self.eps)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        mean = x32.mean(dim=-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        y = (x32 - mean) * torch.rsqrt(var + self.eps) * w
        return (y + b if b is not None else y).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: the tanh approximation, written out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class Activation:
    """One choice of model.activation, with what other code asks of it: its math (written out,
    or torch's kernel), how many hidden-width tensors backward keeps (the memory estimate), its
    name in a Hugging Face GPT2Config (the export) and its number in the CPU decode kernel."""

    hf_names: tuple[str, ...] = ()  # GPT2Config.activation_function values; the first exports
    kernel_id: int = -1  # activation() in engine/cpu_kernels.cpp; -1: not there (torch decodes)

    def __call__(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        raise NotImplementedError

    def saved_tensors(self, native: bool) -> int:
        """Tensors of the hidden layer's size (tokens, 4C) that backward keeps for it."""
        return 1


class GeluTanh(Activation):
    hf_names, kernel_id = ("gelu_new", "gelu_pytorch_tanh"), 0

    def __call__(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        return F.gelu(x, approximate="tanh") if native else gelu_tanh(x)

    def saved_tensors(self, native: bool) -> int:
        return 1 if native else 4  # written out: x, x^3, the tanh and its argument


class GeluErf(Activation):
    hf_names, kernel_id = ("gelu",), 1

    def __call__(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        return F.gelu(x)  # one kernel either way: there is no shorter way to write erf


class ReluSquaredFunction(torch.autograd.Function):
    """relu(x)^2 with its derivative written as one product, 2 relu(x) * grad. Autograd's own
    backward for r * r takes grad * r twice, adds them and masks the sum where x < 0: four
    passes over the hidden layer where this takes two."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative raises, not a wrong 0
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        return (grad * r).mul_(2.0)  # r is 0 wherever x < 0: no mask needed


class ReluSquared(Activation):
    """relu(x)^2 (So et al. 2021, Primer), the modded-nanogpt speedrun's MLP."""

    hf_names, kernel_id = ("relu2",), 2

    def __call__(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        if native:
            return ReluSquaredFunction.apply(x)
        r = F.relu(x)  # backward keeps r once; r * r's backward is ~3x faster than square()'s
        return r * r


ACTIVATIONS: dict[str, Activation] = {"gelu_tanh": GeluTanh(), "gelu_erf": GeluErf(),
                                      "relu2": ReluSquared()}


class KVCache:
    """Keys and values per layer, (2, B, nh, S, hs) (S: block_size unless given), written at the
    caller's explicit positions: input_pos (T,), the same for every row (a prompt, generate.py's
    steps), or (B, T), each row its own (serve.py's slots, each sequence at its own length). A
    call with fewer rows than the cache uses its first rows.

    With `filled` unset, attention reads every position under a mask of each query's past: one
    shape for every step, as compiled code needs. A caller that has written everything at
    positions 0..filled-1 sets filled; eager attention then reads only those (a single token per
    row at the last of them needs no mask: a whole read of GPT-2's 1024 slots costs ~72 MB per
    token, and the mask ops cost more than the attention). Stale keys beyond a query are never
    seen."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype,
                 positions: int | None = None):
        shape = (2, batch, cfg.n_head, positions or cfg.block_size, cfg.n_embd // cfg.n_head)
        self.kv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.slots = torch.arange(shape[3], device=device)
        self.filled: int | None = None
        # model.smear: each row's tokens at their positions, (B, S), for the token before each
        self.tokens = torch.zeros(shape[1], shape[3], dtype=torch.long, device=device) \
            if cfg.smear else None

    def update(self, layer: int, input_pos: torch.Tensor, kv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store kv (2, rows, nh, T, hs), keys and values, at input_pos (T,) or (rows, T) -> the
        layer's keys and values (rows, nh, n, hs) and the mask of what each query sees, (T, n)
        or (rows, 1, T, n) (None: everything)."""
        rows, T = kv.size(1), kv.size(3)
        cache = self.kv[layer][:, :rows]
        kv = kv if kv.dtype == cache.dtype else kv.to(cache.dtype)
        if input_pos.dim() == 1:
            cache.index_copy_(3, input_pos, kv)
        else:
            cache.scatter_(3, input_pos.view(1, rows, 1, T, 1).expand_as(kv), kv)
        n = self.filled
        if n is None or torch.compiler.is_compiling():
            n = cache.size(3)
        elif T == 1 and (rows == 1 or input_pos.dim() == 1):  # each row's one query sees all n
            return cache[0, :, :, :n], cache[1, :, :, :n], None
        if input_pos.dim() == 1:
            mask = self.slots[None, :n] <= input_pos[:, None]  # (T, n)
        else:
            mask = (self.slots[:n] <= input_pos[..., None])[:, None]  # (rows, 1, T, n)
        return cache[0, :, :, :n], cache[1, :, :, :n], mask

    def previous_tokens(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Store idx (rows, T) at input_pos (T,) or (rows, T) -> the token before each, (rows,
        T): the one stored at position - 1 (at position 0 whatever is there; the caller
        leaves it out)."""
        rows, T = idx.shape
        tokens, where = self.tokens[:rows], input_pos.expand(rows, T)
        tokens.scatter_(1, where, idx)
        return tokens.gather(1, (where - 1).clamp(min=0))

    def rows(self, first: int, count: int = 1) -> "KVCache":
        """A view of rows first..first+count-1 (the same storage): one slot decoding alone."""
        view = copy.copy(self)
        view.kv = [kv[:, first:first + count] for kv in self.kv]
        if self.tokens is not None:
            view.tokens = self.tokens[first:first + count]
        return view

    def copy_row(self, row: int, source: "KVCache", length: int, source_row: int = 0) -> None:
        """Copy positions 0..length-1 of source's row source_row into this cache's row."""
        for mine, theirs in zip(self.kv, source.kv):
            mine[:, row, :, :length].copy_(theirs[:, source_row, :, :length])
        if self.tokens is not None:
            self.tokens[row, :length].copy_(source.tokens[source_row, :length])


SLICED_MIN_BYTES = 1 << 20  # smaller weights are multiplied by one F.linear


class Linear(nn.Linear):
    """nn.Linear, with one fast path for decoding: with slices > 1 (sampling.set_matvec), a
    single row times a float weight of SLICED_MIN_BYTES or more, stored row- or column-major,
    goes through sliced_matvec."""

    slices = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.slices > 1 and x.numel() == self.in_features and type(w) is nn.Parameter and (
                w.nbytes >= SLICED_MIN_BYTES and (w.is_contiguous() or w.t().is_contiguous())):
            return sliced_matvec(x, w, self.bias, self.slices)
        return F.linear(x, w, self.bias)


def sliced_matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  slices: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for x holding one row, with the outputs cut into `slices`
    equal blocks (the few left over done apart) that one bmm multiplies side by side, a thread
    each. On the 2-core AMD EPYC MKL's matrix-vector product reads a weight at about one core's
    bandwidth, as fast at two threads as at one; sliced, two threads read it 1.1-1.7x faster
    from 1 MiB weights up, and slower below (0.3x at 64 KiB: the bmm's overhead outweighs the
    read). weight is row-major (out, in) or column-major (its transpose contiguous)."""
    out, width = weight.shape
    cut = out // slices * slices
    if weight.is_contiguous():  # each slice a block of rows, used transposed
        blocks = weight[:cut].view(slices, cut // slices, width).transpose(1, 2)
    else:  # each slice a block of columns of the contiguous (in, out) matrix
        blocks = weight.t()[:, :cut].view(width, slices, cut // slices).transpose(0, 1)
    rows = x.reshape(1, 1, width).expand(slices, 1, width)
    if bias is None:
        y = torch.bmm(rows, blocks)  # (slices, 1, out / slices)
    else:
        y = torch.baddbmm(bias[:cut].view(slices, 1, cut // slices), rows, blocks)
    y = y.view(*x.shape[:-1], cut)
    if cut < out:
        rest = F.linear(x, weight[cut:], None if bias is None else bias[cut:])
        y = torch.cat([y, rest], dim=-1)
    return y


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer), model.position=rotary: a head's
    vector x is cut in halves (x1, x2) and each pair (x1[i], x2[i]) at position p is rotated by
    the angle p * base^(-2i / head_size). A query and a key rotated this way have a dot product
    that depends on their positions only through their distance."""

    def __init__(self, head_size: int, positions: int, base: float):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"model.position=rotary needs an even head size (n_embd / n_head), "
                             f"got {head_size}")
        freq = base ** -(torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
        angle = torch.arange(positions, dtype=torch.float64)[:, None] * freq  # (S, hs / 2)
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., B, nh, T, hs) at positions (T,), or (B, T): each row its own."""
        cos, sin = self.cos[positions], self.sin[positions]  # (T, hs/2) or (B, T, hs/2)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """model.logit_softcap: cap * tanh(logits / cap) in float32 (0: the logits as they are).
    Near zero it is the identity; no logit gets past +-cap."""
    return logits if not cap else torch.tanh(logits.float() / cap) * cap


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.impl = layer, cfg.n_head, cfg.attention
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attn_scale or None  # None: 1/sqrt(head size), GPT-2's
        self.rotary = None
        if cfg.position == "rotary":
            self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_base)
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.causal_mask == "buffer":
            mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).tril()
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        qkv = run(self.c_attn, x).view(B, T, 3, self.n_head, hs).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, T, hs) each
        if self.qk_norm or self.rotary is not None:  # q and k together: half the calls
            qk = F.rms_norm(qkv[:2], (hs,)) if self.qk_norm else qkv[:2]
            if self.rotary is not None:
                qk = self.rotary(qk, torch.arange(T, device=x.device) if input_pos is None
                                 else input_pos)
            q, k = qk.unbind(0)
        if kv_cache is not None:  # k, v: (B, nh, T_k, hs), mask (T, T_k) or None: sees all
            plain = not self.qk_norm and self.rotary is None  # k and v: views of qkv, stored
            k, v, mask = kv_cache.update(self.layer, input_pos,
                                         qkv[1:] if plain else torch.stack((k, v)))
        else:
            mask = None  # sdpa without a buffer: is_causal
            if hasattr(self, "mask"):
                mask = self.mask[:T, :T]
            elif self.impl == "scratch":  # built on the fly
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        dropout_p = self.attn_dropout.p if self.training else 0.0
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                               is_causal=mask is None and kv_cache is None,
                                               scale=self.scale)
        else:
            scale = self.scale or 1.0 / math.sqrt(hs)
            att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, T, T_k)
            if mask is not None:
                att = att.masked_fill(~mask, float("-inf"))
            att = F.softmax(att.float(), dim=-1).to(q.dtype)
            y = self.attn_dropout(att) @ v  # (B, nh, T, hs)
        y = run(self.c_proj, y.transpose(1, 2).contiguous().view(B, T, C))
        return self.resid_dropout(y) if self.training else y  # eval: dropout is the identity


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.activation, self.native = ACTIVATIONS[cfg.activation], cfg.activation_impl == "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = run(self.c_proj, self.activation(run(self.c_fc, x), self.native))  # c_fc: (B, T, 4C)
        return self.dropout(h) if self.training else h


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.mlp = MLP(cfg)
        self.recompute = checkpoint_plan(cfg.activation_checkpointing, cfg.n_layer)[layer]

    def attn_branch(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                    input_pos: torch.Tensor | None = None) -> torch.Tensor:
        return run(self.attn, run(self.ln_1, x), kv_cache, input_pos)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return run(self.mlp, run(self.ln_2, x))

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None, part: str | None = None) -> torch.Tensor:
        # activation checkpointing (model.activation_checkpointing): keep only this part's input
        # and recompute the rest in backward; dropout replays the same masks (RNG is restored)
        if part is None:
            part = self.recompute if kv_cache is None and torch.is_grad_enabled() else ""
        if not part:  # nothing recomputed: every inference step, in as few calls as it takes
            x = x + run(self.attn, run(self.ln_1, x), kv_cache, input_pos)
            return x + run(self.mlp, run(self.ln_2, x))
        if part == "block":  # this forward with nothing recomputed inside
            return checkpoint(self.forward, x, None, None, "", use_reentrant=False)
        if part == "attention":
            x = x + checkpoint(self.attn_branch, x, use_reentrant=False)
        else:
            x = x + self.attn_branch(x, kv_cache, input_pos)
        if part == "mlp":
            return x + checkpoint(self.mlp_branch, x, use_reentrant=False)
        return x + self.mlp_branch(x)


def block_saved_bytes(cfg: ModelConfig, act: int) -> dict[str, int]:
    """Bytes per token one block keeps for backward, per branch (the memory estimate, made
    before any model exists); act: the matmul inputs' bytes per element (4, or 2 under
    autocast)."""
    C, T, nh = cfg.n_embd, cfg.block_size, cfg.n_head
    ln = 4 * C if cfg.norm == "native" else 8 * C  # native: its input; scratch: x-mean and x-hat
    if cfg.attention == "sdpa":  # q, k, v, the output, and the c_attn / c_proj inputs
        attention = 3 * act * C + act * C
    else:  # q, k, v, the float32 softmax output and its cast copy for att @ v
        attention = 3 * act * C + (4 + act) * nh * T
        attention += nh * T if cfg.dropout > 0 else 0
    if cfg.qk_norm or cfg.position == "rotary":  # new q and k tensors, kept by attention
        attention += 2 * act * C
    attn = ln + act * C + attention + act * C
    native = cfg.activation_impl == "native"
    activation = ACTIVATIONS[cfg.activation].saved_tensors(native) * 4 * C * act
    mlp = ln + act * C + activation + 4 * act * C  # + the c_fc and c_proj inputs
    if cfg.dropout > 0:  # one byte per element for each dropout mask
        attn, mlp = attn + C, mlp + C
    return {"attention": attn, "mlp": mlp}


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


LOSS_CHUNK_LOGITS = 2**25  # logits per chunk of model.loss=chunked: 128 MiB in float32


def loss_chunk_rows(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the chunked loss (667 at GPT-2's vocabulary). Far fewer rows (torch's
    default: 32 for 4,096 tokens) leave CPU matmuls re-reading the whole head for little work."""
    return max(1, min(tokens, LOSS_CHUNK_LOGITS // vocab))


def _chunk_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                row_weight: torch.Tensor, grad_x: torch.Tensor | None,
                grad_w: torch.Tensor | None, cap: float = 0.0) -> torch.Tensor:
    """One chunk of ChunkedCrossEntropy -> its share of the mean loss; its gradients go into
    grad_x (the chunk's rows) and add to grad_w. Its (rows, V) buffers die on return."""
    logits = (x @ weight.T).float()  # (rows, V): the only logits that exist
    squashed = None
    if cap:  # model.logit_softcap: cap * tanh(logits / cap)
        squashed = logits.div_(cap).tanh_()
        logits = squashed * cap
    picked = targets.clamp(min=0)[:, None]  # ignored rows: any class, their row_weight is 0
    target_logit = logits.gather(1, picked).squeeze(1)
    peak = logits.amax(dim=-1, keepdim=True)  # logsumexp in place: no second (rows, V) buffer
    exp = logits.sub_(peak).exp_()
    total = exp.sum(dim=-1, keepdim=True)
    loss = ((peak + total.log()).squeeze(1) - target_logit).mul_(row_weight).sum()
    if grad_x is None and grad_w is None:
        return loss
    # d(mean loss)/d(logits) = (softmax - one_hot(target)) * row_weight
    grad = exp.div_(total).scatter_add_(1, picked, -torch.ones_like(logits[:, :1]))
    grad = grad.mul_(row_weight[:, None])
    if squashed is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh(z / cap)^2
        grad = grad.mul_(squashed.square_().neg_().add_(1))
    grad = grad.to(x.dtype)
    if grad_x is not None:
        grad_x.copy_(grad @ weight)
    if grad_w is not None and grad.dtype == torch.float32:
        grad_w.addmm_(grad.T, x)
    elif grad_w is not None:  # bf16 products, summed over chunks in float32
        grad_w += grad.T @ x
    return loss


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight.T, one chunk of tokens at a time: each chunk's logits
    give its loss and, at once, its gradients (kept for backward, which only scales them).
    Where torch's F.linear_cross_entropy is missing or rounds the loss (see chunked_loss_impl)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                cap: float = 0.0) -> torch.Tensor:
        # x (N, C), weight (V, C), targets (N,) with IGNORE_INDEX where nothing is predicted
        valid = targets != IGNORE_INDEX
        row_weight = valid / valid.sum()  # (N,): 1/count, 0 where ignored
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        rows = loss_chunk_rows(x.size(0), weight.size(0))
        loss = torch.zeros((), device=x.device)
        for start in range(0, x.size(0), rows):
            chunk = slice(start, start + rows)
            loss += _chunk_loss(x[chunk], weight, targets[chunk], row_weight[chunk],
                                None if grad_x is None else grad_x[chunk], grad_w, cap)
        ctx.grads, ctx.weight_dtype = (grad_x, grad_w), weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.grads
        del ctx.grads  # the gradients are scaled in place: backward runs once
        if grad_x is not None:
            grad_x.mul_(grad_loss)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None


def chunked_loss_impl(dtype: torch.dtype, cap: float = 0.0) -> str:
    """Which chunked loss runs for matmuls in this dtype: 'torch' (F.linear_cross_entropy, torch
    >= 2.13) or 'ours' (ChunkedCrossEntropy; also for bf16, whose loss torch's rounds to bf16,
    and with a logit soft-cap, which torch's does not apply)."""
    native = hasattr(F, "linear_cross_entropy") and dtype != torch.bfloat16 and not cap
    return "torch" if native else "ours"


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          cap: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (x (..., C), weight (V, C)) against targets
    (...,), IGNORE_INDEX skipped, computed by chunks of tokens: the logits never exist whole.
    cap > 0: the logits soft-capped first (model.logit_softcap).
    The matmuls run in autocast's dtype, as the full path's LM head would; the loss is float32."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    x, weight, targets = x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), targets.reshape(-1)
    if chunked_loss_impl(dtype, cap) == "torch":
        rows = loss_chunk_rows(x.size(0), weight.size(0))
        return F.linear_cross_entropy(x, weight, targets, ignore_index=IGNORE_INDEX,
                                      options=nn.LinearCrossEntropyOptions(batch_chunk_size=rows))
    return _chunked_eager(x, weight, targets, cap)


_chunks_outside_compile = None  # torch.compiler.disable(ChunkedCrossEntropy.apply), on first use


def _chunked_eager(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   cap: float) -> torch.Tensor:
    """ChunkedCrossEntropy.apply, kept out of compiled graphs (the chunk loop is large matmuls:
    nothing to gain). The wrapper is made on first use, not at import: making it imports
    torch._dynamo, ~1.2 s of start-up here that generate.py and serve.py need not pay."""
    global _chunks_outside_compile
    if _chunks_outside_compile is None:
        _chunks_outside_compile = torch.compiler.disable(ChunkedCrossEntropy.apply)
    return _chunks_outside_compile(x, weight, targets, cap)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size is 0: set it, or let train.py take it from the "
                             "dataset's meta.json")
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(self.padded_vocab, cfg.n_embd),
            # learned positions (GPT-2); with rotary ones, attention rotates q and k instead
            **({"wpe": nn.Embedding(cfg.block_size, cfg.n_embd)}
               if cfg.position == "learned" else {}),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm),
        ))
        self.lm_head = Linear(cfg.n_embd, self.padded_vocab, bias=False)
        if cfg.unet_skips:  # skip_weights[i]: block i's output into block n_layer-1-i's input
            self.skip_weights = nn.Parameter(torch.zeros(cfg.n_layer // 2))
        if cfg.smear:  # the previous token's embedding, per channel, into each token's
            self.smear_weights = nn.Parameter(torch.zeros(cfg.n_embd))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2 scales the residual output projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
                if cfg.zero_init_proj:  # after the draw: the other weights stay GPT-2's
                    nn.init.zeros_(p)
        if cfg.zero_init_head:
            if cfg.tie_embeddings:
                raise ValueError("model.zero_init_head needs model.tie_embeddings=false: a tied "
                                 "head is the token embedding, which must not start at zero")
            nn.init.zeros_(self.lm_head.weight)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (the LM head is tied). non_embedding drops wte and wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.learned_positions()
        return n

    def learned_positions(self) -> int:
        """Parameters of the learned position embedding (0 with rotary positions)."""
        return self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B), N without the wpe."""
        cfg = self.config
        n = self.num_params(non_embedding=False) - self.learned_positions()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, input_pos: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) -> (logits (B, T, vocab), loss). With a kv_cache the tokens sit at
        input_pos (T,) (default 0..T-1); the caller keeps those below block_size. logits_at (K,)
        or (B, K), each row's own: the LM head only at these indices into T -> logits
        (B, K, vocab) (a prefill's last).
        With targets and model.loss=chunked the logits never exist: (None, loss)."""
        if logits_at is not None and targets is not None:
            raise ValueError("logits_at is for inference: pass targets or logits_at, not both")
        B, T = idx.size()
        if input_pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of {T} tokens is longer than block_size "
                                 f"{self.config.block_size}; crop the input")
            input_pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.smear:
            x = x + self.smear_weights * self.previous_embeddings(idx, x, kv_cache, input_pos)
        if "wpe" in self.transformer:  # learned positions; rotary ones act in attention
            x = x + self.transformer.wpe(input_pos)
        x = float32(x)
        if self.training:  # precision policy (above): the residual stream is float32
            x = self.transformer.drop(x)
        unet, n, outputs = self.config.unet_skips, len(self.transformer.h), []
        for i, block in enumerate(self.transformer.h):
            if unet and i >= n - n // 2:  # model.unet_skips: block n-1-i's output comes back
                x = x + self.skip_weights[n - 1 - i] * outputs[n - 1 - i]
            x = block(x, kv_cache, input_pos)  # (B, T, C)
            if unet and i < n // 2:
                outputs.append(x)
        x = self.transformer.ln_f(x)
        if targets is not None and self.config.loss == "chunked":  # padded rows left out
            return None, chunked_cross_entropy(x, self.lm_head.weight[:self.vocab_size], targets,
                                               self.config.logit_softcap)
        if logits_at is not None:  # (K,): the same for every row; (B, K): each row's own
            x = x[:, logits_at] if logits_at.dim() == 1 else x.gather(
                1, logits_at[..., None].expand(-1, -1, x.size(-1)))  # (B, K, C)
        logits = self.lm_head(x)[..., :self.vocab_size]  # (B, T, vocab): padded rows never win
        logits = softcap(logits, self.config.logit_softcap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab_size),
                                   targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def previous_embeddings(self, idx: torch.Tensor, x: torch.Tensor, kv_cache: KVCache | None,
                            input_pos: torch.Tensor) -> torch.Tensor:
        """model.smear: the token embedding of the token before each of idx's (B, T), whose own
        are x; zero at position 0. Without a cache idx starts at position 0; with one, the
        tokens before come from the cache, which keeps each row's."""
        if kv_cache is None:
            return F.pad(x[:, :-1], (0, 0, 1, 0))
        before = self.transformer.wte(kv_cache.previous_tokens(idx, input_pos))
        return before * (input_pos > 0).expand(idx.shape)[..., None]

    def new_kv_cache(self, batch: int, positions: int | None = None) -> KVCache:
        """An empty cache of `positions` (default block_size), on the weights' device and in
        the dtype of the residual stream's inputs (the position embedding's, else the token
        embedding's: float32 unless the model is bf16)."""
        t = self.transformer
        p = t.wpe.weight if "wpe" in t else t.wte.weight
        return KVCache(self.config, batch, p.device, p.dtype, positions)

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context (e.g. 1024 -> 256) by keeping the first position embeddings."""
        self.config.block_size = block_size
        if "wpe" in self.transformer:
            wpe = self.transformer.wpe
            wpe.weight = nn.Parameter(wpe.weight.data[:block_size].clone())
            wpe.num_embeddings = block_size
        for block in self.transformer.h:  # rotary angles past block_size are never read
            if hasattr(block.attn, "mask"):
                block.attn.mask = block.attn.mask[:block_size, :block_size]

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices (Linear and embedding weights) only, not biases or norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
