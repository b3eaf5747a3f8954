"""data.doc_aligned: training rows that start at a document start and hold whole documents,
packed best-fit, for a flat token dataset (single train.bin or shards) whose documents end with
the tokenizer's end-of-text id. Validation keeps the dataset's usual loader (build.py).

    batches = DocBatches(meta, "train", batch_size, block_size, seed)
    x, y = batches.next()          # (B, T) each; every row's first token opens a document
    print(batches.note)            # documents, mean length, tokens cropped away

A document starts at offset 0 of each file and at every end-of-text token: the row opens WITH
that token, so the first target is the document's first token (as the modded-nanogpt speedrun
aligns rows to its BOS). Each row of T+1 tokens takes, from a buffer of the next documents of
the epoch's order, the largest that fits the space left, until none fits; then the buffer's
oldest document is cropped to fill the row exactly (its tail is dropped). No padding. The order
is a permutation per epoch from (seed, epoch); all ranks pack the same global rows and rank r
keeps rows r::world_size. The position (epoch, cursor, buffer) is what a checkpoint stores.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.dataset import DataError
from data.loader import Batches
from data.tokenizer import from_meta

if TYPE_CHECKING:
    import torch

BUFFER_DOCS = 64  # upcoming documents best-fit chooses from
SCAN_TOKENS = 1 << 24  # tokens compared at a time when finding documents (memmap-friendly)


def doc_loader(meta: dict, loader_workers: int) -> type[DocBatches]:
    """The training loader for data.doc_aligned, after refusing what it cannot read."""
    if "instruction" in meta:
        raise DataError("data.doc_aligned packs documents of a token dataset; instruction data "
                        "already has one example a row: drop --doc_aligned")
    if loader_workers:
        raise DataError("data.doc_aligned packs rows in the training process: drop "
                        "--loader_workers or --doc_aligned")
    if "mixture" in meta:
        raise DataError("data.doc_aligned packs one dataset's documents, not a mixture's: drop "
                        "--mixture or --doc_aligned")
    return DocBatches


def document_spans(files: list[np.ndarray], offsets: np.ndarray, eot: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(global starts, lengths) of the documents of at least 2 tokens: one starts at offset 0 of
    each file and at each end-of-text token; it ends where the next one starts."""
    starts, lengths = [], []
    for i, tokens in enumerate(files):
        found = [np.zeros(1, dtype=np.int64)]
        for lo in range(0, len(tokens), SCAN_TOKENS):
            found.append(np.flatnonzero(tokens[lo:lo + SCAN_TOKENS] == eot) + lo)
        local = np.unique(np.concatenate(found))  # sorted; offset 0 once if an eot sits there
        length = np.diff(np.append(local, len(tokens)))
        keep = length >= 2  # a lone end-of-text (at a file's end) has no target in it
        starts.append(local[keep] + offsets[i])
        lengths.append(length[keep])
    return np.concatenate(starts), np.concatenate(lengths)


def best_fit(lengths: np.ndarray, space: int) -> int:
    """Index of the longest document that fits `space` (the first of equals), -1 if none."""
    fitting = np.where(lengths <= space, lengths, -1)
    pick = int(np.argmax(fitting))
    return pick if fitting[pick] > 0 else -1


