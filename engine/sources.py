"""Where a model comes from: fresh, one of our checkpoints (or run directories), or a HF GPT-2;
and, for sampling and serving, its weights made ready to decode.

    model, cfg, meta, label = load_model(source, cfg, device)   # engine/hellaswag.py
    model, source = build_model(cfg, data_meta, device)         # train.py (init_from)
    # generate.py and serve.py (their options extend InferenceOptions):
    model, meta, label = load_for_inference(cfg, options, device, "sample from")
    prepared = prepare_weights(model, cfg, options, device, rows=1)   # -> notes for the banner
"""
import dataclasses
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, opt
from data.dataset import DataError, check_vocab, load_meta
from engine import checkpoint, hf, quantize, sparse, weights
from engine.sampling import set_weight_layout
from data.tokenizer import TokenizerError
from model import GPT

# prepared from the bundled tiny Shakespeare on first use (no download)
BUNDLED_DATASETS = ("shakespeare_char", "shakespeare")
# model keys that fix the weights' shapes; the others (attention, norm, ...) may change on loading
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "vocab_pad_multiple",
              "layer_norm_eps", "block_size")


def dataset_meta(dataset: str) -> dict:
    """data.dataset's metadata; a bundled dataset (tiny Shakespeare) is prepared on first use."""
    try:
        return load_meta(dataset)
    except DataError:
        if dataset not in BUNDLED_DATASETS:
            raise
    print(f"preparing {dataset} (from the bundled text) ...")
    importlib.import_module(f"data.{dataset}.prepare").prepare()
    return load_meta(dataset)


def load_model(source: str, cfg: Config, device: torch.device | str = "cpu",
               overrides: dict | None = None) -> tuple[GPT, Config, dict, str]:
    """(model, its config, meta with 'tokenizer', a label). A checkpoint keeps its stored config;
    a GPT-2 takes its shape from config.json, the rest from cfg.model; `overrides` apply to both."""
    if not hf.is_gpt2_source(source):
        path = checkpoint.resolve(source)
        model, stored, meta = checkpoint.load_model(path, device, overrides)
        return model, stored, meta, str(path)
    used = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **(overrides or {})))
    model, hf_dir = hf.load_hf(source, used.model)
    label = source if Path(source) == hf_dir else f"{source} ({hf_dir})"
    meta = {"tokenizer": hf.tokenizer_meta(model.config.vocab_size), "source": str(hf_dir)}
    return model.to(device), used, meta, label


@dataclass
class InferenceOptions:
    """The command-line options generate.py and serve.py share: which model, and how a pruned
    one runs. The rest of what loading reads is the config (sample.checkpoint, sample.weights,
    sample.quantize, sample.weight_layout, system.device ...)."""

    init_from: str = opt("", "the model: gpt2[-medium|-large|-xl] | hf:ORG/NAME | a local HF "
                         "dir | our checkpoint; default: sample.checkpoint, else train.out_dir")
    sparse: str = opt("auto", "a pruned checkpoint (prune.py): auto = sparse kernels for the "
                      "weight shapes a timing probe finds faster here (generate.py: at one row, "
                      "as decoding; serve.py: at --slots rows) | sparse | dense (its weights "
                      "with zeros)", sparse.MODES)

    def model_source(self, cfg: Config) -> str:
        """--init-from, else sample.checkpoint, else train.out_dir."""
        if self.init_from in ("", "resume", "auto"):
            return cfg.sample.checkpoint or cfg.train.out_dir
        return self.init_from


@dataclass
class PreparedWeights:
    """What prepare_weights did to a model, for the start-up banner."""

    weights: str  # the Linears' format (weights.convert's note)
    weight_layout: str  # the layout used (sampling.set_weight_layout)
    sparse: str  # a pruned model's sparse kernels, what was chosen; '' = not pruned


def prepare_weights(model: GPT, cfg: Config, options: InferenceOptions, device: torch.device,
                    rows: int = 1) -> PreparedWeights:
    """Ready a loaded model's weights for decoding on `device` (where the model is), before any
    compile (it traces the strides): their format (sample.weights), their layout
    (sample.weight_layout, sample.huge_pages), then a pruned model's sparse kernels where a
    probe at `rows` input rows timed them faster (--sparse)."""
    held = "torch (as loaded)"  # torch's own products: no CPU kernels to build for that
    if cfg.sample.weights != "torch":  # bf16/int8/int4 ...: packed Linears
        held = weights.convert(model, cfg.sample.weights, device)
    layout = set_weight_layout(model, cfg.sample.weight_layout, cfg.sample.huge_pages)
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
    if cfg.sample.quantize != "none":
        quantize.quantize_targets(cfg.sample.quantize_layers)  # a bad list fails before loading
    init_from = options.model_source(cfg)
    model, _, meta, label = load_model(init_from, cfg, device)
    if meta["tokenizer"]["kind"] == "unknown":
        raise TokenizerError(f"{init_from} has a {model.config.vocab_size}-token vocabulary, not "
                             f"GPT-2's {hf.GPT2_VOCAB}: there is no tokenizer for it here")
    if cfg.sample.quantize == "int8":
        chosen = quantize.quantize_linears(model, cfg.sample.quantize_layers)
        print(f"quantized {len(chosen)} Linear layers to int8 ({cfg.sample.quantize_layers}): "
              f"weights now {quantize.weight_bytes(model) / 2**20:.1f} MiB", file=sys.stderr)
    return model.eval(), meta, label


def build_model(cfg: Config, meta: dict, device: torch.device) -> tuple[GPT, Path | None]:
    """train.init_from's model and its checkpoint or HF directory (None: fresh). A source fixes
    cfg.model's shapes; the switches stay the run's; a shorter block_size crops the context."""
    init, block = cfg.train.init_from, cfg.model.block_size
    if init == "scratch":
        cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
        check_vocab(meta, cfg.model.vocab_size)
        return GPT(cfg.model).to(device), None
    if init == "resume":
        init = checkpoint.latest_checkpoint(cfg.train.out_dir)
        if init is None:
            raise checkpoint.CheckpointError(f"init_from=resume but {cfg.train.out_dir} has no "
                                             "checkpoint; use init_from=scratch to start")
    switches = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in SHAPE_KEYS}
    model, _, source_meta, label = load_model(str(init), cfg, "cpu", switches)
    context = model.config.block_size
    if hf.is_gpt2_source(str(init)):
        source, what = Path(source_meta["source"]), f"{init}'s"
    else:
        source, what = Path(label), "the checkpoint's"
        checkpoint.check_tokenizer(source, meta)  # the same ids, or a clear refusal
    kind = source_meta.get("tokenizer", {}).get("kind")
    check_vocab(meta, model.config.vocab_size, kind if kind == "gpt2" else None)
    if block > context:
        raise ConfigError(f"block_size {block} is larger than {what} context {context}; "
                          f"use a block_size <= {context}")
    for f in dataclasses.fields(cfg.model):  # cfg.model stays the object the run holds
        setattr(cfg.model, f.name, getattr(model.config, f.name))
    model.config = cfg.model
    if block < model.config.block_size:
        model.crop_block_size(block)
    return model.to(device), source
