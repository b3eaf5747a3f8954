"""A local JSON-lines corpus, one document per text file, for trying the sharded preparation
without a network (the tests write their own, smaller corpora).

    python data/local_corpus.py --out /tmp/corpus.jsonl --max-mb 24
    python data/fineweb_edu/prepare.py --dataset json --data-files /tmp/corpus.jsonl \\
        --out-dir data/local_corpus --shard-tokens 1M --val-tokens 200k

By default the documents are the text that ships with this Python: its standard library's
modules and text files (tests and site-packages left out; ~12 MB, ~3.5M GPT-2 tokens for
CPython 3.11), in sorted path order, so the corpus is the same on every run of the same
installation. Pass folders to use other text (*.py, *.md, *.rst, *.txt, README*, LICENSE*).
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

SUFFIXES = (".py", ".md", ".rst", ".txt")
NAMES = ("LICENSE", "README")
SKIP = ("test", "tests", "__pycache__", "site-packages")


def text_files(roots: list[Path]) -> list[Path]:
    files = set()
    for root in roots:
        for path in root.rglob("*"):
            if any(part in SKIP for part in path.relative_to(root).parts):
                continue
            if path.is_file() and (path.suffix in SUFFIXES or path.name.startswith(NAMES)):
                files.add(path)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    paths = sysconfig.get_paths()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", type=Path, default=[Path(paths["stdlib"])],
                        help="folders to read (default: the standard library)")
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    parser.add_argument("--max-mb", type=float, default=24.0, help="stop after this much text")
    args = parser.parse_args(argv)
    budget, written, docs = int(args.max_mb * 2**20), 0, 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for path in text_files(args.folders):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable: not text
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "source": str(path)}) + "\n")
            written, docs = written + len(text.encode()), docs + 1
            if written >= budget:
                break
    print(f"{args.out}: {docs:,} documents, {written / 2**20:.1f} MiB of text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
