"""Instruction data: a JSON or JSON-lines file of examples, each a conversation made token ids by
a chat template (data/chat_template.py), in batches of whole examples whose loss counts only the
responses. train.py reads one when data.dataset names a .json / .jsonl file (docs/finetuning.md).

    data = InstructionData.read("alpaca.json", tokenizer, ChatTemplate(), block_size=1024)
    batches = InstructBatches(data.meta(), "train", batch_size=8, block_size=1024, seed=1337)
    x, y = batches.next()   # (B, T) each, T the longest example's length rounded up to 16; y is
                            # -1 (no loss) on prompts, headers and padding

A record is one of:
    {"instruction": "...", "input": "...", "output": "..."}   Alpaca's (input may be empty)
    {"prompt": "...", "response": "..."}                       ("completion" for "response")
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}
A .json file holds a list of them, a .jsonl file one per line. Each example is one row of a
batch, never sharing it with another; rows are padded to the batch's longest. An example longer
than the context is cut to it (data.overlength=truncate; dropped if no response token is left),
dropped (drop) or refused (error), and the count said at start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.chat_template import ChatTemplate, TemplateError, check_messages
from data.dataset import DataError
from data.loader import Batches

if TYPE_CHECKING:
    import torch

PAD_MULTIPLE = 16  # rows padded to a multiple of this: few distinct shapes for compiled code
IGNORE = -1  # model.IGNORE_INDEX: a target no loss counts


def row_length(longest: int, block_size: int) -> int:
    """The length a batch's rows are padded to: its longest example's, rounded up to
    PAD_MULTIPLE, at most block_size."""
    return min(block_size, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)


def read_records(path: Path) -> list[tuple[str, object]]:
    """(where, record) for each record of a .json list or a .jsonl file; errors name the line."""
    if not path.is_file():
        raise DataError(f"instruction data {path} not found; pass --dataset=<a .json or .jsonl "
                        "file of examples> (docs/finetuning.md; the word-reversal task's files: "
                        "python -m data.instruct_tasks reverse)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}, byte "
                        f"{e.start - start + 1} of line {line}; offset {e.start} in the file); "
                        "save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise DataError(f"{path} is empty: it holds no examples")
    if path.suffix.lower() == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); a .json file holds "
                            "one list of examples (a .jsonl file: one example per line)") from None
        if not isinstance(records, list):
            raise DataError(f"{path} holds a JSON {type(records).__name__}, not a list of "
                            "examples; put them in a list, or one per line in a .jsonl file")
        return [(f"{path} example {i}", r) for i, r in enumerate(records)]
    out = []
    # lines end at "\n" only: splitlines() also breaks at U+2028 and U+0085, which JSON strings
    # may hold as they are, and would number lines unlike an editor and the error above
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                            "a .jsonl file holds one JSON object per line") from None
    return out


def to_messages(record, where: str) -> list[dict]:
    """A record as a conversation (checked: known roles, string contents, a reply to learn)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: an example must be a JSON object, got "
                        f"{type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "instruction" in record or "prompt" in record:
        key = "instruction" if "instruction" in record else "prompt"
        reply = next((k for k in ("output", "response", "completion") if k in record), None)
        if reply is None:
            raise DataError(f"{where}: has {key!r} but no \"output\" (or \"response\", "
                            "\"completion\") to learn")
        user = record[key]
        if isinstance(user, str) and record.get("input"):
            user = f"{user}\n\n{record['input']}"
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": record[reply]}]
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise DataError(f"{where}: an example needs \"messages\" (a conversation) or "
                        f"\"instruction\" and \"output\" (Alpaca's); it has {sorted(record)}")
    try:
        check_messages(messages)
    except TemplateError as e:
        raise DataError(f"{where}: {e}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message: nothing to learn")
    return messages


@dataclass
class Example:
    ids: np.ndarray  # (L,) the conversation's tokens
    targets: np.ndarray  # (L - 1,) the next token where the loss counts it, else IGNORE


