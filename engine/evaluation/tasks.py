"""Tasks: what eval.py measures, each a list of problems of one kind, from a JSONL file a user
writes, from a built-in generator (data/instruct_tasks.py), HellaSwag, or a text file.

    tasks = load_tasks("add,reverse,hellaswag,mine.jsonl,notes.txt", seed=0, limit=100)

Kinds: "choice" (multiple choice, each choice scored by its log-likelihood after the context),
"generate" (a completion generated, then judged by a checker: exact, number or a function of
yours) and "bpb" (bits per byte of a text). A JSONL task file holds one problem per line:

    {"context": "The capital of France is", "choices": [" Paris", " Rome"], "label": 0}
    {"prompt": "What is 2 + 2?", "answer": "4"}

and may begin with a header line, {"task": {...}}, setting any of HEADER_KEYS (its kind and
checker, few-shot examples, the answer's cue, stop strings...). Without one the kind follows the
first problem's fields and the name the file's.
"""
from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from data.dataset import DATA_DIR, DataError
from engine.evaluation import checkers

KINDS = ("choice", "generate", "bpb")
METRICS = {"choice": ("acc", "acc_norm", "acc_char"), "generate": ("pass@1", "reward"),
           "bpb": ("bpb",)}
SUITES = {"builtin": ("reverse", "sort", "add", "copy4", "copy8", "copy16", "add_choice",
                      "shakespeare_bpb")}
BPB_TEXT_CHARS = 10_000  # shakespeare_bpb: the last characters of tiny Shakespeare (in its val)
BUILTIN_PROBLEMS = 200  # per built-in task unless --limit says otherwise
BUILTIN_ANSWER_TOKENS = 24  # the longest built-in answer is 16 characters, then its end


class TaskError(DataError):
    """A task that cannot be read or used; the message names the file and line, or the task."""


@dataclass
class Task:
    """One task: its problems and how they are asked and judged. The fields after `problems`
    are what a JSONL header may set (HEADER_KEYS)."""

    name: str
    kind: str
    problems: list[dict]
    wheres: list[str] = field(default_factory=list)  # each problem's file:line, for errors
    source: str = ""
    checker: str = "exact"  # generate: exact | number | module.path:function
    shots: int = 0  # few-shot examples before each problem (a chat model: 0 unless --shots)
    max_new_tokens: int = 32  # generate: the completion's length limit
    stop: list[str] = field(default_factory=lambda: ["\n"])  # generate: ends a completion
    metric: str = ""  # the headline: acc_norm (choice), pass@1 (generate), bpb
    answer_prefix: str = "\nAnswer:"  # after each prompt (plain format), before the answer
    separator: str = "\n\n"  # between few-shot examples
    fewshot: list[dict] | None = None  # examples to show; None: the task's other problems
    text: str = ""  # bpb: the text

    def __post_init__(self):
        self.metric = self.metric or {"choice": "acc_norm", "generate": "pass@1",
                                      "bpb": "bpb"}[self.kind]
        self.wheres = self.wheres or [f"{self.source} problem {i}"
                                      for i in range(len(self.problems))]
        self._check = None

    def checker_function(self) -> checkers.Checker:
        """The checker, a plain function (problem, completion) -> bool or reward in [0, 1]:
        what reinforcement learning calls for its rewards."""
        if self._check is None:
            try:
                self._check = checkers.resolve(self.checker)
            except checkers.CheckerError as e:
                raise TaskError(f"task {self.name}: {e}") from None
        return self._check

    def check(self, problem: dict, completion: str) -> float:
        """The checker's reward for a completion, in [0, 1] (CheckerError when it fails)."""
        return checkers.reward(self.checker_function(), problem, completion)

    def sha256(self) -> str:
        """Of what is asked and judged: the same digest means the same items, comparable."""
        fields = {k: getattr(self, k) for k in ("kind", "problems", "checker", "answer_prefix",
                                                "separator", "stop", "fewshot", "text")}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


HEADER_KEYS = ("name", "kind", "checker", "shots", "max_new_tokens", "stop", "metric",
               "answer_prefix", "separator")


