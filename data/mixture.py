"""Weighted dataset mixtures: --mixture="fineweb_edu:3,data/mycode:1" trains on several prepared
datasets (folders under data/ or paths, as --dataset; single-file or sharded alike), each row's
source drawn in proportion to the weights (normalised to sum 1). It replaces --dataset.

    meta = mixture_meta(cfg.data)       # looks like one dataset's meta, plus meta["mixture"]
    batches = MixtureBatches(meta, "train", batch_size, block_size, seed, device)
    x, y = batches.next()               # (B, T) int64 each, rows from every source

A batch plan is a (B, 2) array of (source, window start) rows. Each source keeps its own loader
(Batches or ShardBatches) that sees the whole global batch, so every rank draws the same sources
and windows for batch_size * world_size rows and keeps rows rank::world_size.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from config import Config, ConfigError, DataConfig
from data.dataset import DataError, is_instruction_file, load_or_prepare
from data.loader import Batches

EXAMPLE = '--mixture="fineweb_edu:3,data/mycode:1"'
PATH_KEYS = ("dir", "path", "file")  # where a tokenizer was read from: may differ between hosts


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """'NAME:WEIGHT,...' -> [(name, weight normalised to sum 1)]."""
    entries = []
    for item in (part.strip() for part in spec.split(",")):
        name, sep, weight = item.rpartition(":")
        if not sep or not name.strip():
            raise ConfigError(f"mixture entry {item!r} is not NAME:WEIGHT; write e.g. {EXAMPLE}")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"mixture entry {item!r}: the weight {weight.strip()!r} is not a "
                              f"positive number; write e.g. {EXAMPLE}")
        if is_instruction_file(name.strip()):
            raise ConfigError(f"mixture entry {item!r} is instruction data, which cannot be "
                              "mixed; finetune on it alone with --dataset=<file> "
                              "(docs/finetuning.md)")
        entries.append((name.strip(), value))
    total = sum(weight for _, weight in entries)
    return [(name, weight / total) for name, weight in entries]


def tokenizer_id(meta: dict) -> dict:
    """The tokenizer as meta.json records it, less where it was read from; a trained BPE by its
    sha256 (its name is only a label)."""
    tok = meta["tokenizer"]
    if tok.get("kind") == "bpe":
        return {"kind": "bpe", "sha256": tok.get("sha256")}
    return {k: v for k, v in tok.items() if k not in PATH_KEYS}


def check_sources(names: list[str], metas: list[dict]) -> None:
    """One folder once, one tokenizer and one vocabulary for every dataset of a mixture."""
    seen: dict[Path, str] = {}
    for name, meta in zip(names, metas):
        folder = Path(meta["dir"]).resolve()
        if folder in seen:
            raise ConfigError(f"the mixture lists {folder} twice ('{seen[folder]}' and "
                              f"'{name}'); give each dataset once with its total weight")
        seen[folder] = name
    first, head = names[0], metas[0]
    for name, meta in zip(names[1:], metas[1:]):
        if tokenizer_id(meta) != tokenizer_id(head):
            ours, theirs = meta["tokenizer"]["kind"], head["tokenizer"]["kind"]
            how = f"'{ours}' vs '{theirs}'" if ours != theirs else f"two different '{ours}' ones"
            raise DataError(f"mixture datasets '{name}' and '{first}' were prepared with "
                            f"different tokenizers ({how}); prepare every dataset of a mixture "
                            "with the same tokenizer")
        if meta["vocab_size"] != head["vocab_size"]:
            raise DataError(f"mixture datasets '{name}' and '{first}' have vocab_size "
                            f"{meta['vocab_size']} and {head['vocab_size']}; prepare every "
                            "dataset of a mixture with the same tokenizer")


def mixture_meta(data: DataConfig) -> dict:
    """data.mixture's datasets as one dataset meta (the first's vocab_size, tokenizer and dir)
    with meta["mixture"], what a checkpoint records, and meta["sources"], each one's meta."""
    if data.loader_workers:
        raise ConfigError("--loader_workers reads single datasets only; pass "
                          "--loader_workers=0 with --mixture")
    parsed = parse_mixture(data.mixture)
    names = [name for name, _ in parsed]
    metas = [load_or_prepare(name) for name in names]
    check_sources(names, metas)
    record = [{"dataset": name, "dir": meta["dir"], "weight": weight,
               "train_tokens": meta["splits"]["train"], "val_tokens": meta["splits"]["val"]}
              for (name, weight), meta in zip(parsed, metas)]
    head = metas[0]
    return {"vocab_size": head["vocab_size"], "dtype": head["dtype"],
            "tokenizer": head["tokenizer"], "dir": head["dir"], "mixture": record,
            "sources": metas}


