"""Sharded preparation (data/shards.py) from local files, and the sharded batch loader."""
from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import data.shards as shards
import data.stream as stream
from data.loader import Batches, DataError, load_meta
from data.shard_batches import ShardBatches
from data.shards import Source, prepare
from data.bpe import GPT2Tokenizer

SHARD, VAL = 1500, 2000  # tokens per shard, val tokens: a few shards per split
EOT = "<|endoftext|>"


def make_documents() -> list[str]:
    """~60 documents of varied length cut from tiny Shakespeare, some with non-ASCII text and
    one empty, the way web text varies."""
    words = Path(__file__).resolve().parents[1].joinpath("data", "tinyshakespeare.txt") \
        .read_text(encoding="utf-8").split()
    rng = random.Random(0)
    docs = []
    for i in range(60):
        n = rng.choice([3, 40, 150, 400])
        start = rng.randrange(len(words) - n)
        doc = " ".join(words[start:start + n])
        docs.append(doc + (" naïve café — ☃ 東京" if i % 7 == 0 else ""))
    docs[5] = ""
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], list[str]]:
    """The documents, written as three json-lines files (with an extra field to ignore)."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = make_documents()
    files = []
    for part in range(3):
        path = folder / f"part{part}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i, doc in enumerate(docs[part * 20:(part + 1) * 20]):
                f.write(json.dumps({"id": i, "text": doc}) + "\n")
        files.append(str(path))
    return docs, files


def run(files: list[str], out: Path, **kwargs) -> dict:
    kwargs = {"shard_tokens": SHARD, "val_tokens": VAL, "docs_per_task": 8,
              "commit_tokens": 700, "progress": False, **kwargs}
    return prepare(Source("json", data_files=files), out, **kwargs)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One uninterrupted single-worker preparation, the baseline the other runs must equal."""
    out = tmp_path_factory.mktemp("reference")
    run(corpus[1], out, workers=1)
    return out


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*_*.bin"))}


def test_shards_decode_to_the_documents(corpus, reference):
    docs, _ = corpus
    meta = load_meta(str(reference))
    tok = GPT2Tokenizer()
    stream = {split: np.concatenate([np.fromfile(reference / s["file"], dtype=np.uint16)
                                     for s in meta["shards"][split]])
              for split in ("val", "train")}
    expected = np.concatenate([np.array(tok.encode_ordinary(d) + [tok.eot_id]) for d in docs])
    assert np.array_equal(np.concatenate([stream["val"], stream["train"]]), expected)
    assert tok.decode(np.concatenate([stream["val"], stream["train"]]).tolist()) == \
        "".join(d + EOT for d in docs)
    # val is the first VAL tokens extended to the end of a document, then train starts
    assert stream["val"][-1] == tok.eot_id and VAL <= len(stream["val"]) < VAL + 1000
    assert meta["splits"] == {"val": len(stream["val"]), "train": len(stream["train"])}
    assert meta["documents"] == len(docs) and meta["dtype"] == "uint16"
    for split in ("val", "train"):
        sizes = [s["tokens"] for s in meta["shards"][split]]
        assert sizes[:-1] == [SHARD] * (len(sizes) - 1) and 0 < sizes[-1] <= SHARD
        assert [s["file"] for s in meta["shards"][split]] == \
            [f"{split}_{i:06d}.bin" for i in range(len(sizes))]
    assert len(meta["shards"]["train"]) >= 4
    assert not list(reference.glob(".*.partial"))


def test_two_workers_equal_one(corpus, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "TASK_CHARS", 2000)  # tasks end by size as well as by count
    result = run(corpus[1], tmp_path, workers=2, docs_per_task=50)
    assert result["run"]["workers"] == 2 and result["run"]["peak_mib"]["worker"] > 0
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    assert (tmp_path / "meta.json").read_bytes() == (reference / "meta.json").read_bytes()


class Crash(Exception):
    pass


