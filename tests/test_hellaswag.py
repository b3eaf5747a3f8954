"""HellaSwag scoring: examples in the official format, written by the tests."""
from __future__ import annotations

import json
import math

import pytest
import torch

from config import Config
from conftest import tiny_model_config
from data.bpe import GPT2Tokenizer
from engine import hellaswag, saving, sources
from engine.evaluation.scoring import choice_logprobs
from model import GPT

TOK = GPT2Tokenizer()


def official(ind: int, ctx_a: str, ctx_b: str, endings: list[str], label: int) -> dict:
    """One line of hellaswag_val.jsonl, every field the official file has."""
    return {"ind": ind, "activity_label": "Removing ice from car", "ctx_a": ctx_a,
            "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}".strip(), "split": "val",
            "split_type": "indomain", "label": label, "endings": endings,
            "source_id": f"activitynet~v_{ind}"}


EXAMPLES = [
    # the long ending is made of favoured tokens: lowest loss per token, not in total
    official(0, "A man is sitting on a roof.", "he", ["starts pulling up roofing on a roof.",
             "is", "is ripping level tiles off.", "is holding a rubik's cube."], 0),
    official(1, "A woman sits at a piano.", "She", ["sets her fingers on the keys.",
             "plays", "eats the piano.", "walks away from the piano slowly."], 1),
    official(2, "Then, the man writes over the snow.", "then", ["the man adds wax.",
             "a person boards a ski lift.", "the man", "the snow melts."], 3),
]
FAVOURED = set(TOK.encode_ordinary(" starts pulling up roofing on a roof.")) | \
    set(TOK.encode_ordinary(" he"))  # includes the context's last token: misaligned masks show


class Unigram(torch.nn.Module):
    """A 'model' whose next-token distribution ignores the context: logit `boost` for the
    favoured tokens, 0 for every other token. Its losses can be written down by hand."""

    def __init__(self, boost: float = 6.0, block_size: int = 64):
        super().__init__()
        self.config = tiny_model_config(block_size=block_size, vocab_size=TOK.vocab_size)
        logits = torch.zeros(TOK.vocab_size)
        logits[sorted(FAVOURED)] = boost
        self.register_buffer("logits", logits)

    def forward(self, idx, targets=None):
        return self.logits.expand(*idx.shape, -1), None


def hand_losses(boost: float, ending: str) -> tuple[float, int]:
    """-log p summed over the ending's tokens: log Z - boost for a favoured token, log Z else."""
    tokens = TOK.encode_ordinary(" " + ending)
    log_z = math.log(TOK.vocab_size - len(FAVOURED) + len(FAVOURED) * math.exp(boost))
    return sum(log_z - (boost if t in FAVOURED else 0.0) for t in tokens), len(tokens)


def test_scores_match_hand_computation():
    boost = 6.0
    model = Unigram(boost)
    expected_acc = expected_norm = 0
    for ex in EXAMPLES:
        scores = choice_logprobs(model, hellaswag.requests([ex], TOK), kv_cache=False)[0]
        by_hand = [hand_losses(boost, e) for e in ex["endings"]]
        assert [-lp for lp, _ in scores] == pytest.approx([s for s, _ in by_hand], rel=1e-4)
        assert [n for _, n in scores] == [n for _, n in by_hand]
        expected_acc += min(range(4), key=lambda i: by_hand[i][0]) == ex["label"]
        expected_norm += min(range(4), key=lambda i: by_hand[i][0] / by_hand[i][1]) == ex["label"]
    # by construction: example 0 is right only length-normalised, 1 only by total, 2 by neither
    assert (expected_acc, expected_norm) == (1, 1)
    result = hellaswag.evaluate(model, TOK, EXAMPLES, batch_examples=2)
    assert result == {"acc": 1 / 3, "acc_norm": 1 / 3, "correct": 1, "correct_norm": 1, "n": 3}
    first = hellaswag.evaluate(model, TOK, EXAMPLES[:1])
    assert (first["acc"], first["acc_norm"]) == (0.0, 1.0)


