"""Weight formats for inference (sample.weights): every Linear of the blocks and the LM head held
as float32, bfloat16, int8 or int4 and multiplied by float32 activations through the compiled
kernels of cpu_kernels.py; `torch` leaves the model as loaded (torch's own products); `auto`
times the choices on this machine and keeps the fastest of those within 0.5% of float32's
perplexity (torch, float32, bfloat16, int8: int4 is asked for by name). load.py loads this when
sample.weights is not torch.

    note = convert(model, "int8", torch.device("cpu"))   # in place; -> the banner's note
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ConfigError
from engine.fields import facts
from engine.inference import cpu_kernels
from engine.inference.kv_cache import new_kv_cache
from engine.inference.matvec import set_matvec, set_weight_layout
from engine.inference.sampling import decode_step, prefill
from model import ACTIVATIONS, BLOCK_LINEARS, ModelConfig, softcap

FORMATS = ("auto", "torch", "float32", "bfloat16", "int8", "int4")
# within 0.5% of float32's perplexity (int4 is not: bench_results/decode_quality_*.md)
AUTO_CANDIDATES = ("torch", "float32", "bfloat16", "int8")
KERNEL_ROWS = 128  # up to this many rows a call runs the kernels (faster than unpacking the
# weight for a dense product, as bench.py decode measured); more (a long prompt): dense


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight is packed in one of cpu_kernels.FORMATS. Up to
    KERNEL_ROWS rows (decoding, batched decoding) run the compiled kernels; more rows (a
    prompt) multiply the unpacked float32 weight, made for that call."""

    def __init__(self, linear: nn.Linear, fmt: str, isa: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if isa is None:  # the fastest path for the format here; the layout it reads
            isa, layout = cpu_kernels.best_path(fmt) if cpu_kernels.status()[0] else \
                ("torch", "blocked")
        else:
            layout = cpu_kernels.LAYOUT_OF.get(isa, "blocked")
        packed = cpu_kernels.pack(linear.weight, fmt, layout=layout)
        self.format, self.group, self.isa, self.layout = fmt, packed.group, isa, layout
        self.register_buffer("data", packed.data)
        self.register_buffer("scales", packed.scales)
        bias = None if linear.bias is None else F.pad(linear.bias.detach().float(),
                                                      (0, packed.padded - self.out_features))
        self.register_buffer("bias", bias)

    @property
    def packed(self) -> cpu_kernels.Packed:
        return cpu_kernels.Packed(self.format, self.data, self.scales, self.out_features,
                                  self.in_features, self.group, self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= KERNEL_ROWS:
            return cpu_kernels.matmul(x, self.packed, self.bias, self.isa)
        bias = None if self.bias is None else self.bias[:self.out_features]
        return cpu_kernels.reference(x, self.packed, bias)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.bias) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format} ({self.isa})"


def linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, Linear) for each block Linear and the LM head."""
    found = [(model, "lm_head", model.lm_head)]
    for block in model.transformer.h:
        for name in BLOCK_LINEARS:
            parent_name, attr = name.split(".")
            parent = getattr(block, parent_name)
            found.append((parent, attr, getattr(parent, attr)))
    return found


def convert(model: nn.Module, fmt: str, device: torch.device) -> str:
    """sample.weights: repack the model's Linears in place -> the banner's note. torch leaves
    the model as it is (torch's products: MKL and the decode weight layout on a CPU); auto
    times the candidates."""
    if fmt not in FORMATS:
        raise ConfigError(f"sample.weights={fmt!r} is not one of {', '.join(FORMATS)}")
    if isinstance(model.lm_head, PackedLinear):
        return model.lm_head.format + " (packed already)"
    t = model.transformer
    dtype = (t.wpe if "wpe" in t else t.wte).weight.dtype
    if device.type != "cpu" or dtype != torch.float32:
        if fmt in ("auto", "torch"):
            return f"torch (as loaded{', the kernels are CPU only' if fmt == 'auto' else ''})"
        raise ConfigError(f"sample.weights={fmt} runs on a CPU with a float32 model, not on "
                          f"{device.type} with {dtype} weights; use --weights=torch (or auto) "
                          "there")
    built, why = cpu_kernels.status()
    note = ""
    if fmt == "auto":
        fmt, note = choose(model, built, why)
    elif not built and fmt != "torch":
        note = f" ({why}: slower than torch's float32 here)"
    if fmt == "torch":
        return "torch (as loaded)" + note
    for parent, attr, linear in linears(model):
        if not isinstance(linear, PackedLinear):  # auto packed them already
            setattr(parent, attr, PackedLinear(linear, fmt))
    forget_packing(model)
    if fmt != "float32":  # the embedding is read a row a token: bf16 halves its memory
        model.transformer.wte.weight.data = model.transformer.wte.weight.data.to(torch.bfloat16)
    return f"{fmt}{note} ({weight_bytes(model) / 2**20:.0f} MiB)"


def choose(model: nn.Module, built: bool, why: str) -> tuple[str, str]:
    """auto: the fastest of AUTO_CANDIDATES decoding this model here, each timed over a few
    cached steps after a short prompt (torch as generate.py runs it: its weight layout and
    sliced products); the chosen packing is kept."""
    if not built:
        return "torch", f" (auto: {why})"
    set_weight_layout(model, "auto", huge_pages=True)
    set_matvec(model, "auto")
    found = linears(model)
    times, packs = {"torch": step_seconds(model)}, {}
    for fmt in AUTO_CANDIDATES[1:]:
        packs[fmt] = [PackedLinear(linear, fmt) for _, _, linear in found]
        swap(model, found, packs[fmt])
        times[fmt] = step_seconds(model)
        swap(model, found, [linear for _, _, linear in found])
    best = min(times, key=times.get)
    if best != "torch":
        swap(model, found, packs[best])
    timed = ", ".join(f"{f} {t * 1e3:.1f} ms" for f, t in times.items())
    return best, f" (auto: the fastest decode step here of {timed})"


def swap(model: nn.Module, found: list[tuple[nn.Module, str, nn.Linear]],
         modules: list[nn.Module]) -> None:
    """Put modules in the places of linears() (`found`), in order; the decode blocks' arguments
    are made again from them at the next step."""
    for (parent, attr, _), module in zip(found, modules):
        setattr(parent, attr, module)
    forget_packing(model)


def forget_packing(model: nn.Module) -> None:
    """After the Linears changed: the kernel's arguments are made again, and model.decode_rows
    (what sampling.decode_step calls) is this module's one-call-a-block decode, or None."""
    model._decode_blocks = model._fused = None
    model.decode_rows = functools.partial(decode_rows, model) if fused(model) else None


@torch.no_grad()
def step_seconds(model: nn.Module, steps: int = 6) -> float:
    """The median seconds of one cached greedy decode step after a 4-token prompt."""
    cache, token = new_kv_cache(model, 1), torch.zeros((1, 1), dtype=torch.long)
    prefill(model, torch.zeros((1, 4), dtype=torch.long), cache)
    times = []
    for pos in range(4, 4 + steps):
        start = time.perf_counter()
        decode_step(model, token, cache, pos, torch.tensor([pos]))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def weight_bytes(model: nn.Module) -> int:
    """Bytes the weights take: parameters (tied ones once) and packed Linears."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes() for m in model.modules() if isinstance(m, PackedLinear))


def kernel_has_the_math(cfg: ModelConfig) -> bool:
    """Whether the decode kernel computes this config's blocks: its activation, and every
    option the kernel lacks (its field says kernel=False) at its default."""
    default = ModelConfig()
    lacking = [name for name, has in facts(ModelConfig, "kernel").items() if not has]
    return ACTIVATIONS[cfg.activation].kernel_id >= 0 and all(
        getattr(cfg, name) == getattr(default, name) for name in lacking)


def fused(model: nn.Module) -> bool:
    """Whether decode can run each block as one compiled call: every block Linear packed in
    one format for one kernel path, with the kernels built, and the kernel has the model's
    math. Asked every decoded token, so decided once per packing (convert and swap forget it)."""
    if getattr(model, "_fused", None) is None:
        first = model.transformer.h[0].attn.c_attn
        same = all(isinstance(linear, PackedLinear) and (linear.format, linear.isa)
                   == (first.format, first.isa) for _, _, linear in linears(model)[1:])
        model._fused = (isinstance(first, PackedLinear) and first.isa != "torch" and same
                        and kernel_has_the_math(model.config))
    return model._fused


def block_arguments(model: nn.Module) -> list[tuple]:
    """decode_block's arguments per block, made once (on the model, as _decode_blocks)."""
    if getattr(model, "_decode_blocks", None) is None:
        none = torch.empty(0)
        cfg, args = model.config, []
        for block in model.transformer.h:
            ln = [block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias]
            packed = [block.get_submodule(name) for name in BLOCK_LINEARS]
            first = packed[0]
            args.append(([none if t is None else t.detach() for t in ln], cfg.layer_norm_eps,
                         [m.data for m in packed], [m.scales for m in packed],
                         [none if m.bias is None else m.bias for m in packed],
                         [m.data.size(0) * cpu_kernels.BLOCK for m in packed],
                         cpu_kernels.FORMATS[first.format], first.group,
                         cpu_kernels.ISAS.index(first.isa), cfg.n_head,
                         ACTIVATIONS[cfg.activation].kernel_id))
        model._decode_blocks = args
    return model._decode_blocks


@torch.no_grad()
def decode_rows(model: nn.Module, idx: torch.Tensor, kv: list[torch.Tensor],
                positions: torch.Tensor) -> torch.Tensor:
    """GPT.forward for one token per row, idx (B, 1), each at its own position (B,), with the
    blocks' caches kv (2, rows, nh, T, hs) each: every block one compiled call -> logits
    (B, 1, vocab)."""
    B = idx.size(0)
    logits = forward_tokens(model, idx.view(B), kv, torch.arange(B), positions.view(B))
    return logits[:, None]


@torch.no_grad()
def forward_tokens(model: nn.Module, tokens: torch.Tensor, kv: list[torch.Tensor],
                   rows: torch.Tensor, positions: torch.Tensor,
                   logits_at: torch.Tensor | None = None) -> torch.Tensor:
    """GPT.forward for a ragged batch: token i (of tokens (N,)) goes into cache row rows[i] at
    positions[i], keys and values written into kv (the blocks' caches, (2, rows, nh, T, hs)
    each); a row's tokens in order attend to each other causally, as a prompt's do. Decoding
    rows and chunks of prompts share one call a block -> logits (len(logits_at), vocab) of the
    tokens logits_at picks (default: all)."""
    t, C = model.transformer, model.config.n_embd
    rows, positions = rows.long().contiguous(), positions.long().contiguous()
    x = (F.embedding(tokens, t.wte.weight).float() + t.wpe.weight[positions]).contiguous()
    # (learned positions: kernel_has_the_math sends rotary models through forward())
    for cache, args in zip(kv, block_arguments(model)):
        x = torch.ops.gpt2s.decode_block(x, cache, rows, positions, *args)  # (N, C)
    if logits_at is not None:
        x = x[logits_at]
    x = F.layer_norm(x, (C,), t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
    return softcap(model.lm_head(x)[:, :model.vocab_size], model.config.logit_softcap)
