"""Data preparation, the token files and the batch loader."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.dataset import DataError, check_vocab, load_meta
from data.loader import Batches
from data.shakespeare_char.prepare import SOURCE
from data.tokenizer import CharTokenizer, TokenizerError
from data.writing import write_dataset

ROOT = Path(__file__).resolve().parents[1]
FIRST_USE = ("import sys; from data.dataset import load_or_prepare; "
             "meta = load_or_prepare('shakespeare_char'); "
             "print(meta['vocab_size'], sorted(m for m in sys.modules if m.startswith('data')))")


def test_char_round_trip_whole_corpus(char_dataset):
    text = SOURCE.read_text(encoding="utf-8")
    meta = load_meta(str(char_dataset))
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    assert meta["vocab_size"] == 65 and meta["dtype"] == "uint16"
    ids = np.concatenate([np.fromfile(char_dataset / f"{s}.bin", dtype=np.uint16)
                          for s in ("train", "val")])
    assert len(ids) == len(text) == 1_115_394
    assert tok.decode(ids.tolist()) == text
    assert meta["splits"]["val"] == len(text) - int(len(text) * 0.9)


def test_char_tokenizer_rejects_unknown_characters():
    tok = CharTokenizer.from_text("abc \n")
    assert tok.decode(tok.encode("cab a")) == "cab a"
    with pytest.raises(TokenizerError, match=r"1 character\(s\) outside this 5-character "
                                             r"vocabulary: 'é'"):
        tok.encode("abé")


def test_batches_are_windows_of_the_data(char_dataset):
    meta = load_meta(str(char_dataset))
    data = np.fromfile(char_dataset / "train.bin", dtype=np.uint16)
    batches = Batches(meta, "train", batch_size=4, block_size=8, seed=3)
    x, y = batches.next()
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    for row in x.numpy():
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(data, 8) == row,
                                       axis=1))
        assert starts.size > 0


def test_batches_seeded_and_resumable(char_dataset):
    meta = load_meta(str(char_dataset))
    a = Batches(meta, "train", 4, 8, seed=5)
    b = Batches(meta, "train", 4, 8, seed=5)
    c = Batches(meta, "train", 4, 8, seed=6)
    first_a, first_b, first_c = a.next(), b.next(), c.next()
    assert torch.equal(first_a[0], first_b[0]) and not torch.equal(first_a[0], first_c[0])
    state = a.state_dict()
    expected = [a.next()[0] for _ in range(3)]
    fresh = Batches(meta, "train", 4, 8, seed=999)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # survives serialisation
    assert all(torch.equal(fresh.next()[0], e) for e in expected)


def test_fixed_eval_batches_repeat(char_dataset):
    meta = load_meta(str(char_dataset))
    loader = Batches(meta, "val", 4, 8, seed=1)
    first = loader.fixed(3, seed=11)
    loader.next()  # training draws do not move the evaluation set
    assert all(np.array_equal(p, q) for p, q in zip(first, loader.fixed(3, seed=11)))


def test_missing_dataset_names_prepare_command(tmp_path, monkeypatch):
    import data.dataset as loader
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "prepare.py").write_text("")
    monkeypatch.setattr(loader, "DATA_DIR", tmp_path)
    with pytest.raises(DataError, match=r"dataset 'mydata' is not prepared: .*meta.json is "
                                        r"missing; run python data/mydata/prepare.py"):
        load_meta("mydata")


def test_unknown_dataset_says_no_prepare_script(tmp_path):
    with pytest.raises(DataError, match="is not prepared.*none found at data/nonexistent"):
        load_meta("nonexistent")


def test_empty_and_short_splits(tmp_path):
    tok = CharTokenizer.from_text("abcd")
    write_dataset(tmp_path / "empty", tok, [], [0, 1, 2])
    with pytest.raises(DataError, match="train.bin is empty"):
        Batches(load_meta(str(tmp_path / "empty")), "train", 2, 4, seed=0)
    write_dataset(tmp_path / "short", tok, [0, 1, 2], [0, 1, 2])
    with pytest.raises(DataError, match="has 3 tokens, fewer than one block of block_size\\+1 = 9"):
        Batches(load_meta(str(tmp_path / "short")), "train", 2, 8, seed=0)


def test_vocab_and_tokenizer_mismatch(char_dataset):
    meta = load_meta(str(char_dataset))
    with pytest.raises(DataError, match="has vocab_size 65 but the model has 50"):
        check_vocab(meta, 50)
    with pytest.raises(DataError, match="tokenized with 'char' but the model uses 'gpt2'"):
        check_vocab(meta, 65, "gpt2")


def test_large_vocab_uses_uint32(tmp_path):
    class Big:
        vocab_size = 70_000

        def meta(self):
            return {"kind": "gpt2"}
    meta = write_dataset(tmp_path, Big(), [69_999, 1] * 10, [5] * 20)
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint32)[0] == 69_999


def test_a_first_use_dataset_is_prepared_by_its_own_script_in_a_process_of_its_own(tmp_path):
    """A fresh clone's data/shakespeare_char is prepared on first use by running its
    prepare.py, so the run that asked never loads the preparation code; a failing script is one
    line naming the command to run."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "data", clone / "data", ignore=shutil.ignore_patterns(
        "*.bin", "meta.json", "__pycache__", "fineweb_edu", "openwebtext", "hellaswag"))
    run = subprocess.run([sys.executable, "-c", FIRST_USE], cwd=clone, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "preparing shakespeare_char" in run.stdout and "65 " in run.stdout
    assert "data.shakespeare_char.prepare" not in run.stdout and "data.writing" not in run.stdout
    assert (clone / "data" / "shakespeare_char" / "meta.json").is_file()
    (clone / "data" / "shakespeare_char" / "meta.json").unlink()
    (clone / "data" / "shakespeare_char" / "prepare.py").write_text("raise SystemExit(3)\n")
    run = subprocess.run([sys.executable, "-c", FIRST_USE], cwd=clone, capture_output=True,
                         text=True, timeout=120)
    assert "preparing shakespeare_char failed (exit 3, its words above); run python " \
           "data/shakespeare_char/prepare.py to try again" in run.stderr
