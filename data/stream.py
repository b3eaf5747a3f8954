"""Documents in, tokens out (GPT-2's BPE or a trained one), for data/shards.py: a `datasets` stream
(hub, local files or a save_to_disk folder) read in resumable batches, tokenized in worker
processes in order.
"""
from __future__ import annotations

import glob
import multiprocessing
import resource
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from data.dataset import DataError, token_dtype
from data.bpe import GPT2Tokenizer
from data.tokenizer import from_meta

if TYPE_CHECKING:
    import datasets  # imported where used: it is slow to import and the workers never need it

SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TASK_CHARS = 2**20  # text per tokenizer task at most: long documents make smaller tasks
BLANK_BYTES = 2**16  # a local data file this small is read to see whether it is all white space


@dataclass
class Source:
    """A hub dataset, a builder over local data_files (json, text, ...) or a save_to_disk folder."""

    dataset: str
    name: str | None = None
    split: str = "train"
    data_files: list[str] | None = None
    text_field: str = "text"
    revision: str | None = None

    def describe(self) -> str:
        parts = [self.dataset, self.name or "", f"split={self.split}",
                 f"files={','.join(self.data_files)}" if self.data_files else ""]
        return " ".join(p for p in parts if p)


@dataclass
class Batch:
    """Documents handed to one tokenizer task, and where they sit in the stream."""

    first_doc: int  # index of texts[0] in the document stream
    stream_state: dict | None  # the dataset iterator's state just before texts[0]


def open_stream(source: Source) -> datasets.IterableDataset:
    """The documents as a datasets.IterableDataset (streamed: memory stays flat)."""
    try:
        import datasets
    except ImportError:
        raise DataError("preparing sharded datasets needs Hugging Face datasets: pip install "
                        "datasets (pyproject.toml's data group)") from None

    check_local_files(source.data_files or [])
    path = Path(source.dataset)
    saved = path.is_dir() and any((path / m).is_file() for m in SAVED_DATASET_MARKERS)
    try:
        ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(
            source.dataset, source.name, split=source.split, data_files=source.data_files,
            revision=source.revision, streaming=True)
    except Exception as e:  # hub, network, file and script errors all land here
        hint = ("without a network, use local files (--dataset json --data-files 'docs/*.jsonl', "
                "or --dataset text) or a folder saved with Dataset.save_to_disk")
        if source.data_files and not any("://" in f for f in source.data_files):
            hint = f"the files are local: check that --dataset {source.dataset} reads their format"
        if "scripts are no longer supported" in str(e):
            hint = ("this hub dataset still ships a loading script, which datasets>=4 refuses; "
                    "pass --revision refs/convert/parquet (the hub's parquet export) or a "
                    "parquet mirror")
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"could not open {source.describe()}: {type(e).__name__}: {first}; "
                        f"{hint}") from None
    if isinstance(ds, datasets.DatasetDict):  # a saved dataset of several splits
        if source.split not in ds:
            raise DataError(f"saved dataset {path} has splits {sorted(ds)}, not "
                            f"'{source.split}'; pass --split")
        ds = ds[source.split]
    if saved:
        ds = ds.to_iterable_dataset()
    columns = ds.column_names
    if columns is not None and source.text_field not in columns:
        raise DataError(f"documents in {source.describe()} have no '{source.text_field}' field "
                        f"(fields: {', '.join(columns)}); pass --text-field")
    if columns is not None and len(columns) > 1:
        ds = ds.select_columns([source.text_field])  # skip decoding the other columns
    return ds


def check_local_files(patterns: list[str]) -> None:
    """Local --data-files must match files that hold something: datasets reports a missing one as
    not found on the hub, and files with no documents as a bare StopIteration."""
    local = [p for p in patterns if "://" not in p]
    files: list[Path] = []
    for pattern in local:
        found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            missing = "no file matches" if glob.has_magic(pattern) else "no such file"
            raise DataError(f"--data-files {pattern}: {missing}")
        files += [Path(f) for f in found if Path(f).is_file()]
    if not files or len(local) < len(patterns):
        return
    sizes = [f.stat().st_size for f in files]
    if any(size > BLANK_BYTES or f.read_bytes().strip() for f, size in zip(files, sizes)):
        return
    spaces = " of white space" if any(sizes) else ""
    what = (f"the file is empty ({sizes[0]:,} bytes{spaces})" if len(files) == 1 else
            f"the {len(files):,} files are empty ("
            + (" and ".join(f"{n:,}" for n in sizes) if len(files) <= 3 else f"{sum(sizes):,}")
            + f" bytes{spaces})")
    raise DataError(f"--data-files {', '.join(local)}: {what}, so there are no documents to "
                    "prepare; name files that hold them")


