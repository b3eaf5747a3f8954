"""The one config: model / data / train / sample / system / wandb sections.

Defaults live only in the dataclasses below. `configs/NAME.toml` overrides them, and the command
line overrides both:

    python train.py --config gpt2_124m --train.batch_size=8 --learning_rate=3e-4 --compile true

`--section.key=value` always works; `--key=value` works when the key names one field only.
Values are coerced from the field's type, unknown keys name their source and close matches, and
validation collects every problem before raising once. `--help` lists every key with the value
that config and those overrides resolve to.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the model's own section lives with the model (model.py imports nothing from here)
from model import ModelConfig, checkpoint_plan, opt  # noqa: F401  (re-exported)

REPO_ROOT = Path(__file__).resolve().parent
CONFIGS_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = "shakespeare_char"
BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem found."""


@dataclass
class DataConfig:
    dataset: str = opt("shakespeare_char", "folder under data/ holding meta.json with train.bin "
                       "+ val.bin or shards (or a path to such a folder)")
    pin_memory: bool = opt(False, "pinned host batches copied with non_blocking=True (CUDA)")
    prefetch: bool = opt(False, "copy each batch host->GPU on a side CUDA stream, overlapping "
                         "the step that runs meanwhile (implies pinned memory; CUDA)")
    loader_workers: int = opt(0, "processes that read training batches into shared memory "
                              "ahead of the trainer (data/workers.py); 0 = in the training "
                              "process")
    hellaswag_path: str = opt("", "hellaswag_val.jsonl for train.hellaswag_interval; '' = "
                              "data/hellaswag/hellaswag_val.jsonl, downloaded if missing")


@dataclass
class TrainConfig:
    out_dir: str = opt("out/shakespeare_char", "run directory: checkpoints and metrics")
    init_from: str = opt("scratch", "scratch | resume (latest checkpoint in out_dir) | auto "
                         "(resume if out_dir has a checkpoint, else scratch) | "
                         "path to one of our checkpoints | a GPT-2 from Hugging Face: gpt2, "
                         "gpt2-medium, gpt2-large, gpt2-xl, hf:ORG/NAME or a local HF directory "
                         "(block_size may be shorter than its context: cropped)")
    batch_size: int = opt(32, "micro-batch size (sequences per forward pass)")
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step")
    tokens_per_step: int = opt(0, "the global batch in tokens: when set, grad_accum_steps "
                               "becomes tokens_per_step / (batch_size x block_size x processes), "
                               "so the batch is the same on any number of GPUs; 0 = batch_size x "
                               "grad_accum_steps x block_size x processes")
    batch_size_auto: bool = opt(False, "keep batch_size x grad_accum_steps sequences per step "
                                "but make the micro-batch the largest divisor of it that fits "
                                "in device memory (searched at start; CUDA)")
    max_iters: int = opt(2000, "optimizer steps")
    learning_rate: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_iters: int = opt(100, "linear warmup steps")
    lr_schedule: str = opt("cosine", "decay after warmup", ("cosine", "constant"))
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to matrices only")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off")
    fused_adamw: bool = opt(False, "AdamW(fused=True) where the device supports it")
    eval_interval: int = opt(250, "evaluate (and checkpoint) every this many steps")
    eval_iters: int = opt(20, "batches per split in each evaluation (the same batches each time)")
    log_interval: int = opt(10, "print a log line every this many steps")
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep in out_dir")
    save_checkpoints: bool = opt(True, "write checkpoints at each evaluation and at the end")
    hellaswag_interval: int = opt(0, "score HellaSwag every this many steps and at the end "
                                  "(GPT-2-tokenized data only); 0 = off")
    hellaswag_examples: int = opt(0, "HellaSwag validation examples scored each time; "
                                  "0 = all 10,042")
    stop_after_iters: int = opt(0, "end this invocation after this many steps with a checkpoint "
                                "(jobs with a time limit); continue with init_from=resume; "
                                "0 = run to max_iters")
    max_nonfinite_steps: int = opt(10, "stop after this many steps in a row with a NaN/inf loss "
                                   "or gradient norm (each is skipped, no update); the last "
                                   "good checkpoint is kept")


