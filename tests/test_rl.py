"""rl.py and engine/rl/: GRPO's loss against its formula written out and against TRL's on the
same tiny batch; advantages; the sampler's log-probabilities against the training forward's
(no off-policy gap before an update); then rl.py end to end on a tiny chat model: exact resume,
LoRA, the KL penalty's reference, the wall budget, the NaN guard, a failing checker's one line,
the [rl] table and --help."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import eval as eval_script
import rl
from config import Config, ConfigError, load_config
from conftest import tiny_model_config
from data.chat_template import ChatTemplate
from data.tokenizer import CharTokenizer
from engine import checkpoint, saving
from engine.evaluation.tasks import Task
from engine.rl import grpo
from engine.rl.rollout import PromptOrder, RolloutSettings, rollout
from engine.rl.update import row_logprobs
from model import GPT

ROOT = Path(__file__).resolve().parents[1]
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?'\n"))
WORDS = ["apple", "bread", "cider", "dough", "eagle", "fable", "grape", "honey", "igloo", "jolly",
         "karma", "lemon", "mango", "noble", "olive", "pearl", "quilt", "raven", "salad", "tiger",
         "ultra", "vivid", "whale", "xenon", "yacht", "zebra", "amber", "brick", "coral", "daisy"]


def tiny_batch(seed: int = 0, rows: int = 6, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=g) * 3
    old = logp + torch.randn(rows, width, generator=g) * 0.3  # ratios far from 1: clipping acts
    ref = logp + torch.randn(rows, width, generator=g) * 0.2
    mask = torch.rand(rows, width, generator=g) > 0.3
    mask[0] = False  # a row with no completion token
    mask[1, 0] = True
    adv = torch.randn(rows, generator=g)
    return logp, old, ref, mask, adv


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_loss_equals_the_formula_written_out(normalize):
    logp, old, ref, mask, adv = tiny_batch()
    eps, beta = 0.2, 0.05
    per_row, clipped, count = [], 0, 0
    for b in range(logp.size(0)):
        terms = []
        for t in range(logp.size(1)):
            if not mask[b, t]:
                continue
            ratio = math.exp(logp[b, t] - old[b, t])
            a = float(adv[b])
            clip = min(max(ratio, 1 - eps), 1 + eps)
            d = float(ref[b, t] - logp[b, t])
            terms.append(-min(ratio * a, clip * a) + beta * (math.exp(d) - d - 1))
            clipped += (ratio < 1 - eps and a < 0) or (ratio > 1 + eps and a > 0)
            count += 1
        per_row.append(terms)
    if normalize == "token":
        expected = sum(map(sum, per_row)) / count
    else:
        expected = sum(sum(t) / max(1, len(t)) for t in per_row) / len(per_row)
    loss, stats = grpo.policy_loss(logp, old, adv, mask, eps, beta, ref, normalize)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["clipped"].item() == clipped > 0 and stats["tokens"].item() == count
    # split into micro-batches dividing by the whole batch's count: the same sum
    total = count if normalize == "token" else logp.size(0)
    parts = sum(grpo.policy_loss(logp[s], old[s], adv[s], mask[s], eps, beta, ref[s], normalize,
                                 total)[0] for s in (slice(0, 2), slice(2, None)))
    assert parts.item() == pytest.approx(expected, rel=1e-5)


def test_group_advantages_are_relative_to_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    centred = grpo.group_advantages(rewards, scale_by_std=False)
    assert centred.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.75, -0.25, -0.25, -0.25]]
    scaled = grpo.group_advantages(rewards)
    std = math.sqrt(sum((r - 0.25) ** 2 for r in (1, 0, 0, 0)) / 3)  # Bessel's, as TRL's
    assert scaled[2, 0].item() == pytest.approx(0.75 / (std + 1e-4))
    assert scaled[1].tolist() == [0.0] * 4  # all alike: no signal, no division by zero


@pytest.mark.parametrize("normalize,theirs", [("token", "bnpo"), ("token", "dapo"),
                                              ("sequence", "grpo")])
def test_loss_equals_trls_grpo_loss_on_the_same_batch(normalize, theirs):
    """TRL's GRPOTrainer._compute_loss run on the same log-probabilities (its model forward
    replaced by them): the loss, the clipped share and the KL match."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
    from collections import defaultdict

    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd

    logp, old, ref, mask, adv = tiny_batch(seed=3)
    eps, beta = 0.2, 0.04
    same = lambda x, **_: x  # noqa: E731 - one process: gathers and reductions are identity
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=theirs, epsilon_low=eps, epsilon_high=eps, use_vllm=False,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        model=SimpleNamespace(training=False), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=SimpleNamespace(gather=same, reduce=same, num_processes=1),
        _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": torch.zeros(6, 2, dtype=torch.long), "prompt_mask": torch.ones(6, 2),
              "completion_ids": torch.zeros(6, 7, dtype=torch.long),
              "completion_mask": mask.float(), "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum().float()}
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    ours, stats = grpo.policy_loss(logp, old, adv, mask, eps, beta, ref, normalize)
    assert ours.item() == pytest.approx(loss.item(), rel=1e-5)
    metrics = stub._metrics["eval"]
    tokens = stats["tokens"].item()
    assert stats["clipped"].item() / tokens == pytest.approx(metrics["clip_ratio/region_mean"][0])
    assert stats["kl"].item() / tokens == pytest.approx(metrics["kl"][0], rel=1e-5)
    rewards = torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    expected = (rewards - rewards.mean(1, keepdim=True)) / (nanstd(rewards, dim=1)[:, None] + 1e-4)
    torch.testing.assert_close(grpo.group_advantages(rewards), expected)


