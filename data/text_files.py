"""The text a tokenizer trains on (data/train_tokenizer.py): files, folders and globs expanded,
each file read as documents (.jsonl: a document per line) and metered against a byte budget.
"""
from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Iterator

from config import ConfigError
from data.tokenizer import TokenizerError

CHUNK_CHARS = 1 << 16  # a text file is handed to the trainer in pieces of about this size


def input_files(spec: str) -> list[Path]:
    """The files `spec` names: files, folders (every file below, sorted) and globs."""
    found: list[Path] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        matches = sorted(glob.glob(part, recursive=True)) or [part]
        for match in map(Path, matches):
            if match.is_dir():
                found += sorted(p for p in match.rglob("*") if p.is_file())
            elif match.is_file():
                found.append(match)
            else:
                raise ConfigError(f"{part}: no such file, folder or match")
    if not found:
        raise ConfigError("no input: name text files, e.g. python -m data.train_tokenizer "
                          "'corpus/*.txt' --out tokenizers/mine")
    return found


def documents(files: list[Path], text_field: str, bar) -> Iterator[str]:
    """Each file's documents: .jsonl lines' text_field, other files in pieces at line ends; the
    progress bar counts the files' bytes."""
    for path in files:
        with open(path, "rb") as f:
            piece: list[str] = []
            size = 0
            for n, raw in enumerate(f, 1):
                bar.update(len(raw))
                line = raw.decode("utf-8", errors="replace")
                if path.suffix == ".jsonl":
                    if line.strip():
                        yield jsonl_text(line, text_field, path, n)
                    continue
                piece.append(line)
                size += len(line)
                if size >= CHUNK_CHARS:
                    yield "".join(piece)
                    piece, size = [], 0
            if piece:
                yield "".join(piece)


def jsonl_text(line: str, field: str, path: Path, n: int) -> str:
    try:
        text = json.loads(line)[field]
    except (ValueError, KeyError, TypeError):
        raise TokenizerError(f"{path}:{n}: not a JSON object with a '{field}' string; pass "
                             "--text_field naming the text's field") from None
    if not isinstance(text, str):
        raise TokenizerError(f"{path}:{n}: '{field}' is {type(text).__name__}, not text")
    return text


def metered(texts: Iterator[str], budget: int, read: list[int], bar) -> Iterator[str]:
    """texts until `budget` bytes of text (0: all), counted in read[0]; then the bar says the
    trainer has moved on to merging."""
    for text in texts:
        size = len(text.encode("utf-8", errors="replace"))
        if budget and read[0] + size > budget:
            text = text.encode(errors="replace")[:budget - read[0]].decode(errors="ignore")
            size = budget - read[0]
        read[0] += size
        yield text
        if budget and read[0] >= budget:
            break
    bar.set_description("merging (no progress shown)")
