"""Token shards for corpora of any size (GPT-2's BPE, or one trained with data/train_tokenizer.py),
tokenized in worker processes, resumable:

    python data/fineweb_edu/prepare.py --dataset json --data-files 'corpus/*.jsonl' \\
        --out-dir data/mycorpus --max-tokens 5M --shard-tokens 1M [--tokenizer tokenizers/mine]

The first val_tokens of the stream (to the end of that document) are val, the rest train; by
default val is VAL_FRACTION of the tokens prepared, at most VAL_TOKENS: the stream's first
VAL_TOKENS go to val, and at the end the documents past the fraction move to new train shards.
A shard grows as `.NAME.partial`; prepare_state.json, committed after an fsync, holds the
matching stream position, so a resumed run truncates there and writes the same bytes as an
uninterrupted one.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from config import ConfigError, load_options, opt
from data.dataset import DataError, token_dtype
from data.writing import write_atomic, write_meta
from data.stream import Batch, Source, open_stream, peak_rss_mib, read_batches, tokenize_in_order
from data.bpe import GPT2Tokenizer
from data.tokenizer import TokenizerError
from data.train_tokenizer import named_tokenizer

STATE_FILE = "prepare_state.json"
SPLIT_ORDER = ("val", "train")
VAL_FRACTION, VAL_TOKENS = 0.01, 10_000_000  # the default val split: 1% of the tokens, <= 10M
TRAIN_SHARE_WARNING = 0.9  # a split that leaves train less than this share of the tokens is said


def new_shard(split: str, index: int = 0) -> dict:
    """prepare_state.json's record of the shard being written."""
    return {"split": split, "index": index, "tokens": 0, "closing": False}