def encode(messages: list[dict], tokenizer, template: ChatTemplate, every_token: bool,
           where: str) -> Example:
    try:
        ids, counted = template.render(tokenizer, messages, every_token)
    except (TemplateError, ValueError) as e:
        raise DataError(f"{where}: {e}") from None
    ids = np.asarray(ids, dtype=np.int64)
    targets = np.where(np.asarray(counted[1:], dtype=bool), ids[1:], IGNORE)
    return Example(ids, targets)


def fit(examples: list[Example], wheres: list[str], block_size: int, overlength: str,
        what: str) -> tuple[list[Example], str]:
    """Examples cut, dropped or refused at block_size + 1 tokens; the note saying which."""
    long = [i for i, e in enumerate(examples) if len(e.ids) > block_size + 1]
    if not long:
        return examples, ""
    longest = max(len(examples[i].ids) for i in long)
    counts = f"{len(long)} of {len(examples)} {what} examples are longer than the context " \
             f"(block_size + 1 = {block_size + 1} tokens; the longest {longest}, first " \
             f"{wheres[long[0]]})"
    if overlength == "error":
        raise DataError(f"{counts}; pass --overlength=truncate to cut them, --overlength=drop "
                        "to leave them out, or a larger --block_size")
    if overlength == "drop":
        keep = sorted(set(range(len(examples))) - set(long))
        return [examples[i] for i in keep], f"{counts}: dropped (--overlength=drop)"
    out, emptied = [], 0
    for i, e in enumerate(examples):
        if i in long:
            e = Example(e.ids[:block_size + 1], e.targets[:block_size])
            if (e.targets == IGNORE).all():
                emptied += 1
                continue
        out.append(e)
    dropped = f"; {emptied} of them dropped: no response token within the context" \
        if emptied else ""
    return out, (f"{counts}: cut to the context, their responses' ends lost{dropped} "
                 "(--overlength=drop leaves them out, a larger --block_size keeps them)")


@dataclass
class InstructionData:
    """An instruction file's examples, both splits, encoded for one tokenizer and template."""

    source: str
    splits: dict[str, list[Example]]
    notes: list[str]

    @classmethod
    def read(cls, path: str, tokenizer, template: ChatTemplate, block_size: int,
             val_path: str = "", val_fraction: float = 0.05, overlength: str = "truncate",
             every_token: bool = False) -> "InstructionData":
        def load(p: str, what: str) -> tuple[list[Example], str]:
            records = read_records(Path(p))
            if not records:
                raise DataError(f"{p} holds no examples")
            examples = [encode(to_messages(r, where), tokenizer, template, every_token, where)
                        for where, r in records]
            return fit(examples, [w for w, _ in records], block_size, overlength, what)

        train, note = load(path, "training")
        notes = [note] if note else []
        if val_path:
            val, val_note = load(val_path, "validation")
            notes += [val_note] if val_note else []
        else:  # a fixed share of the file, the same whatever the run's seed
            if len(train) < 2:
                raise DataError(f"{path} has {len(train)} usable example(s); at least 2 are "
                                "needed (one held out for validation), or pass --val_file")
            order = np.random.default_rng(0).permutation(len(train))
            n_val = max(1, round(len(train) * val_fraction))
            val = [train[i] for i in sorted(order[:n_val])]
            train = [train[i] for i in sorted(order[n_val:])]
        if not train or not val:
            raise DataError(f"{path}: no usable {'training' if not train else 'validation'} "
                            "examples are left (see the notes above)")
        return cls(str(path), {"train": train, "val": val}, notes)

    def meta(self, tokenizer, template: ChatTemplate) -> dict:
        """A dataset's meta (data/dataset.py's keys) with the examples and the template."""
        counts = {s: sum(len(e.targets) for e in ex) for s, ex in self.splits.items()}
        return {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.meta(),
                "template": template.meta(), "splits": counts, "dir": self.source,
                "examples": {s: len(ex) for s, ex in self.splits.items()},
                "pad_id": template.end_id(tokenizer), "instruction": self}

    def mean_row_length(self, batch_size: int, block_size: int, batches: int = 64) -> float:
        """The mean length training rows are padded to, over `batches` seeded draws of
        batch_size examples: the tokens a step computes per row (the time estimate's)."""
        lengths = np.array([len(e.targets) for e in self.splits["train"]])
        rng, size = np.random.default_rng(0), min(batch_size, len(lengths))
        return float(np.mean([row_length(int(lengths[rng.choice(len(lengths), size, False)]
                                             .max()), block_size) for _ in range(batches)]))

    def summary(self) -> str:
        train, val = self.splits["train"], self.splits["val"]
        counted = sum(int((e.targets != IGNORE).sum()) for e in train)
        tokens = sum(len(e.targets) for e in train)
        return (f"instruction data {self.source}: {len(train):,} training examples "
                f"({tokens:,} tokens, {counted:,} of them counted in the loss), "
                f"{len(val):,} validation examples")


