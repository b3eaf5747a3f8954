"""Run tasks on a model: each kind scored, its statistics, a result per task for the report.

    settings = Settings(seed=0, samples=1, temperature=0.0)
    result = run_task(model, tokenizer, template, task, settings)
    # {"task": "add", "metric": "pass@1", "value": 0.43, "ci95": [0.36, 0.50], "n": 200, ...}
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from data.tokenizer import TokenizerError
from engine.evaluation import prompts, stats
from engine.evaluation.checkers import CheckerError
from engine.evaluation.generation import generate_batch
from engine.evaluation.scoring import bits_per_byte, choice_logprobs
from engine.evaluation.tasks import Task, TaskError

EXAMPLES = 3  # completions kept in the report per generation task, to read what it answered


@dataclass
class Settings:
    seed: int = 0
    shots: int = -1  # -1: each task's own (0 through a chat template)
    samples: int = 1  # completions per problem (temperature > 0)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    pass_k: tuple[int, ...] = (1,)
    batch_rows: int = 32  # choices or samples a forward
    kv_cache: bool = True  # choice scoring: shared prefixes read once (False: each row whole)
    autocast: object = None


def run_task(model: torch.nn.Module, tokenizer, template, task: Task, s: Settings) -> dict:
    """The task's result; a task this tokenizer cannot write is 'skipped' with the reason."""
    t0 = time.perf_counter()
    base = {"task": task.name, "kind": task.kind, "source": task.source,
            "sha256": task.sha256(), "metric": task.metric}
    try:
        run = {"choice": run_choice, "generate": run_generate, "bpb": run_bpb}[task.kind]
        result = run(model, tokenizer, template, task, s)
    except TokenizerError as e:
        return {**base, "skipped": f"the model's tokenizer cannot write this task: {e}",
                "n": 0, "value": None}
    return {**base, **result, "seconds": round(time.perf_counter() - t0, 2)}


def shots_for(task: Task, s: Settings, template) -> int:
    if s.shots >= 0:
        return s.shots
    return 0 if template is not None and task.kind == "generate" else task.shots


def run_choice(model, tokenizer, template, task: Task, s: Settings) -> dict:
    shots, block = shots_for(task, s, None), model.config.block_size
    requests, kept = [], 0
    for i, p in enumerate(task.problems):
        longest = max(len(prompts.encode(tokenizer, c)) for c in p["choices"])
        request, used = prompts.fitted(
            lambda few: prompts.choice_request(task, p, few, tokenizer),
            prompts.pick_shots(task, i, shots, s.seed), block + 1 - longest)
        requests.append(request)
        kept += used
    scores = choice_logprobs(model, requests, s.batch_rows, s.kv_cache, s.autocast)
    picks = {"acc": [], "acc_norm": [], "acc_char": []}
    for problem, choice_scores in zip(task.problems, scores):
        chars = [max(1, len(c)) for c in problem["choices"]]
        ranked = {"acc": [lp for lp, _ in choice_scores],
                  "acc_norm": [lp / n for lp, n in choice_scores],
                  "acc_char": [lp / k for (lp, _), k in zip(choice_scores, chars)]}
        for name, values in ranked.items():
            picks[name].append(float(max(range(len(values)), key=values.__getitem__)
                                     == problem["label"]))
    metrics = {name: sum(v) / len(v) for name, v in picks.items()}
    return {**summary(picks[task.metric], metrics[task.metric]), "metrics": metrics,
            "shots": shots, "mean_shots_kept": kept / max(1, len(requests)),
            "logprobs": [[lp for lp, _ in c] for c in scores[:EXAMPLES]]}


def summary(values: list[float], value: float) -> dict:
    """The headline value, its 95% interval from the per-problem values, which interval, n."""
    low, high = stats.interval(values)
    which = "wilson" if all(v in (0.0, 1.0) for v in values) else "normal"
    return {"value": value, "ci95": [low, high], "interval": which, "n": len(values)}


def run_generate(model, tokenizer, template, task: Task, s: Settings) -> dict:
    shots = shots_for(task, s, template)
    room = model.config.block_size - task.max_new_tokens  # the prompt's, before the answer
    ids, kept = [], 0
    for i, p in enumerate(task.problems):
        prompt, used = prompts.fitted(
            lambda few: prompts.generation_prompt(task, p, few, tokenizer, template),
            prompts.pick_shots(task, i, shots, s.seed), room)
        ids.append(prompt)
        kept += used
    stop_ids, stop_strings = prompts.stops(task, tokenizer, template)
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(s.seed)
    outs = generate_batch(model, tokenizer, ids, task.max_new_tokens, s.samples, s.temperature,
                          s.top_k, s.top_p, stop_ids, stop_strings, generator, s.batch_rows,
                          s.autocast)
    rewards = []
    for i, (problem, completions) in enumerate(zip(task.problems, outs)):
        try:
            rewards.append([task.check(problem, c.text) for c in completions])
        except CheckerError as e:
            raise TaskError(f"task {task.name}, {task.wheres[i]}: {e}") from None
    n = len(outs[0]) if outs else 1
    metrics = {"reward": sum(map(sum, rewards)) / max(1, n * len(rewards))}
    per_problem = {}
    for k in sorted({k for k in s.pass_k if k <= n} | {1}):
        per_problem[k] = [stats.pass_at_k(n, sum(r >= 1.0 for r in rs), k) for rs in rewards]
        metrics[f"pass@{k}"] = sum(per_problem[k]) / max(1, len(rewards))
    headline = per_problem[1] if task.metric == "pass@1" else [sum(r) / n for r in rewards]
    examples = [{"prompt": problem.get("prompt"), "answer": problem.get("answer"),
                 "completions": [c.text for c in completions[:3]]}
                for problem, completions in list(zip(task.problems, outs))[:EXAMPLES]]
    return {**summary(headline, metrics[task.metric]), "metrics": metrics,
            "samples": n, "shots": shots, "mean_shots_kept": kept / max(1, len(ids)),
            "examples": examples, "per_problem": headline}


def run_bpb(model, tokenizer, template, task: Task, s: Settings) -> dict:
    ids = [tokenizer.start_id] + prompts.encode(tokenizer, task.text)
    r = bits_per_byte(model, ids, len(task.text.encode("utf-8")), max(1, s.batch_rows // 4),
                      s.autocast)
    return {"value": r["bpb"], "ci95": None, "interval": "none",
            "n": r["bytes"], "metrics": {"bpb": r["bpb"], "tokens": r["tokens"],
                                          "bytes": r["bytes"]}}
