"""LoRA (Hu et al. 2021): a trained model's chosen Linear layers get low-rank adapters, and only
the adapters train. A wrapped Linear computes

    y = x W^T + b  +  (alpha / rank) * dropout(x) A^T B^T      A (rank, in), B (out, rank)

with W and b frozen (held in bfloat16 if lora.base_dtype says so), A drawn as nn.Linear draws its
weights and B zero: at the start the model is the base model, bit for bit. A run with lora.rank
> 0 saves only A and B (adapter.safetensors, a few MiB at GPT-2 124M) and names its base; loading
one (engine/sources.py) loads the base again, checks it is the same file, and merges B A into W
for sampling, serving and export, or keeps the adapters apart to resume training.

    names = apply_lora(model, cfg.lora)         # wraps lora.targets, freezes everything else
    merge_lora(model)                           # W += (alpha / rank) B A: a plain GPT again
    python -m engine.merge_lora out/run_lora out/merged   # a standalone full checkpoint
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from config import Config, ConfigError, LoraConfig, ModelConfig
from engine import checkpoint
from engine.checkpoint import ADAPTER_FILE, CheckpointError
from engine.context import fit_context
from engine.fields import facts
from engine.loading import read_config
from engine.vocab import grow_vocab
from model import BLOCK_LINEARS, GPT
NEW_ROWS = "transformer.wte.new_rows"  # adapter.safetensors' name for NewRows' rows


class LoRALinear(nn.Linear):
    """An nn.Linear with a trained low-rank update beside its frozen weight; made from one in
    place by wrap(), so the weight and bias keep their names in the state dict."""

    rank: int
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # frozen; bfloat16 with lora.base_dtype=bfloat16
        base = F.linear(x if x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type)
                        else x.to(w.dtype), w, self.bias)
        update = (self.lora_dropout(x) @ self.lora_A.T) @ self.lora_B.T  # (..., rank) first
        return base.to(update.dtype) + update * self.scaling


def wrap(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
    linear.__class__ = LoRALinear
    linear.rank, linear.scaling = rank, alpha / rank
    w = linear.weight
    linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=w.device))
    nn.init.kaiming_uniform_(linear.lora_A, a=math.sqrt(5))  # nn.Linear's own draw
    linear.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=w.device))
    linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    return linear


class NewRows(nn.Module):
    """A frozen table whose rows first..first+n-1 are a trained parameter of their own: the
    tokens grow_vocab added (a character model's end of text), which the frozen base has no row
    for. A parametrization of the token embedding (and the tied head, the same rows)."""

    def __init__(self, table: torch.Tensor, first: int, n: int):
        super().__init__()
        self.first = first
        self.rows = nn.Parameter(table[first:first + n].detach().float().clone())

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        end = self.first + self.rows.size(0)
        return torch.cat([table[:self.first], self.rows.to(table.dtype), table[end:]])


def train_new_rows(model: GPT) -> None:
    """The rows grow_vocab added train with the adapters (the embedding, and the head if tied)."""
    from torch.nn.utils import parametrize

    first = model.grown_from
    wte, head = model.transformer.wte, model.lm_head
    rows = NewRows(wte.weight, first, model.vocab_size - first)
    tied = head.weight is wte.weight
    parametrize.register_parametrization(wte, "weight", rows)
    if tied:
        parametrize.register_parametrization(head, "weight", rows)


@torch.no_grad()
def merge_new_rows(model: GPT) -> None:
    from torch.nn.utils import parametrize

    wte, head = model.transformer.wte, model.lm_head
    tied = parametrize.is_parametrized(head, "weight")
    parametrize.remove_parametrizations(wte, "weight", leave_parametrized=True)
    if tied:
        parametrize.remove_parametrizations(head, "weight", leave_parametrized=False)
        head.weight = wte.weight


def target_names(model: GPT, targets: str) -> list[str]:
    """The block Linears lora.targets names (a name or its ending: c_proj is both)."""
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and name.startswith("transformer.h.")]
    unknown = [t for t in wanted if not any(n.endswith("." + t) for n in linears)]
    if unknown or not wanted:
        raise ConfigError(f"lora.targets={targets!r}: {', '.join(unknown) or 'nothing'} names no "
                          f"Linear in the blocks; choose among {', '.join(BLOCK_LINEARS)} (or "
                          "c_attn, c_proj, c_fc)")
    return [n for n in linears if any(n.endswith("." + t) for t in wanted)]


def apply_lora(model: GPT, lora: LoraConfig) -> list[str]:
    """Wrap lora.targets, freeze every other parameter; the wrapped Linears' names."""
    names = target_names(model, lora.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        linear = wrap(model.get_submodule(name), lora.rank, lora.alpha, lora.adapter_dropout)
        if lora.base_dtype == "bfloat16":
            linear.to(torch.bfloat16)  # the frozen weight and bias; A and B stay float32
            linear.lora_A.data, linear.lora_B.data = (p.data.float() for p in
                                                       (linear.lora_A, linear.lora_B))
    if getattr(model, "grown_from", None) is not None:  # rows no base weight holds
        train_new_rows(model)
    model.lora = lora
    return names


def is_lora(model: nn.Module) -> bool:
    return getattr(model, "lora", None) is not None


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A and B of every adapter (and the rows grow_vocab added), as adapter.safetensors stores
    them."""
    state = {f"{name}.lora_{part}": getattr(m, f"lora_{part}").detach().contiguous().cpu()
             for name, m in adapters(model).items() for part in "AB"}
    for name, m in model.named_modules():
        if isinstance(m, NewRows) and NEW_ROWS not in state:
            state[NEW_ROWS] = m.rows.detach().contiguous().cpu()
    return state


def load_adapters(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    expected = adapter_state(model)
    wrong = sorted(set(expected) ^ set(state)) + sorted(
        k for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    if wrong:
        raise CheckpointError(f"the adapters in {source} do not fit the model "
                              f"({', '.join(wrong[:4])}); the checkpoint's lora section or base "
                              "was changed")
    with torch.no_grad():
        for name, m in adapters(model).items():
            m.lora_A.copy_(state[f"{name}.lora_A"])
            m.lora_B.copy_(state[f"{name}.lora_B"])
        for m in model.modules():
            if isinstance(m, NewRows):
                m.rows.copy_(state[NEW_ROWS])


@torch.no_grad()
def merge_lora(model: GPT) -> None:
    """W += scaling * B A (in float32) in every adapter, which then becomes a plain nn.Linear
    with float32 weights: the model every sampling path takes."""
    for m in adapters(model).values():
        merged = m.weight.float() + m.scaling * (m.lora_B.float() @ m.lora_A.float())
        m.weight = nn.Parameter(merged, requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(m.bias.float(), requires_grad=False)
        for name in ("lora_A", "lora_B", "lora_dropout"):
            delattr(m, name)
        m.__class__ = nn.Linear
    if any(isinstance(m, NewRows) for m in model.modules()):
        merge_new_rows(model)
    model.lora = None


def trainable_note(model: GPT) -> str:
    """The banner's line: what trains, out of what."""
    lora, names = model.lora, adapters(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"lora: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.adapter_dropout:g} on "
            f"{len(names)} Linears ({lora.targets}): {trained:,} of {total:,} weights train "
            f"({100 * trained / total:.2f}%), the base frozen in {lora.base_dtype}")


def weights_file(folder: Path) -> Path | None:
    """The file holding a checkpoint's or a Hugging Face directory's weights."""
    return next((folder / name for name in ("model.safetensors", ADAPTER_FILE,
                                            "pytorch_model.bin") if (folder / name).is_file()),
                None)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def base_record(init_from: str, source: Path) -> dict:
    """What a LoRA checkpoint says of its base: how to load it and its weights' sha256."""
    ours = (source / "meta.json").is_file()
    found = weights_file(source)
    return {"base": str(source.resolve()) if ours else init_from,
            "base_sha256": file_sha256(found) if found else ""}


def load_adapter_checkpoint(path: Path, device: torch.device | str, overrides: dict | None,
                            load_source, merge: bool = True) -> tuple[GPT, Config, dict, str]:
    """A LoRA run's checkpoint: its base (load_source, engine/sources.py's), checked against the
    sha256 it recorded, grown and cropped as the run had it, then its adapters; merged unless
    merge=False (resuming). -> (model, the run's config, its meta, label)."""
    stored, meta = read_config(path), checkpoint.read_meta(path)
    record = meta.get("lora") or {}
    if "base" not in record:
        raise CheckpointError(f"{path} holds adapters but its meta.json names no base model; "
                              "the checkpoint is incomplete")
    fixed = {name for name, is_fixed in facts(ModelConfig, "fixed").items() if is_fixed}
    switches = {k: v for k, v in dataclasses.asdict(stored.model).items() if k not in fixed}
    try:
        model, _, base_meta, base_label = load_source(record["base"], stored, "cpu",
                                                      {**switches, **(overrides or {})})
    except CheckpointError as e:
        raise CheckpointError(f"{path} adapts the base model {record['base']}, which cannot be "
                              f"loaded: {e}") from None
    check_base(path, record, Path(base_meta.get("source", base_label)))  # HF: its directory
    grow_vocab(model, stored.model.vocab_size)
    if stored.model.block_size != model.config.block_size:  # the base's rows past it kept
        fit_context(model, stored.model.block_size)
    apply_lora(model, stored.lora)
    try:
        state = load_file(str(path / ADAPTER_FILE))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}/{ADAPTER_FILE} is unreadable ({e}); the file is "
                              "truncated or corrupt") from None
    load_adapters(model, state, str(path))
    model.lora_record = record
    if merge:
        merge_lora(model)
    return model.to(device), stored, meta, str(path)


