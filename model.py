"""GPT-2 in one file: LayerNorm, attention, MLP, block and model, forward -> (logits, loss),
initialisation, context cropping and optimizer groups; its config, ModelConfig, is config.py's
model section (each field with its help and facts).

    logits, loss = GPT(ModelConfig(vocab_size=65))(idx, targets)   # (B, T, vocab), float32 loss

With every option at its default this is GPT-2 (the tests hold it to Hugging Face's GPT-2). The
speedrun's departures from GPT-2 are options, off by default, each acting in one marked place
(docs/speedrun.md):
    position=rotary   Rotary: q and k rotated by their position in attention, no wpe
    qk_norm           CausalSelfAttention.forward: each head's q and k RMS-normalized
    attn_scale        CausalSelfAttention.forward: the attention logits' scale
    value_embeds      GPT.forward: embeddings of the token added to attention's values
    activation=relu2  ReluSquared in the MLP
    tie_embeddings    GPT.__init__: false gives the LM head weights of its own
    zero_init_*       GPT.init_weights: an untied head, the blocks' projections start at zero
    logit_softcap     softcap(), at the end of GPT.forward
    unet_skips        GPT.forward: block i's output into block n_layer-1-i's input
    smear             GPT.forward: each token's embedding plus the previous token's
The other options compute the same math another way (attention, causal_mask, norm,
activation_impl, vocab_pad_multiple), or save memory with code loaded only when asked for
(activation_checkpointing, loss=chunked: engine/training/). The KV cache is decoding's
(engine/inference/kv_cache.py): forward only calls its update().
"""
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ModelConfig  # the model's section of the one config (torch-free: config.py)

