"""Magnitude pruning of the blocks' Linear weights, and keeping the pruned weights at zero while a
pruned model trains.

    masks = prune(model, sparsity=0.75, pattern="unstructured")   # prune.py
    notes = hold_zeros(model, optimizer)                           # train.py, after make_optimizer

What is pruned: the weight of every Linear inside the blocks (attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj). The embeddings, the tied LM head, biases and norms are left as they are.
    unstructured  per matrix: the `sparsity` fraction of each matrix's weights with the smallest
                  magnitude become zero, so every matrix has the same sparsity (a global
                  threshold would empty the residual projections first: their init is
                  1/sqrt(2 n_layer) smaller)
    2:4           of every 4 consecutive weights along the input dimension, the 2 of largest
                  magnitude stay (sparsity 0.5): the layout of NVIDIA's sparse tensor cores
A mask (True = kept) per pruned weight lives on the model (masks_of) and in the checkpoint
(mask.safetensors, engine/checkpoint.py), so a finetune or a resume keeps the same zeros.
"""
from __future__ import annotations

import torch

from config import ConfigError
from engine.checkpoint import MASKS  # the model attribute holding {state-dict name: bool mask}
from model import GPT

PATTERNS = ("unstructured", "2:4")


def masks_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's pruning masks by weight name ({} for a dense model)."""
    return getattr(model, MASKS, None) or {}


def prunable(model: GPT) -> dict[str, torch.nn.Linear]:
    """The Linear layers pruning acts on, by their weight's state-dict name."""
    return {f"{name}.weight": module for name, module in model.named_modules()
            if name.startswith("transformer.h.") and isinstance(module, torch.nn.Linear)}


def check_request(sparsity: float, pattern: str, model: GPT | None = None) -> None:
    """Raise ConfigError for a sparsity or pattern that cannot be applied (to this model)."""
    if pattern not in PATTERNS:
        raise ConfigError(f"--pattern={pattern!r} is not one of {', '.join(PATTERNS)}")
    if not 0 < sparsity < 1:
        raise ConfigError(f"--sparsity={sparsity} must be in (0, 1): the fraction of each "
                          "matrix's weights set to zero, e.g. 0.5")
    if pattern == "2:4" and sparsity != 0.5:
        raise ConfigError(f"--pattern=2:4 keeps 2 of every 4 weights, sparsity 0.5, not "
                          f"{sparsity}; pass --sparsity=0.5 or --pattern=unstructured")
    for name, linear in prunable(model).items() if model is not None and pattern == "2:4" else ():
        if linear.in_features % 4:
            raise ConfigError(f"--pattern=2:4 needs input dimensions divisible by 4, but {name} "
                              f"has {linear.in_features}; use --pattern=unstructured")


def magnitude_mask(weight: torch.Tensor, sparsity: float, pattern: str) -> torch.Tensor:
    """True where `weight` (out, in) keeps its value: the largest magnitudes per matrix, or 2
    of every 4 along the input dimension."""
    magnitude = weight.detach().abs().float()
    if pattern == "2:4":
        groups = magnitude.reshape(weight.shape[0], -1, 4)  # (out, in/4, 4)
        keep = groups.topk(2, dim=-1).indices
        return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).reshape(
            weight.shape)
    pruned = round(sparsity * weight.numel())
    order = magnitude.flatten().argsort(stable=True)  # ties: the earlier index goes first
    mask = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    mask[order[:pruned]] = False
    return mask.reshape(weight.shape)


@torch.no_grad()
def prune(model: GPT, sparsity: float, pattern: str) -> dict[str, torch.Tensor]:
    """Zero the smallest weights of every block Linear; the masks (ANDed with any the model
    already had) are set on the model and returned."""
    check_request(sparsity, pattern, model)
    masks = dict(masks_of(model))
    for name, linear in prunable(model).items():
        mask = magnitude_mask(linear.weight, sparsity, pattern)
        masks[name] = mask & masks[name].to(mask.device) if name in masks else mask
        linear.weight.mul_(masks[name])
    setattr(model, MASKS, masks)
    return masks


def sparsity_of(model: GPT) -> dict[str, float]:
    """The fraction of zeros in each masked weight."""
    weights = model.state_dict()
    return {name: float((weights[name] == 0).float().mean()) for name in masks_of(model)}


def describe(model: GPT) -> str:
    """'pruned: 16 block matrices, 75.0% of their weights zero', or 'dense'."""
    masks = masks_of(model)
    if not masks:
        return "dense"
    pruned = sum(int((~m).sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    return f"pruned: {len(masks)} block matrices, {100 * pruned / total:.1f}% of their weights zero"


def hold_zeros(model: GPT, optimizer) -> list[str]:
    """Keep a pruned model's zeros through training: each masked weight's gradient is masked as
    it is computed (so clipping, AdamW's moments and Muon's orthogonalization see no gradient
    there) and the weight is masked again after every optimizer step (Muon's update is dense).
    Returns the banner notes ([] for a dense model)."""
    masks = masks_of(model)
    if not masks:
        return []
    params = dict(model.named_parameters())
    if any(type(params[name]).__name__ == "DTensor" for name in masks):
        raise ConfigError("finetuning a pruned checkpoint under system.parallel=fsdp is not "
                          "supported (its masks are not sharded); use --parallel=ddp")
    # MasterWeights (bf16 weights): its float32 copies are what the inner optimizer steps
    stepped = dict(zip(map(id, getattr(optimizer, "model_params", [])),
                       getattr(optimizer, "masters", [])))
    held = []
    for name, mask in masks.items():
        param = params[name]
        mask = masks[name] = mask.to(param.device)
        param.register_hook(lambda grad, mask=mask: grad * mask)
        held.append((stepped.get(id(param), param), ~mask))

    @torch.no_grad()
    def zero_pruned(*_) -> None:
        for tensor, pruned in held:
            tensor.masked_fill_(pruned, 0)

    getattr(optimizer, "inner", optimizer).register_step_post_hook(zero_pruned)
    return [f"{describe(model)}: their gradients and weights are masked at every step"]
