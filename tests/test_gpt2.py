"""GPT-2 in and out: the offline tokenizer, Hugging Face GPT-2 -> our model (parity with
transformers' GPT2LMHeadModel on tiny random configs built here, no download), the padded
vocabulary, export and round trip, greedy generation, finetuning from a HF directory."""
from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

import generate
import load_gpt2_weights
import train
from config import ConfigError, ModelConfig, load_config
from data.loader import DataError
from data.bpe import GPT2_RANKS, GPT2Tokenizer
from data.tokenizer import TokenizerError
from engine import hf as gpt2
from engine import loading
from engine.training import build
from model import ACTIVATIONS

# Odd head counts, n_positions != 1024, vocabularies that are not multiples of 64.
SHAPES = {
    "3heads": dict(n_layer=2, n_head=3, n_embd=24, n_positions=37, vocab_size=101),
    "5heads": dict(n_layer=3, n_head=5, n_embd=40, n_positions=50, vocab_size=250,
                   layer_norm_epsilon=1e-6),
    "gpt2vocab": dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257),
}
IMPLS = {  # the reference path, and every fast switch at once
    "reference": dict(attention="scratch", causal_mask="buffer", norm="scratch",
                      activation_impl="scratch"),
    "fast": dict(attention="sdpa", causal_mask="on_the_fly", norm="native",
                 activation_impl="native"),
}


def random_hf_model(seed: int, **shape) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with every tensor random (biases and LayerNorm gains too), so a wrong
    transpose or a swapped name cannot go unnoticed."""
    eot = 50256 if shape["vocab_size"] == 50257 else None
    config = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eot, eos_token_id=eot)
    model = GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
            p.copy_(float(gain) + 0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[Path, GPT2LMHeadModel]]:
    out = {}
    for seed, (name, shape) in enumerate(SHAPES.items()):
        model = random_hf_model(seed, **shape)
        path = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def ids_for(vocab_size: int, B: int = 2, T: int = 20, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No sockets, and tiktoken's cache in a fresh folder so the ranks file itself is read."""
    def refuse(*args, **kwargs):
        raise OSError("network access in a test")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))


def test_tokenizer_known_ids_offline(offline):
    tok = GPT2Tokenizer()
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303,
                                                          2746, 11]
    assert tok.encode("<|endoftext|>") == [50256] and tok.eot_id == 50256
    assert 50256 not in tok.encode_ordinary("<|endoftext|>")  # data text stays text
    text = "naïve café ☃ 日本 \n\n  spaces\t"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_refuses_tampered_ranks(offline, tmp_path):
    lines = GPT2_RANKS.read_bytes().splitlines(keepends=True)
    token_a, rank_a = lines[300].split()
    token_b, rank_b = lines[301].split()
    lines[300], lines[301] = token_a + b" " + rank_b + b"\n", token_b + b" " + rank_a + b"\n"
    tampered = tmp_path / "gpt2.tiktoken"
    tampered.write_bytes(b"".join(lines))
    with pytest.raises(TokenizerError, match="failed its hash check"):
        GPT2Tokenizer(tampered)


def test_shakespeare_gpt2_prepare(offline, tmp_path):
    from data.shakespeare.prepare import prepare
    source = tmp_path / "text.txt"
    text = Path("data/tinyshakespeare.txt").read_text(encoding="utf-8")[:20000]
    source.write_text(text, encoding="utf-8")
    meta = prepare(out_dir=tmp_path / "ds", source=source)
    assert meta["tokenizer"] == {"kind": "gpt2"} and meta["vocab_size"] == 50257
    assert meta["dtype"] == "uint16"
    tok = GPT2Tokenizer()
    ids = [np.fromfile(tmp_path / "ds" / f"{s}.bin", dtype=np.uint16).tolist()
           for s in ("train", "val")]
    assert tok.decode(ids[0]) + tok.decode(ids[1]) == text
    assert meta["splits"] == {"train": len(ids[0]), "val": len(ids[1])}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pad", [1, 64])
