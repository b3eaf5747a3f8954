"""Small instruction tasks whose answers can be checked exactly, written as instruction data
(data/instruct.py): to try finetuning on a CPU in minutes, and to measure it (bench.py finetune).

    python -m data.instruct_tasks reverse --out data/tasks  # reverse_train.jsonl, reverse_val.jsonl

reverse: "Reverse the word: night" -> "thgin"; sort: "Sort the letters: night" -> "ghint". The
words come from tiny Shakespeare (lower case, 3 to 7 letters), so a character model trained on it
has every character; the validation words never appear in the training file.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from data.dataset import DATA_DIR

TASKS = {  # name -> (instruction, answer) of a word
    "reverse": ("Reverse the word: {}", lambda w: w[::-1]),
    "sort": ("Sort the letters: {}", lambda w: "".join(sorted(w))),
}


def shakespeare_words(lengths: tuple[int, int] = (3, 7)) -> list[str]:
    """The distinct lower-case words of tiny Shakespeare with lengths in the range, sorted."""
    text = (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
    low, high = lengths
    return sorted({w for w in re.findall(r"[a-z]+", text) if low <= len(w) <= high})


def task_examples(task: str, words: list[str]) -> list[dict]:
    instruction, answer = TASKS[task]
    return [{"instruction": instruction.format(w), "output": answer(w)} for w in words]


def split_words(seed: int = 0, n_val: int = 200) -> tuple[list[str], list[str]]:
    """(training words, held-out words): a seeded shuffle of the vocabulary, split."""
    words = shakespeare_words()
    order = np.random.default_rng(seed).permutation(len(words))
    return [words[i] for i in order[n_val:]], [words[i] for i in order[:n_val]]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_task(task: str, out: Path, seed: int = 0, n_val: int = 200) -> tuple[Path, Path]:
    """The task's training and validation files in `out` (TASK_train.jsonl, TASK_val.jsonl)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    train, val = split_words(seed, n_val)
    return (write_jsonl(out / f"{task}_train.jsonl", task_examples(task, train)),
            write_jsonl(out / f"{task}_val.jsonl", task_examples(task, val)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--out", default="data/tasks", help="folder for the two files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=int, default=200, help="held-out examples")
    args = parser.parse_args(argv)
    for path in write_task(args.task, Path(args.out), args.seed, args.val):
        print(f"wrote {path} ({sum(1 for _ in path.open())} examples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