def tiny_chat_model(seed: int = 0) -> tuple[GPT, CharTokenizer]:
    tok = CharTokenizer(CHARS, eot=True)
    torch.manual_seed(seed)
    model = GPT(tiny_model_config(vocab_size=tok.vocab_size, block_size=64, n_embd=32)).eval()
    return model, tok


def test_the_samplers_logprobs_are_the_training_forwards():
    """Before any update the policy that sampled and the one the loss reads are the same: the
    log-probabilities recorded while sampling over the KV cache equal a whole-row forward's."""
    model, tok = tiny_chat_model()
    task = Task("reverse", "generate", [{"prompt": f"Reverse the word: {w}", "answer": w[::-1]}
                                        for w in WORDS[:8]], shots=1)
    for temperature in (1.0, 0.7):
        s = RolloutSettings(group_size=4, max_new_tokens=10, temperature=temperature,
                            shots=1, scale_by_std=True, seed=0, batch_rows=6)
        batch = rollout(model, tok, ChatTemplate(), task, [0, 3, 5], s,
                        torch.Generator().manual_seed(1))
        assert batch.ids.size(0) == 12 and batch.rewards.shape == (3, 4)
        assert batch.mask.sum().item() == sum(batch.lengths)
        with torch.no_grad():
            logp = row_logprobs(model, batch.ids, temperature)
        gap = (logp - batch.old_logp)[batch.mask].abs().max().item()
        assert gap < 1e-5, gap
        _, stats = grpo.policy_loss(logp, batch.old_logp, batch.advantages, batch.mask)
        assert stats["clipped"].item() == 0


def test_prompt_order_is_a_seeded_shuffle_each_pass_and_resumes_exactly():
    whole = PromptOrder(10, seed=4)
    seen = [whole.take(4) for _ in range(5)]  # 20 draws: two passes
    firsts = sorted(i for s in seen for i in s)
    assert firsts == sorted(list(range(10)) * 2)
    again = PromptOrder(10, seed=4)
    again.take(4)
    resumed = PromptOrder(10, 4, **again.state_dict())
    assert [resumed.take(4) for _ in range(4)] == seen[1:]


