"""LoRA (engine/lora.py): at the start the model is its base bit for bit; merged equals unmerged;
the gradients are peft's on transformers' GPT-2 with the same weights; only the adapters train
and are saved; a run resumes bit for bit; a changed base is refused; bfloat16 bases; the merge
command and the config's refusals."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import generate
import load_gpt2_weights
import train
from config import ConfigError, LoraConfig, load_config, validate
from conftest import tiny_model_config
from engine import checkpoint
from engine.checkpoint import ADAPTER_FILE, CheckpointError
from engine.lora import adapter_state, apply_lora, load_adapters, merge_lora
from engine.sources import load_source
from engine.vocab import grow_vocab
from model import GPT


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_model_config(vocab_size=40, block_size=16, **overrides))


def randomize_b(model: GPT) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)


@pytest.mark.parametrize("overrides", [{}, dict(position="rotary", qk_norm=True, smear=True,
                                                unet_skips=True, activation="relu2")])
def test_at_the_start_the_model_is_its_base_bit_for_bit(overrides):
    base = tiny_gpt(**overrides)
    lora = copy.deepcopy(base)
    apply_lora(lora, LoraConfig(rank=4, adapter_dropout=0.1))
    idx = torch.randint(0, 40, (3, 16))
    assert torch.equal(lora.eval()(idx)[0], base.eval()(idx)[0])
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    assert len(trained) == 2 * 4 * 2  # A and B of c_attn, attn.c_proj, c_fc, mlp.c_proj, twice


def test_targets_name_linears_by_their_ending():
    model = tiny_gpt()
    apply_lora(model, LoraConfig(rank=2, targets="c_proj"))
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert wrapped == [f"transformer.h.{i}.{p}.c_proj" for i in range(2) for p in ("attn", "mlp")]
    with pytest.raises(ConfigError, match="lm_head names no Linear in the blocks"):
        apply_lora(tiny_gpt(), LoraConfig(rank=2, targets="c_attn,lm_head"))


def test_merged_equals_unmerged():
    model = tiny_gpt()
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    randomize_b(model)
    idx = torch.randint(0, 40, (3, 16))
    before = model.eval()(idx)[0]
    merge_lora(model)
    assert not any(hasattr(m, "lora_A") for m in model.modules())
    assert type(model.transformer.h[0].attn.c_attn) is torch.nn.Linear
    torch.testing.assert_close(model(idx)[0], before, rtol=1e-5, atol=1e-5)


def test_gradients_match_peft_on_transformers_gpt2():
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    from engine.hf import hf_config, ours_to_hf

    ours = tiny_gpt()
    hf = GPT2LMHeadModel(GPT2Config(**{**hf_config(ours.config), "resid_pdrop": 0.0,
                                       "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    hf.load_state_dict(ours_to_hf(ours), strict=False)
    apply_lora(ours, LoraConfig(rank=4, alpha=8))
    randomize_b(ours)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules=["c_attn", "c_proj", "c_fc"],
                                                     fan_in_fan_out=True))
    with torch.no_grad():
        for name, m in ours.named_modules():
            if hasattr(m, "lora_A"):
                peer = theirs.base_model.model.get_submodule(name)
                peer.lora_A["default"].weight.copy_(m.lora_A)
                peer.lora_B["default"].weight.copy_(m.lora_B)
    idx = torch.randint(0, 40, (2, 16))
    targets = torch.randint(0, 40, (2, 16))
    _, loss = ours(idx, targets)
    loss.backward()
    labels = torch.cat([torch.full((2, 1), -100), targets[:, :-1]], 1)
    hf_loss = theirs(input_ids=idx, labels=labels).loss
    torch.testing.assert_close(ours(idx)[0], theirs(input_ids=idx).logits, rtol=1e-4, atol=1e-5)
    # transformers drops the last position's target: compare with ours on the same targets
    _, same = ours(idx[:, :-1], targets[:, :-1])
    torch.testing.assert_close(same, hf_loss, rtol=1e-5, atol=1e-6)
    for p in ours.parameters():
        p.grad = None
    same.backward()
    hf_loss.backward()
    for name, m in ours.named_modules():
        if hasattr(m, "lora_A"):
            peer = theirs.base_model.model.get_submodule(name)
            for ours_p, their_p in ((m.lora_A, peer.lora_A["default"].weight),
                                    (m.lora_B, peer.lora_B["default"].weight)):
                torch.testing.assert_close(ours_p.grad, their_p.grad, rtol=1e-4, atol=1e-6)


def test_new_rows_of_a_grown_vocabulary_train_with_the_adapters():
    model = tiny_gpt()
    grow_vocab(model, 41)
    base = copy.deepcopy(model)
    apply_lora(model, LoraConfig(rank=2))
    state = adapter_state(model)
    assert state["transformer.wte.new_rows"].shape == (1, 16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx = torch.randint(0, 41, (4, 16))
    for _ in range(3):
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    trained = model(idx)[0]
    again = copy.deepcopy(base)
    apply_lora(again, LoraConfig(rank=2))
    load_adapters(again, adapter_state(model), "test")
    assert torch.equal(again(idx)[0], trained)
    merge_lora(model)
    torch.testing.assert_close(model(idx)[0], trained, rtol=1e-5, atol=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight[:40], base.transformer.wte.weight[:40])
    assert not torch.equal(model.transformer.wte.weight[40], base.transformer.wte.weight[40])


def test_bfloat16_base_holds_its_linears_in_bfloat16_and_trains():
    model = tiny_gpt()
    apply_lora(model, LoraConfig(rank=4, base_dtype="bfloat16"))
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.weight.dtype == torch.bfloat16 and c_attn.lora_A.dtype == torch.float32
    idx = torch.randint(0, 40, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and c_attn.lora_A.grad is not None and c_attn.weight.grad is None


@pytest.mark.parametrize("extra, message", [
    (["--init_from=scratch"], "adapts a trained model"),
    (["--init_from=x", "--optimizer=muon"], "trains its adapters with AdamW"),
    (["--init_from=x", "--dtype=bfloat16", "--weights_dtype=bfloat16"], "drop --weights_dtype"),
    (["--init_from=x", "--parallel=fsdp"], "not supported with parallel=fsdp"),
])
def test_config_refuses_what_lora_cannot_combine_with(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "tiny", "--lora.rank=4", *extra])
    cfg, _ = load_config(["--config", "tiny", *extra])  # the same without LoRA is fine
    assert not any("lora" in p for p in validate(cfg))


@pytest.fixture(scope="module")
def base_run(char_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", f"--out_dir={out}",
                          "--device=cpu", "--max_iters=20", "--eval_interval=20"])
    train.train(cfg)
    return checkpoint.latest_checkpoint(out)


def lora_cfg(base, char_dataset, out, *extra):
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", f"--init_from={base}",
                          f"--out_dir={out}", "--device=cpu", "--lora.rank=4",
                          "--lora.adapter_dropout=0.1", "--max_iters=8", "--eval_interval=4",
                          "--eval_iters=2", "--learning_rate=1e-2", *extra])
    return cfg


def test_a_lora_run_saves_adapters_resumes_bit_for_bit_and_samples_merged(
        base_run, char_dataset, tmp_path, capsys):
    whole = train.train(lora_cfg(base_run, char_dataset, tmp_path / "whole"))
    ckpt = checkpoint.latest_checkpoint(tmp_path / "whole")
    assert (ckpt / ADAPTER_FILE).is_file() and not (ckpt / "model.safetensors").exists()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["base"] == str(base_run.resolve()) and meta["lora"]["base_sha256"]
    assert (ckpt / ADAPTER_FILE).stat().st_size < (base_run / "model.safetensors").stat().st_size
    split = tmp_path / "split"
    train.train(lora_cfg(base_run, char_dataset, split, "--stop_after_iters=3"))
    resumed = train.train(lora_cfg(base_run, char_dataset, split, "--init_from=resume"))
    assert resumed["final"] == whole["final"]
    a = adapter_state(load_source(str(ckpt), None, merge_adapters=False)[0])
    b = adapter_state(load_source(str(split), None, merge_adapters=False)[0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    merged, _, _, _ = load_source(str(ckpt), None)
    assert not any(hasattr(m, "lora_A") for m in merged.modules())
    assert generate.main(["--checkpoint", str(ckpt), "--max_new_tokens=5", "--device=cpu"]) == 0
    # exported merged: transformers' GPT-2 gives the same logits (--verify)
    assert load_gpt2_weights.main(["--export", str(ckpt), "--out", str(tmp_path / "hf"),
                                   "--verify"]) == 0


def test_merge_command_writes_a_full_checkpoint_with_the_same_logits(base_run, char_dataset,
                                                                    tmp_path):
    from engine import merge_lora as command

    train.train(lora_cfg(base_run, char_dataset, tmp_path / "run", "--max_iters=4"))
    assert command.main([str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    full = checkpoint.latest_checkpoint(tmp_path / "merged")
    assert (full / "model.safetensors").is_file()
    idx = torch.randint(0, 65, (2, 16))
    a = load_source(str(tmp_path / "run"), None)[0].eval()(idx)[0]
    b = load_source(str(full), None)[0].eval()(idx)[0]
    assert torch.equal(a, b)
    assert command.main([str(full), str(tmp_path / "again")]) == 2


def test_a_changed_base_is_refused(base_run, char_dataset, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    train.train(lora_cfg(base, char_dataset, tmp_path / "run", "--max_iters=2"))
    model, _, _ = __import__("engine.loading", fromlist=["load_model"]).load_model(base)
    with torch.no_grad():
        model.transformer.wte.weight[0, 0] += 1
    from safetensors.torch import save_file

    save_file(checkpoint.model_state(model), str(base / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has changed since the adapters were trained"):
        load_source(str(tmp_path / "run"), None)


def test_memory_estimate_counts_gradients_and_adamw_for_the_adapters_only():
    from engine.training.memory_estimate import estimate

    cfg, _ = load_config(["--config", "tiny", "--init_from=x", "--lora.rank=4",
                          "--vocab_size=40", "--block_size=16"])
    model = GPT(cfg.model)
    apply_lora(model, cfg.lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    e = estimate(cfg)
    assert (e.gradients, e.optimizer) == (4 * trained, 8 * trained)
    assert e.weights == 4 * sum(p.numel() for p in model.parameters())  # the tied head once


def test_auto_that_finds_nothing_to_resume_is_refused_with_lora(char_dataset, tmp_path):
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", "--device=cpu",
                          f"--out_dir={tmp_path}", "--init_from=auto", "--lora.rank=4"])
    with pytest.raises(ConfigError, match="starts from scratch"):
        train.train(cfg)