def check_base(path: Path, record: dict, folder: Path) -> None:
    """The base (in folder) must be the file the adapters were trained on."""
    found = weights_file(folder)
    if record.get("base_sha256") and found and file_sha256(found) != record["base_sha256"]:
        raise CheckpointError(f"the base model of {path}, {record['base']}, has changed since "
                              f"the adapters were trained ({found} has another sha256); restore "
                              "that base, or finetune again from the new one")


def attach(raw_model: GPT, cfg: Config, source: Path | None) -> str:
    """A training run's adapters (engine/training/build.py): lora.rank's on the model, or a resumed
    run's, which loading put there; the banner's line."""
    if source is None:  # init_from=auto found nothing to resume: a fresh, untrained model
        raise ConfigError(f"lora.rank={cfg.lora.rank} adapts a trained model, but this run "
                          f"starts from scratch (init_from=auto found no checkpoint in "
                          f"{cfg.train.out_dir}); set --init_from=<a checkpoint> or gpt2")
    if getattr(raw_model, "lora", None) is None:
        apply_lora(raw_model, cfg.lora)
        raw_model.lora_record = base_record(cfg.train.init_from, source)
    elif raw_model.lora != cfg.lora:
        raise ConfigError(f"the checkpoint's adapters were trained with {raw_model.lora}, this "
                          f"run asks for {cfg.lora}: resume with the lora section the run "
                          "started with")
    return trainable_note(raw_model)
