"""Train a byte-level BPE tokenizer on your own text; tiktoken encodes with it everywhere after.

    python -m data.train_tokenizer 'corpus/*.jsonl' --vocab_size 16384 --out tokenizers/mine
    python -m data.train_tokenizer book.txt,notes/ --special '<|user|>,<|assistant|>' --out tok/b
    python data/fineweb_edu/prepare.py --dataset json --data-files 'corpus/*.jsonl' \\
        --tokenizer tokenizers/mine --out-dir data/mine        # then: train.py --dataset=mine

Files: .jsonl (a document per line, its --text_field), anything else as UTF-8 text, .gz/.bz2/.xz
decompressed; a folder is read whole, sorted, its files that are not UTF-8 text skipped and
counted (data/text_files.py). The trainer is rustbpe (the faster on 100 MB here: bench_results/
tokenizer_zen4.md) or Hugging Face tokenizers' BPE trainer (--trainer hf). The folder written,
tokenizer.tiktoken (tiktoken's ranks format) + tokenizer.json, loads with load_tokenizer().
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import ConfigError, load_options, opt  # noqa: E402
from data import EOT_TEXT, TokenizerError  # noqa: E402
from data.bpe import GPT2_PATTERN, BPETokenizer, GPT2Tokenizer, ranks_text  # noqa: E402
from data.writing import write_atomic  # noqa: E402
from data.text_files import (Tally, documents, input_files, metered,  # noqa: E402
                             skipped_note, text_files)

RANKS_FILE, META_FILE = "tokenizer.tiktoken", "tokenizer.json"
# split patterns by name: GPT-2's, and cl100k's (GPT-4's: contractions in either case, digits in
# groups of at most three, punctuation runs apart from letters), the default
PATTERNS = {"gpt2": GPT2_PATTERN,
            "gpt4": (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}|"""
                     r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")}
# text of every kind a pattern must match all of: letters of several scripts, marks, digits,
# punctuation, symbols, emoji, spaces, tabs, line ends and control characters
PROBE = ("Hello, world!  It's 3.14159 -- naïve e\u0301 ½ 東京 Ελλάδα Москва عربى हिन्दी 🙂👍🏽\n"
         "\tif (x <= 42) { return y_1; }\r\n\n\x00\x07 ~`@#$%^&*_+=|\\/?<>[]  end ")


@dataclass
class TokenizerOptions:
    positional: ClassVar[str] = "files"
    files: str = opt("", "text to train on: files, folders or quoted globs, comma-separated "
                     "(also the first bare argument); .jsonl = a document per line")
    out: str = opt("", "the folder to write (tokenizer.tiktoken + tokenizer.json)")
    vocab_size: int = opt(16384, "every id: the 256 bytes, the merges, the special tokens")
    special: str = opt("", "special tokens besides <|endoftext|> (always the first), "
                       "comma-separated, e.g. '<|user|>,<|assistant|>'")
    pattern: str = opt("gpt4", "the split pattern text is cut by before merging: gpt4, gpt2, or "
                       "a regex of your own (it must match all of any text)")
    text_field: str = opt("text", ".jsonl files: the field holding a document's text")
    max_mb: float = opt(0.0, "train on the first this many MiB of text; 0 = all of it")
    trainer: str = opt("rustbpe", "rustbpe, or hf (Hugging Face tokenizers' BpeTrainer)",
                       ("rustbpe", "hf"))
    name: str = opt("", "the tokenizer's name in metadata; '' = the folder's name")
    no_progress: bool = opt(False, "no progress bar")


def check_pattern(pattern: str, given: str) -> None:
    """The split pattern must compile as tiktoken (which encodes with it) and the regex module
    (which says where it fails) read it, and match all of any text: tiktoken encodes only what
    the pattern matches, so text it skips would vanish from every document."""
    import regex
    import tiktoken

    try:
        regex.compile(pattern)
        bytes_only = tiktoken.Encoding("check", pat_str=pattern, special_tokens={},
                                       mergeable_ranks={bytes([b]): b for b in range(256)})
    except (regex.error, ValueError) as e:
        raise TokenizerError(f"--pattern {given!r} is not a regex tiktoken can use: {e}; fix it, "
                             "or pass --pattern gpt4 (the default) or gpt2") from None
    matches = list(regex.finditer(pattern, PROBE))
    empty = next((m.start() for m in matches if m.start() == m.end()), None)
    if empty is not None:  # tiktoken cannot step past an empty match
        raise TokenizerError(f"--pattern {given!r} matches empty text (at {PROBE[empty:][:12]!r}"
                             "); make every alternative match at least one character")
    if bytes_only.decode(bytes_only.encode_ordinary(PROBE)) != PROBE:
        matched = {i for m in matches for i in range(m.start(), m.end())}
        missed = "".join(sorted({c for i, c in enumerate(PROBE) if i not in matched}))
        raise TokenizerError(f"--pattern {given!r} leaves text unmatched (here {missed[:24]!r}), "
                             "and tiktoken drops what the pattern does not match; add an "
                             "alternative that matches the rest, as gpt4's |\\s+ ends it")


