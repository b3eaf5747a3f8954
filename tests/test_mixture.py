"""Weighted dataset mixtures (data/mixture.py): proportions, determinism, exact resume of the
loader and of a training run, the checkpoint's record, and every refusal."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config import ConfigError
from data.dataset import DataError
from data.writing import write_dataset, write_meta
from data.loader import Batches
from data.mixture import MixtureBatches, check_sources, mixture_meta, parse_mixture
from data.shard_batches import ShardBatches
from data.tokenizer import CharTokenizer

CHARS = [chr(ord("0") + i) for i in range(64)]  # one 64-id char vocabulary for every dataset
SPAN = 20  # dataset k's ids lie in [k*SPAN, (k+1)*SPAN): train the first 16, val the last 4


def ids(k: int, split: str, n: int, seed: int) -> np.ndarray:
    low = k * SPAN + (16 if split == "val" else 0)
    return np.random.default_rng([seed, k]).integers(low, low + (4 if split == "val" else 16), n)


def source_of(rows: torch.Tensor) -> np.ndarray:
    return rows[:, 0].numpy() // SPAN


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[Path]:
    """Two single-file datasets and one sharded one, told apart by their ids."""
    root, tok = tmp_path_factory.mktemp("mix"), CharTokenizer(CHARS)
    a, b, c = root / "a", root / "b", root / "c"
    write_dataset(a, tok, ids(0, "train", 4000, 0), ids(0, "val", 600, 0))
    write_dataset(b, tok, ids(1, "train", 3000, 0), ids(1, "val", 600, 0))
    c.mkdir()
    shards = {"train": [], "val": []}
    for split, sizes in (("train", (1500, 1200)), ("val", (700,))):
        for i, n in enumerate(sizes):
            name = f"{split}_{i:06d}.bin"
            ids(2, split, n, i).astype(np.uint16).tofile(c / name)
            shards[split].append({"file": name, "tokens": n})
    write_meta(c, tok, {s: sum(e["tokens"] for e in v) for s, v in shards.items()},
               shards=shards)
    return [a, b, c]


def spec(paths: list[Path], weights: list[float]) -> str:
    return ",".join(f"{p}:{w}" for p, w in zip(paths, weights))


def loader(paths, weights, split="train", batch=8, seed=0, **kwargs) -> MixtureBatches:
    meta = mixture_meta(SimpleNamespace(mixture=spec(paths, weights), loader_workers=0))
    return MixtureBatches(meta, split, batch, 16, seed, **kwargs)


def test_rows_follow_the_weights_and_come_from_their_dataset(datasets):
    batches = loader(datasets, [5, 3, 2], batch=16)
    assert isinstance(batches.sources[2], ShardBatches) and type(batches.sources[0]) is Batches
    rows = []
    for _ in range(200):
        x, y = batches.next()
        assert x.shape == y.shape == (16, 16) and torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], dim=1))
    rows = torch.cat(rows)
    source = source_of(rows)
    assert np.all(rows.numpy() // SPAN == source[:, None])  # a row never crosses datasets
    assert np.all(rows.numpy() % SPAN < 16)  # train ids only
    shares = np.bincount(source, minlength=3) / len(source)
    assert np.abs(shares - [0.5, 0.3, 0.2]).max() < 0.05  # 3,200 rows: ~5 standard deviations


def test_seeded_deterministic_and_resumes_bit_for_bit(datasets):
    a, b = loader(datasets, [1, 1, 1], seed=3), loader(datasets, [1, 1, 1], seed=3)
    other = loader(datasets, [1, 1, 1], seed=4)
    first = a.next()[0]
    assert torch.equal(first, b.next()[0]) and not torch.equal(first, other.next()[0])
    for _ in range(80):
        a.next()
    assert a.sources[2].epoch > 0  # the sharded source is in its second epoch
    state = json.loads(json.dumps(a.state_dict()))  # survives serialisation
    expected = [a.next()[0] for _ in range(30)]
    fresh = loader(datasets, [1, 1, 1], seed=3)  # a sharded order comes from the seed
    fresh.load_state_dict(state)
    assert all(torch.equal(fresh.next()[0], e) for e in expected)


def test_ranks_keep_their_share_of_one_global_batch(datasets):
    whole = loader(datasets, [2, 1, 1], batch=8)
    ranks = [loader(datasets, [2, 1, 1], batch=4, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        x = whole.next()[0]
        for r, part in enumerate(ranks):
            assert torch.equal(part.next()[0], x[r::2])
    fixed = whole.fixed(3, seed=7)
    for r, part in enumerate(ranks):
        assert all(np.array_equal(p, f[r::2]) for p, f in zip(part.fixed(3, seed=7), fixed))


def test_fixed_validation_batches_are_val_rows_in_proportion(datasets):
    val = loader(datasets, [5, 3, 2], split="val", batch=16)
    plans = val.fixed(40, seed=1)
    again = val.fixed(40, seed=1)
    assert all(np.array_equal(p, q) for p, q in zip(plans, again))
    rows = torch.cat([val.windows(p)[0] for p in plans])
    assert np.all(rows.numpy() % SPAN >= 16)  # val ids only
    shares = np.bincount(source_of(rows), minlength=3) / len(rows)
    assert np.abs(shares - [0.5, 0.3, 0.2]).max() < 0.06


def test_weights_are_normalised_and_names_split_at_the_last_colon():
    assert parse_mixture("fineweb_edu:3, C:/data/code:1") == [("fineweb_edu", 0.75),
                                                              ("C:/data/code", 0.25)]


@pytest.mark.parametrize("text, message", [
    ("fineweb_edu", r"mixture entry 'fineweb_edu' is not NAME:WEIGHT; write e\.g\. --mixture="),
    (":3", r"mixture entry ':3' is not NAME:WEIGHT"),
    ("a:1,,b:1", r"mixture entry '' is not NAME:WEIGHT"),
    ("a:x", r"mixture entry 'a:x': the weight 'x' is not a positive number"),
    ("a:0", r"the weight '0' is not a positive number"),
    ("a:-1", r"the weight '-1' is not a positive number"),
    ("a:nan", r"the weight 'nan' is not a positive number"),
    ("a:inf", r"the weight 'inf' is not a positive number"),
    ("tasks/alpaca.jsonl:1", r"mixture entry 'tasks/alpaca.jsonl:1' is instruction data, which "
                             r"cannot be mixed; finetune on it alone with --dataset=<file>"),
])
def test_malformed_mixtures_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_mixture(text)


def test_a_dataset_twice_and_loader_workers_are_refused(datasets):
    a = datasets[0]
    with pytest.raises(ConfigError, match=rf"the mixture lists {a} twice \('{a}' and '{a}/'\); "
                                          "give each dataset once with its total weight"):
        mixture_meta(SimpleNamespace(mixture=f"{a}:1,{a}/:2", loader_workers=0))
    with pytest.raises(ConfigError, match=r"--loader_workers reads single datasets only; pass "
                                          r"--loader_workers=0 with --mixture"):
        mixture_meta(SimpleNamespace(mixture=f"{a}:1", loader_workers=2))


def test_datasets_with_other_tokenizers_or_vocabularies_are_refused(datasets, tmp_path):
    a = datasets[0]
    write_dataset(tmp_path / "chars", CharTokenizer(CHARS[::-1]), [1] * 100, [1] * 50)
    with pytest.raises(DataError, match=r"mixture datasets '.*chars' and '.*a' were prepared "
                                        r"with different tokenizers \(two different 'char' ones\)"):
        mixture_meta(SimpleNamespace(mixture=f"{a}:1,{tmp_path / 'chars'}:1", loader_workers=0))
    bpe = {"kind": "bpe", "sha256": "ab12", "path": "/here/tok.json"}

    def meta(tokenizer: dict, vocab: int = 64, folder: str = "x") -> dict:
        return {"dir": str(tmp_path / folder), "tokenizer": tokenizer, "vocab_size": vocab}

    # the same trained tokenizer read from another place is the same tokenizer
    check_sources(["x", "y"], [meta(bpe), meta({**bpe, "path": "/there/tok.json"}, folder="y")])
    with pytest.raises(DataError, match=r"'y' and 'x' were prepared with different tokenizers "
                                        r"\(two different 'bpe' ones\)"):
        check_sources(["x", "y"], [meta(bpe), meta({**bpe, "sha256": "cd34"}, folder="y")])
    with pytest.raises(DataError, match=r"different tokenizers \('gpt2' vs 'bpe'\)"):
        check_sources(["x", "y"], [meta(bpe), meta({"kind": "gpt2"}, folder="y")])
    with pytest.raises(DataError, match=r"mixture datasets 'y' and 'x' have vocab_size 70 and "
                                        r"64; prepare every dataset of a mixture with the same "
                                        r"tokenizer"):
        check_sources(["x", "y"], [meta(bpe), meta(bpe, vocab=70, folder="y")])


def test_a_position_from_another_mixture_or_dataset_is_refused(datasets):
    mixed = loader(datasets[:2], [3, 1])
    with pytest.raises(DataError, match=r"the stored data position is for the mixture "
                                        r"'.*a:0\.75,.*b:0\.25', not this one; resume with "
                                        r"--mixture=\".*a:0\.75,.*b:0\.25\" \(the run's own\)"):
        loader(datasets[:2], [1, 1]).load_state_dict(mixed.state_dict())
    with pytest.raises(DataError, match=r"the mixture '.*a:0\.75,.*b:0\.25', not this one"):
        loader(datasets, [3, 1, 1]).load_state_dict(mixed.state_dict())
    single = mixed.sources[0]
    with pytest.raises(DataError, match=r"the stored data position is for a single dataset, not "
                                        r"a mixture; resume with the --dataset the run started"):
        mixed.load_state_dict(single.state_dict())
    for plain in (single, loader(datasets, [1, 1, 1]).sources[2]):  # single-file, sharded
        with pytest.raises(DataError, match=r"the stored data position is .*, a mixture's or "
                                            r"--doc_aligned's, not windows of .*; resume as the"):
            plain.load_state_dict(mixed.state_dict())


def test_training_on_a_mixture_resumes_exactly_and_records_it(datasets, tmp_path, capsys):
    import train
    from config import load_config
    from engine.checkpoint import latest_checkpoint, read_meta

    mixture = spec(datasets, [3, 1, 1])
    common = ["--config", "tiny", f"--mixture={mixture}", "--device=cpu", "--block_size=16",
              "--batch_size=4", "--max_iters=6", "--eval_interval=6", "--eval_iters=2",
              "--log_interval=1", "--warmup_iters=2", "--n_embd=16"]

    def losses(out: Path) -> list[tuple]:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["kind"], r.get("loss", r.get("val"))) for r in records
                if r["kind"] in ("train", "eval")]

    train.train(load_config(common + [f"--out_dir={tmp_path / 'whole'}"])[0])
    banner = capsys.readouterr().out
    assert f"note: mixture: {datasets[0]} weight 0.600 | 4,000 train tokens | 0.06 epochs in " \
           "6 steps" in banner
    assert f"note: mixture: {datasets[2]} weight 0.200 | 2,700 train tokens" in banner
    for argv in (["--stop_after_iters=4"], ["--init_from=resume"]):
        train.train(load_config(common + [f"--out_dir={tmp_path / 'split'}", *argv])[0])
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # same batches after resume
    record = read_meta(latest_checkpoint(tmp_path / "whole"))["mixture"]
    assert [(r["dataset"], r["weight"], r["train_tokens"], r["val_tokens"]) for r in record] == [
        (str(datasets[0]), 0.6, 4000, 600), (str(datasets[1]), 0.2, 3000, 600),
        (str(datasets[2]), 0.2, 2700, 700)]


def test_a_toml_config_sets_the_mixture_as_the_same_string(tmp_path):
    from config import load_config

    path = tmp_path / "mix.toml"
    path.write_text('[data]\nmixture = "fineweb_edu:3,data/mycode:1"\n')
    cfg, _ = load_config(["--config", str(path)])
    assert cfg.data.mixture == "fineweb_edu:3,data/mycode:1"
    assert parse_mixture(cfg.data.mixture) == [("fineweb_edu", 0.75), ("data/mycode", 0.25)]
