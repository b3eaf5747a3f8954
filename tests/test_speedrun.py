"""The speedrun techniques (docs/speedrun.md): each against a formula written out here, each off
by default (the model is then GPT-2: tests/test_golden.py and tests/test_gpt2.py hold that), and
carried by checkpoints, generation, serving, the HF export and resume."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import generate
from config import Config, ConfigError, gpt2_recipe_flags, load_config
from conftest import tiny_model_config, train_whole_and_resumed
from engine import checkpoint, loading, sources
from engine import hf as gpt2
from engine.fields import departures
from engine.inference.kv_cache import new_kv_cache
from engine.inference.sampling import generate_tokens
from engine.training import optim
from model import GPT, ModelConfig, Rotary

EVERY = dict(position="rotary", qk_norm=True, attn_scale=0.3, value_embeds=1,
             tie_embeddings=False, zero_init_head=True, zero_init_proj=True, logit_softcap=15.0,
             unet_skips=True, smear=True, activation="relu2")
EVERY_FLAGS = ["--position=rotary", "--qk_norm=true", "--attn_scale=0.3", "--value_embeds=1",
               "--tie_embeddings=false", "--zero_init_head=true", "--zero_init_proj=true",
               "--logit_softcap=15", "--unet_skips=true", "--smear=true", "--activation=relu2"]


def test_every_technique_is_off_by_default():
    """The defaults are GPT-2: learned positions, a tied head, GPT-2's init, no cap."""
    cfg = Config()
    assert departures(cfg.model) == []
    assert (cfg.train.lr_schedule, cfg.train.muon_momentum_warmup) == ("cosine", 0)
    model = GPT(tiny_model_config())
    assert model.lm_head.weight is model.transformer.wte.weight and "wpe" in model.transformer
    assert departures(ModelConfig(**EVERY)) == [
        "activation=relu2", "position=rotary", "qk_norm=True", "attn_scale=0.3",
        "value_embeds=1", "tie_embeddings=False", "zero_init_head=True", "zero_init_proj=True",
        "logit_softcap=15.0", "unet_skips=True", "smear=True"]


def test_gpt2_recipe_flags_turn_off_what_the_speedrun_configs_turn_on():
    """The golden default run and bench.py to-loss start from these, whatever a config holds."""
    for name in ("shakespeare_char", "shakespeare_char_speedrun", "gpt2_124m_speedrun"):
        cfg, _ = load_config(["--config", name, *gpt2_recipe_flags()])
        assert departures(cfg.model) == [] and cfg.model.activation == "gelu_tanh", name
        assert (cfg.train.lr_schedule, cfg.train.muon_momentum_warmup) == ("cosine", 0), name
    cfg, _ = load_config([*gpt2_recipe_flags(), "--qk_norm=true"])  # a later flag still wins
    assert departures(cfg.model) == ["qk_norm=True"]


