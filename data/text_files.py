"""The text a tokenizer trains on (data/train_tokenizer.py): files, folders and globs expanded,
files that are not UTF-8 text skipped and counted, .gz/.bz2/.xz files read decompressed, each
file read as documents (.jsonl: a document per line) and metered against a byte budget.

    files, skipped = text_files(input_files("docs/,notes.txt"))   # skipped: {reason: [(path, why)]}
    tally = Tally()
    for text in metered(documents(files, "text", bar), budget, tally, bar): ...
    tally.check()     # refuses text that is mostly U+FFFD, the mark of bytes that were not UTF-8
"""
from __future__ import annotations

import bz2
import codecs
import contextlib
import glob
import gzip
import json
import lzma
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from config import ConfigError
from data.tokenizer import TokenizerError

CHUNK_CHARS = 1 << 16  # a text file is handed to the trainer in pieces of about this size
SNIFF_BYTES = 1 << 16  # the first bytes of a file that decide whether it is text
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # each takes a file object
REPLACED_LIMIT = 0.01  # refused above this share of U+FFFD: natural text has next to none
REPLACEMENT = "\ufffd"
SKIPPED = ("binary", "not UTF-8", "unreadable")  # why_not_text's reasons, in the note's order


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


@contextlib.contextmanager
def open_file(path: Path) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(its bytes, decompressed by its suffix; the file on disk, whose position is progress)."""
    with open(path, "rb") as raw:
        opener = COMPRESSED.get(path.suffix.lower())
        if opener is None:
            yield raw, raw
        else:
            with opener(raw) as unpacked:
                yield unpacked, raw


def why_not_text(path: Path) -> tuple[str, str] | None:
    """(reason, detail) if the file's first SNIFF_BYTES are not UTF-8 text; None if they are."""
    try:
        with open_file(path) as (f, _):
            head = f.read(SNIFF_BYTES)
    except (OSError, EOFError, lzma.LZMAError) as e:  # a damaged or mislabelled archive
        return "unreadable", str(e) or type(e).__name__
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # text, in another encoding
        return "not UTF-8", "a UTF-16 byte-order mark"
    if (nul := head.find(b"\0")) >= 0:
        return "binary", f"a NUL byte at {nul:,}"
    try:  # a character cut at the end of the head is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as e:
        return "not UTF-8", f"byte 0x{head[e.start]:02x} at {e.start:,}"
    return None


def text_files(files: list[Path]) -> tuple[list[Path], dict[str, list[tuple[Path, str]]]]:
    """(the files that are UTF-8 text, {reason: [(path, detail)]} of those that are not)."""
    kept, skipped = [], {reason: [] for reason in SKIPPED}
    for path in files:
        if (why := why_not_text(path)) is None:
            kept.append(path)
        else:
            skipped[why[0]].append((path, why[1]))
    return kept, {reason: entries for reason, entries in skipped.items() if entries}


def skipped_note(skipped: dict[str, list[tuple[Path, str]]], n_files: int) -> str:
    """'skipped 3 of 5 files, ...: 1 binary (logo.png), ...', the first two of each reason."""
    def examples(reason: str, entries: list[tuple[Path, str]]) -> str:
        named = [str(p) + (f": {detail}" if reason == "unreadable" else "")
                 for p, detail in entries[:2]]
        return ", ".join(named) + (", ..." if len(entries) > 2 else "")
    count = sum(map(len, skipped.values()))
    return (f"skipped {count:,} of {n_files:,} files, which are not UTF-8 text: "
            + ", ".join(f"{len(entries):,} {reason} ({examples(reason, entries)})"
                        for reason, entries in skipped.items()))


def documents(files: list[Path], text_field: str, bar, tally: Tally | None = None
              ) -> Iterator[str]:
    """Each file's documents: .jsonl lines' text_field, other files in pieces at line ends; a
    compressed file decompressed (x.jsonl.gz is JSON lines). The progress bar counts the bytes
    of the files on disk; `tally` learns which file the text comes from. Bytes that are not
    UTF-8 become U+FFFD."""
    for path in files:
        if tally is not None:
            tally.path = path
        inner = Path(path.stem).suffix if path.suffix.lower() in COMPRESSED else path.suffix
        with open_file(path) as (f, raw):
            piece: list[str] = []
            size = done = 0
            for n, line_bytes in enumerate(f, 1):
                bar.update((at := raw.tell()) - done)
                done = at
                line = line_bytes.decode("utf-8", errors="replace")
                if inner == ".jsonl":
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


@dataclass
class Tally:
    """The text handed to the trainer: its UTF-8 bytes, its characters, and the replacement
    characters (U+FFFD) among them by file (`path`: the file being read, set by documents())."""

    bytes: int = 0
    chars: int = 0
    replaced: Counter = field(default_factory=Counter)
    path: Path | None = None

    def count(self, text: str, size: int) -> None:
        self.bytes, self.chars = self.bytes + size, self.chars + len(text)
        if REPLACEMENT in text:
            self.replaced[self.path] += text.count(REPLACEMENT)

    def replaced_text(self) -> str:
        """'102,900 of 172,903 characters; most in a.txt: 102,400' ('' when there are none)."""
        total = sum(self.replaced.values())
        if not total:
            return ""
        path, most = self.replaced.most_common(1)[0]
        return f"{total:,} of {self.chars:,} characters; most in {path}: {most:,}"

    def check(self) -> None:
        """Text that is more than REPLACED_LIMIT U+FFFD is refused: it was not UTF-8 (or came
        damaged), and a tokenizer would spend its merges on runs of the replacement."""
        total = sum(self.replaced.values())
        if total > REPLACED_LIMIT * self.chars:
            raise TokenizerError(
                f"the text read is {total / self.chars:.1%} U+FFFD replacement characters "
                f"({self.replaced_text()}), the mark of bytes that are not UTF-8; a tokenizer "
                f"would learn merges of it. Convert those files to UTF-8 (iconv -t UTF-8) or "
                f"leave them out; text up to {REPLACED_LIMIT:.0%} U+FFFD is taken")


def metered(texts: Iterator[str], budget: int, tally: Tally, bar) -> Iterator[str]:
    """texts until `budget` bytes of text (0: all), counted in `tally`; then the bar says the
    trainer has moved on to merging, after tally.check() (which may refuse the text)."""
    for text in texts:
        size = len(text.encode("utf-8", errors="replace"))
        if budget and tally.bytes + size > budget:
            text = text.encode(errors="replace")[:budget - tally.bytes].decode(errors="ignore")
            size = budget - tally.bytes
        tally.count(text, size)
        yield text
        if budget and tally.bytes >= budget:
            break
    tally.check()
    bar.set_description("merging (no progress shown)")
