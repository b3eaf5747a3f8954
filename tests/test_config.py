"""Config loading, overrides, coercion and the errors a user sees."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from config import (CONFIGS_DIR, REPO_ROOT, Config, ConfigError, from_dict, help_text,
                    load_config, opt, validate)

SHIPPED = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def test_expected_configs_ship():
    for name in ("shakespeare_char", "tiny", "gpt2_124m", "gpt2_medium", "gpt2_large", "gpt2_xl"):
        assert name in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_validates(name):
    script = None
    if "[rl]" in (CONFIGS_DIR / f"{name}.toml").read_text():  # rl.py's own table
        from rl import RLOptions as script
    cfg, _ = load_config(["--config", name], script=script)
    assert validate(cfg) == []


def test_default_is_shakespeare_char():
    cfg, _ = load_config([])
    assert cfg.data.dataset == "shakespeare_char"
    assert cfg.train.out_dir == "out/shakespeare_char"


def test_gpt2_architectures():
    shapes = {"gpt2_124m": (12, 12, 768), "gpt2_medium": (24, 16, 1024),
              "gpt2_large": (36, 20, 1280), "gpt2_xl": (48, 25, 1600)}
    for name, (layers, heads, width) in shapes.items():
        m = load_config(["--config", name])[0].model
        assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (layers, heads, width, 1024)


def test_gpt2_124m_recipe():
    t = load_config(["--config", "gpt2_124m"])[0]
    tokens = t.train.batch_size * t.train.grad_accum_steps * t.model.block_size
    assert tokens == 524288  # ~0.5M tokens per step
    assert (t.train.learning_rate, t.train.min_lr_ratio) == (6e-4, 0.1)
    assert (t.train.beta1, t.train.beta2, t.train.weight_decay, t.train.grad_clip) == \
        (0.9, 0.95, 0.1, 1.0)
    assert t.train.lr_schedule == "cosine" and t.train.warmup_iters > 0


def test_overrides_sectioned_bare_and_spaced():
    cfg, _ = load_config(["--config", "tiny", "--model.n_layer=3", "--learning_rate=2e-3",
                          "--batch_size", "5", "--compile=true", "--init-from", "resume",
                          "--top_p=0.5"])
    assert cfg.model.n_layer == 3
    assert cfg.train.learning_rate == 2e-3
    assert cfg.train.batch_size == 5
    assert cfg.system.compile is True
    assert cfg.train.init_from == "resume"
    assert cfg.sample.top_p == 0.5


def test_config_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nn_layer = 7\n[train]\nmax_iters = 3\n")
    cfg, _ = load_config(["--config", str(path)])
    assert cfg.model.n_layer == 7 and cfg.train.max_iters == 3
    # fields not in the file keep the dataclass defaults
    assert cfg.model.n_head == Config().model.n_head


def test_unknown_key_names_source_and_close_match():
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rat' in command line; "
                                          r"did you mean learning_rate"):
        load_config(["--learning_rat=1e-3"])


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nbatch_sise = 4\n[modle]\nn_layer = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(["--config", str(path)])
    msg = str(err.value)
    assert f"unknown key 'train.batch_sise' in {path}; did you mean train.batch_size" in msg
    assert "unknown key 'modle'" in msg and "model" in msg


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(["--learning_rate=-1", "--batch_size=0", "--n_layer=abc",
                     "--attention=fast", "--dropout=1.5"])
    msg = str(err.value)
    assert "train.learning_rate must be > 0, got -1.0" in msg
    assert "train.batch_size must be > 0, got 0" in msg
    assert "model.n_layer (command line): expected an integer, got 'abc'" in msg
    assert "model.attention='fast' is not one of scratch, sdpa" in msg
    assert "model.dropout must be in [0, 1), got 1.5" in msg


def test_wrong_type_bool():
    with pytest.raises(ConfigError, match="system.compile .*expected true/false, got 'maybe'"):
        load_config(["--compile=maybe"])


def test_heads_must_divide_width():
    with pytest.raises(ConfigError, match="n_embd=100 must be divisible by model.n_head=3"):
        load_config(["--n_embd=100", "--n_head=3"])


def test_unknown_config_name_suggests():
    with pytest.raises(ConfigError, match="no config named 'shakespear_char'.*shakespeare_char"):
        load_config(["--config", "shakespear_char"])


def test_missing_value_and_stray_argument():
    with pytest.raises(ConfigError, match="--max_iters needs a value"):
        load_config(["--max_iters"])
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        load_config(["oops"])


def test_round_trip_through_dict():
    cfg, _ = load_config(["--config", "gpt2_124m", "--dropout=0.1", "--top_k=5"])
    assert from_dict(cfg.to_dict()) == cfg


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def value_of(text: str, key: str) -> str:
    """The value the help shows for a dotted key, e.g. value_of(text, 'model.n_layer') -> '4'."""
    match = re.search(rf"--{re.escape(key)}=(\S+)", text)
    assert match, f"{key} missing from help"
    return match.group(1)


def test_train_help_shows_the_default_configs_values():
    result = run_script("train.py", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "shakespeare_char" in text.split("[model]")[0]  # the header names the config
    assert value_of(text, "model.n_layer") == "4"
    assert value_of(text, "model.block_size") == "128"
    assert value_of(text, "train.learning_rate") == "0.004"
    n_layer_line = next(line for line in text.splitlines() if "--model.n_layer=" in line)
    assert "default 6" in n_layer_line  # marked as differing from the dataclass default
    bias_line = next(line for line in text.splitlines() if "--model.bias=" in line)
    assert "default" not in bias_line  # unchanged values carry no mark
    assert "--estimate-memory" in text


def test_train_help_for_another_config():
    result = run_script("train.py", "--config", "gpt2_124m", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "gpt2_124m" in text.split("[model]")[0]
    assert value_of(text, "model.n_layer") == "12"
    assert value_of(text, "model.block_size") == "1024"
    assert value_of(text, "model.vocab_size") == "50257"


def test_generate_help_leads_with_sample_keys():
    result = run_script("generate.py", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "shakespeare_char" in text.split("[sample]")[0]
    sample_keys = [text.index(f"--sample.{k}=") for k in
                   ("prompt", "checkpoint", "max_new_tokens", "temperature", "top_k", "top_p",
                    "kv_cache")]
    later = [text.index(f"--{k}=") for k in ("model.n_layer", "model.attention",
                                             "train.out_dir", "system.device")]
    assert max(sample_keys) < min(later)
    assert text.index("--init-from") < min(sample_keys)
    assert value_of(text, "model.n_layer") == "4"


def test_help_reflects_overrides_and_marks_where_set():
    text = help_text("train.py", ["--config", "tiny", "--n_layer=3", "--top_k", "7"])
    assert "tiny" in text.split("[model]")[0]
    lines = text.splitlines()
    n_layer = next(line for line in lines if "--model.n_layer=" in line)
    n_head = next(line for line in lines if "--model.n_head=" in line)
    assert value_of(text, "model.n_layer") == "3" and "command line" in n_layer
    assert value_of(text, "model.n_head") == "2" and "config tiny" in n_head
    assert value_of(text, "sample.top_k") == "7"


@dataclass
class Options:
    estimate_memory: bool = opt(False, "estimate")
    init_from: str = opt("", "where to start")
    runs: int = opt(3, "how many")


def test_help_from_load_config_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_config(["--config", "tiny", "-h"], script=Options)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert value_of(out, "model.n_layer") == "2" and "--estimate-memory=False" in out
    assert out.index("--runs=3") < out.index("[model]")  # the script's options lead


def test_script_options_are_parsed_typed_and_win_over_config_keys():
    cfg, options = load_config(["--config", "tiny", "--estimate-memory", "--init-from", "gpt2",
                                "--runs=5", "--train.init_from=resume", "--n_layer", "3"],
                               script=Options)
    assert (options.estimate_memory, options.init_from, options.runs) == (True, "gpt2", 5)
    assert cfg.train.init_from == "resume" and cfg.model.n_layer == 3
    with pytest.raises(ConfigError, match="--runs: expected an integer, got 'many'"):
        load_config(["--runs=many"], script=Options)
    _, options = load_config(["--estimate-memory", "false"], script=Options)
    assert options.estimate_memory is False


def test_help_with_a_bad_config_reports_the_error():
    with pytest.raises(ConfigError, match="did you mean n_layer"):
        load_config(["--config", "tiny", "--n_layr=3", "--help"])
    with pytest.raises(ConfigError, match="no config named 'nope'"):
        load_config(["--help", "--config", "nope"])
    result = run_script("train.py", "--help", "--n_layer=0")
    assert result.returncode == 2
    assert "model.n_layer must be > 0" in result.stderr and "[model]" not in result.stdout


def test_help_lead_must_name_sections():
    with pytest.raises(ValueError, match="unknown sections"):
        help_text("generate.py", lead=("sampling",))

@pytest.mark.parametrize("stored,activation,impl", [("scratch", "gelu_tanh", "scratch"),
                                                    ("native", "gelu_tanh", "native"),
                                                    ("erf", "gelu_erf", "scratch")])
def test_a_checkpoint_from_before_model_activation_keeps_its_gelu(stored, activation, impl):
    """Stored configs held one field, model.gelu, for which GELU and how it was computed."""
    cfg = from_dict({"model": {"gelu": stored, "n_layer": 2}})
    assert (cfg.model.activation, cfg.model.activation_impl, cfg.model.n_layer) == (
        activation, impl, 2)