def test_rotary_is_a_complex_rotation_by_position_times_frequency():
    """Each pair (x1[i], x2[i]) at position p, as the complex number x1 + i x2, is multiplied
    by exp(i p base^(-2i/hs))."""
    hs, base = 8, 500.0
    rope = Rotary(hs, 32, base)
    x = torch.randn(2, 3, 10, hs, dtype=torch.float64).float()
    positions = torch.tensor([0, 1, 2, 5, 7, 11, 12, 20, 30, 31])
    got = rope(x, positions)
    freq = torch.tensor([base ** (-2 * i / hs) for i in range(hs // 2)], dtype=torch.float64)
    angle = positions.double()[:, None] * freq
    z = torch.complex(x[..., :hs // 2].double(), x[..., hs // 2:].double()) * torch.polar(
        torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1).float())
    assert torch.equal(rope(x, positions)[..., 0, :], x[..., 0, :])  # position 0: unrotated


def test_rotary_scores_depend_only_on_distance_and_rows_take_their_own_positions():
    rope = Rotary(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i: int, j: int) -> float:
        return (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum().item()

    assert score(10, 7) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(10, 7) != pytest.approx(score(10, 8), abs=1e-3)
    x = torch.randn(3, 2, 4, 16)
    rows = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [60, 61, 62, 63]])  # (B, T)
    each = torch.cat([rope(x[b:b + 1], rows[b]) for b in range(3)])
    torch.testing.assert_close(rope(x, rows), each)


@pytest.mark.parametrize("attention", ["scratch", "sdpa"])
@pytest.mark.parametrize("attn_scale", [0.0, 0.7])
def test_attention_with_qk_norm_and_rotary_matches_the_formula(attention, attn_scale):
    """softmax(rope(rms(q)) rope(rms(k))^T x scale + causal) v, then the projection; scale
    1/sqrt(hs) unless model.attn_scale sets it."""
    cfg = tiny_model_config(position="rotary", qk_norm=True, attention=attention,
                            attn_scale=attn_scale)
    model = GPT(cfg).eval()
    attn, hs, T = model.transformer.h[0].attn, cfg.n_embd // cfg.n_head, 12
    x = torch.randn(2, T, cfg.n_embd)
    q, k, v = (attn.c_attn(x).view(2, T, 3, cfg.n_head, hs).permute(2, 0, 3, 1, 4))

    def rms(t):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + torch.finfo(t.dtype).eps)

    positions = torch.arange(T)
    q, k = attn.rotary(rms(q), positions), attn.rotary(rms(k), positions)
    scores = (q @ k.transpose(-1, -2)) * (attn_scale or 1 / math.sqrt(hs))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, cfg.n_embd)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), attn.c_proj(y), atol=1e-5, rtol=1e-5)


