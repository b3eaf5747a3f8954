"""The GPT-2 architecture, written out, with every part switchable between a plain reference
implementation and the fast one (see ModelConfig in config.py).

forward(idx, targets=None) -> (logits, loss): logits for every position over the real vocabulary,
and the float32 cross-entropy loss when targets are given (targets == IGNORE_INDEX are skipped).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import ModelConfig, checkpoint_plan

IGNORE_INDEX = -1


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias; 'scratch' writes the math out, 'native' calls F.layer_norm."""

    def __init__(self, dim: int, bias: bool, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # precision policy: statistics and affine in float32 whatever the weights' dtype (no-op
        # casts when everything is float32 already); the output keeps the input's dtype
        w = self.weight.float()
        b = self.bias.float() if self.bias is not None else None
        x32 = x.float()
        if self.impl == "native":
            return F.layer_norm(x32, w.shape, w, b, self.eps).to(x.dtype)
        mean = x32.mean(dim=-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        y = (x32 - mean) * torch.rsqrt(var + self.eps) * w
        return (y + b if b is not None else y).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: the tanh approximation, written out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class KVCache:
    """Preallocated keys and values for every layer: (B, nh, max_len, hs) each, filled in place.

    Static shapes mean each decoded token does the same work and compiled code sees no new shapes.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, head_size: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (batch, n_head, max_len, head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.pos = 0  # tokens already stored

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, t, hs) at the current position; return all keys/values so far."""
        t = k.size(2)
        end = self.pos + t
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.pos += t


class StaticKVCache(KVCache):
    """A KVCache for compiled decoding: its position is a tensor, and attention reads the whole
    (B, nh, max_len, hs) cache under a mask of the filled positions, so every decode step has the
    same shapes and no changing Python number for torch.compile to specialise on (no
    recompiles). The caller checks the length (it cannot be read without a device sync)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.position = torch.zeros((), dtype=torch.long, device=self.k[0].device)

    def positions(self, t: int) -> torch.Tensor:
        """(t,) positions of the next t tokens."""
        return self.position + torch.arange(t, device=self.position.device)

    def mask(self, t: int) -> torch.Tensor:
        """(t, max_len) boolean: query i (at position+i) sees every key up to its own."""
        keys = torch.arange(self.max_len, device=self.position.device)
        return keys[None, :] <= self.positions(t)[:, None]

    def update(self, layer: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.positions(k.size(2))
        self.k[layer].index_copy_(2, index, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, index, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]  # (B, nh, max_len, hs): the mask hides the rest

    def advance(self, t: int) -> None:
        self.position += t

    def set_length(self, t: int) -> None:
        """After a padded prefill: only the first t positions hold real tokens."""
        self.position.fill_(t)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.impl = cfg.attention
        self.mask_mode = cfg.causal_mask
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        if self.mask_mode == "buffer":
            mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).tril()
            self.register_buffer("mask", mask, persistent=False)

    def causal_mask(self, q_start: int, t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
        """(t_q, t_k) boolean, True where query position q_start+i may see key j."""
        if self.mask_mode == "buffer":
            return self.mask[q_start:q_start + t_q, :t_k]
        q_pos = torch.arange(q_start, q_start + t_q, device=device)
        return torch.arange(t_k, device=device)[None, :] <= q_pos[:, None]

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        q_start, static_mask = 0, None
        if isinstance(kv_cache, StaticKVCache):
            static_mask = kv_cache.mask(T)  # (T, max_len)
            k, v = kv_cache.update(self.layer, k, v)  # (B, nh, max_len, hs)
        elif kv_cache is not None:
            q_start = kv_cache.pos
            k, v = kv_cache.update(self.layer, k, v)  # (B, nh, q_start+T, hs)
        t_k = k.size(2)
        if self.impl == "sdpa":
            dropout_p = self.dropout if self.training else 0.0
            if static_mask is not None:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=static_mask,
                                                   dropout_p=dropout_p)
            elif q_start == 0 and self.mask_mode == "on_the_fly":
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            elif T == 1:  # one new query sees every cached key
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            else:
                mask = self.causal_mask(q_start, T, t_k, x.device)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, t_k)
            mask = static_mask if static_mask is not None else self.causal_mask(q_start, T, t_k,
                                                                                x.device)
            att = att.masked_fill(~mask, float("-inf"))
            att = F.softmax(att.float(), dim=-1).to(q.dtype)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.native_gelu = cfg.gelu == "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = F.gelu(h, approximate="tanh") if self.native_gelu else gelu_tanh(h)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.mlp = MLP(cfg)
        self.recompute = checkpoint_plan(cfg.activation_checkpointing, cfg.n_layer)[layer]

    def attn_branch(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        return self.attn(self.ln_1(x), kv_cache)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_2(x))

    def body(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn_branch(x, kv_cache)
        return x + self.mlp_branch(x)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # activation checkpointing (model.activation_checkpointing): keep only this part's input
        # and recompute the rest in backward; dropout replays the same masks (RNG is restored)
        part = self.recompute if kv_cache is None and torch.is_grad_enabled() else ""
        if part == "block":
            return checkpoint(self.body, x, use_reentrant=False)
        if part == "attention":
            x = x + checkpoint(self.attn_branch, x, use_reentrant=False)
            return x + self.mlp_branch(x)
        if part == "mlp":
            x = x + self.attn_branch(x, kv_cache)
            return x + checkpoint(self.mlp_branch, x, use_reentrant=False)
        return self.body(x, kv_cache)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


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
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, self.padded_vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2
        self.apply(self._init_weights)
        # GPT-2 scales the residual output projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (the LM head is tied). non_embedding drops wte and wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12*L*H*Q*T for attention (PaLM
        appendix B), where N counts the weights that multiply (all but the position table)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        n = self.num_params(non_embedding=False) - self.transformer.wpe.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.size()
        if isinstance(kv_cache, StaticKVCache):  # its caller keeps within block_size
            pos = kv_cache.positions(T)
        else:
            start = kv_cache.pos if kv_cache is not None else 0
            if start + T > self.config.block_size:
                raise ValueError(f"sequence of {start + T} tokens is longer than block_size "
                                 f"{self.config.block_size}; crop the input")
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        x = self.transformer.drop(x.float())  # precision policy: the residual stream is float32
        for block in self.transformer.h:
            x = block(x, kv_cache)  # (B, T, C)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)[..., :self.vocab_size]  # (B, T, vocab): padded rows never win
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab_size),
                                   targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def new_kv_cache(self, batch: int, max_len: int | None = None,
                     dtype: torch.dtype | None = None, static: bool = False) -> KVCache:
        cfg = self.config
        p = self.transformer.wte.weight
        kind = StaticKVCache if static else KVCache
        return kind(cfg.n_layer, batch, cfg.n_head, max_len or cfg.block_size,
                    cfg.n_embd // cfg.n_head, p.device, dtype or p.dtype)

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices (Linear and embedding weights) only, not biases or norms."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]