IGNORE_INDEX = -1  # a target that counts in no loss
# each block's Linears, in the order forward runs them: the one list every other module reads
# (the packed kernels, LoRA, int8, the Hugging Face export, the sparse benchmark)
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias: the math written out (scratch), or F.layer_norm (native).
    Under autocast its statistics and affine stay float32, whatever the weights' dtype."""

    def __init__(self, dim: int, bias: bool, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps, self.impl = eps, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.float(), None if self.bias is None else self.bias.float()
        x32 = x.float()
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


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (So et al. 2021, Primer), the speedrun's MLP; backward keeps r once."""
    r = F.relu(x)
    return r * r


class ReluSquaredFunction(torch.autograd.Function):
    """relu(x)^2 with its derivative as one product, 2 relu(x) * grad: two passes over the hidden
    layer in backward, where autograd's for r * r takes four (grad * r twice, a sum, a mask)."""

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


@dataclass(frozen=True)
class Activation:
    """A model.activation and what other code asks of it: its math written out (scratch) and as
    a torch or fused kernel (native), its GPT2Config names (the first exports), its number in
    engine/inference/cpu_kernels.cpp (-1: none) and the (tokens, 4C) tensors backward keeps."""

    scratch: Any
    native: Any
    hf_names: tuple[str, ...]
    kernel_id: int
    kept: tuple[int, int] = (1, 1)

    def __call__(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        return (self.native if native else self.scratch)(x)

    def saved_tensors(self, native: bool) -> int:
        return self.kept[native]


ACTIVATIONS: dict[str, Activation] = {  # written out: x, x^3, the tanh and its argument kept
    "gelu_tanh": Activation(gelu_tanh, lambda x: F.gelu(x, approximate="tanh"),
                            ("gelu_new", "gelu_pytorch_tanh"), 0, kept=(4, 1)),
    "gelu_erf": Activation(F.gelu, F.gelu, ("gelu",), 1),  # no shorter way to write erf
    "relu2": Activation(relu_squared, ReluSquaredFunction.apply, ("relu2",), 2),
}


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
        angle = torch.arange(positions, dtype=torch.float64)[:, None] * freq  # (S, hs/2)
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., B, nh, T, hs) at positions (T,), or (B, T): each row its own."""
        cos, sin = self.cos[positions], self.sin[positions]  # (T, hs/2) or (B, T, hs/2)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs/2): the same for every head
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
        self.qk_norm, self.scale = cfg.qk_norm, cfg.attn_scale or None  # None: GPT-2's 1/sqrt(hs)
        self.rotary = None
        if cfg.position == "rotary":
            self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_base)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.causal_mask == "buffer":
            mask = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).tril()
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, kv_cache=None, input_pos: torch.Tensor | None = None,
                value_embed: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, hs).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, T, hs) each
        if self.qk_norm or self.rotary is not None:  # q and k together: half the calls
            qk = F.rms_norm(qkv[:2], (hs,)) if self.qk_norm else qkv[:2]  # model.qk_norm
            if self.rotary is not None:  # model.position=rotary
                qk = self.rotary(qk, torch.arange(T, device=x.device) if input_pos is None
                                 else input_pos)
            q, k = qk.unbind(0)
        if value_embed is not None:  # model.value_embeds: (B, T, C), weighted already
            v = v + value_embed.view(B, T, self.n_head, hs).transpose(1, 2)
        mask = None  # sdpa without a mask buffer: is_causal
        if kv_cache is not None:  # decoding: k, v (B, nh, T_k, hs) so far; mask None: sees all
            changed = self.qk_norm or self.rotary is not None or value_embed is not None
            k, v, mask = kv_cache.update(self.layer, input_pos,
                                         torch.stack((k, v)) if changed else qkv[1:])
        elif hasattr(self, "mask"):
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
        y = self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # heads side by side
        return self.resid_dropout(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.activation, self.native = ACTIVATIONS[cfg.activation], cfg.activation_impl == "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.c_fc(x), self.native)  # (B, T, 4C)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache=None, input_pos: torch.Tensor | None = None,
                value_embed: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, input_pos, value_embed)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size is 0: set it, or let train.py take it from the "
                             "dataset's meta.json")
        self.config, self.vocab_size = cfg, cfg.vocab_size
        self.padded_vocab = -(-cfg.vocab_size // cfg.vocab_pad_multiple) * cfg.vocab_pad_multiple
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(self.padded_vocab, cfg.n_embd),
            # learned positions (GPT-2); with rotary ones, attention rotates q and k instead
            **({"wpe": nn.Embedding(cfg.block_size, cfg.n_embd)}
               if cfg.position == "learned" else {}),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias, cfg.layer_norm_eps, cfg.norm),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, self.padded_vocab, bias=False)
        if cfg.unet_skips:  # skip_weights[i]: block i's output into block n_layer-1-i's input
            self.skip_weights = nn.Parameter(torch.zeros(cfg.n_layer // 2))
        if cfg.smear:  # the previous token's embedding, per channel, into each token's
            self.smear_weights = nn.Parameter(torch.zeros(cfg.n_embd))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2
        self.init_weights()
        if cfg.value_embeds:  # table i: blocks i and n_layer-1-i (after GPT-2's draws, which stay)
            self.value_embeds = nn.ModuleList(nn.Embedding(self.padded_vocab, cfg.n_embd)
                                              for _ in range(cfg.value_embeds))
            for table in self.value_embeds:  # each times a weight that starts at 0
                nn.init.normal_(table.weight, mean=0.0, std=0.02)
            self.value_weights = nn.Parameter(torch.zeros(cfg.value_embeds, 2))
        self.chunked_loss = None
        if cfg.loss == "chunked":  # the LM head and loss a chunk of tokens at a time
            from engine.training.chunked_loss import chunked_cross_entropy
            self.chunked_loss = chunked_cross_entropy
        if cfg.activation_checkpointing.strip().lower() != "none":  # recomputed in backward
            from engine.training.recompute import recompute_blocks
            recompute_blocks(self, cfg.activation_checkpointing)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, residual projections / sqrt(2 n_layer)."""
        cfg = self.config
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
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

    def embedding_params(self) -> int:
        """Parameters looked up, not multiplied: wte (unless the tied head), wpe, value_embeds."""
        tables = [self.transformer.wte] * (not self.config.tie_embeddings)
        tables += [self.transformer.wpe] if "wpe" in self.transformer else []
        tables += list(getattr(self, "value_embeds", []))
        return sum(t.weight.numel() for t in tables)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once; non_embedding leaves out every table, the tied wte too."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embedding_params() + self.config.tie_embeddings * self.lm_head.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B), N the multiplied weights."""
        cfg, n = self.config, self.num_params(non_embedding=False) - self.embedding_params()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache=None,
                input_pos: torch.Tensor | None = None, logits_at: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) -> (logits (B, T, vocab), loss). Decoding passes a kv_cache and the tokens'
        positions input_pos (T,) or (B, T) (default 0..T-1), and logits_at (K,) or (B, K): the LM
        head only at these indices into T -> logits (B, K, vocab).
        With targets and model.loss=chunked the logits never exist: (None, loss)."""
        if logits_at is not None and targets is not None:
            raise ValueError("logits_at is for inference: pass targets or logits_at, not both")
        B, T = idx.size()
        if input_pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of {T} tokens is longer than block_size "
                                 f"{self.config.block_size}; crop the input")
            input_pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.smear:  # model.smear
            x = x + self.smear_weights * self.previous_embeddings(idx, x, kv_cache, input_pos)
        if "wpe" in self.transformer:  # learned positions; rotary ones act in attention
            x = x + self.transformer.wpe(input_pos)
        x = self.transformer.drop(x.float())  # the residual stream is float32 under autocast
        n, outputs = len(self.transformer.h), []
        values = [table(idx) for table in getattr(self, "value_embeds", [])]  # (B, T, C) each
        for i, block in enumerate(self.transformer.h):
            if self.config.unet_skips and i >= n - n // 2:  # block n-1-i's output comes back
                x = x + self.skip_weights[n - 1 - i] * outputs[n - 1 - i]
            pair = min(i, n - 1 - i)  # model.value_embeds: block i and its mirror share a table
            value = self.value_weights[pair, int(i != pair)] * values[pair] \
                if pair < len(values) else None
            x = block(x, kv_cache, input_pos, value)  # (B, T, C)
            if self.config.unet_skips and i < n // 2:
                outputs.append(x)
        x = self.transformer.ln_f(x)
        if targets is not None and self.chunked_loss is not None:  # the padded head, whole
            return None, self.chunked_loss(x, self.lm_head.weight, targets,
                                           self.config.logit_softcap, IGNORE_INDEX, self.vocab_size)
        if logits_at is not None:  # (K,): the same for every row; (B, K): each row's own
            x = x[:, logits_at] if logits_at.dim() == 1 else x.gather(
                1, logits_at[..., None].expand(-1, -1, x.size(-1)))  # (B, K, C)
        logits = self.lm_head(x)[..., :self.vocab_size]  # (B, T, vocab): padded rows never win
        logits = softcap(logits, self.config.logit_softcap)  # model.logit_softcap
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab_size),
                                   targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def previous_embeddings(self, idx: torch.Tensor, x: torch.Tensor, kv_cache,
                            input_pos: torch.Tensor) -> torch.Tensor:
        """model.smear: the embedding of the token before each of idx's (B, T) (their own: x),
        zero at position 0; with a cache, the tokens before come from it (it keeps each row's)."""
        if kv_cache is None:
            return F.pad(x[:, :-1], (0, 0, 1, 0))  # (B, T, C): shifted one position right
        before = self.transformer.wte(kv_cache.previous_tokens(idx, input_pos))
        return before * (input_pos > 0).expand(idx.shape)[..., None]

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