@pytest.mark.parametrize("shape", ["3heads", "5heads"])
def test_logits_and_loss_match_transformers(hf_dirs, shape, pad, impl):
    path, hf_model = hf_dirs[shape]
    model, _ = gpt2.load_hf(str(path), ModelConfig(vocab_pad_multiple=pad, **IMPLS[impl]))
    model.eval()
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == tuple(
        SHAPES[shape][k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"))
    assert cfg.layer_norm_eps == SHAPES[shape].get("layer_norm_epsilon", 1e-5)
    assert model.padded_vocab == (cfg.vocab_size if pad == 1 else
                                  -(-cfg.vocab_size // 64) * 64)
    ids = ids_for(cfg.vocab_size, T=cfg.block_size)  # the full context
    with torch.no_grad():
        expected = hf_model(ids, labels=ids)
        logits, loss = model(ids[:, :-1], ids[:, 1:])
        full, _ = model(ids)
    assert full.shape == expected.logits.shape  # the real vocabulary only
    torch.testing.assert_close(full, expected.logits, rtol=0, atol=1e-5)
    assert loss.item() == pytest.approx(expected.loss.item(), abs=1e-5)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu_erf", "relu2"])
def test_each_activation_exports_to_and_imports_from_transformers(activation, tmp_path):
    """model.activation=X: exported under X's GPT2Config name, transformers computes the same
    logits (1e-5), and importing the export gives X back."""
    from model import GPT
    torch.manual_seed(0)
    model = GPT(ModelConfig(block_size=16, vocab_size=70, n_layer=2, n_head=2, n_embd=16,
                            activation=activation)).eval()
    gpt2.write_hf_dir(model, tmp_path, tokenizer=None)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert reloaded.config.activation_function == ACTIVATIONS[activation].hf_names[0]
    ids = ids_for(70, T=16)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids)[0], rtol=0, atol=1e-5)
    back, _ = gpt2.load_hf(str(tmp_path))
    assert back.config.activation == activation


def test_padded_rows_never_win(hf_dirs):
    path, hf_model = hf_dirs["3heads"]
    model, _ = gpt2.load_hf(str(path), ModelConfig(vocab_pad_multiple=64))
    with torch.no_grad():
        model.transformer.wte.weight[101:] = 100.0  # padded rows that would dominate if seen
        ids = ids_for(101)
        logits, _ = model(ids)
        torch.testing.assert_close(logits, hf_model(ids).logits, rtol=0, atol=1e-5)
    out = generate.generate_tokens(model.eval(), ids[:, :4], 30, temperature=2.0,
                                   generator=torch.Generator().manual_seed(0))
    assert out.max().item() < 101


def test_greedy_generation_matches_transformers(hf_dirs):
    path, hf_model = hf_dirs["5heads"]
    model, _ = gpt2.load_hf(str(path), ModelConfig(vocab_pad_multiple=64))
    prompt = ids_for(250, B=2, T=6)
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=20, do_sample=False, pad_token_id=0)
    for kv_cache in (True, False):
        ours = generate.generate_tokens(model.eval(), prompt, 20, temperature=0.0,
                                        kv_cache=kv_cache)
        assert torch.equal(ours, expected)


def test_old_pickled_checkpoint_with_mask_buffers(hf_dirs, tmp_path):
    """pytorch_model.bin (weights-only unpickler), unprefixed names and attn.bias buffers, as in
    the original GPT-2 upload."""
    path, hf_model = hf_dirs["3heads"]
    state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    mask = torch.ones(37, 37).tril().view(1, 1, 37, 37)
    for i in range(2):
        state[f"h.{i}.attn.bias"], state[f"h.{i}.attn.masked_bias"] = mask, torch.tensor(-1e4)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save(state, tmp_path / "pytorch_model.bin")
    model, _ = gpt2.load_hf(str(tmp_path))
    ids = ids_for(101)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf_model(ids).logits, rtol=0, atol=1e-5)
    trap = argparse.Namespace(x=1)  # an arbitrary class: the weights-only unpickler refuses it
    torch.save({"weights": state, "trap": trap}, tmp_path / "pytorch_model.bin")
    with pytest.raises(gpt2.GPT2WeightsError, match="refusing to load .*pytorch_model.bin"):
        gpt2.load_hf(str(tmp_path))