class InstructBatches(Batches):
    """Batches of whole examples: each epoch a seeded permutation of the split, batch_size
    examples a step (every rank drawing the global batch and keeping its rows, as Batches does),
    padded to the global batch's longest. The position (epoch, index) is what a checkpoint
    stores."""

    ragged = True  # T varies per batch (engine/training/restore.py)

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False):
        self.examples = meta["instruction"].splits[split]
        self.pad_id = meta["pad_id"]  # the end of text: any id would do, no loss counts it
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.setup_device(device, pin_memory, prefetch)
        self.epoch, self.index = 0, 0
        self.order = self._permutation(0)
        self.rows_read = self.tokens_read = 0  # for the log's tokens per step

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def draw(self) -> np.ndarray:
        """The next global batch's example indices (advances the position), this rank's rows."""
        picked = []
        while len(picked) < self.batch_size * self.world_size:
            if self.index == len(self.order):
                self.epoch, self.index = self.epoch + 1, 0
                self.order = self._permutation(self.epoch)
            take = min(len(self.order) - self.index,
                       self.batch_size * self.world_size - len(picked))
            picked += self.order[self.index:self.index + take].tolist()
            self.index += take
        return np.asarray(picked)

    def windows(self, picked: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples `picked` (the global batch) padded to its longest -> this rank's rows."""
        rows = [self.examples[i] for i in picked]
        T = row_length(max(len(e.targets) for e in rows), self.block_size)
        x = np.full((len(rows), T), self.pad_id, dtype=np.int64)
        y = np.full((len(rows), T), IGNORE, dtype=np.int64)
        for r, e in enumerate(rows):
            x[r, :len(e.targets)], y[r, :len(e.targets)] = e.ids[:-1], e.targets
        xy = self.to_device(np.stack([x, y])[:, self.rank::self.world_size])
        return xy[0], xy[1]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.windows(self.draw())
        self.rows_read, self.tokens_read = self.rows_read + x.size(0), self.tokens_read + x.numel()
        return x, y

    @property
    def mean_row_tokens(self) -> float | None:
        """The mean padded length of the rows next() gave so far (None before the first)."""
        return self.tokens_read / self.rows_read if self.rows_read else None

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """n_batches global batches for evaluation: the split in order from a seeded start,
        wrapping around (a small split is read whole, some examples twice)."""
        n, size = len(self.examples), self.batch_size * self.world_size
        first = int(np.random.default_rng(seed).integers(n))
        return [(first + np.arange(b * size, (b + 1) * size)) % n for b in range(n_batches)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:
            raise DataError("the stored data position is for a token dataset, but this run "
                            "reads instruction data; resume with the data the run started on")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.order = self._permutation(self.epoch)
