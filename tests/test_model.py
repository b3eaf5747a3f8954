"""The model: shapes, init, loss, and every implementation switch against the reference path,
on the CPU and, where there is one, on CUDA (float32 with TF32 off: the same reference, only the
tolerances differ)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from config import ModelConfig
from conftest import on_each_device, tiny_model_config
from engine.inference.kv_cache import new_kv_cache
from model import ACTIVATIONS, GPT, IGNORE_INDEX, MLP, gelu_tanh

# float32 on both; CUDA kernels (cuBLAS, the memory-efficient SDPA kernel) sum in other orders
LOGITS_TOL = {"cpu": dict(atol=1e-5, rtol=1e-5), "cuda": dict(atol=1e-4, rtol=1e-4)}
LOSS_TOL = {"cpu": dict(atol=1e-6, rtol=1e-6), "cuda": dict(atol=1e-5, rtol=1e-5)}
GRAD_TOL = {"cpu": dict(atol=1e-5, rtol=1e-4), "cuda": dict(atol=1e-4, rtol=1e-3)}


def same_weights(reference: GPT, cfg) -> GPT:
    other = GPT(cfg)
    other.load_state_dict(reference.state_dict())
    return other


def batch(cfg, B=3, T=None, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same tokens on every device
    T = T or cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x.to(device), y.to(device)


def test_shapes_and_loss_at_init_near_uniform():
    cfg = tiny_model_config(vocab_size=65, block_size=32, n_embd=32)
    model = GPT(cfg)
    x, y = batch(cfg, B=4)
    logits, loss = model(x, y)
    assert logits.shape == (4, 32, 65)
    assert loss.dtype == torch.float32
    # small init -> near-uniform predictions -> loss close to ln(vocab)
    assert abs(loss.item() - math.log(65)) < 0.1
    logits_only, no_loss = model(x[:, :5])
    assert logits_only.shape == (4, 5, 65) and no_loss is None


def test_gpt2_init_and_tied_head():
    cfg = tiny_model_config(n_layer=8, n_embd=64)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.1)
    assert fc.std().item() == pytest.approx(0.02, rel=0.1)
    assert all(b.attn.c_attn.bias.abs().sum() == 0 for b in model.transformer.h)


def test_param_counts():
    cfg = tiny_model_config()
    model = GPT(cfg)
    C, V, L, T = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.block_size
    norms, attention = 2 * 2 * C, (C * 3 * C + 3 * C) + (C * C + C)  # qkv, then the projection
    mlp = (C * 4 * C + 4 * C) + (4 * C * C + C)
    per_block = norms + attention + mlp
    non_embedding = L * per_block + 2 * C
    assert model.num_params() == non_embedding
    assert model.num_params(non_embedding=False) == non_embedding + V * C + T * C


def test_no_bias_option():
    model = GPT(tiny_model_config(bias=False))
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())
    x, y = batch(model.config)
    assert torch.isfinite(model(x, y)[1])


def test_ignore_index_skips_targets():
    cfg = tiny_model_config()
    model = GPT(cfg)
    x, y = batch(cfg)
    masked = y.clone()
    masked[:, : cfg.block_size // 2] = IGNORE_INDEX
    logits, loss = model(x, masked)
    keep = slice(cfg.block_size // 2, None)
    expected = torch.nn.functional.cross_entropy(
        logits[:, keep].reshape(-1, cfg.vocab_size), y[:, keep].reshape(-1))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("change", [
    {"attention": "sdpa"},
    {"causal_mask": "on_the_fly"},
    {"attention": "sdpa", "causal_mask": "on_the_fly"},
    {"norm": "native"},
    {"activation_impl": "native"},
    {"attention": "sdpa", "causal_mask": "on_the_fly", "norm": "native",
     "activation_impl": "native"},
])
@on_each_device
def test_fast_paths_match_reference(change, device):
    """Same weights, same inputs: logits, loss and gradients equal to the reference path."""
    cfg = tiny_model_config()
    reference = GPT(cfg).to(device)
    fast = same_weights(reference, tiny_model_config(**change)).to(device)
    x, y = batch(cfg, device=device)
    ref_logits, ref_loss = reference(x, y)
    fast_logits, fast_loss = fast(x, y)
    torch.testing.assert_close(fast_logits, ref_logits, **LOGITS_TOL[device])
    torch.testing.assert_close(fast_loss, ref_loss, **LOSS_TOL[device])
    ref_loss.backward()
    fast_loss.backward()
    for (name, p_ref), (_, p_fast) in zip(reference.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(p_fast.grad, p_ref.grad, **GRAD_TOL[device], msg=name)


@pytest.mark.parametrize("impl", ["scratch", "native"])
def test_relu_squared_is_its_formula_in_the_mlp(impl):
    cfg = tiny_model_config(activation="relu2", activation_impl=impl)
    torch.manual_seed(0)
    mlp, x = MLP(cfg), torch.randn(2, 4, cfg.n_embd)
    hidden = mlp.c_fc(x)
    torch.testing.assert_close(mlp(x), mlp.c_proj(torch.where(hidden > 0, hidden * hidden, 0.0)),
                               rtol=0, atol=1e-6)


def test_relu_squared_native_backward_equals_autograds_bit_for_bit():
    """The native path's one-product backward (2 relu(x) grad) gives autograd's own gradient
    of relu(x) * relu(x), at negative, zero and positive inputs, and can't be differentiated
    twice."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4, 64), torch.zeros(1, 64), -torch.rand(1, 64)])
    grad = torch.randn_like(x)
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    relu2 = ACTIVATIONS["relu2"]
    y_ref, y_fast = relu2(x_ref, native=False), relu2(x_fast, native=True)
    y_ref.backward(grad)
    y_fast.backward(grad)
    assert torch.equal(y_fast, y_ref)
    assert torch.equal(x_fast.grad, x_ref.grad)
    torch.testing.assert_close(x_fast.grad, 2 * torch.relu(x) * grad, rtol=0, atol=0)
    assert (x_fast.grad[4:] == 0).all()
    wide = torch.randn(3, 5, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: relu2(t, native=True), (wide,))
    (first,) = torch.autograd.grad(relu2(wide, native=True).sum(), wide, create_graph=True)
    with pytest.raises(RuntimeError):
        first.sum().backward()


