"""data.doc_aligned (data/doc_batches.py): rows open at a document start, hold whole documents
packed best-fit, are exactly T+1 tokens, split across ranks as one stream, resume bit for bit;
a training run with the flag resumes exactly; what it cannot read is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_whole_and_resumed
from data.dataset import DataError, load_meta
from data.writing import write_meta
from data.doc_batches import DocBatches, best_fit, doc_loader
from data.loader import Batches
from data.shard_batches import ShardBatches
from data.tokenizer import CharTokenizer
from engine import checkpoint

TOKENIZER = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,\n"), eot=True)
SHAKESPEARE_START = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
EOT = TOKENIZER.eot_id


def documents(lengths: list[int], rng: np.random.Generator) -> np.ndarray:
    """Documents of exactly these lengths, each opening with the end-of-text token."""
    return np.concatenate([np.concatenate([[EOT], rng.integers(0, EOT, n - 1)])
                           for n in lengths]).astype(np.uint16)


def write_files(folder: Path, train: list[np.ndarray], val: np.ndarray) -> dict:
    """A dataset of one train.bin (one array) or of train shards (several), and val tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    val.tofile(folder / "val.bin")
    if len(train) == 1:
        train[0].tofile(folder / "train.bin")
        write_meta(folder, TOKENIZER, {"train": len(train[0]), "val": len(val)})
    else:
        shards = {"val": [{"file": "val.bin", "tokens": len(val)}], "train": []}
        for i, tokens in enumerate(train):
            tokens.tofile(folder / f"train_{i}.bin")
            shards["train"].append({"file": f"train_{i}.bin", "tokens": len(tokens)})
        write_meta(folder, TOKENIZER, {"train": sum(map(len, train)), "val": len(val)},
                   shards=shards)
    return load_meta(str(folder))


def random_dataset(folder: Path, n_files: int, seed: int = 0) -> tuple[dict, list[np.ndarray]]:
    """Files of random documents; each file opens mid-document (no end-of-text at offset 0)."""
    rng = np.random.default_rng(seed)
    files = [np.concatenate([rng.integers(0, EOT, 5), documents(rng.integers(2, 50, 40), rng)])
             .astype(np.uint16) for _ in range(n_files)]
    return write_files(folder, files, documents([30] * 20, rng)), files


def doc_starts(files: list[np.ndarray]) -> dict[int, int]:
    """{global start: length} of every document: at each file's offset 0 and each end-of-text."""
    out, offset = {}, 0
    for tokens in files:
        local = sorted({0, *np.flatnonzero(tokens == EOT).tolist()}) + [len(tokens)]
        out.update({offset + a: b - a for a, b in zip(local, local[1:])})
        offset += len(tokens)
    return out


@pytest.mark.parametrize("n_files", [1, 3], ids=["train.bin", "shards"])
def test_rows_start_at_documents_and_hold_whole_ones(tmp_path, n_files):
    meta, files = random_dataset(tmp_path, n_files)
    flat, starts = np.concatenate(files), doc_starts(files)
    file_starts = set(np.cumsum([0] + [len(f) for f in files[:-1]]).tolist())
    T, batches = 24, DocBatches(meta, "train", 4, 24, seed=3, buffer_docs=8)
    cropped = 0
    for _ in range(60):  # past an epoch's end (~100 rows of 25 from ~3,300 tokens a file)
        rows = batches.draw()
        x, y = batches.to_tensors(batches.read(rows))
        assert x.shape == y.shape == (4, T) and torch.equal(x[:, 1:], y[:, :-1])
        for r, pieces in enumerate(rows):
            assert sum(n for _, n in pieces) == T + 1  # exactly a row: no padding
            for i, (start, n) in enumerate(pieces):
                assert start in starts  # every piece opens a document ...
                assert flat[start] == EOT or start in file_starts  # ... at an eot or a file start
                assert n == starts[start] or i == len(pieces) - 1  # only the last one is cropped
                cropped += starts[start] - n
            row = np.concatenate([flat[s:s + n] for s, n in pieces])
            assert np.array_equal(row, torch.cat([x[r], y[r, -1:]]).numpy())
    assert batches.epoch >= 1 and batches.cropped == cropped > 0
    assert "documents, mean" in batches.note and "cropped away" in batches.note