@contextlib.contextmanager
def graceful_interrupt() -> Iterator[threading.Event]:
    """The first Ctrl-C sets the event (stop after the current batch); a second one stops now."""
    requested = threading.Event()

    def handle(signum, frame) -> None:
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        print("\nstopping after the current batch (Ctrl-C again to stop at once) ...",
              file=sys.stderr)
    on_main = threading.current_thread() is threading.main_thread()  # signals need the main one
    previous = signal.signal(signal.SIGINT, handle) if on_main else None
    try:
        yield requested
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class ShardWriter:
    """Appends the token stream to shards and keeps prepare_state.json in step with them."""

    def __init__(self, out_dir: Path, settings: dict, commit_tokens: int, eot: int):
        self.out, self.settings, self.commit_tokens = out_dir, settings, commit_tokens
        self.eot = eot  # the end-of-text id that closes each document
        self.shard_tokens, self.max_tokens = settings["shard_tokens"], settings["max_tokens"]
        self.dtype = np.dtype(settings["dtype"])
        self.file, self.uncommitted = None, 0
        self.state = self._load_or_start()
        self.closed = {split: sum(s["tokens"] for s in self.state["shards"][split])
                       for split in SPLIT_ORDER}  # tokens in finished shards, per split

    def _load_or_start(self) -> dict:
        path = self.out / STATE_FILE
        if not path.is_file():
            stray = sorted(p.name for p in self.out.glob("*.bin"))
            if stray:
                raise DataError(f"{self.out} holds token files ({', '.join(stray[:3])}) but no "
                                f"{STATE_FILE}; delete them or choose another --out-dir")
            return {"settings": self.settings, "shards": {s: [] for s in SPLIT_ORDER},
                    "current": new_shard("val"),
                    "pos": {"doc": 0, "offset": 0, "batch_doc": 0, "stream_state": None},
                    "finished": False}
        state = json.loads(path.read_text())
        changed = [f"{k}: {state['settings'].get(k)!r} then, {v!r} now"
                   for k, v in self.settings.items() if state["settings"].get(k) != v]
        if changed:
            raise DataError(f"{self.out} holds a preparation with other settings ("
                            + "; ".join(changed) + "); re-run with the same settings to resume, "
                            "or delete the folder (or pick another --out-dir) to start over")
        return state

    def paths(self) -> tuple[Path, Path]:
        """The current shard's final and partial (still growing) paths."""
        cur = self.state["current"]
        final = self.out / f"{cur['split']}_{cur['index']:06d}.bin"
        return final, self.out / f".{final.name}.partial"

    def recover(self) -> None:
        """Bring the files in line with the last committed state after an interruption."""
        for shard in (s for shards in self.state["shards"].values() for s in shards):
            self._check_size(self.out / shard["file"], shard["tokens"])
        cur = self.state["current"]
        final, partial = self.paths()
        if cur["closing"]:  # stopped between committing a full shard and renaming it
            if partial.exists():
                os.replace(partial, final)
            self._check_size(final, cur["tokens"])
            self._advance()
            self.commit(None)
        elif final.exists() and "trim" not in self.state:  # trim_val may have written it
            raise DataError(f"{final} exists but {STATE_FILE} records it as unfinished; "
                            f"delete {self.out} and prepare again")
        elif cur["tokens"] or partial.exists():  # drop whatever was written after the commit
            self._check_size(partial, cur["tokens"], at_least=True)
            os.truncate(partial, cur["tokens"] * self.dtype.itemsize)
        for stray in set(self.out.glob(".*.partial")) - {self.paths()[1]}:
            stray.unlink()

    def _check_size(self, path: Path, tokens: int, at_least: bool = False) -> None:
        size = path.stat().st_size if path.exists() else -1
        want = tokens * self.dtype.itemsize
        if size < want or (size != want and not at_least):
            raise DataError(f"{path} has {max(size, 0)} bytes but {STATE_FILE} records {tokens:,} "
                            f"tokens ({want} bytes); the folder was changed by hand: delete "
                            f"{self.out} and prepare again")

    def written(self, split: str | None = None) -> int:
        """Tokens written to `split` (None: to both), finished shards and the current one."""
        cur = self.state["current"]
        return sum(self.closed[s] + (cur["tokens"] if cur["split"] == s else 0)
                   for s in SPLIT_ORDER if split in (None, s))

    def add_document(self, tokens: np.ndarray, batch: Batch) -> bool:
        """Append document pos.doc past pos.offset; False once max_tokens is reached."""
        pos = self.state["pos"]
        tokens = tokens[pos["offset"]:]
        while tokens.size:
            room = self.shard_tokens - self.state["current"]["tokens"]
            if self.max_tokens:
                room = min(room, self.max_tokens - self.written())
            take = tokens[:room]
            self._append(take)
            pos["offset"] += take.size
            tokens = tokens[take.size:]
            if self.state["current"]["tokens"] == self.shard_tokens:
                self.close_shard(batch)
            if self.max_tokens and self.written() >= self.max_tokens:
                return False
        cur = self.state["current"]
        if cur["split"] == "val" and self.written("val") >= self.val_head():
            # checked before pos moves past the document, so a run resumed from the commit in
            # close_shard reaches this same switch
            if cur["tokens"]:
                self.close_shard(batch)
            self.state["current"] = new_shard("train")
        pos["doc"], pos["offset"] = pos["doc"] + 1, 0
        return True

    def _append(self, tokens: np.ndarray) -> None:
        if self.file is None:
            self.file = open(self.paths()[1], "ab")
        self.file.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.state["current"]["tokens"] += tokens.size
        self.uncommitted += tokens.size

    def commit(self, batch: Batch | None) -> None:
        """fsync the partial shard, then record the matching state (batch None: same position)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
        if batch is not None:
            pos = self.state["pos"]
            pos["batch_doc"], pos["stream_state"] = batch.first_doc, batch.stream_state
        write_atomic(self.out / STATE_FILE, json.dumps(self.state).encode())
        self.uncommitted = 0

    def close_shard(self, batch: Batch | None) -> None:
        """Commit the full shard as 'closing', rename it into place, then start the next one."""
        self.state["current"]["closing"] = True
        self.commit(batch)
        self.close()
        final, partial = self.paths()
        rename_shard(partial, final)
        self._advance()
        self.commit(batch)

    def _advance(self) -> None:
        cur = self.state["current"]
        self.state["shards"][cur["split"]].append({"file": self.paths()[0].name,
                                                   "tokens": cur["tokens"]})
        self.closed[cur["split"]] += cur["tokens"]
        self.state["current"] = new_shard(cur["split"], cur["index"] + 1)

    def val_head(self) -> int:
        """The stream's tokens val takes while streaming: --val-tokens, or for the default split
        VAL_TOKENS (a fraction of --max-tokens when that is known), trimmed at the end."""
        given, most = self.settings["val_tokens"], self.settings["max_tokens"]
        if given:
            return given
        return min(VAL_TOKENS, max(1, round(VAL_FRACTION * most))) if most else VAL_TOKENS

    def finish(self, batch: Batch | None) -> None:
        if self.state["current"]["tokens"]:
            self.close_shard(batch)
        if self.settings["val_tokens"] is None:
            self.trim_val()
        self.state["finished"] = True
        self.commit(None)
        self.drop_trimmed()

    def val_shards(self) -> Iterator[tuple[int, dict, np.ndarray]]:
        """(first token's offset in val, its record, its tokens) for each val shard."""
        start = 0
        for shard in self.state["shards"]["val"]:
            tokens = np.memmap(self.out / shard["file"], dtype=self.dtype, mode="r",
                               shape=(shard["tokens"],)) if shard["tokens"] else np.empty(0)
            yield start, shard, tokens
            start += shard["tokens"]

    def val_cut(self) -> int | None:
        """Where the default val split ends: the end of the document that reaches VAL_FRACTION
        of every token written (at most VAL_TOKENS); None if val ends there already."""
        val = self.closed["val"]
        target = min(VAL_TOKENS, max(1, round(VAL_FRACTION * self.written())))
        for start, _, tokens in self.val_shards():
            if start + len(tokens) >= target:
                ends = np.flatnonzero(tokens[max(0, target - 1 - start):] == self.eot)
                if ends.size:
                    cut = start + max(0, target - 1 - start) + int(ends[0]) + 1
                    return cut if cut < val else None
        return None

    def trim_val(self) -> None:
        """The default split: val's documents past val_cut() are copied to new train shards.
        The cut is committed first and the val shards change only after the finished state is
        (drop_trimmed), so an interrupted trim is redone from the same files."""
        if "trim" not in self.state:
            if (cut := self.val_cut()) is None:
                return
            self.state["trim"] = cut
            self.commit(None)
        cut, kept, moved = self.state["trim"], [], Moved(self)
        for start, shard, tokens in self.val_shards():
            if start < cut:
                kept.append({**shard, "tokens": min(shard["tokens"], cut - start)})
            moved.write(tokens[max(0, cut - start):])
        self.state["shards"]["val"] = kept
        self.state["shards"]["train"] += moved.close()
        self.closed = {split: sum(s["tokens"] for s in self.state["shards"][split])
                       for split in SPLIT_ORDER}

    def drop_trimmed(self) -> None:
        """Val shard files cut to the tokens the state records for them, and those it no longer
        lists deleted (nothing to do unless the default split moved documents)."""
        listed = {s["file"]: s["tokens"] * self.dtype.itemsize for s in self.state["shards"]["val"]}
        for path in self.out.glob("val_*.bin"):
            if path.name not in listed:
                path.unlink()
            elif path.stat().st_size > listed[path.name]:
                os.truncate(path, listed[path.name])

    def close(self) -> None:
        """Release the partial file without committing (used on errors and interrupts)."""
        if self.file is not None:
            self.file.close()
            self.file = None


class Moved:
    """Tokens the default split moves from val, written as the next train shards (each of
    shard_tokens but the last), each under its partial name, then renamed in place."""

    def __init__(self, writer: ShardWriter):
        self.out, self.size = writer.out, writer.shard_tokens
        self.index, self.dtype = len(writer.state["shards"]["train"]), writer.dtype
        self.shards: list[dict] = []
        self.file, self.tokens = None, 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self.file is None:
                self.file = open(self.out / f".{self.name()}.partial", "wb")
            take = tokens[:self.size - self.tokens]
            self.file.write(np.asarray(take, dtype=self.dtype).tobytes())
            self.tokens, tokens = self.tokens + take.size, tokens[take.size:]
            if self.tokens == self.size:
                self.end_shard()

    def name(self) -> str:
        return f"train_{self.index + len(self.shards):06d}.bin"

    def end_shard(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        rename_shard(self.out / f".{self.name()}.partial", self.out / self.name())
        self.shards.append({"file": self.name(), "tokens": self.tokens})
        self.file, self.tokens = None, 0

    def close(self) -> list[dict]:
        """The shards written, the last one ended."""
        if self.file is not None:
            self.end_shard()
        return self.shards


def rename_shard(partial: Path, final: Path) -> None:
    os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename durable before the state that depends on it
    finally:
        os.close(fd)


def finish_meta(out_dir: Path, state: dict, source: Source, tok: GPT2Tokenizer) -> dict:
    shards, settings = state["shards"], state["settings"]
    counts = {split: sum(s["tokens"] for s in shards[split]) for split in SPLIT_ORDER}
    if not counts["train"] and settings["val_tokens"]:
        raise DataError(f"the train split is empty: the corpus gave {counts['val']:,} tokens and "
                        f"the val split takes the first {settings['val_tokens']:,}; delete "
                        f"{out_dir} and prepare again with a smaller --val-tokens or more data")
    if not counts["train"]:  # the default split ends at a document's end: too few of them
        docs = state["pos"]["doc"]
        raise DataError(f"the train split is empty: the corpus gave {counts['val']:,} tokens in "
                        f"{docs:,} document{'s' * (docs != 1)}, and val, {VAL_FRACTION:.0%} of "
                        "the tokens, runs to the end of a document; prepare the text as more "
                        f"documents (a .jsonl, a document per line), after deleting {out_dir}")
    return write_meta(out_dir, tok, counts, shards=shards,
                      shard_tokens=settings["shard_tokens"], documents=state["pos"]["doc"],
                      source=source.describe(), settings=settings)


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) of this process and of its finished child processes."""
    usage = {"main": resource.RUSAGE_SELF, "workers": resource.RUSAGE_CHILDREN}
    return {k: (u := resource.getrusage(who)).ru_utime + u.ru_stime for k, who in usage.items()}


def prepare(source: Source, out_dir: str | Path, shard_tokens: int = 100_000_000,
            val_tokens: int | None = None, max_tokens: int = 0, workers: int = 1,
            docs_per_task: int = 256, commit_tokens: int = 16_000_000,
            expected_tokens: int = 0, progress: bool = True,
            tok: GPT2Tokenizer | None = None) -> dict:
    """Stream `source` into token shards in out_dir (resuming), tokenized by `tok` (GPT-2's by
    default), the first val_tokens val (None: the default split); meta.json's content + `run`."""
    check_sizes(shard_tokens, val_tokens, max_tokens, workers, docs_per_task)
    tok = tok or GPT2Tokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**asdict(source), "shard_tokens": shard_tokens, "val_tokens": val_tokens,
                "max_tokens": max_tokens, "tokenizer": "gpt2" if tok.kind == "gpt2" else
                f"{tok.kind}:{tok.name}:{tok.sha256}", "dtype": token_dtype(tok.vocab_size).name}
    writer = ShardWriter(out, settings, commit_tokens, tok.eot_id)
    if writer.state["finished"]:
        writer.drop_trimmed()  # in case it was interrupted
        print(f"{out}: already prepared ({writer.written():,} tokens); nothing to do")
        return {**finish_meta(out, writer.state, source, tok), "run": {"tokens": 0}}
    writer.recover()
    start_tokens, started, cpu_before = writer.written(), time.perf_counter(), cpu_seconds()
    begin = f"resuming at {start_tokens:,} tokens" if start_tokens else "starting"
    print(f"{out}: {begin} | {source.describe()} | tokenizer {settings['tokenizer'][:40]} | "
          f"{workers} worker(s) | shards of {shard_tokens:,} tokens")
    try:
        worker_peak, stream_seconds = _run(writer, source, workers, docs_per_task,
                                           (max_tokens or expected_tokens) if progress else -1,
                                           tok.meta())
    finally:
        writer.close()
    seconds = time.perf_counter() - started
    meta = finish_meta(out, writer.state, source, tok)
    tokens = writer.written() - start_tokens
    cpu = {k: round(v - cpu_before[k], 1) for k, v in cpu_seconds().items()}
    # stream_seconds leaves out the start-up (imports, opening the dataset)
    run = {"tokens": tokens, "seconds": round(seconds, 2), "workers": workers,
           "tokens_per_s": round(tokens / seconds), "stream_seconds": round(stream_seconds, 2),
           "stream_tokens_per_s": round(tokens / max(stream_seconds, 1e-9)), "cpu_s": cpu,
           "peak_mib": {"main": round(peak_rss_mib()), "worker": round(worker_peak)}}
    both = workers > 1
    print(f"done: {tokens:,} tokens in {seconds:.1f}s ({run['tokens_per_s']:,} tok/s; "
          f"{run['stream_tokens_per_s']:,} tok/s after start-up) with {workers} worker(s) | "
          f"{len(meta['shards']['val'])} val + {len(meta['shards']['train'])} train shards, "
          f"{meta['splits']['val']:,} val / {meta['splits']['train']:,} train tokens | cpu: "
          f"main {cpu['main']}s" + (f", workers {cpu['workers']}s" if both else "")
          + f" | peak memory: main {run['peak_mib']['main']} MiB"
          + (f", largest worker {run['peak_mib']['worker']} MiB" if both else ""))
    warn_small_train(meta["splits"], val_tokens, out)
    return {**meta, "run": run}


