"""One step's experience: prompts drawn from the task's training problems, G completions of each
sampled in one batch over the KV cache (engine/evaluation/generation.py, eval.py's sampler),
their rewards from the task's checker, and the rows the update trains on.

    order = PromptOrder(len(task.problems), seed)
    batch = rollout(model, tokenizer, template, task, order.take(8), settings, generator)
    batch.ids, batch.mask, batch.old_logp, batch.advantages     # what grpo.policy_loss needs
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.evaluation import prompts
from engine.evaluation.checkers import CheckerError
from engine.evaluation.generation import generate_batch
from engine.evaluation.tasks import Task
from engine.rl.grpo import group_advantages


class RewardError(RuntimeError):
    """A checker that raised or answered something other than a reward; names task and problem."""


class PromptOrder:
    """The training problems in a seeded shuffle, a new shuffle each pass; exact to resume."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0):
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position
        self.order = None  # this pass's shuffle, drawn when first needed

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.order is None:
                self.order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
            got = self.order[self.position:self.position + k - len(out)].tolist()
            out += got
            self.position += len(got)
            if self.position >= self.n:
                self.epoch, self.position, self.order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


@dataclass
class RolloutSettings:
    group_size: int
    max_new_tokens: int
    temperature: float
    shots: int
    scale_by_std: bool
    seed: int
    batch_rows: int = 64
    autocast: object = None


@dataclass
class Rollout:
    ids: torch.Tensor  # (B, T): prompt, completion, its stop token; right-padded; B = P x G
    mask: torch.Tensor  # (B, T - 1): which targets (ids[:, 1:]) are completion tokens
    old_logp: torch.Tensor  # (B, T - 1): the sampler's log-probabilities of those
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (P, G)
    lengths: list[int]  # each completion's tokens, its stop token included
    seconds: float  # sampling and checking


def prompt_ids(task: Task, index: int, tokenizer, template, s: RolloutSettings,
               block_size: int) -> list[int]:
    """Problem `index`'s prompt as eval.py writes it (its shots from the task's pool)."""
    room = block_size - s.max_new_tokens
    ids, _ = prompts.fitted(
        lambda few: prompts.generation_prompt(task, task.problems[index], few, tokenizer,
                                              template),
        prompts.pick_shots(task, index, s.shots, s.seed), room)
    return ids[-room:]


def rewards_of(task: Task, indices: list[int], texts: list[list[str]]) -> torch.Tensor:
    """(P, G) rewards from the checker; RewardError naming the task and problem if it fails."""
    out = []
    for i, group in zip(indices, texts):
        try:
            out.append([task.check(task.problems[i], text) for text in group])
        except CheckerError as e:
            raise RewardError(f"task {task.name}, {task.wheres[i]}: {e}") from None
    return torch.tensor(out, dtype=torch.float32)


def rollout(model: torch.nn.Module, tokenizer, template, task: Task, indices: list[int],
            s: RolloutSettings, generator: torch.Generator) -> Rollout:
    t0 = time.perf_counter()
    block = model.config.block_size
    asked = [prompt_ids(task, i, tokenizer, template, s, block) for i in indices]
    stop_ids, stop_strings = prompts.stops(task, tokenizer, template)
    outs = generate_batch(model, tokenizer, asked, s.max_new_tokens, s.group_size,
                          s.temperature, stop_ids=stop_ids, stop_strings=stop_strings,
                          generator=generator, batch_rows=s.batch_rows, autocast=s.autocast,
                          logprobs=True)
    rewards = rewards_of(task, indices, [[c.text for c in group] for group in outs])
    advantages = group_advantages(rewards, s.scale_by_std).flatten()
    rows, starts, logps = [], [], []
    for prompt, group in zip(asked, outs):
        for c in group:
            completion = c.tokens + ([c.stop_token] if c.stop_token is not None else [])
            rows.append(prompt + completion)
            starts.append(len(prompt))
            logps.append(c.logprobs)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    old = torch.zeros(len(rows), width - 1)
    for r, (row, start, lp) in enumerate(zip(rows, starts, logps)):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, start - 1:len(row) - 1] = True  # target j is ids[j + 1]
        old[r, start - 1:len(row) - 1] = torch.tensor(lp)
    return Rollout(ids, mask, old, advantages, rewards, [len(lp) for lp in logps],
                   time.perf_counter() - t0)