def test_best_fit_takes_the_largest_that_fits_then_crops_the_oldest(tmp_path):
    assert best_fit(np.array([4, 7, 3, 7]), 10) == 1  # the largest that fits, first of equals
    assert best_fit(np.array([4, 7, 3]), 3) == 2 and best_fit(np.array([12, 11]), 10) == -1
    rng = np.random.default_rng(0)
    for i, (docs, first_row) in enumerate([([5, 6, 4, 5], [6, 4]), ([2, 3, 5, 8], [8, 2]),
                                           ([3, 7, 5, 2], [7, 3])]):
        meta = write_files(tmp_path / str(i), [documents(docs, rng)], documents([9] * 4, rng))
        for seed in range(4):  # whatever the order, the buffer holds all four
            (row,) = DocBatches(meta, "train", 1, 9, seed=seed, buffer_docs=4).draw()
            assert [n for _, n in row] == first_row
    meta = write_files(tmp_path / "b", [documents([12, 3, 9, 4], rng)], documents([9] * 4, rng))
    batches = DocBatches(meta, "train", 2, 9, seed=1, buffer_docs=2)
    batches.order = lambda epoch: np.arange(4)  # the file's order, to follow it by hand
    starts = [0, 12, 15, 24]
    # row 1: buffer [12, 3]: the 3 fits; [12, 9]: nothing fits 7, the oldest (12) is cropped.
    # row 2: [9, 4]: the 9; [4, 12]: nothing fits 1, the 4 is cropped to it
    assert batches.draw() == [[(starts[1], 3), (starts[0], 7)], [(starts[2], 9), (starts[3], 1)]]
    assert batches.cropped == 5 + 3 and batches.buffer == [0] and batches.epoch == 1


def test_ranks_partition_the_single_process_rows(tmp_path):
    meta, _ = random_dataset(tmp_path, 2)
    whole = DocBatches(meta, "train", 6, 16, seed=5)
    ranks = [DocBatches(meta, "train", 2, 16, seed=5, rank=r, world_size=3) for r in range(3)]
    for _ in range(40):
        rows = whole.draw()
        for r, loader in enumerate(ranks):
            assert loader.draw() == rows[r::3]


def test_state_dict_resumes_bit_for_bit_through_a_safe_load(tmp_path):
    meta, _ = random_dataset(tmp_path, 3)
    a = DocBatches(meta, "train", 4, 20, seed=7, buffer_docs=6)
    for _ in range(35):  # into the second epoch
        a.next()
    assert a.epoch == 1
    torch.save(a.state_dict(), tmp_path / "state.pt")
    expected = [a.next() for _ in range(40)]
    b = DocBatches(meta, "train", 4, 20, seed=7, buffer_docs=6)
    b.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for x, y in expected:
        bx, by = b.next()
        assert torch.equal(bx, x) and torch.equal(by, y)
    assert not torch.equal(DocBatches(meta, "train", 4, 20, seed=8).next()[0],
                           DocBatches(meta, "train", 4, 20, seed=7).next()[0])


def test_what_it_cannot_read_is_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(0)
    plain = CharTokenizer(list("ab"))
    (tmp_path / "c").mkdir()
    rng.integers(0, 2, 200).astype(np.uint16).tofile(tmp_path / "c" / "train.bin")
    rng.integers(0, 2, 200).astype(np.uint16).tofile(tmp_path / "c" / "val.bin")
    write_meta(tmp_path / "c", plain, {"train": 200, "val": 200})
    with pytest.raises(DataError, match="character tokenizer without an end-of-text token, so "
                                        "it has no documents: drop --doc_aligned"):
        DocBatches(load_meta(str(tmp_path / "c")), "train", 2, 8, seed=0)
    with pytest.raises(DataError, match="instruction data already has one example a row"):
        doc_loader({"instruction": object()}, 0)
    with pytest.raises(DataError, match="packs rows in the training process: drop "
                                        "--loader_workers"):
        doc_loader({}, 2)
    meta, _ = random_dataset(tmp_path / "one", 1)
    docs, windows = DocBatches(meta, "train", 2, 8, seed=0), Batches(meta, "train", 2, 8, seed=0)
    sharded = ShardBatches(random_dataset(tmp_path / "three", 3)[0], "train", 2, 8, seed=0)
    for loader in (windows, sharded):
        with pytest.raises(DataError, match="a mixture's or --doc_aligned's, not windows of .*; "
                                            "resume as the run began"):
            loader.load_state_dict(docs.state_dict())
        with pytest.raises(DataError, match="not for document-aligned batches; resume with the "
                                            "data.doc_aligned the run started with"):
            docs.load_state_dict(loader.state_dict())