class DocBatches(Batches):
    """Rows of whole documents packed best-fit, each starting at a document start; see above."""

    kind = "doc_aligned"

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: bool = False,
                 buffer_docs: int = BUFFER_DOCS):
        eot = getattr(from_meta(meta["tokenizer"]), "eot_id", None)
        if eot is None:
            raise DataError(f"{meta['dir']} uses a character tokenizer without an end-of-text "
                            "token, so it has no documents: drop --doc_aligned")
        super().__init__(meta, split, batch_size, block_size, seed, device, pin_memory, rank,
                         world_size, prefetch)  # Batches refuses shards only to itself
        self.sharded = "shards" in meta
        self.starts, self.lengths = document_spans(self.tokens.files, self.tokens.offsets, eot)
        if len(self.starts) == 0:
            raise DataError(f"the {split} split of {meta['dir']} holds no document of 2 or more "
                            "tokens: drop --doc_aligned")
        self.refuse_too_few_documents(meta["dir"], split)
        self.buffer_docs = buffer_docs
        self.epoch, self.cursor, self.buffer = 0, 0, []
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its document order)
        self.packed = self.cropped = 0  # tokens placed in rows / dropped by cropping, so far
        self.note = self.describe(split)

    def refuse_too_few_documents(self, folder: str, split: str) -> None:
        """Each row opens at a document, so a split of fewer documents than a batch has rows
        repeats rows in every batch; one document (a text file prepared whole) is one row."""
        docs, rows = len(self.starts), self.batch_size * self.world_size
        if docs >= max(2, rows):
            return
        repeats = "every row would be the same" if docs == 1 else "every batch would repeat rows"
        raise DataError(f"the {split} split of {folder} holds {docs:,} document{'s' * (docs > 1)} "
                        f"({int(self.lengths.sum()):,} tokens) but a batch has {rows:,} "
                        f"row{'s' * (rows > 1)}, and each row opens at a document: {repeats}; "
                        "drop --doc_aligned (random windows read all of it), or prepare the text "
                        "as many documents (data/fineweb_edu/prepare.py --dataset json "
                        "--data-files FILE.jsonl: a document per line)")

    def describe(self, split: str) -> str:
        row = self.block_size + 1
        beyond = int(np.maximum(self.lengths - row, 0).sum())
        return (f"data.doc_aligned: {split} rows of {row} tokens packed best-fit from "
                f"{self.buffer_docs} upcoming documents; an epoch is {len(self.lengths):,} "
                f"documents, mean {self.lengths.mean():,.0f} tokens; at least "
                f"{beyond / self.lengths.sum():.1%} of its tokens are cropped away (documents "
                "longer than a row)")

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's document order: a permutation from (seed, epoch)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(len(self.starts)))
        return self._order[1]

    def _refill(self) -> None:
        while len(self.buffer) < self.buffer_docs:
            order = self.order(self.epoch)
            if self.cursor == len(order):  # documents run out: the next epoch's order
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            take = order[self.cursor:self.cursor + self.buffer_docs - len(self.buffer)]
            self.buffer += take.tolist()
            self.cursor += len(take)

    def _pack_row(self) -> list[tuple[int, int]]:
        """One row's pieces (global start, length), taken from the buffer (advances it)."""
        space, pieces = self.block_size + 1, []
        while space:
            self._refill()
            lengths = self.lengths[self.buffer]
            pick = best_fit(lengths, space)
            take = int(lengths[pick]) if pick >= 0 else space
            doc = self.buffer.pop(max(pick, 0))  # none fits: the oldest, cropped to the space
            pieces.append((int(self.starts[doc]), take))
            self.cropped += int(self.lengths[doc]) - take
            self.packed += take
            space -= take
        return pieces

    def draw(self) -> list[list[tuple[int, int]]]:
        """This rank's rows of the next global batch, as pieces (advances the position)."""
        rows = [self._pack_row() for _ in range(self.batch_size * self.world_size)]
        return rows[self.rank::self.world_size]

    def read(self, rows: list[list[tuple[int, int]]]) -> np.ndarray:
        """(B, T+1) int64 tokens of the rows draw() gave."""
        out = np.empty((len(rows), self.block_size + 1), dtype=np.int64)
        offsets = self.tokens.offsets
        for r, pieces in enumerate(rows):
            at = 0
            for start, length in pieces:  # a document lies inside one file
                f = int(np.searchsorted(offsets, start, side="right")) - 1
                local = start - int(offsets[f])
                out[r, at:at + length] = self.tokens.files[f][local:local + length]
                at += length
        return out

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_tensors(self.read(self.draw()))

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """Evaluation windows at random offsets of any file (one file: Batches.fixed's)."""
        if not self.sharded:
            return super().fixed(n_batches, seed)
        rng = np.random.default_rng(seed)
        counts = np.maximum(self.tokens.lengths - self.block_size, 0)
        ends = np.cumsum(counts)
        picks = rng.integers(0, ends[-1], size=(n_batches, self.batch_size * self.world_size))
        file = np.searchsorted(ends, picks, side="right")
        starts = self.tokens.offsets[file] + picks - (ends[file] - counts[file])
        return list(starts[:, self.rank::self.world_size])

    def state_dict(self) -> dict:
        return {"doc_epoch": self.epoch, "doc_cursor": self.cursor,
                "doc_buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        if "doc_buffer" not in state:
            raise DataError("the stored data position is not for document-aligned batches; "
                            "resume with the data.doc_aligned the run started with")
        self.epoch, self.cursor = int(state["doc_epoch"]), int(state["doc_cursor"])
        self.buffer = [int(d) for d in state["doc_buffer"]]