def warn_small_train(splits: dict[str, int], val_tokens: int | None, out: Path) -> None:
    """Say so when val leaves train under TRAIN_SHARE_WARNING of the tokens."""
    total = sum(splits.values())
    if splits["train"] < TRAIN_SHARE_WARNING * total:
        given = (f"--val-tokens {val_tokens:,}" if val_tokens else
                 f"the default ({VAL_FRACTION:.0%} of the tokens, to the end of a document)")
        print(f"warning: train holds {splits['train'] / total:.1%} of the {total:,} tokens: "
              f"{given} gave val {splits['val']:,}; for more training data, delete {out} and "
              "prepare again with a smaller --val-tokens", file=sys.stderr)


def _run(writer: ShardWriter, source: Source, workers: int, docs_per_task: int,
         bar_total: int, tokenizer: dict) -> tuple[float, float]:
    """read -> tokenize -> append -> commit; (largest worker peak MiB, seconds since opened).
    bar_total: the progress bar's total (0: unknown, -1: no bar)."""
    from tqdm import tqdm

    pos, worker_peak, batch = writer.state["pos"], 0.0, None
    if "trim" in writer.state or writer.max_tokens and writer.written() >= writer.max_tokens:
        writer.finish(None)  # the stream is done: only the end is left
        return worker_peak, 0.0
    ds = open_stream(source)
    opened = time.perf_counter()
    batches = read_batches(ds, source.text_field, pos["batch_doc"],
                           pos["doc"] - pos["batch_doc"], docs_per_task, pos["stream_state"],
                           source.describe())
    with (tqdm(total=bar_total or None, initial=writer.written(), unit="tok", unit_scale=True,
               dynamic_ncols=True, desc="tokens", smoothing=0.05, disable=bar_total < 0) as bar,
          graceful_interrupt() as interrupt,
          contextlib.closing(tokenize_in_order(batches, workers, tokenizer)) as results):
        for batch, flat, lengths, peak in results:
            worker_peak = max(worker_peak, peak)
            before, ends = writer.written(), np.cumsum(lengths)
            docs = range(pos["doc"] - batch.first_doc, len(lengths))
            if not all(writer.add_document(flat[ends[i] - lengths[i]:ends[i]], batch)
                       for i in docs):
                break
            if writer.uncommitted >= writer.commit_tokens:
                writer.commit(batch)
            bar.update(writer.written() - before)
            bar.set_postfix(docs=f"{pos['doc']:,}", refresh=False)
            if interrupt.is_set():
                writer.commit(batch)
                raise KeyboardInterrupt
    writer.finish(batch)
    return worker_peak, time.perf_counter() - opened