def test_every_mapping_problem_in_one_error(hf_dirs, tmp_path):
    path, hf_model = hf_dirs["3heads"]
    state = load_file(str(path / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.bias"]
    c_attn = "transformer.h.0.attn.c_attn.weight"
    state[c_attn] = state[c_attn].t().contiguous()
    state["transformer.h.0.adapter.weight"] = torch.zeros(3)
    state["lm_head.weight"] = torch.zeros(101, 24)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(gpt2.GPT2WeightsError) as err:
        gpt2.load_hf(str(tmp_path))
    message = str(err.value)
    assert "missing ['h.1.mlp.c_fc.bias']" in message
    assert "unexpected ['transformer.h.0.adapter.weight']" in message
    assert "transformer.h.0.attn.c_attn.weight: file (72, 24) vs config (24, 72)" in message
    assert "lm_head.weight differs from wte.weight" in message


def test_unrepresentable_config_is_refused(hf_dirs, tmp_path):
    path, _ = hf_dirs["3heads"]
    config = json.loads((path / "config.json").read_text())
    config.update(activation_function="relu", n_inner=50, scale_attn_by_inverse_layer_idx=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(gpt2.GPT2WeightsError, match="cannot represent: activation_function="
                       "'relu'.*n_inner=50.*attention scaling"):
        gpt2.load_hf(str(tmp_path))


def test_sources_hub_ids_and_errors(hf_dirs, monkeypatch, tmp_path):
    import huggingface_hub
    path, hf_model = hf_dirs["3heads"]
    calls = []

    def fake_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, hf_dir = gpt2.load_hf("gpt2-medium")
    assert calls[0][0] == "openai-community/gpt2-medium" and "model.safetensors" in calls[0][1]
    assert hf_dir == path and model.config.n_head == 3
    assert gpt2.is_gpt2_source("gpt2") and gpt2.is_gpt2_source(str(path))
    assert gpt2.is_gpt2_source("hf:someone/gpt2-finetuned")
    assert not gpt2.is_gpt2_source("scratch") and not gpt2.is_gpt2_source(str(tmp_path))

    def no_network(repo_id, allow_patterns):
        raise OSError("Temporary failure in name resolution")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(gpt2.GPT2WeightsError, match="could not fetch openai-community/gpt2 .*"
                       "without a network, copy a model directory"):
        gpt2.load_hf("gpt2")
    assert gpt2.is_gpt2_source("gpt-2")  # a near miss is reported, not taken for a checkpoint
    with pytest.raises(gpt2.GPT2WeightsError, match="did you mean gpt2"):
        gpt2.load_hf("gpt-2")
    with pytest.raises(gpt2.GPT2WeightsError, match="has no config.json"):
        gpt2.load_hf(str(tmp_path))


def test_export_round_trip_is_exact(hf_dirs, tmp_path):
    path, hf_model = hf_dirs["5heads"]
    model, _ = gpt2.load_hf(str(path), ModelConfig(vocab_pad_multiple=64))
    files = gpt2.write_hf_dir(model, tmp_path / "export", tokenizer=None)
    assert files == ["config.json", "model.safetensors"]
    original = load_file(str(path / "model.safetensors"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert isinstance(reloaded, GPT2LMHeadModel)
    ids = ids_for(250, T=50)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_export_of_a_model_without_biases(tmp_path):
    from model import GPT
    model = GPT(ModelConfig(block_size=16, vocab_size=70, n_layer=2, n_head=2, n_embd=16,
                            bias=False, vocab_pad_multiple=64)).eval()
    gpt2.write_hf_dir(model, tmp_path, tokenizer=None)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = ids_for(70, T=16)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids)[0], rtol=0, atol=1e-5)


def test_cli_import_verify_sample_export(hf_dirs, tmp_path, capsys):
    path, hf_model = hf_dirs["gpt2vocab"]
    run = tmp_path / "run"
    assert load_gpt2_weights.main([str(path), "--out", str(run), "--verify",
                                   "--vocab-pad-multiple", "64"]) == 0
    out = capsys.readouterr().out
    assert "2 layers, 2 heads, width 32, context 64, vocab 50257 padded to 50304" in out
    assert "verify: max |logit difference|" in out
    _, stored, meta = loading.load_model(run)
    assert stored.model.vocab_pad_multiple == 64 and meta["tokenizer"] == {"kind": "gpt2"}

    assert generate.main([f"--checkpoint={run}", "--prompt", "Hello world", "--temperature=0",
                          "--max_new_tokens=12", "--device=cpu"]) == 0
    text = capsys.readouterr().out
    prompt = torch.tensor([[15496, 995]])
    greedy = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                               do_sample=False, pad_token_id=0)
    assert text.rstrip("\n") == GPT2Tokenizer().decode(greedy[0].tolist())

    export = tmp_path / "hf_export"
    assert load_gpt2_weights.main(["--export", str(run), "--out", str(export), "--verify"]) == 0
    assert "verify: max |logit difference|" in capsys.readouterr().out
    original = load_file(str(path / "model.safetensors"))
    exported = load_file(str(export / "model.safetensors"))
    assert all(torch.equal(original[k], exported[k]) for k in original)
    hf_tok = AutoTokenizer.from_pretrained(str(export))  # written from the bundled ranks
    assert hf_tok("Hello, I'm a language model,")["input_ids"] == [15496, 11, 314, 1101, 257,
                                                                    3303, 2746, 11]
    assert hf_tok.eos_token_id == 50256


def test_cli_usage_errors(capsys):
    assert load_gpt2_weights.main(["gpt2"]) == 2
    assert "nothing to do" in capsys.readouterr().err
    assert load_gpt2_weights.main(["--export", "out/x"]) == 2
    assert "--export needs --out" in capsys.readouterr().err
    assert load_gpt2_weights.main(["gpt2", "gpt2-xl", "--verify"]) == 2
    assert "unexpected argument 'gpt2-xl'" in capsys.readouterr().err
    assert load_gpt2_weights.main(["gpt2", "--export", "out/x", "--out", "y"]) == 2
    assert "not both" in capsys.readouterr().err


def test_verify_fails_loudly_on_wrong_weights(hf_dirs):
    path, _ = hf_dirs["3heads"]
    model, _ = gpt2.load_hf(str(path))
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight.mul_(1.01)
    with pytest.raises(gpt2.VerificationError, match="logits differ by"):
        gpt2.verify(model, path)


def test_generate_samples_from_hf_dir(hf_dirs, capsys):
    path, hf_model = hf_dirs["gpt2vocab"]
    assert generate.main(["--init-from", str(path), "--prompt", "Hello world", "--temperature=0",
                          "--max_new_tokens=10", "--device=cpu"]) == 0
    prompt = torch.tensor([[15496, 995]])
    greedy = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                               do_sample=False, pad_token_id=0)
    assert capsys.readouterr().out.rstrip("\n") == GPT2Tokenizer().decode(greedy[0].tolist())
    assert generate.main([f"--init_from={path}", "--checkpoint=out/x", "--device=cpu"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    small, _ = hf_dirs["3heads"]
    assert generate.main(["--init-from", str(small), "--device=cpu"]) == 2
    assert "101-token vocabulary, not GPT-2's 50257" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpt2_dataset(tmp_path_factory) -> Path:
    from data.shakespeare.prepare import prepare
    tmp = tmp_path_factory.mktemp("shakespeare_gpt2")
    source = tmp / "text.txt"
    source.write_text(Path("data/tinyshakespeare.txt").read_text(encoding="utf-8")[:60000],
                      encoding="utf-8")
    prepare(out_dir=tmp / "ds", source=source)
    return tmp / "ds"


def finetune_cfg(hf_dir, dataset, out_dir, *extra):
    cfg, _ = load_config(["--config", "finetune_shakespeare", f"--init_from={hf_dir}",
                          f"--dataset={dataset}", f"--out_dir={out_dir}", "--device=cpu",
                          "--dtype=float32", "--tf32=false", "--block_size=32", "--batch_size=4",
                          "--grad_accum_steps=1", "--eval_iters=2", "--dropout=0", *extra])
    return cfg


def test_finetune_from_hf_dir(hf_dirs, gpt2_dataset, tmp_path):
    path, hf_model = hf_dirs["gpt2vocab"]
    cfg = finetune_cfg(path, gpt2_dataset, tmp_path / "ft", "--max_iters=8", "--eval_interval=8",
                       "--learning_rate=3e-3")
    from data.loader import load_meta
    model, source = build.build_model(cfg, load_meta(str(gpt2_dataset)), torch.device("cpu"))
    assert source == path and model.transformer.wpe.weight.shape == (32, 32)  # cropped 64 -> 32
    ids = ids_for(50257, T=32)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids)[0], hf_model(ids).logits, rtol=0, atol=1e-5)

    summary = train.train(finetune_cfg(path, gpt2_dataset, tmp_path / "ft", "--max_iters=8",
                                       "--eval_interval=8", "--learning_rate=3e-3"))
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text()
               .splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 8
    assert evals[-1]["val"] < evals[0]["val"] - 0.5
    tuned, stored, meta = loading.load_model(summary["checkpoint"])
    assert (stored.model.n_layer, stored.model.n_embd, stored.model.block_size) == (2, 32, 32)
    assert stored.model.vocab_pad_multiple == 64 and meta["tokenizer"] == {"kind": "gpt2"}


def test_finetune_errors(hf_dirs, gpt2_dataset, char_dataset, tmp_path):
    path, _ = hf_dirs["gpt2vocab"]
    with pytest.raises(ConfigError, match="block_size 128 is larger than .* context 64"):
        train.train(finetune_cfg(path, gpt2_dataset, tmp_path / "a", "--block_size=128"))
    with pytest.raises(DataError, match="tokenized with 'char' but the model uses 'gpt2'"):
        train.train(finetune_cfg(path, char_dataset, tmp_path / "b"))


def test_finetune_config_starts_from_gpt2():
    cfg, _ = load_config(["--config", "finetune_shakespeare"])
    assert cfg.train.init_from == "gpt2" and cfg.data.dataset == "shakespeare"
    assert cfg.model.block_size == 1024 and cfg.train.learning_rate <= 1e-4


def reverse_task(folder: Path) -> tuple[Path, Path]:
    """Short word-reversal examples in GPT-2 tokens, as data/instruct_tasks.py writes them."""
    words = ["night", "stone", "river", "apple", "green", "light", "sound", "world", "table",
             "chair", "music", "bread"]
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, part in (("train", words[:9]), ("val", words[9:])):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"instruction": f"Reverse the word: {w}",
                                            "output": w[::-1]}) + "\n" for w in part))
        files.append(path)
    return files[0], files[1]