def load_tasks(spec: str, seed: int = 0, limit: int = 0, hellaswag_path: str = "") -> list[Task]:
    """Tasks by comma-separated names: built-in ones, a suite (builtin), hellaswag, a .jsonl
    task file, a .txt file (bits per byte)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise TaskError("--tasks names no task; try --tasks=builtin")
    expanded = [t for n in names for t in SUITES.get(n, (n,))]
    tasks = [load_task(name, seed, limit, hellaswag_path) for name in expanded]
    for task in tasks:  # a checker that does not import fails now, before the model loads
        if task.kind == "generate":
            task.checker_function()
    return tasks


def load_task(name: str, seed: int, limit: int, hellaswag_path: str = "") -> Task:
    from data import instruct_tasks

    if name in instruct_tasks.BUILTIN:
        return builtin_task(name, seed, limit or BUILTIN_PROBLEMS)
    if name == "add_choice":
        return add_choice(seed, limit or BUILTIN_PROBLEMS)
    if name == "shakespeare_bpb":
        text = (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
        return Task("shakespeare_bpb", "bpb", [], source="data/tinyshakespeare.txt",
                    text=text[-BPB_TEXT_CHARS:])
    if name == "hellaswag":
        return hellaswag_task(hellaswag_path, limit)
    path = Path(name)
    if path.suffix.lower() in (".jsonl", ".txt"):
        if not path.is_file():
            raise TaskError(f"task file {path} not found")
        return jsonl_task(path, limit) if path.suffix.lower() == ".jsonl" else text_task(path)
    known = [*SUITES, *instruct_tasks.BUILTIN, "add_choice", "shakespeare_bpb", "hellaswag"]
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise TaskError(f"unknown task {name!r}{hint}; the built-in ones are {', '.join(known)}, "
                    "or give a .jsonl task file or a .txt file (bits per byte)")


def builtin_task(name: str, seed: int, n: int, split: str = "test") -> Task:
    """A built-in generation task: n problems of `split` (test: what eval.py scores; train:
    reinforcement learning's prompts); few-shot examples from the training split."""
    from data import instruct_tasks

    return Task(name, "generate", instruct_tasks.problems(name, split, n, seed),
                source=f"built-in {name} (seed {seed})",
                checker=instruct_tasks.CHECKERS.get(name, "exact"), shots=3,
                max_new_tokens=BUILTIN_ANSWER_TOKENS,
                fewshot=instruct_tasks.problems(name, "train", 50, seed))


def add_choice(seed: int, n: int) -> Task:
    """add as multiple choice: the sum among three near misses (+-1, +-10), in a seeded order."""
    import numpy as np

    from data import instruct_tasks

    def as_choice(p: dict, rng) -> dict:
        right = int(p["answer"])
        wrong = [v for v in (right + 1, right - 1, right + 10, right - 10) if v >= 0][:3]
        order = rng.permutation(4)
        choices = [f" {v}" for v in np.array([right, *wrong])[order]]
        return {"context": f"{p['prompt']}\nAnswer:", "choices": choices,
                "label": int(np.argmin(order))}

    rng = np.random.default_rng(seed)
    test = [as_choice(p, rng) for p in instruct_tasks.problems("add", "test", n, seed)]
    shots = [as_choice(p, rng) for p in instruct_tasks.problems("add", "train", 50, seed)]
    return Task("add_choice", "choice", test, source=f"built-in add_choice (seed {seed})",
                shots=3, fewshot=shots, metric="acc")


def hellaswag_task(path: str, limit: int) -> Task:
    """HellaSwag's validation set as a choice task: the context, then " " + each ending."""
    from engine import hellaswag

    file = hellaswag.ensure_file(path)
    problems = [{"context": ex["ctx"], "choices": [" " + e for e in ex["endings"]],
                 "label": ex["label"]} for ex in hellaswag.load_examples(file, limit)]
    return Task("hellaswag", "choice", problems, source=str(file), separator="\n\n")


def text_task(path: Path) -> Task:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}); save it as UTF-8") from None
    if not text:
        raise TaskError(f"{path} is empty: no text to measure bits per byte on")
    return Task(path.stem, "bpb", [], source=str(path), text=text)


