"""The fast paths nanoGPT's CPU recipe uses: each equal to its reference (CPU, tiny, no timing)."""
import dataclasses
import math

import torch

from config import load_config
from engine.hf import hf_config
from model import GPT, MLP, ModelConfig


def test_erf_gelu_is_nanogpts_exact_gelu():
    cfg = ModelConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=8, block_size=4,
                      activation="gelu_erf")
    torch.manual_seed(0)
    mlp, x = MLP(cfg), torch.randn(2, 4, 8)
    hidden = mlp.c_fc(x)
    written_out = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    torch.testing.assert_close(mlp(x), mlp.c_proj(written_out), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp(x), mlp.c_proj(torch.nn.GELU()(hidden)), rtol=0, atol=0)
    tanh = MLP(dataclasses.replace(cfg, activation="gelu_tanh", activation_impl="native"))
    tanh.load_state_dict(mlp.state_dict())
    assert not torch.equal(tanh(x), mlp(x))  # a different function: the flag really switches


def test_erf_gelu_exports_as_hf_gelu_and_is_accepted_by_the_config():
    cfg, _ = load_config(["--config", "tiny", "--activation=gelu_erf"])
    assert cfg.model.activation == "gelu_erf"
    assert hf_config(cfg.model)["activation_function"] == "gelu"
    assert hf_config(ModelConfig(vocab_size=11))["activation_function"] == "gelu_new"
    GPT(dataclasses.replace(cfg.model, vocab_size=11))  # builds


def test_side_by_side_reports_the_median_of_per_round_ratios():
    from engine.benchmarks import to_loss

    def run(seconds, step_ms, val):
        return {"seconds": seconds, "step_ms": step_ms, "val": val, "returncode": 0, "tail": ""}

    report = {"hardware": "CPU test", "date": "now", "command": "cmd",
              "programs": {"nanoGPT": {"args": ["--a"]}, "ours": {"args": ["--b"]}},
              "runs": {"nanoGPT": [run(100, 40, 1.9), run(200, 80, 1.9), run(100, 40, 1.9)],
                       "ours": [run(90, 30, 1.8), run(100, 40, 1.8), run(70, 36, 1.8)]}}
    table = to_loss.describe_side_by_side(report)
    ours = next(line for line in table.splitlines() if line.startswith("| ours"))
    assert "| 90.0 / 100.0 / 70.0 | 0.70x |" in ours  # ratios 0.9, 0.5, 0.7
    assert "| 0.75x |" in ours  # step ratios 0.75, 0.5, 0.9


def test_side_by_side_refuses_a_folder_without_nanogpt(tmp_path, capsys):
    import bench

    assert bench.main(["vs-nanogpt", str(tmp_path)]) == 2
    assert "no train.py there; give a nanoGPT checkout" in capsys.readouterr().err


def test_side_by_side_picks_its_programs_and_refuses_unknown_ones(tmp_path, capsys):
    import bench
    from engine.benchmarks import to_loss

    (tmp_path / "train.py").write_text("")
    assert bench.main(["vs-nanogpt", str(tmp_path), "--programs", "fast"]) == 2
    assert ("--programs: unknown fast; choose from every speedup, erf, speedrun"
            in capsys.readouterr().err)
    programs = to_loss.side_programs(to_loss.VsNanoGPTOptions(nanogpt=str(tmp_path)))
    assert programs["ours, speedrun config"][1] == ["--config", "shakespeare_char_speedrun"]