@dataclass
class WandbConfig:
    """Optional Weights & Biases logging, on top of metrics.jsonl/csv and loss_curve.png."""

    enabled: bool = opt(False, "log metrics to Weights & Biases (pip install wandb)")
    project: str = opt("gpt2-scratch", "W&B project")
    entity: str = opt("", "W&B team or user; '' = your default")
    name: str = opt("", "W&B run name; '' = the out_dir's folder name")
    group: str = opt("", "W&B group, to gather related runs")
    tags: str = opt("", "comma-separated W&B tags")
    mode: str = opt("auto", "auto = WANDB_MODE or online; offline logs locally for a later "
                    "`wandb sync`", ("auto", "online", "offline"))


@dataclass
class SampleConfig:
    prompt: str = opt("\n", "text to continue")
    checkpoint: str = opt("", "checkpoint directory (or run directory); '' = latest in out_dir")
    max_new_tokens: int = opt(500, "tokens to generate per sample")
    num_samples: int = opt(1, "independent samples")
    temperature: float = opt(0.8, "softmax temperature; 0 = greedy")
    top_k: int = opt(200, "keep only the k most likely tokens; 0 = off")
    top_p: float = opt(1.0, "nucleus sampling: smallest set with this much probability; 1 = off")
    kv_cache: bool = opt(True, "reuse past keys/values so each token costs the same")
    prompt_bucket: int = opt(64, "with --compile: a static KV cache, and prompts right-padded "
                             "to a multiple of this many tokens, so compiled decoding sees a "
                             "few fixed shapes and never recompiles")
    quantize: str = opt("none", "int8: int8 weight-only Linear layers for sampling (torchao): "
                        "about half the weight bytes of bf16, a quarter of float32",
                        ("none", "int8"))
    quantize_layers: str = opt("attn,mlp", "which Linear layers sample.quantize converts, a "
                               "comma list of attn, mlp, c_attn, attn.c_proj, c_fc, mlp.c_proj; "
                               "embeddings and the tied LM head stay floating point")


@dataclass
class SystemConfig:
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    dtype: str = opt("float32", "autocast precision", ("float32", "bfloat16", "float16"))
    weights_dtype: str = opt("float32", "how the model's weights are held: bfloat16 halves "
                             "weight and gradient memory, AdamW keeps a float32 master copy and "
                             "its state (needs --dtype=bfloat16; not with fsdp, whose "
                             "mixed precision does this)", ("float32", "bfloat16"))
    tf32: bool = opt(False, "TF32 tensor-core matmuls for float32 (CUDA, Ampere and newer)")
    compile: bool = opt(False, "torch.compile the model")
    compile_mode: str = opt("default", "torch.compile mode",
                            ("default", "reduce-overhead", "max-autotune",
                             "max-autotune-no-cudagraphs"))
    seed: int = opt(1337, "seed for weights, data order and sampling")
    empty_cache: bool = opt(True, "return cached CUDA memory to the driver after each "
                            "evaluation, sampling and checkpoint save (never inside a step)")
    threads: int = opt(0, "CPU threads for torch; 0 = torch's default")
    peak_flops: float = opt(0.0, "device peak FLOP/s for MFU; 0 = look the device up")
    parallel: str = opt("ddp", "with several processes (torchrun, accelerate launch): ddp = a "
                        "full replica per GPU, gradients averaged; fsdp = weights, gradients and "
                        "AdamW state sharded over the GPUs (FSDP2), for models too big for ddp",
                        ("ddp", "fsdp"))
    fsdp_reshard: bool = opt(True, "fsdp: free each block's gathered weights after its forward "
                             "and gather them again for backward (least memory); false keeps "
                             "them until backward (less traffic, more memory)")
    dist_timeout: float = opt(600.0, "seconds a process waits for the others in a collective "
                              "before the job fails (a hung rank); must exceed the slowest "
                              "checkpoint save or evaluation")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
    "system": SystemConfig,
    "wandb": WandbConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _field_types(section_cls: type) -> dict[str, type]:
    return typing.get_type_hints(section_cls)