def export_and_check(source: Path, out: Path, base: torch.Tensor, trained: bool) -> Path:
    """Export with --verify: config.json has the source's context 64, positions 32-63 are the
    source's bit for bit, 0-31 the finetune's (trained: changed); transformers runs all 64."""
    assert load_gpt2_weights.main(["--export", str(source), "--out", str(out), "--verify"]) == 0
    assert json.loads((out / "config.json").read_text())["n_positions"] == 64
    wpe = load_file(str(out / "model.safetensors"))["transformer.wpe.weight"]
    assert wpe.shape == (64, 32) and torch.equal(wpe[32:], base[32:])
    assert torch.equal(wpe[:32], base[:32]) != trained
    with torch.no_grad():
        AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids_for(50257, T=64))
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_finetune_at_a_shorter_context_exports_at_its_sources(hf_dirs, tmp_path, lora,
                                                                capsys):
    """HF (context 64) -> instruction finetune at block_size 32 (configs/instruct_cpu.toml) ->
    HF: the export has context 64, positions 32-63 the source's and 0-31 the finetune's, after
    a resume (full) or a merge (LoRA) too; generate.py samples at block_size 32."""
    from engine import merge_lora

    path, _ = hf_dirs["gpt2vocab"]
    base = load_file(str(path / "model.safetensors"))["transformer.wpe.weight"]
    train_file, val_file = reverse_task(tmp_path / "task")
    run = ["--config", "instruct_cpu", f"--init_from={path}", f"--dataset={train_file}",
           f"--val_file={val_file}", "--block_size=32", "--batch_size=4", "--max_iters=4",
           "--eval_interval=4", "--eval_iters=1", "--device=cpu", "--loss_curve=false",
           f"--out_dir={tmp_path / 'ft'}"]
    if lora:
        assert train.main([*run, "--lora.rank=4", "--learning_rate=1e-2"]) == 0
        assert merge_lora.main([str(tmp_path / "ft"), str(tmp_path / "merged")]) == 0
    else:  # the second half resumes from the first's checkpoint
        assert train.main([*run, "--stop_after_iters=2"]) == 0
        assert train.main([*run, "--init_from=resume"]) == 0
    trained = capsys.readouterr().out
    export_and_check(tmp_path / "ft", tmp_path / "hf", base, trained=not lora)
    assert "context 64 (trained at 32; positions 32-63 are its source's)" in \
        capsys.readouterr().out
    assert "position rows 32-63 stay as the source has them" in trained  # said at start
    ours = loading.load_model(tmp_path / ("merged" if lora else "ft"))[0].eval()
    assert ours.config.block_size == 32
    if lora:
        export_and_check(tmp_path / "merged", tmp_path / "hf_merged", base, trained=False)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = ids_for(50257, T=32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)
    assert generate.main(["--checkpoint", str(tmp_path / "ft"), "--chat", "--prompt",
                          "Reverse the word: night", "--max_new_tokens=8", "--device=cpu"]) == 0
    if not lora:  # a later run from the checkpoint at 48: rows 32-47 come back, untrained
        later = [*run[:-1], f"--init_from={tmp_path / 'ft'}", "--max_iters=1",
                 f"--out_dir={tmp_path / 'ft48'}"]
        assert train.main([*later, "--block_size=80"]) == 2
        assert "error: block_size 80 is larger than the checkpoint's context 32, 64 with the " \
            "position rows it kept of its source; use a block_size <= 64" in capsys.readouterr().err
        assert train.main([*later, "--block_size=48"]) == 0
        assert "positions 32-47 are the rows it kept of its source" in capsys.readouterr().out
        assert loading.load_model(tmp_path / "ft48")[0].config.block_size == 48
        assert gpt2.write_hf_dir(loading.load_model(tmp_path / "ft48")[0], tmp_path / "hf48")
        wpe = load_file(str(tmp_path / "hf48" / "model.safetensors"))["transformer.wpe.weight"]
        assert wpe.shape == (64, 32) and torch.equal(wpe[48:], base[48:])


