"""The model generate.py samples from and serve.py serves: loaded from one of our checkpoints or a
Hugging Face GPT-2, then its weights made ready to decode (their format, layout and, for a
pruned model, sparse kernels), each part loaded only when its option asks for it.

    model, meta, label = load_for_inference(cfg, options, device, "sample from")
    prepared = prepare_weights(model, cfg, options, device, rows=1)   # -> notes for the banner
"""
import sys
from dataclasses import dataclass

import torch

from config import Config, ConfigError
from data import GPT2_EOT, TokenizerError
from engine import checkpoint, sources
from engine.inference.options import InferenceOptions
from model import GPT



@dataclass
class PreparedWeights:
    """What prepare_weights did to a model, for the start-up banner."""

    weights: str  # the Linears' format (packed.convert's note)
    weight_layout: str  # the layout used (matvec.set_weight_layout)
    sparse: str  # a pruned model's sparse kernels, what was chosen; '' = not pruned


def prepare_weights(model: GPT, cfg: Config, options: InferenceOptions, device: torch.device,
                    rows: int = 1) -> PreparedWeights:
    """Ready a loaded model's weights for decoding on `device` (where the model is), before any
    compile (it traces the strides): their format (sample.weights), their layout
    (sample.weight_layout, sample.huge_pages), then a pruned model's sparse kernels where a
    probe at `rows` input rows timed them faster (--sparse)."""
    held = "torch (as loaded)"  # torch's own products: no CPU kernels to build for that
    if cfg.sample.weights != "torch":  # bf16/int8/int4 ...: packed Linears
        from engine.inference import packed

        held = packed.convert(model, cfg.sample.weights, device)
    layout = "row (CPU only)"  # the layouts were measured on CPUs; elsewhere as trained
    if device.type == "cpu":
        from engine.inference.matvec import set_weight_layout

        layout = set_weight_layout(model, cfg.sample.weight_layout, cfg.sample.huge_pages)
    chosen = ""
    if getattr(model, checkpoint.MASKS, None):  # a pruned checkpoint: sparse kernels maybe
        from engine.inference import sparse

        chosen = sparse.prepare_for_inference(model, options.sparse, device, rows)
    return PreparedWeights(held, layout, chosen)


def load_for_inference(cfg: Config, options: InferenceOptions, device: torch.device | str,
                       purpose: str) -> tuple[GPT, dict, str]:
    """What generate.py samples from and serve.py serves (options.model_source); int8 Linears
    if sample.quantize. -> (model in eval mode, meta, label). purpose ("sample from", "serve")
    words the errors."""
    init_from = options.init_from
    if init_from and cfg.sample.checkpoint:
        raise ConfigError(f"--init-from {init_from} and --checkpoint {cfg.sample.checkpoint} both "
                          f"name a model to {purpose}; pass one of them")
    if init_from == "scratch":
        raise ConfigError(f"--init-from scratch has nothing to {purpose}; pass a GPT-2 id, a "
                          "Hugging Face directory or one of our checkpoints")
    if cfg.sample.quantize != "none":  # torchao's int8 Linears
        from engine.inference import quantize

        quantize.quantize_targets(cfg.sample.quantize_layers)  # a bad list fails before loading
    init_from = options.model_source(cfg)
    model, _, meta, label = sources.load_source(init_from, cfg, device)
    if meta["tokenizer"]["kind"] == "unknown":
        raise TokenizerError(f"{init_from} has a {model.config.vocab_size}-token vocabulary, not "
                             f"GPT-2's {GPT2_EOT + 1}: there is no tokenizer for it here")
    if cfg.sample.quantize == "int8":
        chosen = quantize.quantize_linears(model, cfg.sample.quantize_layers)
        print(f"quantized {len(chosen)} Linear layers to int8 ({cfg.sample.quantize_layers}): "
              f"weights now {quantize.weight_bytes(model) / 2**20:.1f} MiB", file=sys.stderr)
    return model.eval(), meta, label
