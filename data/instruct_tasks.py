"""Small tasks whose answers can be checked exactly, generated from a seed with no download: one
definition each, written as instruction data (data/instruct.py) for finetuning, read by eval.py
as built-in tasks (engine/evaluation/), and by reinforcement learning as prompts with a checker.

    python -m data.instruct_tasks reverse --out data/tasks   # reverse_{train,val}.jsonl
    problems("add", "test", 100, seed=0)    # [{"prompt": "What is 37 + 58?", "answer": "95"}, ...]

reverse: "Reverse the word: night" -> "thgin"; sort: "Sort the letters: night" -> "ghint". Their
words come from tiny Shakespeare (lower case, 3 to 7 letters), so a character model trained on it
has every character; the 200 held-out words (a fixed shuffle, seed 0) never appear in the
training file. add: "What is 37 + 58?" -> "95", checked as a number; copyN: "Copy the text:
qhwd" -> "qhwd" for N random lower-case letters. A generated task's problems are split by their
text: the tenth whose crc32 is a multiple of 10 is held out (test), so no seed can put a test
problem in training data.
"""
from __future__ import annotations

import argparse
import json
import re
import zlib
from pathlib import Path

import numpy as np

from data.dataset import DATA_DIR

TASKS = {  # the word tasks: name -> (instruction, answer) of a word
    "reverse": ("Reverse the word: {}", lambda w: w[::-1]),
    "sort": ("Sort the letters: {}", lambda w: "".join(sorted(w))),
}
COPY_LENGTHS = (4, 8, 16)
# generated tasks: name -> (instruction, a seeded draw of its input, answer); the checker that
# judges a reply: exact (the text, stripped) or number (the last number in the reply)
GENERATED = {
    "add": ("What is {}?", lambda rng: f"{rng.integers(100)} + {rng.integers(100)}",
            lambda q: str(sum(int(t) for t in q.split(" + ")))),
    **{f"copy{n}": ("Copy the text: {}",
                    lambda rng, n=n: "".join(chr(97 + c) for c in rng.integers(26, size=n)),
                    lambda q: q) for n in COPY_LENGTHS},
}
CHECKERS = {"add": "number"}  # the rest: exact
BUILTIN = (*TASKS, *GENERATED)


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


def held_out(prompt: str) -> bool:
    """Whether a generated problem belongs to the test split: fixed by its text alone."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def problems(task: str, split: str, n: int, seed: int = 0) -> list[dict]:
    """n problems ({"prompt", "answer"}) of a built-in task from one split ("train" or "test"),
    fewer where the split has fewer. Word tasks: the held-out words are the SFT files' own (the
    seed picks their order); generated ones: distinct draws of a seeded generator."""
    if task in TASKS:
        instruction, answer = TASKS[task]
        words = split_words()[split == "test"]
        order = np.random.default_rng(seed).permutation(len(words))
        return [{"prompt": instruction.format(words[i]), "answer": answer(words[i])}
                for i in order[:n]]
    if task not in GENERATED:
        raise ValueError(f"unknown task {task!r}; the built-in tasks are {', '.join(BUILTIN)}")
    instruction, draw, answer = GENERATED[task]
    rng, seen, out = np.random.default_rng(seed), set(), []
    for _ in range(100 * n + 1000):  # add's test split has ~1,000 problems: stop there
        question = draw(rng)
        prompt = instruction.format(question)
        if held_out(prompt) == (split == "test") and prompt not in seen:
            seen.add(prompt)
            out.append({"prompt": prompt, "answer": answer(question)})
            if len(out) == n:
                break
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_task(task: str, out: Path, seed: int = 0, n_val: int = 200, n_train: int = 5000
               ) -> tuple[Path, Path]:
    """The task's training and validation files in `out` (TASK_train.jsonl, TASK_val.jsonl).
    Word tasks: every training word; generated ones: n_train problems."""
    if task in TASKS:
        train, val = split_words(seed, n_val)
        train, val = task_examples(task, train), task_examples(task, val)
    elif task in GENERATED:
        train, val = ([{"instruction": p["prompt"], "output": p["answer"]}
                       for p in problems(task, split, n, seed)]
                      for split, n in (("train", n_train), ("test", n_val)))
    else:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(BUILTIN)}")
    return (write_jsonl(out / f"{task}_train.jsonl", train),
            write_jsonl(out / f"{task}_val.jsonl", val))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=BUILTIN)
    parser.add_argument("--out", default="data/tasks", help="folder for the two files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=int, default=200, help="held-out examples")
    parser.add_argument("--train", type=int, default=5000,
                        help="training examples of a generated task (word tasks: every word)")
    args = parser.parse_args(argv)
    for path in write_task(args.task, Path(args.out), args.seed, args.val, args.train):
        print(f"wrote {path} ({sum(1 for _ in path.open())} examples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
