"""How a problem is put to a model: few-shot examples, then the problem, as plain text or through
a checkpoint's chat template; and what ends its answer.

Plain (a base model): each example is `prompt + answer_prefix + " " + answer + separator`, then
the problem's `prompt + answer_prefix`; the completion ends at a stop string (a newline by
default) or the end-of-text token. Chat (a checkpoint finetuned with a template): the examples
are earlier turns, the problem the last user turn; the completion ends at the end of the turn.
A choice problem is always plain: `context + choices[label] + separator` per example, then the
context, each choice scored after it. Examples that would not fit in the model's context are
dropped, the earliest first, rather than cropping one in the middle.
"""
from __future__ import annotations

import random

from engine.evaluation.tasks import Task


def pick_shots(task: Task, index: int, shots: int, seed: int) -> list[dict]:
    """The few-shot examples for problem `index`: a seeded draw from the task's few-shot pool,
    or from its other problems (those with an answer to show); the same for every model at the
    same seed."""
    if shots <= 0:
        return []
    pool = task.fewshot if task.fewshot is not None else \
        task.problems[:index] + task.problems[index + 1:]
    if task.kind == "generate":
        pool = [p for p in pool if "answer" in p]
    rng = random.Random(f"{seed}:{task.name}:{index}")  # str seeds hash the same in every run
    return rng.sample(pool, min(shots, len(pool)))


def encode(tokenizer, text: str) -> list[int]:
    """Text as ordinary tokens (a literal "<|endoftext|>" stays text); a character model's
    unknown characters raise its TokenizerError."""
    return tokenizer.encode_ordinary(text)


def fitted(build, shots: list[dict], limit: int) -> tuple[object, int]:
    """build(shots) with as many of the last shots as keep its length (build's first item's,
    for a choice request) within limit tokens -> (what build made, the shots kept)."""
    for start in range(len(shots) + 1):
        made = build(shots[start:])
        ids = made[0] if isinstance(made, tuple) else made
        if len(ids) <= limit or start == len(shots):
            return made, len(shots) - start
    raise AssertionError("unreachable")


def generation_prompt(task: Task, problem: dict, shots: list[dict], tokenizer,
                      template=None) -> list[int]:
    if template is not None:
        messages = []
        for s in shots:
            messages += [{"role": "user", "content": s["prompt"]},
                         {"role": "assistant", "content": str(s["answer"])}]
        messages.append({"role": "user", "content": problem["prompt"]})
        return template.prompt(tokenizer, messages)
    text = "".join(f"{s['prompt']}{task.answer_prefix} {s['answer']}{task.separator}"
                   for s in shots)
    return encode(tokenizer, text + problem["prompt"] + task.answer_prefix)


def stops(task: Task, tokenizer, template=None) -> tuple[set[int], list[str]]:
    """(stop token ids, stop strings) that end a completion."""
    if template is not None:
        return {template.end_id(tokenizer)}, []
    eot = getattr(tokenizer, "eot_id", None)
    return ({eot} if eot is not None else set()), list(task.stop)


def choice_request(task: Task, problem: dict, shots: list[dict], tokenizer
                   ) -> tuple[list[int], list[list[int]]]:
    """(context ids, each choice's ids): the two encoded apart, as HellaSwag is scored."""
    text = "".join(s["context"] + s["choices"][s["label"]] + task.separator for s in shots)
    context = encode(tokenizer, text + problem["context"]) or [tokenizer.start_id]
    return context, [encode(tokenizer, c) for c in problem["choices"]]