def crash_on_call(n: int, original, after: bool = False):
    """A stand-in for `original` that raises on its n-th call (after doing the work if `after`)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            if after:
                original(*args, **kwargs)
            raise Crash(f"simulated crash in call {n}")
        return original(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("where", ["mid-shard", "before-rename", "after-rename", "twice"])
def test_interrupted_run_resumes_to_identical_shards(corpus, reference, tmp_path, monkeypatch,
                                                     where):
    if where in ("mid-shard", "twice"):  # tokens written after the last commit are dropped
        monkeypatch.setattr(stream, "encode_batch", crash_on_call(4, stream.encode_batch))
    else:
        # the 2nd shard closed is the last val shard (switching to train), the 3rd a full one
        after = where == "after-rename"
        monkeypatch.setattr(shards, "rename_shard", crash_on_call(2 if after else 3,
                                                                  shards.rename_shard, after))
    with pytest.raises(Crash):
        run(corpus[1], tmp_path, workers=1)
    assert not (tmp_path / "meta.json").exists()
    done = shard_bytes(tmp_path)  # a file with a shard's name is always complete
    assert done and all(content == (reference / name).read_bytes()
                        for name, content in done.items())
    state = json.loads((tmp_path / "prepare_state.json").read_text())
    if where == "after-rename":  # the shard is in place; its record still says 'closing'
        assert state["current"]["closing"] and not list(tmp_path.glob(".*.partial"))
    else:  # the unfinished shard, under a hidden name
        assert list(tmp_path.glob(".*.partial"))
    monkeypatch.undo()
    if where == "twice":
        monkeypatch.setattr(stream, "encode_batch", crash_on_call(3, stream.encode_batch))
        with pytest.raises(Crash):
            run(corpus[1], tmp_path, workers=1)
        monkeypatch.undo()
    result = run(corpus[1], tmp_path, workers=1)
    assert 0 < result["run"]["tokens"] < sum(result["splits"].values())  # it resumed
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    assert (tmp_path / "meta.json").read_bytes() == (reference / "meta.json").read_bytes()
    assert run(corpus[1], tmp_path, workers=1)["run"]["tokens"] == 0  # done: nothing to redo


def split_of(folder: Path) -> dict[str, np.ndarray]:
    meta = load_meta(str(folder))
    return {split: np.concatenate([np.fromfile(folder / s["file"], dtype=np.uint16)
                                   for s in meta["shards"][split]]) for split in ("val", "train")}


def test_default_val_split_scales_with_the_corpus(corpus, tmp_path, capsys):
    """No --val-tokens: val is 1% of the tokens prepared (at most 10M), to the end of a document,
    however small the corpus; the documents after it are train. A --val-tokens that leaves train
    under 90% of the tokens is said."""
    docs, files = corpus
    tok = GPT2Tokenizer()
    stream = np.concatenate([tok.encode_ordinary(d) + [tok.eot_id] for d in docs])
    target = round(len(stream) * 0.01)
    cut = int(np.flatnonzero(stream[target - 1:] == tok.eot_id)[0]) + target
    common = ["--data-files", ",".join(files), "--shard-tokens", str(SHARD), "--workers", "1",
              "--no-progress"]
    assert shards.main(shards.Defaults("json", tmp_path / "d"), common) == 0
    split = split_of(tmp_path / "d")
    assert len(split["val"]) == cut and len(split["train"]) == len(stream) - cut
    assert np.array_equal(split["val"], stream[:cut])
    texts = tok.decode(np.concatenate([split["val"], split["train"]]).tolist()).split(EOT)
    assert sorted(texts[:-1]) == sorted(docs)  # every document once, in one split
    assert "warning" not in capsys.readouterr().err
    assert shards.main(shards.Defaults("json", tmp_path / "e"), [*common, "--val-tokens",
                                                                  "3000"]) == 0
    val = len(split_of(tmp_path / "e")["val"])
    assert f"warning: train holds {1 - val / len(stream):.1%} of the {len(stream):,} tokens: " \
           f"--val-tokens 3,000 gave val {val:,}" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["moving", "renamed", "deleting"])
def test_an_interrupted_default_split_resumes_to_the_same_shards(corpus, tmp_path, monkeypatch,
                                                                  where):
    """The default split moves val's later documents into train shards at the end: interrupted
    while moving them, just after one is renamed into place, or before the val shards they came
    from are cut, it ends the same."""
    # the corpus's 12,406 tokens: all streamed to val (no --max-tokens, so val takes up to 10M
    # at first), or under --max-tokens 100k the first 1,000 (1,182: two documents) then train
    kwargs = {"val_tokens": None, "workers": 1, "max_tokens": 0 if where == "moving" else 10**5}
    run(corpus[1], tmp_path / "whole", **kwargs)
    if where == "moving":  # renames 1-9 close the val shards, 10-17 write the moved tokens
        monkeypatch.setattr(shards, "rename_shard", crash_on_call(12, shards.rename_shard))
    elif where == "renamed":  # 1 closes val, 2-9 train; 10 puts the moved document in place
        monkeypatch.setattr(shards, "rename_shard", crash_on_call(10, shards.rename_shard, True))
    else:
        monkeypatch.setattr(shards.ShardWriter, "drop_trimmed",
                            crash_on_call(1, shards.ShardWriter.drop_trimmed))
    with pytest.raises(Crash):
        run(corpus[1], tmp_path / "cut", **kwargs)
    monkeypatch.undo()
    run(corpus[1], tmp_path / "cut", **kwargs)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    assert (tmp_path / "cut" / "meta.json").read_bytes() == \
        (tmp_path / "whole" / "meta.json").read_bytes()
    assert not list((tmp_path / "cut").glob(".*.partial"))
    meta = load_meta(str(tmp_path / "whole"))
    assert meta["splits"]["val"] == 625 and len(meta["shards"]["val"]) == 1  # the first document


def test_ctrl_c_commits_the_batch_then_stops(corpus, reference, tmp_path, monkeypatch):
    encode = stream.encode_batch
    calls = []

    def interrupted_in_fourth_batch(texts):
        calls.append(len(texts))
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
        return encode(texts)
    monkeypatch.setattr(stream, "encode_batch", interrupted_in_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        run(corpus[1], tmp_path, workers=1, commit_tokens=10**9)  # no periodic commits
    state = json.loads((tmp_path / "prepare_state.json").read_text())
    assert len(calls) == 4 and state["pos"]["doc"] == sum(calls)  # batch 4 written, committed
    monkeypatch.undo()
    assert run(corpus[1], tmp_path, workers=1)["documents"] == len(corpus[0])
    assert shard_bytes(tmp_path) == shard_bytes(reference)


def test_saved_dataset_and_max_tokens(corpus, reference, tmp_path):
    import datasets
    docs, files = corpus
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": d, "n": i} for i, d in enumerate(docs)]) \
        .save_to_disk(str(saved))
    run_saved = prepare(Source(str(saved)), tmp_path / "from_saved", SHARD, VAL,
                        docs_per_task=8, progress=False)
    assert shard_bytes(tmp_path / "from_saved") == shard_bytes(reference)
    capped = run(files, tmp_path / "capped", max_tokens=4321)
    assert sum(capped["splits"].values()) == 4321
    assert run_saved["documents"] == len(docs)


def test_preparation_errors(corpus, tmp_path):
    _, files = corpus
    run(files, tmp_path / "a", max_tokens=3000)
    with pytest.raises(DataError, match=r"other settings \(shard_tokens: 1500 then, 1000 now\)"):
        run(files, tmp_path / "a", max_tokens=3000, shard_tokens=1000)
    with pytest.raises(DataError, match=r"have no 'body' field \(fields: id, text\); pass "
                                        r"--text-field"):
        prepare(Source("json", data_files=files, text_field="body"), tmp_path / "b",
                progress=False)
    with pytest.raises(DataError, match="train split is empty: the corpus gave"):
        run(files, tmp_path / "c", val_tokens=10**7)
    text = "one long document " * 300  # the default val split ends at its end: train is empty
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    tokens = len(GPT2Tokenizer().encode_ordinary(text)) + 1
    with pytest.raises(DataError, match=f"the train split is empty: the corpus gave {tokens} "
                                        "tokens in 1 document, and val, 1% of the tokens, runs "
                                        "to the end of a document; prepare the text as more "
                                        "documents"):
        run([str(tmp_path / "one.jsonl")], tmp_path / "one", val_tokens=None)
    with pytest.raises(DataError, match="--val-tokens 5,000 leaves nothing for train"):
        run(files, tmp_path / "d", val_tokens=5000, max_tokens=5000)
    with pytest.raises(DataError, match="--data-files .*no_such_file.jsonl: no such file"):
        run([str(tmp_path / "no_such_file.jsonl")], tmp_path / "e")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "train_000000.bin").write_bytes(b"xx")
    with pytest.raises(DataError, match="holds token files .* but no prepare_state.json"):
        run(files, tmp_path / "f")


def test_local_data_files_that_are_missing_empty_or_malformed_are_said_so(corpus, tmp_path,
                                                                          capsys):
    """datasets reports an empty local file as StopIteration and a missing one as not found on
    the hub, and a malformed line surfaces mid-stream: each is one line that names the file."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    defaults = shards.Defaults(dataset="org/hub-corpus", out_dir=tmp_path / "out")
    common = ["--dataset", "json", "--workers", "1", "--no-progress", "--data-files"]
    cases = [("empty.jsonl", f"--data-files {tmp_path}/empty.jsonl: the file is empty (0 bytes), "
                             "so there are no documents to prepare; name files that hold them"),
             (f"{tmp_path}/empty.jsonl,{tmp_path}/blank.jsonl",
              f"--data-files {tmp_path}/empty.jsonl, {tmp_path}/blank.jsonl: the 2 files are "
              "empty (0 and 4 bytes of white space)"),
             ("nope.jsonl", f"--data-files {tmp_path}/nope.jsonl: no such file"),
             ("*.parquet", f"--data-files {tmp_path}/*.parquet: no file matches"),
             ("bad.jsonl", f"could not read json split=train files={tmp_path}/bad.jsonl after 0 "
                           "documents: ArrowInvalid: JSON parse error")]
    for files, says in cases:
        files = ",".join(f if f.startswith("/") else f"{tmp_path}/{f}" for f in files.split(","))
        assert shards.main(defaults, [*common, files]) == 2
        err = capsys.readouterr().err.splitlines()  # datasets may log its own line first
        assert says in err[-1] and err[-1].startswith("error: ") and "Traceback" not in err, err
        assert not any("without a network" in line for line in err)