def train_rustbpe(texts: Iterator[str], n_ranks: int, pattern: str) -> list[bytes]:
    try:
        import rustbpe
    except ImportError:
        raise TokenizerError("rustbpe is not installed: pip install rustbpe (requirements.txt), "
                             "or pass --trainer hf") from None
    trainer = rustbpe.Tokenizer()
    try:
        trainer.train_from_iterator(texts, n_ranks, pattern=pattern)
    except ValueError as e:  # its regex crate is not tiktoken's: some patterns differ
        if not str(e).startswith("Invalid regex pattern"):
            raise
        raise TokenizerError(f"--pattern {pattern!r} is a regex tiktoken can use but rustbpe "
                             f"cannot ({e}); pass --trainer hf") from None
    return [token for token, _ in sorted(trainer.get_mergeable_ranks(), key=lambda t: t[1])]


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map (vocab.json, merges.txt, tokenizers' ByteLevel): printable
    non-space Latin-1 bytes stand for themselves, the others for chr(256), chr(257), ..."""
    others = iter(range(256, 512))
    return {b: chr(b) if b > 32 and chr(b).isprintable() else chr(next(others))
            for b in range(256)}


def train_hf(texts: Iterator[str], n_ranks: int, pattern: str) -> list[bytes]:
    """Hugging Face tokenizers' BpeTrainer behind the same split; its merges, in order, become
    ranks after the 256 bytes (GPT-2's byte-to-character alphabet undone)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    try:
        split = Regex(pattern)
    except Exception as e:  # tokenizers raises a bare Exception
        raise TokenizerError(f"--pattern {pattern!r} is a regex tiktoken can use but Hugging "
                             f"Face tokenizers' Oniguruma cannot ({e}); pass --trainer "
                             "rustbpe") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=n_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    byte_of = {char: b for b, char in byte_alphabet().items()}
    tokens = [bytes([b]) for b in range(256)]
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        tokens.append(bytes(byte_of[c] for c in left + right))
    return tokens


def train(files: list[Path], vocab_size: int, special: list[str], pattern: str,
          text_field: str = "text", max_bytes: int = 0, trainer: str = "rustbpe",
          name: str = "", progress: bool = True) -> tuple[BPETokenizer, dict]:
    """A BPETokenizer trained on `files`, and how the training went."""
    from tqdm import tqdm

    special = [EOT_TEXT] + [s for s in special if s != EOT_TEXT]
    if vocab_size < 256 + len(special):
        raise TokenizerError(f"--vocab_size {vocab_size} is smaller than the 256 byte tokens "
                             f"plus {len(special)} special token(s); use at least "
                             f"{256 + len(special)}")
    given, pattern = pattern, PATTERNS.get(pattern, pattern)
    check_pattern(pattern, given)
    files, skipped = text_files(files)
    if skipped:
        note = skipped_note(skipped, len(files) + sum(map(len, skipped.values())))
        if not files:
            raise TokenizerError(f"no UTF-8 text to train on: {note}")
        print(f"note: {note}")
    started, tally = time.perf_counter(), Tally()
    with tqdm(total=None if max_bytes else sum(p.stat().st_size for p in files), unit="B",
              unit_scale=True, desc="reading + counting pairs", disable=not progress,
              dynamic_ncols=True) as bar:
        texts = metered(documents(files, text_field, bar, tally), max_bytes, tally, bar)
        fit = train_rustbpe if trainer == "rustbpe" else train_hf
        tokens = fit(texts, vocab_size - len(special), pattern)
    if tally.bytes == 0:
        raise TokenizerError(f"no text in {', '.join(map(str, files[:3]))}: the files are empty")
    if tally.replaced:
        print(f"note: U+FFFD replacement characters in the text: {tally.replaced_text()}")
    seconds = time.perf_counter() - started
    tok = BPETokenizer(tokens, pattern, special, name)
    named = [k for k, v in PATTERNS.items() if v == pattern]
    info = {"trainer": trainer, "pattern_name": named[0] if named else "custom",
            "files": [str(p) for p in files[:20]], "n_files": len(files),
            "skipped": {reason: len(entries) for reason, entries in skipped.items()},
            "bytes": tally.bytes, "replaced": sum(tally.replaced.values()),
            "seconds": round(seconds, 2),
            "mb_per_s": round(tally.bytes / 2**20 / max(seconds, 1e-9), 2)}
    return tok, info


def save(tok: BPETokenizer, folder: str | Path, **info) -> Path:
    """tokenizer.tiktoken, then tokenizer.json (written last: a folder that has it is whole)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / RANKS_FILE, ranks_text(tok.tokens).encode())
    record = {"kind": tok.kind, "name": tok.name, "sha256": tok.sha256,
              "vocab_size": tok.vocab_size, "pattern": tok.pattern,
              "special": tok.special_ids, **info}
    write_atomic(folder / META_FILE, json.dumps(record, indent=1).encode())
    return folder


def load_tokenizer(folder: str | Path) -> BPETokenizer:
    """A folder save() wrote, its ranks checked against tokenizer.json's sha256."""
    folder = Path(folder)
    if not (folder / META_FILE).is_file() or not (folder / RANKS_FILE).is_file():
        raise TokenizerError(f"{folder} is not a trained tokenizer (it needs {RANKS_FILE} and "
                             f"{META_FILE}); train one with python -m data.train_tokenizer")
    record = json.loads((folder / META_FILE).read_text())
    lines = [line.split() for line in (folder / RANKS_FILE).read_text().splitlines() if line]
    if [int(rank) for _, rank in lines] != list(range(len(lines))):
        raise TokenizerError(f"{folder / RANKS_FILE}: the ranks must run 0, 1, 2, ... in order")
    return BPETokenizer.from_meta({**record, "special": list(record["special"]),
                                   "ranks": [token for token, _ in lines]})


def checkpoint_tokenizer(recorded: dict, meta_path: Path) -> BPETokenizer:
    """The trained tokenizer a checkpoint's meta.json records, checked against its sha256. The
    weights' ids mean that tokenizer's text, so preparing the data again fixes nothing: an
    edited one is refused with the checkpoint's fix."""
    return BPETokenizer.from_meta(recorded, (
        f"{meta_path} was changed after the checkpoint was saved: restore it from a copy of the "
        "checkpoint, or copy its 'tokenizer' entry back from the meta.json the run took it from "
        "(its prepared dataset's, or for a finetune its base checkpoint's)"))


def named_tokenizer(name: str) -> GPT2Tokenizer:
    """A preparation's --tokenizer: gpt2, or a folder save() wrote."""
    return GPT2Tokenizer() if name == "gpt2" else load_tokenizer(name)


def main(argv: list[str] | None = None) -> int:
    try:
        o = load_options(sys.argv[1:] if argv is None else argv, TokenizerOptions,
                         prog="-m data.train_tokenizer", about=__doc__)
        if not o.out:
            raise ConfigError("--out FOLDER is required: where the tokenizer is written")
        specials = [s.strip() for s in o.special.split(",") if s.strip()]
        tok, info = train(input_files(o.files), o.vocab_size, specials, o.pattern, o.text_field,
                          int(o.max_mb * 2**20), o.trainer, o.name or Path(o.out).name,
                          progress=not o.no_progress)
    except (ConfigError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save(tok, o.out, trained=info)
    short = tok.vocab_size < o.vocab_size
    print(f"{o.out}: {tok.vocab_size:,} ids ({len(tok.tokens) - 256:,} merges + 256 bytes + "
          f"{len(tok.special)} special) from {info['bytes'] / 2**20:.1f} MiB in "
          f"{info['seconds']:.1f}s ({info['mb_per_s']} MiB/s, {o.trainer}) | sha256 "
          f"{tok.sha256[:12]}" + (" | the text ran out of pairs to merge before "
                                  f"--vocab_size {o.vocab_size}" if short else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