@pytest.mark.parametrize("mask", ["buffer", "on_the_fly"])
def test_a_cropped_context_keeps_its_rows_and_gives_them_back(mask):
    """engine/context.fit_context: 32 -> 16 keeps rows 16-31 apart (the source's context is
    still 32), 16 -> 24 -> 32 gives them back: the original model, bit for bit."""
    from engine.context import fit_context, rows_past_block, source_context

    from conftest import tiny_model_config
    from model import GPT

    torch.manual_seed(0)
    model = GPT(tiny_model_config(block_size=32, causal_mask=mask)).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 37, (2, 32))
    expected = model(idx)[0]
    assert "rows 16-31 stay as the source has them" in fit_context(model, 16)
    assert model.config.block_size == 16 and source_context(model) == 32
    assert torch.equal(rows_past_block(model), original["transformer.wpe.weight"][16:])
    assert torch.equal(model(idx[:, :16])[0], expected[:, :16])
    assert "positions 16-23 are the rows it kept" in fit_context(model, 24)
    assert rows_past_block(model).shape == (8, 16) and source_context(model) == 32
    fit_context(model, 32)
    assert rows_past_block(model) is None and model.config.block_size == 32
    state = model.state_dict()
    assert state.keys() == original.keys() and all(torch.equal(state[k], original[k])
                                                    for k in state)
    assert torch.equal(model(idx)[0], expected)
    with pytest.raises(ValueError, match="block_size 40 is past the source's context 32"):
        fit_context(model, 40)