def _all_keys() -> dict[str, list[str]]:
    """bare key -> the sections that have it"""
    owners: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(section)
    return owners


def _coerce(value: Any, typ: type, where: str) -> Any:
    """Turn a TOML or command-line value into the field's type, or raise ValueError."""
    kind = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(typ)
    if kind is None:
        raise ValueError(f"{where}: unsupported field type {typ}")
    wrong = ValueError(f"{where}: expected {kind}, got {value!r}")
    if typ is bool:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in BOOL_WORDS:
            return value if isinstance(value, bool) else text in ("1", "true", "yes", "on")
        raise wrong
    if isinstance(value, (dict, list)) or (typ is not str and isinstance(value, bool)):
        raise wrong
    if typ is str:
        return str(value)
    try:
        if typ is float:
            return float(value)
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            as_float = float(str(value))  # 1e6, 3.0
        if as_float.is_integer():
            return int(as_float)
    except (TypeError, ValueError, OverflowError):
        pass
    raise wrong


def _unknown_key_message(key: str, source: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown key '{key}' in {source}{hint}"


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
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"no config named '{name}' (looked for {candidate}){hint} "
                      f"known configs: {', '.join(known)}")


def _apply(cfg: Config, section: str, key: str, value: Any, source: str,
           problems: list[str]) -> None:
    section_obj = getattr(cfg, section)
    typ = _field_types(type(section_obj))[key]
    try:
        setattr(section_obj, key, _coerce(value, typ, f"{section}.{key} ({source})"))
    except ValueError as e:
        problems.append(str(e))


def apply_sections(cfg: Config, data: dict, source: str, problems: list[str],
                   strict: bool = True) -> None:
    """Set cfg from {section: {key: value}}; unknown sections and keys are problems when strict,
    skipped otherwise (a stored config may hold keys dropped since)."""
    for section, body in data.items():
        if section not in SECTIONS or not isinstance(body, dict):
            if strict and section not in SECTIONS:
                problems.append(_unknown_key_message(section, source, list(SECTIONS)) +
                                " (top-level tables must be sections)")
            elif strict:
                problems.append(f"{source}: [{section}] must be a table, got {body!r}")
            continue
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for key, value in body.items():
            if key in names:
                _apply(cfg, section, key, value, source, problems)
            elif strict:
                problems.append(_unknown_key_message(f"{section}.{key}", source,
                                                     [f"{section}.{n}" for n in names]))


def apply_toml(cfg: Config, path: Path, problems: list[str]) -> None:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        problems.append(f"{path}: invalid TOML: {e}")
        return
    apply_sections(cfg, data, str(path), problems)


def split_override(arg: str, next_arg: str | None) -> tuple[str, str, bool]:
    """'--a.b=c' -> ('a.b', 'c', False); '--a.b c' -> ('a.b', 'c', True: consumed next_arg)."""
    body = arg[2:]
    if "=" in body:
        key, value = body.split("=", 1)
        return key.replace("-", "_"), value, False
    if next_arg is None or (next_arg.startswith("--") and len(next_arg) > 2):
        raise ConfigError(f"{arg} needs a value: use {arg}=VALUE")
    return body.replace("-", "_"), next_arg, True


def apply_override(cfg: Config, key: str, value: str, problems: list[str]) -> None:
    source = "command line"
    owners = _all_keys()
    if "." in key:
        section, name = key.split(".", 1)
        if section in SECTIONS and name in owners and section in owners[name]:
            _apply(cfg, section, name, value, source, problems)
            return
        dotted = [f"{s}.{n}" for n, ss in owners.items() for s in ss]
        problems.append(_unknown_key_message(key, source, dotted))
        return
    if key not in owners:
        problems.append(_unknown_key_message(key, source, list(owners)))
        return
    if len(owners[key]) > 1:
        choices = " or ".join(f"--{s}.{key}" for s in owners[key])
        problems.append(f"'{key}' is ambiguous ({source}); use {choices}")
        return
    _apply(cfg, owners[key][0], key, value, source, problems)