def test_command_line(corpus, tmp_path, capsys):
    defaults = shards.Defaults(dataset="org/hub-corpus", name="big-config",
                               out_dir=tmp_path / "default")
    out = tmp_path / "cli"
    code = shards.main(defaults, ["--dataset", "json", "--data-files", ",".join(corpus[1]),
                                  "--out-dir",
                                  str(out), "--shard-tokens", "2k", "--max-tokens", "6k",
                                  "--workers", "1", "--no-progress"])
    assert code == 0
    meta = load_meta(str(out))
    assert sum(meta["splits"].values()) == 6000 and meta["shard_tokens"] == 2000
    assert meta["splits"]["val"] == 625  # 1% of --max-tokens, to the end of the first document
    assert meta["settings"]["name"] is None  # the script's hub config is not applied to json
    said = capsys.readouterr()
    assert "done: 6,000 tokens" in said.out
    assert "warning: train holds 89.6% of the 6,000 tokens: the default (1% of the tokens, to " \
           "the end of a document) gave val 625" in said.err
    assert shards.parse_count("2.5B") == 2_500_000_000 and shards.parse_count("1e6") == 10**6
    assert shards.main(defaults, ["--max-tokens", "lots"]) == 2
    assert "'lots' is not a token count" in capsys.readouterr().err
    assert shards.main(defaults, ["--max-token", "1M"]) == 2
    assert "unknown key 'max_token' in command line; did you mean max_tokens" \
        in capsys.readouterr().err