def test_a_split_of_fewer_documents_than_a_batch_has_rows_is_refused(tmp_path, capsys):
    """One document (what data/shakespeare/prepare.py --source FILE makes) would give one row, its
    first T+1 tokens, again and again; any split with fewer documents than a global batch has
    rows repeats rows in every batch. train.py refuses it in one line before training."""
    import train
    from data.shakespeare.prepare import main as prepare_text

    rng = np.random.default_rng(0)
    one = write_files(tmp_path / "one", [documents([5000], rng)], documents([30] * 20, rng))
    with pytest.raises(DataError, match=f"the train split of {tmp_path / 'one'} holds 1 document "
                                        r"\(5,000 tokens\) but a batch has 2 rows, and each row "
                                        "opens at a document"):
        DocBatches(one, "train", 2, 8, seed=0)
    with pytest.raises(DataError, match="holds 1 document .* but a batch has 1 row, and"):
        DocBatches(one, "train", 1, 8, seed=0)  # one row, the same at every step
    three = write_files(tmp_path / "three", [documents([900, 40, 700], rng)],
                        documents([30] * 20, rng))
    with pytest.raises(DataError, match="holds 3 documents \\(1,640 tokens\\) but a batch has 4"):
        DocBatches(three, "train", 4, 8, seed=0)
    with pytest.raises(DataError, match="holds 3 documents .* but a batch has 4 rows"):
        DocBatches(three, "train", 1, 8, seed=0, world_size=4)  # 1 row each on 4 ranks
    assert DocBatches(three, "train", 3, 8, seed=0).next()[0].shape == (3, 8)
    book = tmp_path / "book.txt"
    book.write_text(SHAKESPEARE_START * 40)
    assert prepare_text(["--source", str(book), "--out_dir", str(tmp_path / "book")]) == 0
    assert train.main(["--config", "tiny", f"--dataset={tmp_path / 'book'}", "--doc_aligned=true",
                       f"--out_dir={tmp_path / 'run'}", "--max_iters=2", "--device=cpu"]) != 0
    err = capsys.readouterr().err
    assert f"the train split of {tmp_path / 'book'} holds 1 document" in err
    assert err.rstrip().endswith("every row would be the same; drop --doc_aligned (random "
                                 "windows read all of it), or prepare the text as many documents "
                                 "(data/fineweb_edu/prepare.py --dataset json --data-files "
                                 "FILE.jsonl: a document per line)")
    assert not (tmp_path / "run").exists() or not checkpoint.latest_checkpoint(tmp_path / "run")


def test_a_doc_aligned_training_run_resumes_exactly(tmp_path, capsys):
    meta, _ = random_dataset(tmp_path / "data", 1)
    whole, _ = train_whole_and_resumed(
        Path(meta["dir"]), tmp_path, "--doc_aligned=true", "--max_iters=8", "--eval_interval=4",
        "--eval_iters=2", "--log_interval=1", "--block_size=16", "--batch_size=4")
    out = capsys.readouterr().out
    assert "note: data.doc_aligned: train rows of 17 tokens packed best-fit" in out
    state = torch.load(checkpoint.latest_checkpoint(whole) / "train_state.pt", weights_only=True)
    assert "doc_buffer" in state["data"]  # the training rows were packed documents


def test_bench_doc_aligned_trains_both_ways_and_scores_both_kinds_of_rows(tmp_path):
    """bench.py doc-aligned end to end at toy size: speeches in a BPE trained on them, a pair
    of runs, each model scored on windows and on document rows."""
    import bench

    assert bench.main(["doc-aligned", "--seeds", "3", "--max-iters", "2", "--block-size", "32",
                       "--batch-size", "2", "--eval-batches", "2", "--work", str(tmp_path / "w"),
                       "--results", str(tmp_path), "--name", "t"]) == 0
    report = json.loads((tmp_path / "doc_aligned_t.json").read_text())
    windows, docs = report["runs"]
    assert (windows["rows"], docs["rows"]) == ("windows", "documents")
    assert docs["note"].startswith("note: data.doc_aligned: train rows of 33 tokens") and \
        not windows["note"]
    for run in (windows, docs):
        assert 0 < run["bpb_windows"] < 20 and 0 < run["bpb_documents"] < 20
        assert run["val_windows"] != run["val_documents"]  # different rows
    meta = json.loads((tmp_path / "w" / "speeches" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["vocab_size"] == 2048
    assert "| **documents, median** |" in (tmp_path / "doc_aligned_t.md").read_text()