def test_scratch_gelu_and_layernorm_formulas():
    x = torch.linspace(-6, 6, 101)
    torch.testing.assert_close(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"))
    # the scratch GELU is the tanh approximation, not the exact erf GELU
    assert (gelu_tanh(x) - torch.nn.functional.gelu(x)).abs().max() > 1e-5


@on_each_device
def test_padded_vocab_matches_unpadded(device):
    cfg = tiny_model_config(vocab_size=37)
    reference = GPT(cfg)
    padded = GPT(tiny_model_config(vocab_size=37, vocab_pad_multiple=64))
    assert padded.transformer.wte.weight.shape[0] == padded.padded_vocab == 64
    state = reference.state_dict()
    with torch.no_grad():
        own = padded.state_dict()
        for k, v in state.items():
            if k in ("transformer.wte.weight", "lm_head.weight"):
                own[k][:37].copy_(v)
                own[k][37:].normal_(std=5.0)  # large junk rows must still never win
            else:
                own[k].copy_(v)
    reference, padded = reference.to(device), padded.to(device)
    x, y = batch(cfg, device=device)
    ref_logits, ref_loss = reference(x, y)
    pad_logits, pad_loss = padded(x, y)
    assert pad_logits.shape[-1] == 37
    tol = {} if device == "cpu" else LOGITS_TOL[device]  # CPU: assert_close's float32 defaults
    torch.testing.assert_close(pad_logits, ref_logits, **tol)
    torch.testing.assert_close(pad_loss, ref_loss, **tol)


@pytest.mark.parametrize("attention,mask", [("scratch", "buffer"), ("sdpa", "buffer"),
                                            ("sdpa", "on_the_fly"), ("scratch", "on_the_fly")])
@on_each_device
def test_kv_cache_matches_full_forward(attention, mask, device):
    cfg = tiny_model_config(attention=attention, causal_mask=mask)
    model = GPT(cfg).to(device).eval()
    x, _ = batch(cfg, B=2, device=device)
    full, _ = model(x)
    cache = new_kv_cache(model, 2)
    model(x.flip(1), kv_cache=cache)  # stale keys in every slot: each is masked or overwritten
    prefix, _ = model(x[:, :5], kv_cache=cache)  # a multi-token prefill at 0..4 ...
    steps = [model(x[:, t:t + 1], kv_cache=cache, input_pos=torch.tensor([t], device=device))[0]
             for t in range(5, cfg.block_size)]
    cached = torch.cat([prefix] + steps, dim=1)  # ... then one token at a time
    torch.testing.assert_close(cached, full, **LOGITS_TOL[device])
    assert cache.kv[0].shape == (2, 2, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)


def test_crop_block_size_keeps_the_first_positions():
    cfg = tiny_model_config()  # block_size 16, causal mask buffer
    model = GPT(cfg).eval()
    x, _ = batch(cfg, B=2, T=8)
    before, _ = model(x)
    first = model.transformer.wpe.weight[:8].clone()
    model.crop_block_size(8)
    assert torch.equal(model.transformer.wpe.weight, first)
    assert model.transformer.h[0].attn.mask.shape == (8, 8)
    torch.testing.assert_close(model(x)[0], before, atol=0, rtol=0)
    with pytest.raises(ValueError, match="longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_too_long_input_is_refused():
    cfg = tiny_model_config()
    model = GPT(cfg)
    with pytest.raises(ValueError, match="longer than block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_rule():
    cfg = tiny_model_config()
    model = GPT(cfg)
    n = model.num_params(non_embedding=False) - cfg.block_size * cfg.n_embd
    assert model.flops_per_token() == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def test_weight_decay_groups():
    model = GPT(tiny_model_config())
    decay, no_decay = model.optimizer_groups(0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params(non_embedding=False)


def test_every_activation_config_offers_is_in_model_activations():
    """config.py (torch-free) names the choices; model.ACTIVATIONS holds their code."""
    offered = next(f.metadata["choices"] for f in dataclasses.fields(ModelConfig)
                   if f.name == "activation")
    assert set(offered) == set(ACTIVATIONS)
