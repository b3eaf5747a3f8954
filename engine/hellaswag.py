"""HellaSwag, zero-shot: each of four endings is scored by its log-likelihood after the context,
as eval.py scores any multiple-choice task (`eval.py --tasks hellaswag` runs it in the suite);
`acc` takes the highest sum, `acc_norm` the highest per-token mean. This module reads the file
and runs it during training (train.hellaswag_interval) and from its own command line:

    python -m engine.hellaswag --model out/gpt2_124m       # our checkpoint (or its run directory)
    python -m engine.hellaswag --model gpt2 --limit 500    # OpenAI's GPT-2 from the hub"""
from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, command_line_keys, load_config, opt
from data.bpe import GPT2Tokenizer
from data.dataset import DataError
from data.tokenizer import TokenizerError, from_meta
from engine import checkpoint, sources
from engine.device import Runtime, SetupError, setup

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "data" / "hellaswag" / "hellaswag_val.jsonl"
VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_EXAMPLES = 10_042
REFERENCES = "GPT-2 124M acc_norm 0.2955 (this scoring), GPT-3 Small 0.337"


class HellaSwagError(DataError):
    """A HellaSwag file that is missing or malformed, or a model that cannot be scored."""


def ensure_file(path: str | Path = "") -> Path:
    """The validation file at `path` ('' = the default location), downloaded there if missing."""
    path = Path(path) if path else DEFAULT_PATH
    if path.is_file():
        return path
    if path != DEFAULT_PATH:
        raise HellaSwagError(f"HellaSwag file {path} not found; pass the path of "
                             "hellaswag_val.jsonl, or leave it unset to download it")
    print(f"downloading HellaSwag validation set to {path} ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with urllib.request.urlopen(VAL_URL, timeout=60) as response:
            tmp.write_bytes(response.read())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise HellaSwagError(f"could not download {VAL_URL} ({e}); on a machine without a "
                             f"network, copy hellaswag_val.jsonl to {path} or pass its "
                             "path") from None
    return tmp.replace(path)


def load_examples(path: str | Path, limit: int = 0) -> list[dict]:
    """The first `limit` (0 = all) examples of a HellaSwag jsonl file, checked."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                examples.append(_check_example(line, f"{path}:{line_no}"))
            if limit and len(examples) == limit:
                break
    if not examples:
        raise HellaSwagError(f"{path} holds no examples")
    return examples


def _check_example(line: str, where: str) -> dict:
    """ctx, endings (4 strings) and label (0-3) of one line, or a HellaSwagError naming it."""
    try:
        ex = json.loads(line)
        ctx, endings, label = ex["ctx"], ex["endings"], int(ex["label"])
    except json.JSONDecodeError as e:
        raise HellaSwagError(f"{where}: not a JSON line ({e}); is this the official "
                             "hellaswag_val.jsonl?") from None
    except (KeyError, TypeError, ValueError) as e:
        raise HellaSwagError(f"{where}: needs 'ctx', 'endings' and an integer 'label' "
                             f"({type(e).__name__}: {e})") from None
    if (not isinstance(ctx, str) or not isinstance(endings, list) or len(endings) != 4
            or not all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{where}: 'ctx' must be text and 'endings' a list of 4 texts")
    if not 0 <= label < 4:
        raise HellaSwagError(f"{where}: label {label} is not 0, 1, 2 or 3")
    return {"ctx": ctx, "endings": endings, "label": label}


def requests(examples: list[dict], tokenizer: GPT2Tokenizer) -> list[tuple[list[int], list]]:
    """Each example as a multiple-choice request of eval.py's scoring: the context's ids, and
    each " " + ending's."""
    return [(tokenizer.encode_ordinary(ex["ctx"]),
             [tokenizer.encode_ordinary(" " + ending) for ending in ex["endings"]])
            for ex in examples]


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: GPT2Tokenizer, examples: list[dict],
             autocast=None, batch_examples: int = 4, rank: int = 0, world_size: int = 1,
             progress: bool | None = False, kv_cache: bool = False) -> dict:
    """acc (the ending of the highest summed log-likelihood), acc_norm (per token) and the counts
    behind them over examples[rank::world_size], scored as eval.py scores a multiple-choice task
    (engine/evaluation/scoring.py; kv_cache: each context read once for its four endings).
    progress: a bar with the pace and the time left on stderr (None: only on a terminal)."""
    from tqdm import tqdm

    from engine.evaluation.scoring import choice_logprobs

    was_training = model.training
    model.eval()
    mine = examples[rank::world_size]
    correct = correct_norm = 0
    bar = tqdm(total=len(mine), desc="hellaswag", unit="ex", mininterval=1.0,
               disable=None if progress is None else not progress, leave=progress is not None)
    for start in range(0, len(mine), batch_examples):
        chunk = mine[start:start + batch_examples]
        scores = choice_logprobs(model, requests(chunk, tokenizer), 4 * len(chunk), kv_cache,
                                 autocast)  # per example, per ending: (log-likelihood, tokens)
        for ex, ending in zip(chunk, scores):
            correct += max(range(4), key=lambda i: ending[i][0]) == ex["label"]
            correct_norm += max(range(4), key=lambda i: ending[i][0] / ending[i][1]) == ex["label"]
        bar.update(len(chunk))
        bar.set_postfix(acc_norm=f"{correct_norm / (start + len(chunk)):.4f}", refresh=False)
    bar.close()
    model.train(was_training)
    n = len(mine)
    return {"acc": correct / n if n else math.nan, "acc_norm": correct_norm / n if n else math.nan,
            "correct": correct, "correct_norm": correct_norm, "n": n}


