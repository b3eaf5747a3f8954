"""The one config: dataclass defaults, then configs/NAME.toml, then the command line
(`--section.key=value`, or `--key=value` where the key is one field's); `--help` lists them all.

    python train.py --config gpt2_124m --train.batch_size=8 --learning_rate=3e-4 --compile true
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.fields import FRACTION, NON_NEGATIVE, POSITIVE, Flag, Range, facts, flags_from, opt


REPO_ROOT = Path(__file__).resolve().parent
CONFIGS_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = "shakespeare_char"
BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


@dataclass
class ModelConfig:
    """The GPT's shape, its departures from GPT-2 and how each part is computed: the section
    model.py's GPT is given (nothing else of the config). Here, not in model.py, so that reading
    options imports no torch."""

    block_size: int = opt(256, "context length in tokens", fixed=True, hf="n_positions",
                          check=POSITIVE)
    vocab_size: int = opt(0, "vocabulary size; 0 = take it from the dataset's meta.json",
                          fixed=True, hf="vocab_size", check=NON_NEGATIVE)
    n_layer: int = opt(6, "transformer blocks", fixed=True, hf="n_layer", check=POSITIVE)
    n_head: int = opt(6, "attention heads per block", fixed=True, hf="n_head", check=POSITIVE)
    n_embd: int = opt(384, "embedding width", fixed=True, hf="n_embd", check=POSITIVE)
    dropout: float = opt(0.0, "dropout probability (0 for pretraining, ~0.1 for finetuning)",
                         check=FRACTION)
    bias: bool = opt(True, "biases in Linear and LayerNorm layers, as GPT-2", fixed=True)
    layer_norm_eps: float = opt(1e-5, "LayerNorm epsilon", fixed=True, check=POSITIVE)
    activation: str = opt("gelu_tanh", "the MLP's activation: GPT-2's tanh GELU, the exact (erf) "
                          "GELU (nanoGPT's nn.GELU), or relu(x)^2 (the speedrun's)",
                          ("gelu_tanh", "gelu_erf", "relu2"), departure=True, kernel=True,
                          speedrun="relu2")
    # implementations of the same math, each checked against its reference in the tests
    attention: str = opt("scratch", "softmax(QK^T/sqrt(d))V by hand, or "
                         "F.scaled_dot_product_attention (Flash kernels)", ("scratch", "sdpa"),
                         fast="sdpa")
    causal_mask: str = opt("buffer", "causal mask: a (block, block) buffer, or built per call",
                           ("buffer", "on_the_fly"), fast="on_the_fly")
    norm: str = opt("scratch", "LayerNorm: written out, or F.layer_norm", ("scratch", "native"),
                    fast="native", flag="norm_gelu")
    activation_impl: str = opt("scratch", "the activation written out by hand, or torch's kernel "
                               "(F.gelu; for relu2 a backward of one product)",
                               ("scratch", "native"), fast="native", flag="norm_gelu")
    vocab_pad_multiple: int = opt(1, "pad the embedding/LM head rows to a multiple of this "
                                  "(64: 50257 -> 50304); padded logits never win", fixed=True,
                                  check=POSITIVE, fast=64, flag="vocab_pad")
    activation_checkpointing: str = opt("none", "recompute in backward (less memory, ~1/3 more "
                                        "compute): none|all|attention|mlp|every:K|blocks:0,3,5")
    loss: str = opt("full", "LM head + cross-entropy: the whole (tokens, vocab) logits, or in "
                    "chunks of tokens so they never exist (same loss and gradients)",
                    ("full", "chunked"), fast="chunked", flag="chunked_loss")
    # the speedrun's departures from GPT-2 (the module docstring says where each acts)
    position: str = opt("learned", "positions: GPT-2's learned embedding added to the tokens, "
                        "or rotary (RoPE: each head's queries and keys rotated by their "
                        "position)", ("learned", "rotary"), departure=True,
                        gpt2="learned positions", speedrun="rotary")
    rope_base: float = opt(10000.0, "position=rotary: the base of the rotation frequencies",
                           departure=True, check=Range(gt=1))
    qk_norm: bool = opt(False, "RMS-normalize each head's queries and keys before attention (no "
                        "weights): attention logits stay bounded at high learning rates",
                        departure=True, gpt2="no query/key norm", speedrun=True)
    attn_scale: float = opt(0.0, "attention logits = scale x q.k; 0 = 1/sqrt(head size) "
                            "(GPT-2); with qk_norm the logits lie within +-scale x head size",
                            departure=True, check=NON_NEGATIVE,
                            gpt2="logits scaled by 1/sqrt(head size)", speedrun=0.3)
    value_embeds: int = opt(0, "value embeddings: blocks i and n_layer-1-i, for each i < K, add "
                            "an embedding of the token (one table per pair), times a learned "
                            "weight that starts at 0, to attention's values; 0 = off",
                            departure=True, gpt2="no value embeddings", speedrun=1,
                            check=("<= n_layer // 2", lambda v, m: 0 <= v <= m.n_layer // 2))
    tie_embeddings: bool = opt(True, "the LM head is the token embedding (GPT-2); false: an LM "
                               "head of its own", departure=True, kernel=True, speedrun=False)
    zero_init_head: bool = opt(False, "an untied LM head starts at zero (uniform first logits)",
                               departure=True, kernel=True, fixed=False, speedrun=True)
    zero_init_proj: bool = opt(False, "the blocks' output projections (attn.c_proj, "
                               "mlp.c_proj) start at zero: each block starts as the identity",
                               departure=True, kernel=True, fixed=False, speedrun=True)
    logit_softcap: float = opt(0.0, "logits = cap * tanh(logits / cap) (Gemma 2); 0 = off",
                               departure=True, kernel=True, check=NON_NEGATIVE,
                               gpt2="uncapped logits", speedrun=15.0)
    unet_skips: bool = opt(False, "U-net skips: block i's output, times a learned weight that "
                           "starts at 0, is added to block n_layer-1-i's input, for each i in "
                           "the first half", departure=True, gpt2="no skips between blocks",
                           speedrun=True)
    smear: bool = opt(False, "each token's embedding gets the previous token's added, times a "
                      "learned per-channel weight that starts at 0 (a bigram the first block "
                      "sees directly)", departure=True, gpt2="no previous-token embedding",
                      speedrun=True)


@dataclass
class DataConfig:
    dataset: str = opt("shakespeare_char", "folder under data/ or a path: meta.json + tokens; "
                       "or a .json/.jsonl file of instruction examples (docs/finetuning.md)")
    mixture: str = opt("", "several prepared datasets, each row's source drawn by weight: "
                       "'NAME:WEIGHT,...' (e.g. 'fineweb_edu:3,data/mycode:1'); replaces "
                       "dataset (data/mixture.py)")
    val_file: str = opt("", "instruction data: a .json/.jsonl file of validation examples; '' = "
                        "hold out val_fraction of the dataset's")
    val_fraction: float = opt(0.05, "instruction data: the share of examples held out for "
                              "validation (the same ones whatever the seed)",
                              check=Range(gt=0, lt=1))
    template: str = opt("chat", "instruction data: the chat template (data/chat_template.py); "
                        "the checkpoint keeps it for generate.py --chat and serve.py",
                        ("chat",))
    overlength: str = opt("truncate", "instruction data: an example longer than block_size is "
                          "cut to it, dropped, or refused (error)", ("truncate", "drop", "error"))
    loss_on: str = opt("responses", "instruction data: the tokens the loss counts: the "
                       "responses (the assistant's turns and their end), or every token (all)",
                       ("responses", "all"))
    doc_aligned: bool = opt(False, "training rows start at a document start and hold whole "
                            "documents, packed best-fit (data/doc_batches.py); val keeps windows")
    pin_memory: bool = opt(False, "pinned host batches, copied with non_blocking=True (CUDA)",
                           fast=True, cuda=True)
    prefetch: bool = opt(False, "copy the next batch on a side CUDA stream (implies pin_memory)")
    loader_workers: int = opt(0, "processes reading batches into shared memory; 0 = in-process",
                              check=NON_NEGATIVE)
    hellaswag_path: str = opt("", "hellaswag_val.jsonl for train.hellaswag_interval; '' = "
                              "data/hellaswag/hellaswag_val.jsonl, downloaded if missing",
                              resume=True)


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA: low-rank adapters of this rank on the targets train, every other "
                    "weight frozen (engine/lora.py); 0 = off: every weight trains",
                    check=NON_NEGATIVE)
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / rank", check=POSITIVE)
    adapter_dropout: float = opt(0.0, "dropout on the adapters' input", check=FRACTION)
    targets: str = opt("c_attn,c_proj,c_fc", "the block Linears that get adapters, by name or "
                       "ending: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (c_proj: both)")
    base_dtype: str = opt("float32", "the frozen Linears' weights: float32, or bfloat16 (half "
                          "their memory, their products in bfloat16)", ("float32", "bfloat16"))


@dataclass
class TrainConfig:
    out_dir: str = opt("out/shakespeare_char", "run directory: checkpoints and metrics",
                       resume=True)
    init_from: str = opt("scratch", "scratch | resume (latest checkpoint in out_dir) | auto "
                         "(resume if there is one) | a checkpoint path | a Hugging Face GPT-2: "
                         "gpt2[-medium|-large|-xl], hf:ORG/NAME or a local HF directory "
                         "(cropped to block_size)", resume=True)
    batch_size: int = opt(32, "micro-batch size (sequences per forward pass)", check=POSITIVE)
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step", check=POSITIVE)
    tokens_per_step: int = opt(0, "global batch in tokens, the same on any number of GPUs: sets "
                               "grad_accum_steps = tokens_per_step / (batch_size x block_size "
                               "x processes); 0 = off", check=NON_NEGATIVE)
    batch_size_auto: bool = opt(False, "same sequences per step, largest micro-batch that fits "
                                "(CUDA)", fast=True, cuda=True)
    max_iters: int = opt(2000, "optimizer steps", check=NON_NEGATIVE, resume=True)
    learning_rate: float = opt(1e-3, "peak learning rate", check=POSITIVE)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak",
                              check=Range(ge=0, le=1))
    warmup_iters: int = opt(100, "linear warmup steps", check=NON_NEGATIVE)
    lr_schedule: str = opt("cosine", "after warmup: cosine decay to min_lr_ratio, constant, or wsd "
                           "(warmup-stable-decay: the peak until the last cooldown_frac of the "
                           "steps, then linear to min_lr_ratio)", ("cosine", "constant", "wsd"),
                           departure=True, speedrun="wsd")
    cooldown_frac: float = opt(0.4, "lr_schedule=wsd: the fraction of max_iters spent decaying",
                               check=Range(gt=0, le=1))
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to matrices only",
                              check=NON_NEGATIVE)
    beta1: float = opt(0.9, "AdamW beta1", check=FRACTION)
    beta2: float = opt(0.95, "AdamW beta2", check=FRACTION)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off",
                           check=NON_NEGATIVE)
    fused_adamw: bool = opt(False, "AdamW(fused=True) where the device supports it", fast=True)
    optimizer: str = opt("adamw", "adamw: AdamW on every parameter | muon: torch.optim.Muon on "
                         "the blocks' Linear weights, AdamW (learning_rate) on the rest",
                         ("adamw", "muon"), fast="muon", flag="muon")
    muon_lr: float = opt(0.01, "Muon's peak learning rate (best of a sweep in docs/speedups.md); "
                         "it follows the same warmup and decay", check=POSITIVE)
    muon_momentum: float = opt(0.95, "Muon momentum (Nesterov)", check=FRACTION)
    muon_momentum_warmup: int = opt(0, "steps over which Muon's momentum rises linearly from "
                                    "muon_momentum_start to muon_momentum (the speedrun: 300 "
                                    "from 0.85); 0 = off", check=NON_NEGATIVE, departure=True,
                                    speedrun=300)
    muon_momentum_start: float = opt(0.85, "Muon's momentum at step 0 with muon_momentum_warmup",
                                     check=FRACTION)
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per Muon update (torch's 5); each "
                             "costs about 3 matmuls per matrix, which at small batches on a CPU "
                             "rivals the model's own step", check=POSITIVE)
    muon_ns_coefficients: str = opt("torch", "the Newton-Schulz quintic: torch (torch.optim."
                                    "Muon's (3.4445, -4.775, 2.0315) at every step) | "
                                    "polar_express (one per step, each the closest to 1 on "
                                    "where the singular values are by then: at the speedrun "
                                    "config three trained as well as torch's five; "
                                    "docs/speedrun.md); "
                                    "polar_express iterates in float32",
                                    ("torch", "polar_express"))
    muon_adjust_lr: str = opt("match_rms_adamw", "Muon's per-matrix lr scale: match_rms_adamw "
                              "(0.2 x sqrt(max(rows, cols)): updates the size of AdamW's, so "
                              "weight_decay carries over) | original (sqrt(max(1, rows/cols)))",
                              ("match_rms_adamw", "original"))
    muon_ns_dtype: str = opt("auto", "dtype of Muon's Newton-Schulz iteration: bfloat16 is "
                             "torch.optim.Muon's own; float32 is many times faster on CPUs "
                             "that emulate bf16 (docs/speedups.md); auto = bfloat16 on CUDA, "
                             "else float32",
                             ("auto", "bfloat16", "float32"))
    eval_interval: int = opt(250, "evaluate (and checkpoint) every this many steps",
                             check=POSITIVE, resume=True)
    eval_at_start: bool = opt(True, "evaluate a fresh run at step 0 too (its loss before "
                              "training)", resume=True)
    eval_iters: int = opt(20, "batches per split in each evaluation (the same batches each time)",
                          check=POSITIVE)
    log_interval: int = opt(10, "print a log line every this many steps", check=POSITIVE,
                            resume=True)
    loss_curve: bool = opt(True, "draw out_dir/loss_curve.png at the evaluations (at most once a "
                           "minute, and at the end; matplotlib's first drawing takes a second)",
                           resume=True)
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep in out_dir",
                                check=POSITIVE, resume=True)
    save_checkpoints: bool = opt(True, "write checkpoints at each evaluation and at the end",
                                 resume=True)
    checkpoint_format: str = opt("auto", "full: rank 0 writes every weight and optimizer state | "
                                 "sharded: each process its own shards (engine/sharded.py) | "
                                 "auto: sharded under parallel=fsdp", ("auto", "full", "sharded"),
                                 resume=True)
    checkpoint_async: bool = opt(False, "sharded checkpoints written in the background while "
                                 "training goes on (from a copy in host memory)", resume=True)
    hellaswag_interval: int = opt(0, "score HellaSwag every this many steps and at the end "
                                  "(GPT-2 BPE data); 0 = off", check=NON_NEGATIVE, resume=True)
    hellaswag_examples: int = opt(0, "HellaSwag examples scored each time; 0 = all 10,042",
                                  check=NON_NEGATIVE, resume=True)
    stop_after_iters: int = opt(0, "checkpoint and stop after this many steps (then "
                                "init_from=resume); 0 = off", check=NON_NEGATIVE, resume=True)
    max_nonfinite_steps: int = opt(10, "stop after this many NaN/inf steps in a row (each "
                                   "skipped); the last good checkpoint is kept", check=POSITIVE,
                                   resume=True)


@dataclass
class WandbConfig:
    enabled: bool = opt(False, "also log metrics to Weights & Biases (pip install wandb)")
    project: str = opt("gpt2-scratch", "W&B project")
    entity: str = opt("", "W&B team or user; '' = your default")
    name: str = opt("", "W&B run name; '' = the out_dir's folder name")
    group: str = opt("", "W&B group, to gather related runs")
    tags: str = opt("", "comma-separated W&B tags")
    mode: str = opt("auto", "auto = WANDB_MODE or online; offline = local, `wandb sync` later",
                    ("auto", "online", "offline"))


@dataclass
class SampleConfig:
    prompt: str = opt("\n", "text to continue")
    checkpoint: str = opt("", "checkpoint directory (or run directory); '' = latest in out_dir")
    max_new_tokens: int = opt(500, "tokens to generate per sample", check=NON_NEGATIVE)
    num_samples: int = opt(1, "independent samples", check=Range(ge=1))
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy", check=Range(ge=0, le=2))
    top_k: int = opt(200, "keep only the k most likely tokens; 0 = off", check=NON_NEGATIVE)
    top_p: float = opt(1.0, "nucleus sampling: smallest set with this much probability; 1 = off",
                       check=Range(gt=0, le=1))
    kv_cache: bool = opt(True, "reuse past keys/values so each token costs the same")
    prompt_bucket: int = opt(64, "with --compile: prompts padded to a multiple of this, so "
                             "decoding sees a few fixed shapes (no recompiles)", check=POSITIVE)
    prefill_chunk: int = opt(128, "serving: the prompt tokens read between two decode steps "
                             "(a long prompt is read in chunks, so running streams wait for one "
                             "chunk, not the whole prompt); 0 = each prompt whole",
                             check=NON_NEGATIVE)
    weight_layout: str = opt("auto", "how Linear weights are stored for decoding: row-major (as "
                             "trained) or column-major (faster one-token matmuls on CPU); auto: "
                             "on CPU column-major where a weight has more outputs than inputs, "
                             "row elsewhere", ("auto", "row", "column"))
    huge_pages: bool = opt(True, "on CPU (Linux), keep the decoding weights in 2 MiB transparent "
                           "huge pages, which one-token matmuls read faster than 4 KiB pages")
    matvec: str = opt("auto", "how decoding multiplies one token by each weight: blas (one "
                      "F.linear) or sliced (one output slice per thread, side by side in a bmm); "
                      "auto: sliced on CPU with 2+ threads", ("auto", "blas", "sliced"))
    weights: str = opt("torch", "how sampling and serving hold the Linear weights: torch (as "
                       "loaded, torch's products) | on a CPU, packed for the compiled kernels of "
                       "engine/inference/cpu_kernels.py: float32 (as trained) | bfloat16 | int8 "
                       "(a scale per output) | int4 (a scale per 32 inputs) | auto: the fastest of "
                       "torch, float32, bfloat16 and int8 timed here",
                       ("torch", "float32", "bfloat16", "int8", "int4", "auto"))
    quantize: str = opt("none", "int8: torchao's int8 weight-only Linear layers (the blocks' "
                        "only; sample.weights=int8 is ours)", ("none", "int8"))
    quantize_layers: str = opt("attn,mlp", "Linear layers sample.quantize converts: comma list "
                               "of attn, mlp, c_attn, attn.c_proj, c_fc, mlp.c_proj")


@dataclass
class SystemConfig:
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    dtype: str = opt("float32", "autocast precision; auto: bfloat16 where the hardware runs it "
                     "natively (CUDA Ampere+, CPUs with AMX / AVX512-BF16), else float32",
                     ("float32", "bfloat16", "float16", "auto"), fast="auto")
    weights_dtype: str = opt("float32", "bfloat16 halves weight and gradient memory (AdamW keeps "
                             "float32 master weights; needs dtype=bfloat16; not with fsdp)",
                             ("float32", "bfloat16"))
    tf32: bool = opt(False, "TF32 tensor-core matmuls for float32 (CUDA, Ampere and newer)",
                     fast=True, cuda=True)
    compile: bool = opt(False, "torch.compile the model", fast=True)
    compile_mode: str = opt("default", "torch.compile mode", ("default", "reduce-overhead",
                            "max-autotune", "max-autotune-no-cudagraphs"))
    seed: int = opt(1337, "seed for weights, data order and sampling", check=Range(ge=0, lt=2**63))
    empty_cache: bool = opt(True, "free cached CUDA memory after evaluations, samples, saves",
                            resume=True)
    threads: int = opt(0, "CPU threads for torch; 0 = torch's default", check=NON_NEGATIVE)
    peak_flops: float = opt(0.0, "device peak FLOP/s for MFU; 0 = look the device up",
                            check=NON_NEGATIVE, resume=True)
    parallel: str = opt("ddp", "several processes (torchrun, accelerate launch): ddp = a replica "
                        "per GPU; fsdp = weights, gradients, AdamW state sharded (FSDP2)",
                        ("ddp", "fsdp"), resume=True)
    fsdp_reshard: bool = opt(True, "fsdp: free gathered weights after each block's forward "
                             "(least memory); false keeps them until backward (less traffic)",
                             resume=True)
    dist_timeout: float = opt(600.0, "seconds a process waits in a collective before the job "
                              "fails; must exceed the slowest checkpoint save or evaluation",
                              check=POSITIVE, resume=True)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
KEYS = {section: [f.name for f in dataclasses.fields(cls)] for section, cls in SECTIONS.items()}


def section_types(cfg: Config | None = None) -> dict[str, type]:
    """{section: its dataclass}: cfg's own (a field added in a subclass counts), else SECTIONS."""
    return SECTIONS if cfg is None else {name: type(getattr(cfg, name)) for name in SECTIONS}