def test_softcap_is_cap_times_tanh_and_the_chunked_loss_agrees():
    torch.manual_seed(0)
    plain = GPT(tiny_model_config())
    capped = GPT(tiny_model_config(logit_softcap=1.0))
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(20) if p.dim() == 2 else None  # logits well past the cap
    capped.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 37, (2, 16))
    raw, capped_logits = plain(idx)[0], capped(idx)[0]
    torch.testing.assert_close(capped_logits, torch.tanh(raw))
    assert raw.abs().max() > 2 and capped_logits.abs().max() < 1.0
    chunked = GPT(tiny_model_config(logit_softcap=1.0, loss="chunked"))
    chunked.load_state_dict(plain.state_dict())
    targets = torch.randint(0, 37, (2, 16))
    targets[0, :3] = -1  # ignored positions
    full_loss = capped(idx, targets)[1]
    chunk_loss = chunked(idx, targets)[1]
    expected = F.cross_entropy(capped_logits.reshape(-1, 37), targets.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(full_loss, expected)
    torch.testing.assert_close(chunk_loss, full_loss, atol=1e-6, rtol=1e-6)
    full_loss.backward()
    chunk_loss.backward()
    for (name, a), b in zip(capped.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


def gpt2_and_with(flag: str, value=True, **shape) -> tuple[GPT, GPT]:
    """GPT-2 and the same model with one zero-initialized technique on, from the same seed (so
    every other weight is the same draw), in eval mode."""
    torch.manual_seed(5)
    plain = GPT(tiny_model_config(**shape)).eval()
    torch.manual_seed(5)
    return plain, GPT(tiny_model_config(**shape, **{flag: value})).eval()


@pytest.mark.parametrize("n_layer", [4, 3])
def test_unet_skips_bring_the_first_half_outputs_back_in_mirror_order(n_layer):
    """Block i's output, times skip_weights[i], joins block n-1-i's input (i < n // 2; an odd
    middle block takes none). At their initial zeros the model is GPT-2's from the same seed."""
    plain, model = gpt2_and_with("unet_skips", n_layer=n_layer)
    idx = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        assert model.skip_weights.shape == (n_layer // 2,) and not model.skip_weights.any()
        torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=0)
        model.skip_weights.normal_()
        t, outputs = model.transformer, {}
        x = t.wte(idx) + t.wpe(torch.arange(16))
        for i in range(n_layer):
            if n_layer - 1 - i < n_layer // 2:  # a second-half block: its mirror's output
                x = x + model.skip_weights[n_layer - 1 - i] * outputs[n_layer - 1 - i]
            x = outputs[i] = t.h[i](x)
        expected = model.lm_head(t.ln_f(x))
        torch.testing.assert_close(model(idx)[0], expected)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_smear_adds_the_previous_tokens_embedding_per_channel(position):
    """Token t's embedding gets smear_weights * token t-1's (none at position 0), before the
    position embedding; at the initial zeros the model is GPT-2's from the same seed."""
    plain, model = gpt2_and_with("smear", position=position)
    idx = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        assert model.smear_weights.shape == (16,) and not model.smear_weights.any()
        torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=0)
        model.smear_weights.normal_()
        t = model.transformer
        e = t.wte(idx)
        x = torch.stack([e[:, i] + (model.smear_weights * e[:, i - 1] if i else 0)
                         for i in range(16)], dim=1)
        if position == "learned":
            x = x + t.wpe(torch.arange(16))
        for block in t.h:
            x = block(x)
        torch.testing.assert_close(model(idx)[0], model.lm_head(t.ln_f(x)))


def attention_with_values(attn, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """GPT-2's attention written out, with `extra` (B, T, C) added to the values."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=-1)
    if extra is not None:
        v = v + extra
    heads = [t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-2, -1) / math.sqrt(C // attn.n_head)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (torch.softmax(scores, dim=-1) @ heads[2]).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


@pytest.mark.parametrize("n_layer,pairs", [(4, 2), (4, 1), (5, 2)])
def test_value_embeddings_add_an_embedding_of_the_token_to_attentions_values(n_layer, pairs):
    """Blocks i and n-1-i (i < pairs) add value_weights[i, side] * value_embeds[i](token) to
    their attention's values (an odd middle block takes none); at the weights' initial zeros
    the model is GPT-2's from the same seed, and the tables train as embeddings (AdamW)."""
    plain, model = gpt2_and_with("value_embeds", pairs, n_layer=n_layer)
    idx = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        assert len(model.value_embeds) == pairs and model.value_weights.shape == (pairs, 2)
        assert not model.value_weights.any()
        torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=0)
        model.value_weights.normal_()
        t = model.transformer
        x = t.wte(idx) + t.wpe(torch.arange(16))
        for i, block in enumerate(t.h):
            pair, extra = min(i, n_layer - 1 - i), None
            if pair < pairs:
                extra = model.value_weights[pair, int(i > pair)] * model.value_embeds[pair](idx)
            x = x + attention_with_values(block.attn, block.ln_1(x), extra)
            x = x + block.mlp(block.ln_2(x))
        torch.testing.assert_close(model(idx)[0], model.lm_head(t.ln_f(x)))
    cfg = Config()
    cfg.model, cfg.train.optimizer = model.config, "muon"
    hidden = {id(p) for g in optim.make_optimizer(model, cfg, torch.device("cpu")).param_groups
              if g.get("muon") for p in g["params"]}
    assert all(id(table.weight) not in hidden for table in model.value_embeds)
    with pytest.raises(ConfigError, match="model.value_embeds must be <= n_layer // 2"):
        load_config([f"--n_layer={n_layer}", f"--value_embeds={n_layer // 2 + 1}"])


def test_zero_inits_zero_only_their_weights_and_leave_the_rest_as_gpt2():
    """The same seed gives the same weights but the zeroed ones; a zero head gives uniform first
    logits (loss log V)."""
    torch.manual_seed(3)
    base = GPT(tiny_model_config(tie_embeddings=False))
    torch.manual_seed(3)
    zeroed = GPT(tiny_model_config(tie_embeddings=False, zero_init_head=True,
                                   zero_init_proj=True))
    for (name, a), b in zip(base.named_parameters(), zeroed.parameters()):
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            assert not b.any(), name
        else:
            assert torch.equal(a, b), name
    assert base.lm_head.weight is not base.transformer.wte.weight and base.lm_head.weight.std() > 0
    idx = torch.randint(0, 37, (2, 16))
    assert zeroed(idx, idx)[1].item() == pytest.approx(math.log(37), abs=1e-6)
    with pytest.raises(ValueError, match="zero_init_head needs model.tie_embeddings=false"):
        GPT(tiny_model_config(zero_init_head=True))


@pytest.mark.parametrize("flag", [dict(position="rotary"), dict(qk_norm=True),
                                  dict(logit_softcap=15.0), dict(unet_skips=True, n_layer=3),
                                  dict(smear=True), dict(value_embeds=1), EVERY])
def test_decoding_with_a_kv_cache_matches_the_whole_forward(flag):
    """One token at a time, positions (T,) as generate.py and (B, T) as serve.py's slots."""
    model = GPT(tiny_model_config(**flag)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # zero inits would hide a wrong path
        idx = torch.randint(0, 37, (2, 12))
        whole = model(idx)[0]
        cache, rows = new_kv_cache(model, 2), new_kv_cache(model, 2)
        for t in range(12):
            step = model(idx[:, t:t + 1], kv_cache=cache, input_pos=torch.tensor([t]))[0]
            torch.testing.assert_close(step[:, 0], whole[:, t], atol=1e-5, rtol=1e-5)
            per_row = model(idx[:, t:t + 1], kv_cache=rows, input_pos=torch.tensor([[t], [t]]))[0]
            torch.testing.assert_close(per_row[:, 0], whole[:, t], atol=1e-5, rtol=1e-5)
        # a prompt in two chunks, then a row alone through a view of the cache
        chunks = new_kv_cache(model, 2)
        first = model(idx[:, :5], kv_cache=chunks, input_pos=torch.arange(5))[0]
        then = model(idx[:, 5:9], kv_cache=chunks, input_pos=torch.arange(5, 9))[0]
        torch.testing.assert_close(torch.cat([first, then], 1), whole[:, :9], atol=1e-5,
                                   rtol=1e-5)
        alone = model(idx[1:, 9:10], kv_cache=chunks.rows(1), input_pos=torch.tensor([9]))[0]
        torch.testing.assert_close(alone[:, 0], whole[1:, 9], atol=1e-5, rtol=1e-5)


def test_wsd_schedule_warms_up_holds_then_decays_linearly():
    cfg = Config()
    t = cfg.train
    t.learning_rate, t.warmup_iters, t.max_iters, t.min_lr_ratio = 1.0, 10, 100, 0.1
    t.lr_schedule, t.cooldown_frac = "wsd", 0.4
    lrs = [optim.lr_at(s, cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(lr == 1.0 for lr in lrs[10:61])  # stable until the last 40%
    assert lrs[80] == pytest.approx(0.1 + 0.9 * 20 / 40) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[60:], lrs[61:]))


def test_muon_momentum_warms_up_then_stays():
    cfg = Config()
    cfg.train.muon_momentum_warmup, cfg.train.muon_momentum_start = 300, 0.85
    assert optim.momentum_at(0, cfg) == pytest.approx(0.85)
    assert optim.momentum_at(150, cfg) == pytest.approx(0.90)
    assert optim.momentum_at(300, cfg) == optim.momentum_at(5000, cfg) == 0.95
    cfg.train.muon_momentum_warmup = 0
    assert optim.momentum_at(0, cfg) == 0.95
    cfg.train.optimizer = "muon"
    model = GPT(tiny_model_config())
    optimizer = optim.make_optimizer(model, cfg, torch.device("cpu"))
    optim.set_schedule(optimizer, 1e-3, 0.9)
    assert [g.get("momentum") for g in optimizer.param_groups] == [None, None, 0.9]
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3] * 3


def test_config_refuses_what_cannot_work():
    with pytest.raises(ConfigError) as e:
        load_config(["--zero_init_head=true", "--position=rotary", "--n_embd=18", "--n_head=6",
                     "--cooldown_frac=0", "--logit_softcap=-1", "--attn_scale=-0.1"])
    text = str(e.value)
    for part in ("zero_init_head needs model.tie_embeddings=false", "even head size",
                 "train.cooldown_frac must be in (0, 1]", "model.logit_softcap must be >= 0",
                 "model.attn_scale must be >= 0"):
        assert part in text


@pytest.mark.parametrize("flag,name", [(dict(position="rotary"), "model.position=rotary"),
                                       (dict(qk_norm=True), "model.qk_norm=True"),
                                       (dict(attn_scale=0.3), "model.attn_scale=0.3"),
                                       (dict(unet_skips=True), "model.unet_skips=True"),
                                       (dict(smear=True), "model.smear=True"),
                                       (dict(value_embeds=1), "model.value_embeds=1"),
                                       (dict(logit_softcap=30.0), "model.logit_softcap=30.0")])
def test_hf_export_refuses_what_gpt2_cannot_hold_in_one_line(flag, name, tmp_path):
    model = GPT(tiny_model_config(**flag))
    with pytest.raises(gpt2.GPT2WeightsError, match=f"cannot export .*{name}") as e:
        gpt2.write_hf_dir(model, tmp_path / "hf", tokenizer=None)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def test_an_activation_gpt2_has_no_name_for_is_refused_in_one_line(tmp_path, monkeypatch):
    """An activation with no GPT2Config name (one added without hf_names) is refused by the
    export, not an IndexError."""
    import dataclasses

    from model import ACTIVATIONS
    monkeypatch.setitem(ACTIVATIONS, "relu2", dataclasses.replace(ACTIVATIONS["relu2"],
                                                                  hf_names=()))
    model = GPT(tiny_model_config(activation="relu2"))
    with pytest.raises(gpt2.GPT2WeightsError, match="model.activation=relu2 has no place") as e:
        gpt2.write_hf_dir(model, tmp_path / "hf", tokenizer=None)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def test_untied_zero_init_relu2_model_exports_to_transformers_and_back(tmp_path):
    """What GPT-2's format can hold goes out: transformers gives the same logits, and the
    import gives an untied head back."""
    torch.manual_seed(0)
    model = GPT(tiny_model_config(tie_embeddings=False, zero_init_proj=True,
                                  activation="relu2", vocab_pad_multiple=8)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_()
        for block in model.transformer.h:
            block.mlp.c_proj.weight.normal_(std=0.02)
    gpt2.write_hf_dir(model, tmp_path, tokenizer=None)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids)[0], rtol=0, atol=1e-5)
    back, _ = gpt2.load_hf(str(tmp_path))
    assert not back.config.tie_embeddings
    assert torch.equal(back.lm_head.weight, model.lm_head.weight[:37])
    asked = ModelConfig(position="rotary", qk_norm=True, attn_scale=0.3, logit_softcap=15.0,
                        unet_skips=True, smear=True)
    gpt2_again, _ = gpt2.load_hf(str(tmp_path), asked)  # GPT-2's architecture is what it holds
    assert departures(gpt2_again.config) == ["activation=relu2", "tie_embeddings=False"]


