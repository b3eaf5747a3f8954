"""GRPO's arithmetic, written out: advantages relative to each prompt's group of completions, the
clipped policy-gradient loss over the completion tokens only, and the KL penalty's estimator.

A prompt's G completions with rewards r_1..r_G get advantages A_j = r_j - mean(r), divided by
the group's standard deviation (+ 1e-4) when scale_by_std. Each completion token t then costs

    ratio_t = exp(logp_t - old_logp_t)                  # the policy now / when it sampled
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
              + kl_coef * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   # k3, >= 0, when on

normalize="token" averages loss_t over every completion token of the batch (long completions
weigh by their length: DAPO's, and TRL's "bnpo" on one process); "sequence" averages within each
completion, then over completions (the GRPO paper's; TRL's "grpo"). On the first update of a
batch ratio_t is 1, so the loss's gradient is the plain policy gradient; clipping acts only when
a batch is used again (updates_per_batch > 1).
"""
from __future__ import annotations

import torch

NORMALIZE = ("token", "sequence")
STD_EPS = 1e-4  # keeps a group whose rewards are all alike (std 0) at advantage 0


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """rewards (P, G), a row per prompt -> advantages (P, G), each row centred on its mean."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std and rewards.size(1) > 1:
        centred = centred / (rewards.std(dim=1, keepdim=True) + STD_EPS)
    return centred


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """logits (B, T, V), targets (B, T) -> each target's log-probability (B, T) under
    softmax(logits / temperature), the distribution the sampler drew from."""
    scaled = torch.log_softmax(logits.float() / temperature, dim=-1)
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float = 0.2, kl_coef: float = 0.0,
                ref_logp: torch.Tensor | None = None, normalize: str = "token",
                total: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of (B, T) token log-probabilities (mask: the completion tokens) for advantages
    (B,) -> (loss, {"clipped": tokens clipped, "kl": summed KL, "tokens": counted tokens}).
    `total` divides instead of this batch's own count (tokens, or completions for "sequence"):
    the whole batch's, when it is split into micro-batches."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.zeros_like(logp)
    if kl_coef:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    if normalize == "token":
        loss = (per_token * mask).sum() / (total or mask.sum().clamp(min=1))
    elif normalize == "sequence":
        per_row = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = per_row.sum() / (total or mask.size(0))
    else:
        raise ValueError(f"normalize={normalize!r}: one of {', '.join(NORMALIZE)}")
    clipped = ((ratio < 1 - clip_eps) & (a < 0)) | ((ratio > 1 + clip_eps) & (a > 0))
    return loss, {"clipped": (clipped.float() * mask).sum().detach(),
                  "kl": (kl.detach() * mask).sum(), "tokens": mask.sum()}