def describe(meta: dict, cfg: Config, world_size: int) -> list[str]:
    """The banner's lines: each source's weight, size and the epochs of it the run reads."""
    t = cfg.train
    tokens = t.batch_size * t.grad_accum_steps * world_size * cfg.model.block_size * t.max_iters
    return [f"mixture: {s['dataset']} weight {s['weight']:.3f} | {s['train_tokens']:,} train "
            f"tokens | {s['weight'] * tokens / s['train_tokens']:.2f} epochs in "
            f"{t.max_iters} steps" for s in meta["mixture"]]


def source_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class MixtureBatches(Batches):
    """Batches whose rows come from several datasets, each row's source drawn by weight."""

    def __init__(self, meta: dict, split: str, batch_size: int, block_size: int, seed: int,
                 device="cpu", pin_memory: bool = False, rank: int = 0, world_size: int = 1,
                 prefetch: bool = False):
        from data.shard_batches import ShardBatches

        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.setup_device(device, pin_memory, prefetch)
        self.names = [s["dataset"] for s in meta["mixture"]]
        self.weights = np.array([s["weight"] for s in meta["mixture"]])
        # each source's loader reads for every rank: the global batch, rank 0 of 1
        self.sources = [(ShardBatches if "shards" in m else Batches)(
            m, split, batch_size * world_size, block_size, source_seed(seed, i + 1))
            for i, m in enumerate(meta["sources"])]
        self.rng = np.random.default_rng(source_seed(seed, 0))  # each row's source

    def _choose(self, rng: np.random.Generator, shape: tuple) -> np.ndarray:
        return rng.choice(len(self.sources), size=shape, p=self.weights)

    def draw(self) -> np.ndarray:
        """The next batch's plan, (B, 2) rows of (source, start); advances every position."""
        source = self._choose(self.rng, (self.batch_size * self.world_size,))
        starts = np.zeros_like(source)
        for i, loader in enumerate(self.sources):
            mine = source == i
            if mine.any():
                starts[mine] = loader.draw(int(mine.sum()))
        return np.stack([source, starts], axis=1)[self.rank::self.world_size]

    def fixed(self, n_batches: int, seed: int) -> list[np.ndarray]:
        """n_batches plans from each source's fixed windows of this split, the same every call."""
        rows = self.batch_size * self.world_size
        source = self._choose(np.random.default_rng(seed), (n_batches, rows))
        starts = np.zeros_like(source)
        for i, loader in enumerate(self.sources):
            mine = source == i
            if mine.any():
                need = int(mine.sum())
                picks = loader.fixed(-(-need // rows), source_seed(seed, i + 1))
                starts[mine] = np.concatenate(picks)[:need]
        return list(np.stack([source, starts], axis=-1)[:, self.rank::self.world_size])

    def rows(self, plan: np.ndarray) -> np.ndarray:
        """(B, T+1) int64 token rows of a plan."""
        out = np.empty((len(plan), self.block_size + 1), dtype=np.int64)
        for i, loader in enumerate(self.sources):
            mine = plan[:, 0] == i
            if mine.any():
                out[mine] = loader.tokens.rows(plan[mine, 1])
        return out

    def windows(self, plan: np.ndarray):
        return self.to_tensors(self.rows(plan))

    def state_dict(self) -> dict:
        return {"mixture": {"datasets": self.names, "weights": self.weights.tolist()},
                "choice_rng": self.rng.bit_generator.state,
                "sources": [loader.state_dict() for loader in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        stored = state.get("mixture")
        if stored is None:
            raise DataError("the stored data position is for a single dataset, not a mixture; "
                            "resume with the --dataset the run started on")
        same = stored["datasets"] == self.names and np.allclose(stored["weights"], self.weights)
        if not same:
            then = ",".join(f"{n}:{w:g}" for n, w in zip(stored["datasets"], stored["weights"]))
            raise DataError(f"the stored data position is for the mixture '{then}', not this "
                            f"one; resume with --mixture=\"{then}\" (the run's own)")
        self.rng.bit_generator.state = state["choice_rng"]
        for loader, source_state in zip(self.sources, state["sources"]):
            loader.load_state_dict(source_state)