def jsonl_task(path: Path, limit: int) -> Task:
    """A task file: an optional header line {"task": {...}}, then one problem per line."""
    from data.instruct import read_records

    records = read_records(path)  # DataError naming the line: not JSON, not UTF-8, empty
    header: dict = {}
    if isinstance(records[0][1], dict) and set(records[0][1]) == {"task"}:
        header = check_header(records[0][1]["task"], records[0][0])
        records = records[1:]
    if not records:
        raise TaskError(f"{path} holds a header but no problems")
    kind = header.pop("kind", None) or infer_kind(*records[0])
    checker = header.get("checker", "exact")
    checks = {"choice": check_choice, "generate": check_generate}[kind]
    problems = [checks(record, where, checker) for where, record in records]
    if limit:
        records, problems = records[:limit], problems[:limit]
    task = Task(header.pop("name", path.stem), kind, problems, [w for w, _ in records],
                source=str(path), **header)
    if task.metric not in METRICS[kind]:
        raise TaskError(f"{path}: metric {task.metric!r} is not one of a {kind} task's: "
                        f"{', '.join(METRICS[kind])}")
    return task


def check_header(header, where: str) -> dict:
    """The header's settings, each checked against its field's type."""
    if not isinstance(header, dict):
        raise TaskError(f"{where}: \"task\" must be an object of settings "
                        f"({', '.join(HEADER_KEYS)})")
    types = {"name": str, "kind": str, "checker": str, "shots": int, "max_new_tokens": int,
             "stop": list, "metric": str, "answer_prefix": str, "separator": str}
    for key, value in header.items():
        if key not in types:
            close = difflib.get_close_matches(key, HEADER_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TaskError(f"{where}: unknown task setting {key!r}{hint}; the settings are "
                            f"{', '.join(HEADER_KEYS)}")
        if not isinstance(value, types[key]) or isinstance(value, bool) and types[key] is int:
            raise TaskError(f"{where}: task setting {key!r} must be a {types[key].__name__}, "
                            f"got {value!r}")
    if "kind" in header and header["kind"] not in ("choice", "generate"):
        raise TaskError(f"{where}: unknown task kind {header['kind']!r}; a task file's kind is "
                        "choice or generate (bits per byte: give a .txt file)")
    if not all(isinstance(s, str) and s for s in header.get("stop", [])):
        raise TaskError(f"{where}: \"stop\" must be a list of non-empty strings")
    if header.get("shots", 0) < 0 or header.get("max_new_tokens", 1) < 1:
        raise TaskError(f"{where}: \"shots\" must be >= 0 and \"max_new_tokens\" >= 1")
    return dict(header)


def infer_kind(where: str, record) -> str:
    if isinstance(record, dict) and "choices" in record:
        return "choice"
    if isinstance(record, dict) and "prompt" in record:
        return "generate"
    raise TaskError(f"{where}: a problem needs \"context\", \"choices\" and \"label\" (multiple "
                    "choice) or \"prompt\" and \"answer\" (generation); or put a header line "
                    "{\"task\": {\"kind\": ...}} first")


def check_choice(record, where: str, checker: str) -> dict:
    ok = isinstance(record, dict) and isinstance(record.get("context"), str) \
        and isinstance(record.get("choices"), list) and len(record["choices"]) >= 2 \
        and all(isinstance(c, str) and c for c in record["choices"]) \
        and type(record.get("label")) is int
    if not ok:
        raise TaskError(f"{where}: a choice problem needs \"context\" (text), \"choices\" (a "
                        "list of 2 or more non-empty texts) and \"label\" (an integer), got "
                        f"{str(record)[:100]}")
    if not 0 <= record["label"] < len(record["choices"]):
        raise TaskError(f"{where}: label {record['label']} is not the index of one of its "
                        f"{len(record['choices'])} choices (0-based)")
    return record


def check_generate(record, where: str, checker: str) -> dict:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise TaskError(f"{where}: a generation problem needs \"prompt\" (text) and "
                        f"\"answer\", got {str(record)[:100]}")
    if "answer" not in record and checker in checkers.BUILTIN:
        raise TaskError(f"{where}: no \"answer\" for the {checker!r} checker to compare with")
    return record