POSITIVE, NON_NEGATIVE = ("> 0", lambda v: v > 0), (">= 0", lambda v: v >= 0)
FRACTION = ("in [0, 1)", lambda v: 0 <= v < 1)
RULES = {  # dotted key -> (what it must be, the test)
    **dict.fromkeys(("model.block_size", "model.n_layer", "model.n_head", "model.n_embd",
                     "model.vocab_pad_multiple", "model.layer_norm_eps", "train.batch_size",
                     "train.grad_accum_steps", "train.learning_rate", "train.eval_iters",
                     "train.eval_interval", "train.log_interval", "train.keep_checkpoints",
                     "train.max_nonfinite_steps", "system.dist_timeout",
                     "sample.prompt_bucket"), POSITIVE),
    **dict.fromkeys(("model.vocab_size", "train.max_iters", "train.warmup_iters",
                     "train.weight_decay", "train.grad_clip", "train.stop_after_iters",
                     "train.tokens_per_step", "train.hellaswag_interval",
                     "train.hellaswag_examples", "sample.max_new_tokens", "sample.temperature",
                     "sample.top_k", "system.threads", "system.peak_flops",
                     "data.loader_workers"), NON_NEGATIVE),
    **dict.fromkeys(("model.dropout", "train.beta1", "train.beta2"), FRACTION),
    "train.min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "sample.top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "sample.num_samples": (">= 1", lambda v: v >= 1),
}