def scoring_tokenizer(meta: dict, what: str) -> GPT2Tokenizer:
    """The model's own byte-level BPE (GPT-2's or one trained here): any text has ids in it."""
    kind = meta.get("kind", "unknown")
    if kind not in ("gpt2", "bpe"):
        raise HellaSwagError(f"{what} uses the '{kind}' tokenizer; HellaSwag is scored on "
                             "byte-level BPE models only (GPT-2's or one trained with "
                             "data/train_tokenizer.py), which can encode any text")
    return from_meta(meta)


class TrainingEval:
    """HellaSwag every train.hellaswag_interval steps. Every rank scores the whole set (FSDP's
    collectives need the same forward calls on all ranks); rank 0 reports it."""

    def __init__(self, cfg: Config, meta: dict, rt: Runtime):
        self.tokenizer = scoring_tokenizer(meta["tokenizer"], f"dataset {meta['dir']}")
        self.interval, self.max_iters = cfg.train.hellaswag_interval, cfg.train.max_iters
        self.examples = load_examples(ensure_file(cfg.data.hellaswag_path),
                                      cfg.train.hellaswag_examples)
        self.rt = rt

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.max_iters

    def run(self, model: torch.nn.Module, step: int) -> dict:
        t0 = time.perf_counter()
        r = evaluate(model, self.tokenizer, self.examples, self.rt.autocast, progress=None)
        print(f"hellaswag {step:5d} | acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | "
              f"{r['n']:,} examples | {time.perf_counter() - t0:.1f}s")
        return {"acc": r["acc"], "acc_norm": r["acc_norm"], "n": r["n"]}


@dataclass
class HellaSwagOptions:
    """Its own options; the rest is the config (--device, --dtype, --attention, ...)."""

    model: str = opt("", "our checkpoint or run directory, or a GPT-2 (gpt2, gpt2-medium, ..., "
                     "hf:ORG/NAME, a local HF directory)")
    data: str = opt("", f"hellaswag_val.jsonl; '' = {DEFAULT_PATH}, downloaded if missing")
    limit: int = opt(0, "score only the first N examples; 0 = all")
    batch_examples: int = opt(4, "examples per forward pass")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, o = load_config(argv, prog="-m engine.hellaswag", script=HellaSwagOptions)
        if not o.model or o.limit < 0 or o.batch_examples < 1:
            raise ConfigError("needs --model X; --limit must be >= 0 and --batch-examples >= 1")
        rt = setup(cfg.system)
        examples = load_examples(ensure_file(o.data), o.limit)
        # a checkpoint keeps its stored switches except those this command line sets
        overrides = {k: getattr(cfg.model, k)
                     for k in command_line_keys(argv, "model", HellaSwagOptions)}
        model, _, meta, _ = sources.load_source(o.model, cfg, rt.device, overrides)
        tokenizer = scoring_tokenizer(meta.get("tokenizer", {}), o.model)
    except (ConfigError, DataError, checkpoint.CheckpointError, SetupError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    r = evaluate(model, tokenizer, examples, rt.autocast, o.batch_examples, progress=True,
                 kv_cache=True)
    note = "" if r["n"] == VAL_EXAMPLES else f" (a subset; the full set has {VAL_EXAMPLES:,})"
    print(f"hellaswag | {o.model} | acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | "
          f"{r['n']:,} examples{note} | {time.perf_counter() - t0:.1f}s on {rt.device}\n"
          f"reference: {REFERENCES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