def check_sizes(shard_tokens: int, val_tokens: int | None, max_tokens: int, workers: int,
                docs_per_task: int) -> None:
    problems = [f"{name} must be >= 1, got {value}" for name, value in
                (("--shard-tokens", shard_tokens), ("--val-tokens", val_tokens),
                 ("--workers", workers), ("--docs-per-task", docs_per_task))
                if value is not None and value < 1]
    if max_tokens < 0:
        problems.append(f"--max-tokens must be >= 0 (0 = no cap), got {max_tokens}")
    if max_tokens and val_tokens and val_tokens >= max_tokens:
        problems.append(f"--val-tokens {val_tokens:,} leaves nothing for train under "
                        f"--max-tokens {max_tokens:,}; use a smaller --val-tokens")
    if problems:
        raise DataError("; ".join(problems))


def parse_count(text: str) -> int:
    """'100M', '2.5B', '1_000_000' or '1e6' -> an int number of tokens."""
    match = re.fullmatch(r"\s*([0-9_.eE+]+)\s*([kKmMbB]?)\s*", text)
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}
    try:
        value = float(match.group(1).replace("_", "")) * scale[match.group(2).lower()]
    except (AttributeError, ValueError):  # no match, or not a number
        raise ConfigError(f"{text!r} is not a token count; write e.g. 100M, 2.5B or "
                          "1000000") from None
    if value != int(value):
        raise ConfigError(f"{text!r} is not a whole number of tokens")
    return int(value)