def test_a_run_with_every_technique_resumes_bit_exact_and_generates(char_dataset, tmp_path,
                                                                    capsys):
    run = ["--optimizer=muon", "--max_iters=8", "--eval_interval=4", "--log_interval=1",
           "--lr_schedule=wsd", "--muon_momentum_warmup=5", "--loss=chunked",
           "--muon_ns_coefficients=polar_express", "--muon_ns_steps=3", *EVERY_FLAGS]

    whole, parts = train_whole_and_resumed(char_dataset, tmp_path, *run)
    a, b = (checkpoint.latest_checkpoint(out) for out in (whole, parts))
    model_a, cfg_a, _ = loading.load_model(a)
    model_b = loading.load_model(b)[0]
    assert departures(cfg_a.model) == departures(ModelConfig(**EVERY))
    for (name, p), q in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(p, q), name
    assert "lm_head.weight" in checkpoint.model_state(model_a)  # untied: stored
    assert "recipe=activation=relu2,position=rotary,qk_norm=True" in capsys.readouterr().out
    # generate.py reads the checkpoint with no flags, and sampling with the cache is the
    # whole forward's
    assert generate.main(["--checkpoint", str(a), "--max_new_tokens=20", "--device=cpu",
                          "--prompt=ROMEO:", "--temperature=0"]) == 0
    model = sources.load_source(str(a), Config())[0].eval()
    idx = torch.tensor([[5, 6, 7]])
    cached = generate_tokens(model, idx, 10, 0.0, 0, 1.0, True, torch.Generator())
    plain = generate_tokens(model, idx, 10, 0.0, 0, 1.0, False, torch.Generator())
    assert torch.equal(cached, plain)