def reference_losses(model: GPT, ex: dict) -> list[float]:
    """Each ending scored alone, no padding, no batching: its last block_size - 1 tokens at most
    (so at least one context token comes before it), after as much context as fits."""
    ctx, block = TOK.encode_ordinary(ex["ctx"]), model.config.block_size
    out = []
    for ending in ex["endings"]:
        end = TOK.encode_ordinary(" " + ending)[-(block - 1):]
        row = torch.tensor([(ctx + end)[-(block + 1):]])
        logits, _ = model(row[:, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1)[0]
        targets = row[0, 1:]
        out.append(-logp[torch.arange(len(targets)), targets][-len(end):].sum().item())
    return out


@pytest.mark.parametrize("block_size", [64, 9])  # 9: contexts are cropped on the left
@pytest.mark.parametrize("kv_cache", [False, True])
def test_batched_padded_scoring_equals_one_at_a_time(block_size, kv_cache):
    model = GPT(tiny_model_config(block_size=block_size, vocab_size=TOK.vocab_size)).eval()
    scores = choice_logprobs(model, hellaswag.requests(EXAMPLES, TOK), 8, kv_cache)
    for ex, endings in zip(EXAMPLES, scores):
        assert [-lp for lp, _ in endings] == pytest.approx(reference_losses(model, ex), abs=1e-4)
    one = hellaswag.evaluate(model, TOK, EXAMPLES, batch_examples=1, kv_cache=kv_cache)
    many = hellaswag.evaluate(model, TOK, EXAMPLES, batch_examples=2, kv_cache=kv_cache)
    assert one == many and model.training is False
    halves = [hellaswag.evaluate(model, TOK, EXAMPLES, rank=r, world_size=2) for r in (0, 1)]
    assert [h["n"] for h in halves] == [2, 1]
    assert sum(h["correct_norm"] for h in halves) == one["correct_norm"]


@pytest.fixture
def val_file(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    return path


def test_reading_the_official_format(val_file, tmp_path):
    examples = hellaswag.load_examples(val_file)
    assert [e["label"] for e in examples] == [0, 1, 3] and examples[1]["ctx"] == \
        "A woman sits at a piano. She"
    assert len(hellaswag.load_examples(val_file, limit=2)) == 2
    assert hellaswag.ensure_file(val_file) == val_file
    bad = {"three endings": dict(EXAMPLES[0], endings=["a", "b", "c"]),
           "label 7": dict(EXAMPLES[0], label=7), "no ctx": {"endings": ["a"] * 4, "label": 0}}
    messages = {"three endings": "'endings' a list of 4 texts",
                "label 7": "label 7 is not 0, 1, 2 or 3", "no ctx": "needs 'ctx', 'endings'"}
    for name, ex in bad.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(EXAMPLES[1]) + "\n" + json.dumps(ex) + "\n")
        with pytest.raises(hellaswag.HellaSwagError, match=f":2: .*{messages[name]}"):
            hellaswag.load_examples(path)
    (tmp_path / "html.jsonl").write_text("<html>\n")
    with pytest.raises(hellaswag.HellaSwagError, match=":1: not a JSON line"):
        hellaswag.load_examples(tmp_path / "html.jsonl")
    with pytest.raises(hellaswag.HellaSwagError, match="nope.jsonl not found"):
        hellaswag.ensure_file(tmp_path / "nope.jsonl")


def save_tiny(out, tokenizer: dict, vocab_size: int) -> None:
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=vocab_size, block_size=32)
    saving.save(out, 1, GPT(cfg.model), cfg, {"tokenizer": tokenizer})


def test_command_line_on_our_checkpoints(val_file, tmp_path, capsys):
    save_tiny(tmp_path / "gpt2run", {"kind": "gpt2"}, TOK.vocab_size)
    code = hellaswag.main(["--model", str(tmp_path / "gpt2run"), "--data", str(val_file),
                           "--device", "cpu", "--attention", "sdpa"])
    out, err = capsys.readouterr()
    assert code == 0 and "| 3 examples (a subset; the full set has 10,042)" in out
    assert "acc_norm 0." in out and "reference: GPT-2 124M acc_norm 0.2955" in out
    bar = err.replace("\r", "\n").splitlines()[-1]  # the progress bar's last state, with its ETA
    assert bar.startswith("hellaswag: 100%") and "3/3 [" in bar and "<00:00" in bar, err
    assert "acc_norm=0." in bar
    save_tiny(tmp_path / "charrun", {"kind": "char", "chars": list("abc")}, 3)
    code = hellaswag.main(["--model", str(tmp_path / "charrun"), "--data", str(val_file),
                           "--device", "cpu"])
    assert code == 2 and "uses the 'char' tokenizer; HellaSwag is scored on byte-level BPE models" \
        in capsys.readouterr().err


def test_checkpoints_and_hf_directories_load_through_sources(val_file, tmp_path, capsys):
    from config import Config
    from engine import hf
    save_tiny(tmp_path / "ours", {"kind": "gpt2"}, TOK.vocab_size)
    ours, _, meta, _ = sources.load_source(str(tmp_path / "ours"), Config(), "cpu")
    hf.export_hf(ours, meta, tmp_path / "hf")  # a Hugging Face GPT-2 dir
    theirs, _, hf_meta, _ = sources.load_source(str(tmp_path / "hf"), Config(), "cpu",
                                               {"attention": "sdpa"})
    assert meta["tokenizer"] == hf_meta["tokenizer"] == {"kind": "gpt2"}
    assert ours.config.attention == "scratch" and theirs.config.attention == "sdpa"
    request = hellaswag.requests(EXAMPLES[:1], TOK)
    ours_scores, theirs_scores = (choice_logprobs(m, request)[0] for m in (ours, theirs))
    assert [lp for lp, _ in ours_scores] == pytest.approx([lp for lp, _ in theirs_scores],
                                                          abs=1e-4)
    assert hellaswag.main(["--model", str(tmp_path / "hf"), "--data", str(val_file),
                           "--device", "cpu", "--limit", "2"]) == 0
    assert "| 2 examples (a subset" in capsys.readouterr().out