def write_synthetic(folder: Path, lengths: list[int], val: int = 400) -> dict:
    """A sharded dataset whose token values say where they are: shard i holds i*1000 + k."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = {"train": [], "val": []}
    for split, sizes in (("train", lengths), ("val", [val])):
        for i, n in enumerate(sizes):
            name = f"{split}_{i:06d}.bin"
            (np.arange(n, dtype=np.uint16) + 1000 * i).tofile(folder / name)
            entries[split].append({"file": name, "tokens": n})
    meta = {"vocab_size": 50257, "dtype": "uint16", "tokenizer": {"kind": "gpt2"},
            "splits": {"train": sum(lengths), "val": val}, "shards": entries}
    (folder / "meta.json").write_text(json.dumps(meta))
    return load_meta(str(folder))


def epoch_windows(loader: ShardBatches) -> list[tuple[int, ...]]:
    epoch, rows = loader.epoch, []
    while True:
        x, y = loader.next()
        if loader.epoch != epoch:
            return rows
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows += [tuple(r) for r in torch.cat([x, y[:, -1:]], dim=1).tolist()]


def test_shard_batches_cover_each_window_once_per_epoch(tmp_path):
    T, lengths = 8, [130, 95, 7, 210]  # a shard shorter than one window is skipped
    meta = write_synthetic(tmp_path, lengths)
    loader = ShardBatches(meta, "train", batch_size=3, block_size=T, seed=4)
    assert isinstance(loader, ShardBatches)
    rows = epoch_windows(loader)
    for row in rows:  # consecutive tokens of one shard: no window crosses a shard's end
        assert row[-1] - row[0] == T and row[0] // 1000 == row[-1] // 1000
    starts = [r[0] % 1000 for r in rows]
    shift = starts[0] % T
    assert all(s % T == shift for s in starts) and len(set(rows)) == len(rows)
    windows = sum((n - 1 - shift) // T for n in lengths)
    assert len(rows) == windows - windows % 3  # all but the last partial batch
    assert rows[:10] != sorted(rows)[:10]  # shuffled across shards, not read in order
    loader.next()
    assert loader.epoch == 1 and epoch_windows(loader) != rows  # each epoch reshuffles


def test_shard_batches_ranks_disjoint_and_resumable(tmp_path):
    meta = write_synthetic(tmp_path, [300, 300, 300])
    ranks = [ShardBatches(meta, "train", 2, 8, seed=1, rank=r, world_size=2) for r in range(2)]
    seen = [set(), set()]
    for r, loader in enumerate(ranks):
        for _ in range(10):
            seen[r] |= {tuple(row) for row in loader.next()[0].tolist()}
    assert len(seen[0]) == len(seen[1]) == 20 and not seen[0] & seen[1]
    a = ShardBatches(meta, "train", 4, 8, seed=7)
    for _ in range(20):  # past the end of the first epoch (103 windows / 4)
        a.next()
    path = tmp_path / "state.pt"
    torch.save(a.state_dict(), path)
    expected = [a.next()[0] for _ in range(12)]
    b = ShardBatches(meta, "train", 4, 8, seed=7)
    b.load_state_dict(torch.load(path, weights_only=True))
    assert all(torch.equal(b.next()[0], e) for e in expected)
    assert not torch.equal(ShardBatches(meta, "train", 4, 8, seed=8).next()[0],
                           ShardBatches(meta, "train", 4, 8, seed=7).next()[0])
    # training draws don't move the fixed batches
    fixed = ShardBatches(meta, "train", 4, 8, seed=0).fixed(3, seed=11)
    assert len(fixed) == 3 and all(np.array_equal(p, q) for p, q in
                                   zip(fixed, a.fixed(3, seed=11)))
    assert len({int(s) for batch in fixed for s in batch}) == 12  # no repeats


def test_shard_batches_errors(tmp_path, char_dataset):
    meta = write_synthetic(tmp_path / "s", [100])
    with pytest.raises(DataError, match=r"12 windows of block_size\+1 = 9 per rank, fewer than "
                                        r"batch_size 16"):
        ShardBatches(meta, "train", 16, 8, seed=0)
    sharded = ShardBatches(meta, "train", 2, 8, seed=0)
    single = Batches(load_meta(str(char_dataset)), "train", 2, 8, seed=0)
    assert type(single) is Batches
    with pytest.raises(DataError, match="is sharded: read it with ShardBatches"):
        Batches(meta, "train", 2, 8, seed=0)
    with pytest.raises(DataError, match="position is a train.bin's, a mixture's or "
                                        "--doc_aligned's, not windows of shards"):
        sharded.load_state_dict(single.state_dict())
    with pytest.raises(DataError, match="position is a sharded dataset's, a mixture's or "
                                        "--doc_aligned's, not windows of"):
        single.load_state_dict(sharded.state_dict())
    (tmp_path / "s" / "train_000000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"train_000000.bin is 10 bytes, not 200; the folder was "
                                        r"changed after preparation"):
        ShardBatches(meta, "train", 2, 8, seed=0)


def test_training_on_shards_resumes_exactly_and_scores_hellaswag(reference, tmp_path):
    import train
    from config import load_config
    from test_hellaswag import EXAMPLES

    hs = tmp_path / "hellaswag_val.jsonl"
    hs.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    common = ["--config", "tiny", f"--dataset={reference}", "--device=cpu", "--block_size=16",
              "--batch_size=4", "--max_iters=6", "--eval_interval=6", "--eval_iters=2",
              "--log_interval=1", "--warmup_iters=2"]

    def losses(out: Path) -> list[tuple]:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]

    cfg, _ = load_config(common + [f"--out_dir={tmp_path / 'whole'}", "--hellaswag_interval=3",
                                   "--hellaswag_examples=2", f"--hellaswag_path={hs}"])
    train.train(cfg)
    records = [json.loads(line) for line in
               (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if r["kind"] == "hellaswag"]
    assert [r["step"] for r in scored] == [0, 3, 6] and all(r["n"] == 2 for r in scored)
    assert all(r["acc_norm"] in (0.0, 0.5, 1.0) for r in scored)
    for argv in (["--stop_after_iters=4"], ["--init_from=resume"]):
        cfg, _ = load_config(common + [f"--out_dir={tmp_path / 'split'}", *argv])
        train.train(cfg)
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # same batches after resume