def read_batches(ds: datasets.IterableDataset, text_field: str, start_doc: int, skip: int,
                 docs_per_task: int, stream_state: dict | None, what: str = "the dataset"
                 ) -> Iterator[tuple[Batch, list[str]]]:
    """Documents in batches from document start_doc + skip, resuming from `stream_state` (saved
    at start_doc; None: start_doc is 0); `what` names the source in errors."""
    if stream_state is not None:
        ds.load_state_dict(stream_state)
    rows = _rows(ds, start_doc, what)
    next(islice(rows, skip, skip), None)  # skip documents: itertools' consume recipe
    doc = start_doc + skip
    while True:
        state = ds.state_dict()
        texts, chars = [], 0
        for row in rows:  # a task ends at docs_per_task documents or TASK_CHARS of text
            texts.append(_text(row, text_field, doc + len(texts)))
            chars += len(texts[-1])
            if len(texts) == docs_per_task or chars >= TASK_CHARS:
                break
        if not texts:
            return
        yield Batch(doc, state), texts
        doc += len(texts)


def _rows(ds: datasets.IterableDataset, index: int, what: str) -> Iterator[dict]:
    """ds's rows, the first being document `index`; rows that cannot be read (a malformed line
    of a local file, found only when the builder gets there) end in a DataError that says
    how many documents came before (builders read blocks of rows: the bad one is further on)."""
    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # pyarrow, json, fsspec ...: whatever the builder raises
            text = str(e).strip()
            raise DataError(f"could not read {what} after {index:,} documents: "
                            f"{type(e).__name__}: {text.splitlines()[0] if text else ''}; fix "
                            "the file or leave it out") from None
        yield row
        index += 1


def _text(row: dict, field: str, index: int) -> str:
    if field not in row:
        raise DataError(f"document {index} has no '{field}' field (fields: "
                        f"{', '.join(row)}); pass --text-field")
    if not isinstance(row[field], str):
        raise DataError(f"document {index}: '{field}' is {type(row[field]).__name__}, not text; "
                        "pass --text-field naming a text column")
    return row[field]


_worker_tokenizer = None  # set by use_tokenizer in this process (each worker sets its own)


def use_tokenizer(meta: dict) -> None:
    """Make the tokenizer `meta` describes the one encode_batch uses in this process."""
    global _worker_tokenizer
    _worker_tokenizer = from_meta(meta)


def encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each document's tokens + <|endoftext|>, concatenated, and each one's count."""
    global _worker_tokenizer
    tok = _worker_tokenizer = _worker_tokenizer or GPT2Tokenizer()
    dtype = token_dtype(tok.vocab_size)
    docs = [np.array(tok.encode_ordinary(text) + [tok.eot_id], dtype=dtype) for text in texts]
    return np.concatenate(docs), np.array([len(d) for d in docs], dtype=np.int64)


def encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray, float]:
    """encode_batch, plus the worker's peak resident memory so far (MiB)."""
    return (*encode_batch(texts), peak_rss_mib())


def _start_worker(tokenizer: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops at
    use_tokenizer(tokenizer)  # a consistent point


def tokenize_in_order(batches: Iterator[tuple[Batch, list[str]]], workers: int,
                      tokenizer: dict) -> Iterator[tuple[Batch, np.ndarray, np.ndarray, float]]:
    """encode_in_worker with the tokenizer `tokenizer` (its meta) in `workers` processes, in input
    order; at most 2 * workers + 1 batches in flight, so memory stays bounded."""
    use_tokenizer(tokenizer)
    if workers == 1:
        yield from ((batch, *encode_in_worker(texts)) for batch, texts in batches)
        return
    # spawn, not fork: the datasets/fsspec stack runs threads that fork would copy mid-flight
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(tokenizer,)) as pool:
        pending: deque = deque()
        try:
            for batch, texts in batches:
                pending.append((batch, pool.submit(encode_in_worker, texts)))
                if len(pending) > 2 * workers:
                    done, future = pending.popleft()
                    yield (done, *future.result())
            while pending:
                done, future = pending.popleft()
                yield (done, *future.result())
        except BrokenProcessPool:
            raise DataError("a tokenizer worker process died (out of memory, killed, or it "
                            "could not start: run the preparation as a script, not from stdin "
                            "or a notebook cell); run the same command again to resume, or "
                            "use --workers 1") from None
        finally:
            for _, future in pending:
                future.cancel()


def peak_rss_mib() -> float:
    """Peak resident memory in MiB: VmHWM on Linux (ru_maxrss counts the parent's at the fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