def speedup_flags(cfg: Config | None = None) -> dict[str, Flag]:
    """The speedup flags (bench.py ablation's, the banner's), from the fields stating `fast`."""
    return flags_from(section_types(cfg))


def _owners(key: str, cfg: Config | None = None) -> list[str]:
    """The sections that have a field named `key`."""
    return [section for section, cls in section_types(cfg).items()
            if key in {f.name for f in dataclasses.fields(cls)}]


def _coerce(value: Any, typ: type, where: str) -> Any:
    """A TOML or command-line value as the field's type, or ValueError."""
    kind = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}[typ]
    text = str(value).strip().lower()
    if typ is bool and (isinstance(value, bool) or text in BOOL_WORDS):
        return value if isinstance(value, bool) else text in ("1", "true", "yes", "on")
    if typ is str and not isinstance(value, (dict, list)):
        return str(value)
    if typ in (int, float) and not isinstance(value, (bool, dict, list)):
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            if typ is float or isinstance(value, int):
                return typ(value)
            with contextlib.suppress(ValueError):
                return int(str(value).replace("_", ""))
            if float(str(value)).is_integer():  # 1e6, 3.0
                return int(float(str(value)))
    raise ValueError(f"{where}: expected {kind}, got {value!r}")


def _did_you_mean(name: str, candidates: list[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=cutoff)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _unknown(key: str, source: str, candidates: list[str]) -> str:
    return f"unknown key '{key}' in {source}{_did_you_mean(key, candidates)}"


def resolve_config_path(name: str) -> Path:
    """`--config NAME` finds configs/NAME.toml; a path to a .toml file works too."""
    as_path = Path(name)
    if as_path.suffix == ".toml" or as_path.parent != Path("."):
        if as_path.is_file():
            return as_path
        raise ConfigError(f"config file {name} not found")
    candidate = CONFIGS_DIR / f"{name}.toml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))
    hint = _did_you_mean(name, known, cutoff=0.5)
    raise ConfigError(f"no config named '{name}' (looked for {candidate}){hint} "
                      f"known configs: {', '.join(known)}")


def _set(obj: Any, key: str, value: Any, where: str, problems: list[str]) -> None:
    """obj.key = value as its field's type; a value that does not fit is a problem."""
    try:
        setattr(obj, key, _coerce(value, typing.get_type_hints(type(obj))[key], where))
    except ValueError as e:
        problems.append(str(e))


def apply_sections(cfg: Config, data: dict, source: str, problems: list[str],
                   strict: bool = True) -> None:
    """Set cfg from {section: {key: value}}; unknown keys are problems when strict, else skipped
    (a stored config may hold keys dropped since)."""
    for section, body in data.items():
        if section in SECTIONS and isinstance(body, dict):
            names = KEYS[section]
            for key, value in body.items():
                if key in names:
                    _set(getattr(cfg, section), key, value, f"{section}.{key} ({source})",
                         problems)
                elif strict:
                    problems.append(_unknown(f"{section}.{key}", source,
                                             [f"{section}.{n}" for n in names]))
        elif strict and section not in SECTIONS:
            problems.append(_unknown(section, source, list(SECTIONS)) +
                            " (top-level tables must be sections)")
        elif strict:
            problems.append(f"{source}: [{section}] must be a table, got {body!r}")


def apply_override(cfg: Config, key: str, value: str, problems: list[str]) -> None:
    section, name = key.split(".", 1) if "." in key else (None, key)
    sections = _owners(name, cfg)
    if section is not None and section not in sections:
        dotted = [f"{s}.{n}" for s, names in KEYS.items() for n in names]
        problems.append(_unknown(key, "command line", dotted))
    elif not sections:
        bare = list({name for names in KEYS.values() for name in names})
        problems.append(_unknown(key, "command line", bare))
    elif section is None and len(sections) > 1:
        choices = " or ".join(f"--{s}.{key}" for s in sections)
        problems.append(f"'{key}' is ambiguous (command line); use {choices}")
    else:
        section = section or sections[0]
        _set(getattr(cfg, section), name, value, f"{section}.{name} (command line)", problems)


def gpt2_recipe_flags() -> list[str]:
    """Command-line flags that turn off every departure from GPT-2 whatever the config turns on
    (GPT-2's model, activation included, a cosine schedule, no momentum warm-up for Muon). The
    golden default run and bench.py to-loss's rows start from these."""
    return [f"--{name}={getattr(section(), name)}" for section in (ModelConfig, TrainConfig)
            for name in facts(section, "departure")]


def field_problems(values: Any, named: Callable[[str], str]) -> list[str]:
    """Each field of a config section or a script's options whose value is outside its choices
    or fails its check=, as named(field) says it (section.key, or --key)."""
    problems = []
    for f in dataclasses.fields(values):
        value, choices = getattr(values, f.name), f.metadata.get("choices")
        text, holds = f.metadata.get("check") or ("", lambda v, section: True)
        if choices and value not in choices and named(f.name).startswith("--"):
            problems.append(f"{named(f.name)}={value!r}: use " + " or ".join(choices))
        elif choices and value not in choices:
            problems.append(f"{named(f.name)}={value!r} is not one of {', '.join(choices)}")
        elif not holds(value, values):
            problems.append(f"{named(f.name)} must be {text}, got {value}")
    return problems


def validate(cfg: Config) -> list[str]:
    """Every problem with the values, as a list of messages (empty when the config is usable)."""
    problems = [p for section in SECTIONS
                for p in field_problems(getattr(cfg, section), lambda name: f"{section}.{name}")]
    m, t = cfg.model, cfg.train
    if cfg.sample.quantize != "none" and cfg.sample.weights != "torch":
        problems.append(f"sample.quantize={cfg.sample.quantize} (torchao) and "
                        f"sample.weights={cfg.sample.weights} both choose the weights' format; "
                        "pass one of them")
    if cfg.system.weights_dtype == "bfloat16" and cfg.system.dtype != "bfloat16":
        problems.append(f"system.weights_dtype=bfloat16 needs --dtype=bfloat16 (autocast), "
                        f"got dtype={cfg.system.dtype}")
    if t.muon_ns_coefficients == "polar_express" and t.muon_ns_dtype == "bfloat16":
        problems.append("train.muon_ns_coefficients=polar_express iterates in float32 "
                        "(torch.optim.Muon's bfloat16 iteration takes one quintic for every "
                        "step): drop --muon_ns_dtype=bfloat16")
    if m.activation_checkpointing.strip().lower() != "none":
        from engine.training.recompute import checkpoint_plan

        try:
            checkpoint_plan(m.activation_checkpointing, m.n_layer)
        except ValueError as e:
            problems.append(str(e))
    problems += lora_problems(cfg)
    if m.n_head > 0 and m.n_embd % m.n_head:
        problems.append(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    elif m.position == "rotary" and m.n_head > 0 and m.n_embd // m.n_head % 2:
        problems.append(f"model.position=rotary needs an even head size, got n_embd / n_head = "
                        f"{m.n_embd // m.n_head}")
    if m.zero_init_head and m.tie_embeddings:
        problems.append("model.zero_init_head needs model.tie_embeddings=false: a tied head is "
                        "the token embedding, which must not start at zero")
    per_sequence = t.batch_size * m.block_size
    if t.tokens_per_step > 0 and per_sequence > 0 and t.tokens_per_step % per_sequence:
        problems.append(f"train.tokens_per_step={t.tokens_per_step} must be a multiple of "
                        f"batch_size x block_size = {per_sequence} (x the number of processes)")
    return problems


def lora_problems(cfg: Config) -> list[str]:
    """What LoRA cannot be combined with."""
    if not cfg.lora.rank:
        return []
    return [f"lora.rank={cfg.lora.rank} {why}" for why, bad in (
        ("adapts a trained model: set --init_from=<a checkpoint> or gpt2",
         cfg.train.init_from == "scratch"),
        ("trains its adapters with AdamW: pass --optimizer=adamw",
         cfg.train.optimizer == "muon"),
        ("keeps the frozen base in lora.base_dtype: drop --weights_dtype=bfloat16",
         cfg.system.weights_dtype == "bfloat16"),
        ("is not supported with parallel=fsdp (frozen and trained weights in one shard); use "
         "parallel=ddp", cfg.system.parallel == "fsdp")) if bad]


def from_dict(data: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (as stored in checkpoints)."""
    model = dict(data.get("model") or {})
    if "gelu" in model:  # a checkpoint from before model.activation and activation_impl
        old = model.pop("gelu")
        model.setdefault("activation", "gelu_erf" if old == "erf" else "gelu_tanh")
        model.setdefault("activation_impl", "native" if old == "native" else "scratch")
        data = {**data, "model": model}
    cfg, problems = Config(), []
    apply_sections(cfg, data, "stored config", problems, strict=False)
    _raise_problems(problems, "stored config")
    return cfg


@dataclass
class CommandLine:
    """argv split into its parts; `problems` collects what could not be parsed."""

    config_name: str = DEFAULT_CONFIG
    overrides: list[tuple[str, str]] = field(default_factory=list)
    script: list[tuple[str, str]] = field(default_factory=list)  # the script's own options
    wants_help: bool = False
    problems: list[str] = field(default_factory=list)


def parse_command_line(argv: list[str], script: type | None = None) -> CommandLine:
    """Split argv into --config, -h/--help, the script's options (a dataclass of opt() fields;
    they win over config keys of the same name) and --key=value overrides."""
    line, i = CommandLine(), 0
    hints = typing.get_type_hints(script) if script is not None else {}
    options = {f.name: hints[f.name] for f in dataclasses.fields(script)} if hints else {}
    while i < len(argv):
        arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        key, has_value, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if arg in ("-h", "--help"):
            line.wants_help = True
        elif not arg.startswith("--") or len(arg) <= 2:
            # a script may name one option that also takes a bare argument (ClassVar positional)
            positional = getattr(script, "positional", None)
            if positional and positional not in dict(line.script):
                line.script.append((positional, arg))
            else:
                line.problems.append(f"unexpected argument {arg!r}; overrides look like "
                                     "--key=value")
        elif not has_value and options.get(key) is bool and (following is None or
                                                             following.lower() not in BOOL_WORDS):
            line.script.append((key, "true"))  # a bare switch: --estimate-memory
        elif not has_value and (following is None or (following.startswith("--")
                                                      and len(following) > 2)):
            line.problems.append(f"{arg} needs a value: use {arg}=VALUE")
        else:
            if not has_value:  # --a.b c
                value, i = following, i + 1
            if key in options:
                line.script.append((key, value))
            elif key == "config":
                line.config_name = value
            else:
                line.overrides.append((key, value))
    return line


def _script_options(line: CommandLine, script: type, problems: list[str],
                    table: dict | None = None) -> Any:
    """The script's options: its table of the config file (script.table: [rl]), then argv."""
    options, names = script(), [f.name for f in dataclasses.fields(script)]
    for name, value in [*(table if isinstance(table, dict) else {}).items(), *line.script]:
        if name in names:
            _set(options, name, value, f"--{name}", problems)
        else:
            problems.append(_unknown(f"{script.table}.{name}", "the config file", names))
    problems += field_problems(options, lambda name: f"--{name.replace('_', '-')}")
    return options


def _raise_problems(problems: list[str], what: str = "config") -> None:
    if problems:  # one problem, one line
        separator = " " if len(problems) == 1 else "\n  "
        raise ConfigError(f"invalid {what}:{separator}" + "\n  ".join(problems))


def resolve_command_line(line: CommandLine, script: type | None = None
                         ) -> tuple[Config, Config, Any]:
    """(config file over defaults, that + the command line, script options), validated."""
    problems = list(line.problems)
    from_file, path, table = Config(), resolve_config_path(line.config_name), None
    try:
        data = tomllib.loads(path.read_text())
        table = data.pop(getattr(script, "table", None), None)
        apply_sections(from_file, data, str(path), problems)
    except tomllib.TOMLDecodeError as e:
        problems.append(f"{path}: invalid TOML: {e}")
    cfg = copy.deepcopy(from_file)
    for key, value in line.overrides:
        apply_override(cfg, key, value, problems)
    options = _script_options(line, script, problems, table) if script is not None else None
    _raise_problems(problems + validate(cfg))
    return from_file, cfg, options


def load_options(argv: list[str], script: type, prog: str, about: str = "") -> Any:
    """Only a script's own options (data preparation: no config); -h/--help lists them."""
    line = parse_command_line(argv, script)
    if line.wants_help:  # the help's words live apart: a run never loads them
        from engine.config_help import script_help

        print("\n".join([f"usage: python {prog} [options]", "", about.strip(), "",
                         *script_help(prog, script())]))
        raise SystemExit(0)
    names = [f.name for f in dataclasses.fields(script)]
    problems = line.problems + [_unknown(key, "command line", names) for key, _ in line.overrides]
    if line.config_name != DEFAULT_CONFIG:
        problems.append(f"{prog} reads no config: --config is not one of its options")
    options = _script_options(line, script, problems)
    _raise_problems(problems, "options")
    return options


def help_text(prog: str, argv: list[str] | tuple[str, ...] = (), script: type | None = None,
              lead: tuple[str, ...] = ()) -> str:
    """--help: the script's options, then every config key as argv resolves it (engine/
    config_help.py words it); ConfigError as a run would raise it."""
    from engine.config_help import render  # its words live apart: a run never loads them

    line = parse_command_line(list(argv), script)
    return render(prog, line, resolve_config_path(line.config_name), DEFAULT_CONFIG,
                  resolve_command_line(line, script), SECTIONS, lead)


def exit_with_help(prog: str, argv: list[str], script: type | None = None,
                   lead: tuple[str, ...] = ()) -> None:
    print(help_text(prog, argv, script, lead))
    raise SystemExit(0)


def help_first(prog: str, script: type | None = None, lead: tuple[str, ...] = (),
               main: str = "") -> None:
    """A script's --help answered from the config alone, before the script imports what its run
    needs (torch, the model): called from the script's top, under `__name__ == "__main__"`
    (main: that name, so an import of the script does nothing here)."""
    argv = sys.argv[1:]
    if main == "__main__" and parse_command_line(argv, script).wants_help:
        try:
            exit_with_help(prog, argv, script, lead)
        except ConfigError as e:  # what a run would say of the config asked about
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def command_line_keys(argv: list[str], section: str, script: type | None = None) -> list[str]:
    """The keys of `section` argv sets itself (--section.key or an unambiguous --key)."""
    keys = []
    for key, _ in parse_command_line(argv, script).overrides:
        prefix, _, name = key.rpartition(".")
        if prefix == section or (not prefix and _owners(name) == [section]):
            keys.append(name)
    return keys


def load_config(argv: list[str], prog: str = "train.py", script: type | None = None,
                lead: tuple[str, ...] = ()) -> tuple[Config, Any]:
    """(validated Config, the script's options or None); -h/--help prints the help and exits."""
    line = parse_command_line(argv, script)
    if line.wants_help:
        exit_with_help(prog, argv, script, lead)
    _, cfg, options = resolve_command_line(line, script)
    return cfg, options
