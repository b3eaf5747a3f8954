"""int8 weight-only quantization of chosen Linear layers (torchao), and the bytes the weights take.

    python generate.py --quantize=int8 --quantize_layers=attn,mlp
"""
import torch

from config import ConfigError
from model import GPT

# sample.quantize_layers names -> the Linear layers of every block they cover
QUANTIZABLE = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj"),
               "c_attn": ("attn.c_attn",), "attn.c_proj": ("attn.c_proj",),
               "c_fc": ("mlp.c_fc",), "mlp.c_proj": ("mlp.c_proj",)}


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
