"""int8 weight-only quantization of chosen Linear layers (torchao), and the bytes the weights take.

    python generate.py --quantize=int8 --quantize_layers=attn,mlp
"""
import torch

from config import ConfigError
from model import BLOCK_LINEARS, GPT


def quantizable() -> dict[str, tuple[str, ...]]:
    """sample.quantize_layers names -> the Linears of every block they cover: a part of the block
    (attn, mlp), or one Linear by its own name where that is unique, else by its path."""
    parts: dict[str, tuple[str, ...]] = {}
    for name in BLOCK_LINEARS:
        part = name.split(".")[0]
        parts[part] = (*parts.get(part, ()), name)
    short = [name.split(".")[1] for name in BLOCK_LINEARS]
    return {**parts, **{(s if short.count(s) == 1 else name): (name,)
                        for s, name in zip(short, BLOCK_LINEARS)}}


QUANTIZABLE = quantizable()


def quantize_targets(layers: str) -> set[str]:
    """'attn,mlp' -> the block-relative Linear names to quantize. Raises ConfigError."""
    names = [n.strip() for n in layers.split(",") if n.strip()]
    unknown = [n for n in names if n not in QUANTIZABLE]
    if unknown or not names:
        raise ConfigError(f"sample.quantize_layers={layers!r}: {unknown or 'nothing'} is not a "
                          f"choice; use a comma list of {', '.join(QUANTIZABLE)} (the embeddings "
                          "and the tied LM head stay in floating point)")
    return {target for n in names for target in QUANTIZABLE[n]}


def quantize_linears(model: GPT, layers: str) -> list[str]:
    """Replace the chosen Linear weights of every block by int8 tensors with per-channel scales;
    activations and biases stay as they are. Returns the quantized module names."""
    targets = quantize_targets(layers)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError("sample.quantize=int8 needs torchao: pip install torchao "
                          "(pyproject.toml's quant group)") from None
    chosen = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name.startswith("transformer.h.")
              and name.split(".", 3)[3] in targets]
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name in chosen)
    return chosen


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights occupy (int8 tensors: their data and scales), tied parameters once."""
    total = 0
    for p in model.parameters():  # yields a tied parameter once
        tensors = [getattr(p, name) for name in getattr(p, "tensor_data_names", [])] or [p]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