def validate(cfg: Config) -> list[str]:
    """Every problem with the values, as a list of messages (empty when the config is usable)."""
    problems = [f"{section}.{f.name}={getattr(getattr(cfg, section), f.name)!r} is not one of "
                f"{', '.join(f.metadata['choices'])}"
                for section in SECTIONS for f in dataclasses.fields(SECTIONS[section])
                if f.metadata.get("choices")
                and getattr(getattr(cfg, section), f.name) not in f.metadata["choices"]]
    for key, (text, ok) in RULES.items():
        section, name = key.split(".")
        if not ok(value := getattr(getattr(cfg, section), name)):
            problems.append(f"{key} must be {text}, got {value}")
    m, t = cfg.model, cfg.train
    if cfg.system.weights_dtype == "bfloat16" and cfg.system.dtype != "bfloat16":
        problems.append(f"system.weights_dtype=bfloat16 needs --dtype=bfloat16 (autocast), "
                        f"got dtype={cfg.system.dtype}")
    try:
        checkpoint_plan(m.activation_checkpointing, m.n_layer)
    except ValueError as e:
        problems.append(str(e))
    if m.n_head > 0 and m.n_embd % m.n_head:
        problems.append(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    per_sequence = t.batch_size * m.block_size
    if t.tokens_per_step > 0 and per_sequence > 0 and t.tokens_per_step % per_sequence:
        problems.append(f"train.tokens_per_step={t.tokens_per_step} must be a multiple of "
                        f"batch_size x block_size = {per_sequence} (x the number of processes)")
    return problems


def from_dict(data: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (as stored in checkpoints)."""
    cfg, problems = Config(), []
    apply_sections(cfg, data, "stored config", problems, strict=False)
    if problems:
        raise ConfigError("stored config is invalid:\n  " + "\n  ".join(problems))
    return cfg


@dataclass
class CommandLine:
    """argv split into its parts; `problems` collects what could not be parsed."""

    config_name: str = DEFAULT_CONFIG
    overrides: list[tuple[str, str]] = field(default_factory=list)
    script: list[tuple[str, str]] = field(default_factory=list)  # the script's own options
    wants_help: bool = False
    problems: list[str] = field(default_factory=list)


def script_field(script: type | None, arg: str) -> dataclasses.Field | None:
    """The script option `--name`, `--name=value` or `--some-name` refers to, if any."""
    if script is None or not arg.startswith("--"):
        return None
    name = arg[2:].split("=", 1)[0].replace("-", "_")
    return next((f for f in dataclasses.fields(script) if f.name == name), None)


def parse_command_line(argv: list[str], script: type | None = None) -> CommandLine:
    """Split argv: --config, -h/--help, the script's own options (a dataclass of opt() fields,
    which win over config keys of the same bare name) and --key=value config overrides."""
    line = CommandLine()
    i = 0
    while i < len(argv):
        arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if arg in ("-h", "--help"):
            line.wants_help = True
            continue
        if not arg.startswith("--") or len(arg) <= 2:
            # a script may name one option that also takes a bare argument (ClassVar positional)
            positional = getattr(script, "positional", None)
            if positional and positional not in dict(line.script):
                line.script.append((positional, arg))
            else:
                line.problems.append(f"unexpected argument {arg!r}; overrides look like "
                                     "--key=value")
            continue
        option = script_field(script, arg)
        if option is not None and "=" not in arg and _field_types(script)[option.name] is bool \
                and (following is None or following.lower() not in BOOL_WORDS):
            line.script.append((option.name, "true"))  # a bare switch: --estimate-memory
            continue
        try:
            key, value, consumed = split_override(arg, following)
        except ConfigError as e:
            line.problems.append(str(e))
            continue
        i += 1 if consumed else 0
        if option is not None:
            line.script.append((option.name, value))
        elif key == "config":
            line.config_name = value
        else:
            line.overrides.append((key, value))
    return line


def resolve_command_line(line: CommandLine, script: type | None = None
                         ) -> tuple[Config, Config, Any]:
    """(the config file over the defaults, that plus the command line, the script's options),
    validated; raises ConfigError listing every problem."""
    problems = list(line.problems)
    from_file = Config()
    apply_toml(from_file, resolve_config_path(line.config_name), problems)
    cfg = copy.deepcopy(from_file)
    for key, value in line.overrides:
        apply_override(cfg, key, value, problems)
    options = _script_options(line, script, problems) if script is not None else None
    _raise_problems(problems + validate(cfg))
    return from_file, cfg, options


def _script_options(line: CommandLine, script: type, problems: list[str]) -> Any:
    options = script()
    for name, value in line.script:
        try:
            setattr(options, name, _coerce(value, _field_types(script)[name], f"--{name}"))
        except ValueError as e:
            problems.append(str(e))
    return options


def _raise_problems(problems: list[str], what: str = "config") -> None:
    if len(problems) == 1:  # one problem, one line
        raise ConfigError(f"invalid {what}: {problems[0]}")
    if problems:
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(problems))


def load_options(argv: list[str], script: type, prog: str, about: str = "") -> Any:
    """Only a script's own options, for scripts that build no model (data preparation): the
    same --name=value, --name value and bare-switch syntax; -h/--help lists them and exits."""
    line = parse_command_line(argv, script)
    if line.wants_help:
        print("\n".join([f"usage: python {prog} [options]", "", about.strip(), "",
                         *_script_help(prog, script())]))
        raise SystemExit(0)
    names = [f.name for f in dataclasses.fields(script)]
    problems = line.problems + [_unknown_key_message(key, "command line", names)
                                for key, _ in line.overrides]
    if line.config_name != DEFAULT_CONFIG:
        problems.append(f"{prog} reads no config: --config is not one of its options")
    options = _script_options(line, script, problems)
    _raise_problems(problems, "options")
    return options


def _config_label(name: str) -> str:
    path = resolve_config_path(name).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _help_header(prog: str, line: CommandLine) -> list[str]:
    count = len(line.overrides)
    overrides = f" + {count} override{'s' * (count != 1)} from the command line" if count else ""
    name = Path(line.config_name).stem
    options = {"--config NAME": f"configs/NAME.toml or a path (default: {DEFAULT_CONFIG})",
               "-h, --help": "this list, for the config and overrides given with it"}
    width = max(len(flag) for flag in options)
    return [f"usage: python {prog} [options] [--config NAME] [--section.key=value | "
            "--key=value ...]", "",
            f"config: {line.config_name} ({_config_label(line.config_name)}){overrides}",
            "Each key shows the value this command line resolves to; where that is not the "
            "built-in default,",
            f"it says where it was set: (config {name}; default ...) or "
            "(command line; default ...).", "",
            *(f"  {flag:<{width}}  {text}" for flag, text in options.items()), ""]


def _option_line(setting: str, f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    if f.metadata.get("choices"):
        text += f" [{' | '.join(map(str, f.metadata['choices']))}]"
    return f"  {setting:<32}  {text}"


def _script_help(prog: str, options: Any) -> list[str]:
    lines = [f"[{prog} options]"]
    for f in dataclasses.fields(options):
        flag = f"--{f.name.replace('_', '-')}"
        if f.name == getattr(options, "positional", None):
            flag = f"[{f.name.upper()} | {flag}]"
        lines.append(_option_line(f"{flag}={getattr(options, f.name)!r}", f))
    return lines + [""]


def _section_help(section: str, cfg: Config, from_file: Config, config_name: str) -> list[str]:
    owners = _all_keys()
    default = SECTIONS[section]()
    lines = [f"[{section}]"]
    for f in dataclasses.fields(default):
        value = getattr(getattr(cfg, section), f.name)
        setting = f"--{section}.{f.name}={value!r}"
        if value != getattr(default, f.name):
            came_from = (f"config {Path(config_name).stem}"
                         if value == getattr(getattr(from_file, section), f.name)
                         else "command line")
            setting += f" ({came_from}; default {getattr(default, f.name)!r})"
        line = _option_line(setting, f)
        lines.append(line + (" (use the section prefix)" if len(owners[f.name]) > 1 else ""))
    return lines + [""]


def help_text(prog: str, argv: list[str] | tuple[str, ...] = (), script: type | None = None,
              lead: tuple[str, ...] = ()) -> str:
    """The script's own options, then every config key with the value this command line
    resolves to, marked where it is not the dataclass default. Sections named in `lead` come
    first (generate.py: "sample"). Raises ConfigError, as a run would, when the config or an
    override is wrong."""
    unknown = [s for s in lead if s not in SECTIONS]
    if unknown:
        raise ValueError(f"lead names unknown sections {unknown}; sections are {list(SECTIONS)}")
    line = parse_command_line(list(argv), script)
    from_file, cfg, options = resolve_command_line(line, script)
    lines = _help_header(prog, line)
    if options is not None:
        lines += _script_help(prog, options)
    for section in [*lead, *(s for s in SECTIONS if s not in lead)]:
        lines += _section_help(section, cfg, from_file, line.config_name)
    return "\n".join(lines)


def command_line_keys(argv: list[str], section: str, script: type | None = None) -> list[str]:
    """The keys of `section` that argv sets itself (as --section.key or as an unambiguous --key),
    for a script whose source (a checkpoint) has its own values for the rest."""
    owners, keys = _all_keys(), []
    for key, _ in parse_command_line(argv, script).overrides:
        prefix, _, name = key.rpartition(".")
        if prefix == section or (not prefix and owners.get(name) == [section]):
            keys.append(name)
    return keys


def load_config(argv: list[str], prog: str = "train.py", script: type | None = None,
                lead: tuple[str, ...] = ()) -> tuple[Config, Any]:
    """Parse argv into a validated Config, and the script's own options when `script` (a
    dataclass of opt() fields, e.g. generate.py's --init-from) is given (else None).

    Raises ConfigError listing every problem; with -h/--help prints help_text for the rest of
    argv (`lead`: the sections it lists first) and raises SystemExit(0).
    """
    line = parse_command_line(argv, script)
    if line.wants_help:
        print(help_text(prog, argv, script, lead))
        raise SystemExit(0)
    _, cfg, options = resolve_command_line(line, script)
    return cfg, options