@dataclass
class Defaults:
    """What a dataset's prepare script changes about the shared command line."""

    dataset: str
    out_dir: Path
    name: str | None = None
    expected_tokens: int = 0  # rough size of the full corpus, for the progress bar's ETA


@dataclass
class PrepareOptions:
    """The command line of every sharded prepare script; '' = the script's own default."""

    dataset: str = opt("", "hub dataset id, a builder over local files (json, text, parquet, "
                       "csv; with --data-files) or a folder saved with save_to_disk")
    name: str = opt("", "hub dataset config (the script's own for its dataset)")
    split: str = opt("train", "split to read")
    data_files: str = opt("", "comma-separated local files or globs for those builders")
    text_field: str = opt("text", "column holding the document text")
    revision: str = opt("", "hub revision (branch, tag or commit)")
    out_dir: str = opt("", "where the shards go (default: the script's folder); a bare name in "
                       "train.py's --dataset is a folder under data/")
    shard_tokens: str = opt("100M", "tokens per shard")
    val_tokens: str = opt("", "tokens held out as val, from the start of the stream to the end "
                          "of a document; '' = 1% of the tokens prepared, at most 10M")
    max_tokens: str = opt("0", "stop after this many tokens (0: the whole dataset), e.g. 20M")
    tokenizer: str = opt("gpt2", "gpt2, or a folder written by python -m data.train_tokenizer")
    workers: int = opt(0, "tokenizer processes; 0 = CPU cores - 1")
    docs_per_task: int = opt(256, "documents per tokenizer task")
    no_progress: bool = opt(False, "no progress bar")


def main(defaults: Defaults, argv: list[str] | None = None, description: str = "") -> int:
    """The command line of a sharded prepare script: PrepareOptions over `defaults`."""
    out_dir = defaults.out_dir
    try:
        o = load_options(sys.argv[1:] if argv is None else argv, PrepareOptions,
                         prog=sys.argv[0], about=description)
        out_dir = o.out_dir or out_dir
        max_tokens = parse_count(o.max_tokens)
        val_tokens = parse_count(o.val_tokens) if o.val_tokens else None
        dataset = o.dataset or defaults.dataset
        own = dataset == defaults.dataset  # the script's config and size apply to its dataset
        source = Source(dataset, o.name or (defaults.name if own else None), o.split,
                        [f for f in o.data_files.split(",") if f] or None, o.text_field,
                        o.revision or None)
        prepare(source, out_dir, parse_count(o.shard_tokens), val_tokens, max_tokens,
                o.workers or max(1, (os.cpu_count() or 2) - 1), o.docs_per_task,
                expected_tokens=defaults.expected_tokens if own else 0, progress=not o.no_progress,
                tok=named_tokenizer(o.tokenizer))
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: run the same command again to resume from the last commit in "
              f"{out_dir}", file=sys.stderr)
        return 130
    return 0