# rl.py end to end, on a tiny random chat model and a task whose checker rewards vowels


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny chat checkpoint, a task file (its checker: a completion's share of vowels, a reward a
    random model earns in part) and where to write runs."""
    root = tmp_path_factory.mktemp("rl")
    model, tok = tiny_chat_model(seed=2)
    cfg = Config()
    cfg.model = model.config
    ckpt = saving.save(root / "start", 5, model, cfg,
                       {"tokenizer": tok.meta(), "template": ChatTemplate().meta()})
    (root / "rewards.py").write_text(
        "import os\n"
        "def length(problem, completion):\n"
        "    if os.environ.get('RL_TEST_BOOM'):\n"
        "        raise ValueError('boom')\n"
        "    return sum(c in 'aeiou' for c in completion) / max(1, len(completion))\n")
    lines = [{"task": {"name": "long", "checker": "rewards.py:length", "max_new_tokens": 8}}]
    lines += [{"prompt": f"Say {w}", "answer": w} for w in WORDS]
    (root / "long.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, ckpt


def run_rl(root: Path, *args: str) -> int:
    return rl.main(["--task", "long.jsonl", "--eval_task", "long.jsonl", "--eval_problems=6",
                    "--group_size=4", "--prompts_per_step=3", "--temperature=1.0",
                    "--threads=1", "--optimizer=adamw", "--learning_rate=3e-3", "--warmup_iters=0",
                    "--lr_schedule=constant", "--log_interval=1", "--eval_interval=2",
                    "--wandb.enabled=false", *args])


def weights(ckpt: Path) -> dict:
    name = "adapter.safetensors" if (ckpt / "adapter.safetensors").is_file() else \
        "model.safetensors"
    return load_file(str(ckpt / name))


def records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_rl_runs_and_resumes_exactly(start, monkeypatch, capsys):
    root, ckpt = start
    monkeypatch.chdir(root)
    twice = "--updates_per_batch=2"  # the second update on a batch: ratios off 1, clipped
    assert run_rl(root, f"--init_from={ckpt}", "--out_dir=whole", "--max_iters=4", twice) == 0
    assert run_rl(root, f"--init_from={ckpt}", "--out_dir=parts", "--max_iters=2", twice) == 0
    assert run_rl(root, "--init_from=resume", "--out_dir=parts", "--max_iters=4", twice) == 0
    out = capsys.readouterr().out
    assert "resumed" in out and "held-out pass@1" in out
    a, b = (checkpoint.latest_checkpoint(root / d) for d in ("whole", "parts"))
    assert a.name == b.name == "ckpt_0000004"
    for name, tensor in weights(a).items():
        assert torch.equal(tensor, weights(b)[name]), name
    assert not all(torch.equal(t, weights(ckpt)[n]) for n, t in weights(a).items())
    ra, rb = records(root / "whole", "train"), records(root / "parts", "train")
    assert [r["reward"] for r in ra] == [r["reward"] for r in rb] and len(ra) == 4
    assert any(r["clip_frac"] > 0 for r in ra)
    first = ra[0]
    for key in ("reward", "pass_rate", "length", "clip_frac", "sample_tok_s", "update_tok_s",
                "loss", "norm", "lr"):
        assert math.isfinite(first[key]), key
    meta = json.loads((a / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "char" and meta["template"]["name"] == "chat"
    assert meta["rl"]["start"] == str(ckpt) and meta["rl"]["last_eval"]["step"] == 4
    summary = json.loads((root / "whole" / "summary.json").read_text())
    assert summary["stop_reason"] == "done" and [e["step"] for e in summary["evals"]] == [0, 2, 4]
    # the checkpoint is a model eval.py reads like any other
    assert eval_script.main(["--checkpoint", str(a), "--tasks", "long.jsonl", "--limit=3",
                             "--threads=1"]) == 0


def test_lora_trains_only_adapters_and_the_kl_reference_starts_at_zero(start, monkeypatch):
    root, ckpt = start
    monkeypatch.chdir(root)
    assert run_rl(root, f"--init_from={ckpt}", "--out_dir=lora", "--max_iters=2",
                  "--lora.rank=4", "--kl_coef=0.1") == 0
    done = checkpoint.latest_checkpoint(root / "lora")
    assert set(weights(done)) and all("lora_" in n for n in weights(done))
    meta = json.loads((done / "meta.json").read_text())
    assert meta["lora"]["base"] == str(ckpt)
    steps = records(root / "lora", "train")
    assert steps[0]["kl"] < 1e-6  # the first update's model is the reference itself
    assert steps[1]["kl"] > 0  # after it they differ
    assert eval_script.main(["--checkpoint", str(done), "--tasks", "long.jsonl", "--limit=2",
                             "--threads=1"]) == 0


def test_the_budget_the_nan_guard_and_a_failing_checker(start, monkeypatch, capsys):
    root, ckpt = start
    monkeypatch.chdir(root)
    assert run_rl(root, f"--init_from={ckpt}", "--out_dir=budget", "--max_iters=50",
                  "--max_seconds=1e-9") == 0
    summary = json.loads((root / "budget" / "summary.json").read_text())
    assert summary["stop_reason"] == "max_seconds" and summary["step"] == 1
    monkeypatch.setenv("RL_TEST_BOOM", "1")  # the checker now raises: one line, no traceback
    assert run_rl(root, "--init_from=resume", "--out_dir=budget", "--max_iters=50") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: task long, long.jsonl:") and "ValueError: boom" in err[-1]
    assert checkpoint.latest_checkpoint(root / "budget").name == "ckpt_0000001"  # intact
    monkeypatch.delenv("RL_TEST_BOOM")
    nan = lambda *a, **k: (torch.tensor(math.nan, requires_grad=True), {  # noqa: E731
        "clipped": torch.tensor(0.0), "kl": torch.tensor(0.0), "tokens": torch.tensor(1.0)})
    monkeypatch.setattr("engine.rl.update.policy_loss", nan)
    assert run_rl(root, f"--init_from={ckpt}", "--out_dir=nan", "--max_iters=9",
                  "--max_nonfinite_steps=2") == 3
    assert "NaN/inf" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(root / "nan") is None


def test_the_rl_table_of_a_config_and_bad_options(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[rl]\ngroup_size = 4\ntask = "sort"\n[train]\nlearning_rate = 1e-5\n')
    cfg, o = load_config(["--config", str(path), "--group_size=6"], script=rl.RLOptions)
    assert (o.group_size, o.task, cfg.train.learning_rate) == (6, "sort", 1e-5)
    path.write_text('[rl]\ngroup_sise = 4\n')
    with pytest.raises(ConfigError, match="unknown key 'rl.group_sise'.*group_size"):
        load_config(["--config", str(path)], script=rl.RLOptions)
    with pytest.raises(ConfigError, match="--group-size must be >= 2, got 1"):
        load_config(["--group_size=1"], script=rl.RLOptions)
    assert rl.main(["--init_from=scratch", f"--out_dir={tmp_path / 'x'}"]) == 2


def test_help_lists_the_options_without_torch():
    code = ("import runpy, sys; sys.argv = ['rl.py', '--help']\n"
            "try:\n    runpy.run_path('rl.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "--group-size" in out and "--kl-coef" in out and out.strip().endswith("False")


def test_bench_rl_pairs_each_runs_held_out_answers_and_pools_the_seeds(tmp_path):
    """bench.py rl's page from finished runs' summaries (the runs themselves are rl.py's, above):
    a row per run with its paired gain, and the seeds pooled."""
    from engine.benchmarks import rl as bench_rl
    from engine.evaluation.stats import paired_difference

    before = [1.0] * 5 + [0.0] * 15
    runs = {("full", 0): [1.0] * 9 + [0.0] * 11, ("full", 1): [1.0] * 5 + [0.0] * 10 + [1.0] * 5,
            ("lora", 0): [0.0] * 20}
    plan = []
    for (mode, seed), after in runs.items():
        out = tmp_path / f"rl_{mode}_{seed}"
        out.mkdir()
        evals = [{"step": s, "pass@1": sum(v) / 20, "ci95": [0.1, 0.5], "per_problem": v,
                  "sampled_pass@1": 0.1, "sampled_per_problem": [0.1] * 20}
                 for s, v in ((0, before), (100, after))]
        (out / "summary.json").write_text(json.dumps({
            "stop_reason": "max_seconds", "steps": 100, "seconds": 60.0, "sample_seconds": 15.0,
            "first_eval": evals[0], "last_eval": evals[1], "evals": evals}))
        plan.append((mode, seed, out))
    (tmp_path / "rl_lora_1").mkdir()  # a run not finished: left out, not an error
    plan.append(("lora", 1, tmp_path / "rl_lora_1"))
    o = bench_rl.RLBenchOptions(results=str(tmp_path / "results"), name="t")
    bench_rl.report(o, plan, Path("out/sft"), "python bench.py rl")
    page = (tmp_path / "results" / "rl_reverse_t.md").read_text()
    assert "| full | 0 | 100 | 60 | 25.0% | 25.0% [10.0%, 50.0%] | 45.0% [10.0%, 50.0%] | " \
        f"{bench_rl.span(paired_difference(before, runs[('full', 0)]))} |" in page
    pooled = paired_difference(before * 2, runs[("full", 0)] + runs[("full", 1)])
    assert f"| full | 2 | {bench_rl.span(pooled)} |" in page
    assert "| lora | 1 | -25.0 [" in page  # a loss is reported as one
    record = json.loads((tmp_path / "results" / "rl_reverse_t.json").read_text())
    assert len(record["rows"]) == 3


def test_paired_difference_against_its_definition():
    from engine.evaluation.stats import Z95, paired_difference

    mean, low, high = paired_difference([0, 1, 1], [1, 1, 1])
    half = Z95 * math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) / math.sqrt(3)
    assert (mean, low, high) == pytest.approx((1 / 3, 1 / 3 - half, 1 / 3 + half))
    assert paired_difference([1, 0], [1, 0]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_difference([1], [1, 0])
