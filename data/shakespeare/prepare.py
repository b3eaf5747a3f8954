"""Tiny Shakespeare in BPE tokens: train.bin / val.bin (90% / 10%) and meta.json.

    python data/shakespeare/prepare.py                      # GPT-2's BPE, into data/shakespeare
    python data/shakespeare/prepare.py --tokenizer tokenizers/mine --out_dir data/shakespeare_mine
    python data/shakespeare/prepare.py --source my_book.txt --tokenizer tokenizers/mine \\
        --out_dir data/my_book                             # any UTF-8 text file, as one document

The data for finetuning GPT-2 (configs/finetune_shakespeare.toml), split by characters as in
data/shakespeare_char, so every tokenizer holds out the same text.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config import ConfigError, load_options, opt  # noqa: E402
from data.dataset import DATA_DIR, DataError  # noqa: E402
from data.writing import write_text  # noqa: E402
from data.train_tokenizer import named_tokenizer  # noqa: E402
from data.tokenizer import TokenizerError  # noqa: E402

SOURCE = DATA_DIR / "tinyshakespeare.txt"


@dataclass
class TextOptions:
    source: str = opt(str(SOURCE), "the UTF-8 text file to tokenize")
    tokenizer: str = opt("gpt2", "gpt2, or a folder written by python -m data.train_tokenizer")
    out_dir: str = opt(str(DATA_DIR / "shakespeare"), "where train.bin, val.bin and meta.json go")


def prepare(out_dir: Path = DATA_DIR / "shakespeare", source: Path = SOURCE,
            tokenizer: str = "gpt2") -> dict:
    return write_text(out_dir, source, lambda text: named_tokenizer(tokenizer))


def main(argv: list[str] | None = None) -> int:
    try:
        o = load_options(sys.argv[1:] if argv is None else argv, TextOptions,
                         prog="data/shakespeare/prepare.py", about=__doc__)
        if not Path(o.source).is_file():
            raise DataError(f"--source {o.source}: no such file")
        prepare(Path(o.out_dir), Path(o.source), o.tokenizer)
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
