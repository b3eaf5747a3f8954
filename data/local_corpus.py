"""A local JSON-lines corpus, one document per text file, for trying the sharded preparation
without a network (the tests write their own, smaller corpora).

    python data/local_corpus.py --out /tmp/corpus.jsonl --max-mb 24
    python data/fineweb_edu/prepare.py --dataset json --data-files /tmp/corpus.jsonl \\
        --out-dir data/local_corpus --shard-tokens 1M --val-tokens 200k

By default the documents are this Python's standard library files (~12 MB), sorted; or pass
folders (*.py, *.md, *.rst, *.txt, README*, LICENSE*).
"""
from __future__ import annotations

import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import ConfigError, load_options, opt  # noqa: E402

SUFFIXES = (".py", ".md", ".rst", ".txt")
NAMES = ("LICENSE", "README")
SKIP = {"test", "tests", "__pycache__", "site-packages"}


def text_files(roots: list[Path]) -> list[Path]:
    return sorted({path for root in roots for path in root.rglob("*")
                   if not SKIP.intersection(path.relative_to(root).parts) and path.is_file()
                   and (path.suffix in SUFFIXES or path.name.startswith(NAMES))})


@dataclass
class CorpusOptions:
    positional: ClassVar[str] = "folders"
    folders: str = opt("", "folders to read, comma-separated (also the first bare argument); "
                       "'' = the standard library")
    out: str = opt("", "the .jsonl file to write")
    max_mb: float = opt(24.0, "stop after this much text (MiB)")


def write_corpus(files: list[Path], out: Path, budget: int) -> tuple[int, int]:
    """One JSON line per readable, non-empty text file until `budget` bytes; (documents, bytes)."""
    written = docs = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable: not text
            if text.strip():
                f.write(json.dumps({"text": text, "source": str(path)}) + "\n")
                written, docs = written + len(text.encode()), docs + 1
            if written >= budget:
                break
    return docs, written


def main(argv: list[str] | None = None) -> int:
    try:
        o = load_options(sys.argv[1:] if argv is None else argv, CorpusOptions,
                         prog="data/local_corpus.py", about=__doc__)
        if not o.out:
            raise ConfigError("--out FILE.jsonl is required")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    roots = [Path(f) for f in o.folders.split(",") if f] or [Path(sysconfig.get_paths()["stdlib"])]
    docs, written = write_corpus(text_files(roots), Path(o.out), int(o.max_mb * 2**20))
    print(f"{o.out}: {docs:,} documents, {written / 2**20:.1f} MiB of text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
