"""model.loss=chunked against the full logits: the same loss and gradients (padded vocabulary,
ignored targets, bf16 autocast, a training step), our fallback against torch's
F.linear_cross_entropy, the memory estimate, and logits_at (the LM head at chosen positions)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from config import Config, ConfigError, load_config
from conftest import tiny_model_config
from engine import device as machine
from engine.inference.kv_cache import new_kv_cache
from engine.training import chunked_loss, memory_estimate
from engine.training.chunked_loss import ChunkedCrossEntropy
from engine.training.step import Trainer, train_step
from model import GPT, IGNORE_INDEX

# torch >= 2.13; the same two names chunked_loss_impl asks for
HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn,
                                                                "LinearCrossEntropyOptions")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 200 logits: 5 tokens at the test vocabulary of 37, so every loss has several
    chunks and a short last one."""
    monkeypatch.setattr(chunked_loss, "LOSS_CHUNK_LOGITS", 200)


def twins(pad: int = 1, **overrides) -> tuple[GPT, GPT]:
    """A full-loss and a chunked-loss GPT with the same weights."""
    torch.manual_seed(0)
    full = GPT(tiny_model_config(vocab_pad_multiple=pad, **overrides))
    chunked = GPT(tiny_model_config(vocab_pad_multiple=pad, loss="chunked", **overrides))
    chunked.load_state_dict(full.state_dict())
    return full, chunked


def batch(cfg, B: int = 3, ignored: bool = False, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    if ignored:  # a finetuning mask: the prompt's targets, and a few scattered ones
        y[:, :5] = IGNORE_INDEX
        y[1, 9::3] = IGNORE_INDEX
    return x, y


def loss_and_grads(model: GPT, x, y, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(x, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl, pad, ignored", [
    ("torch", 1, False), ("torch", 1, True),  # torch's cannot leave padded logits out
    ("ours", 1, False), ("ours", 64, False), ("ours", 1, True), ("ours", 64, True)])
def test_chunked_equals_full_loss_and_every_gradient(pad, ignored, impl, small_chunks,
                                                     monkeypatch):
    """float32, several chunks: equal to 1e-5; the padded rows get no gradient, as in full."""
    if impl == "torch" and not HAS_TORCH_LCE:
        pytest.skip("this torch has no F.linear_cross_entropy (torch >= 2.13)")
    monkeypatch.setattr(chunked_loss, "chunked_loss_impl",
                        lambda dtype, cap=0.0, padded=False: impl)
    full, chunked = twins(pad)
    x, y = batch(full.config, ignored=ignored)
    _, loss_full, grads_full = loss_and_grads(full, x, y)
    logits, loss, grads = loss_and_grads(chunked, x, y)
    assert logits is None  # with targets, the chunked loss never makes the logits
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_full, rtol=0, atol=1e-5)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=name)
    if pad > 1:
        assert chunked.padded_vocab > chunked.vocab_size
        assert not grads["transformer.wte.weight"][chunked.vocab_size:].any()  # = the LM head


class MatmulShapes(TorchDispatchMode):
    """The shapes of every matrix product dispatched under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cap", [0.0, 15.0])
def test_chunked_loss_multiplies_the_padded_head(cap, small_chunks):
    """model.vocab_pad_multiple pays under the chunked loss too: its products take the head
    with its padded rows (40 of them at vocabulary 37 padded to 8), never the 37 real ones
    alone, and the loss and gradients are still the full path's."""
    full, chunked = twins(8, logit_softcap=cap)
    assert (chunked.vocab_size, chunked.padded_vocab) == (37, 40)
    assert chunked_loss.chunked_loss_impl(torch.float32, padded=True) == "ours"
    x, y = batch(full.config, ignored=True)
    _, loss_full, grads_full = loss_and_grads(full, x, y)
    with MatmulShapes() as seen:
        _, loss, grads = loss_and_grads(chunked, x, y)
    head = [shapes for shapes in seen.shapes if any(40 in s or 37 in s for s in shapes)]
    assert head and all(any(40 in s for s in shapes) for shapes in head), seen.shapes
    assert not any(37 in s for shapes in head for s in shapes)
    torch.testing.assert_close(loss, loss_full, rtol=0, atol=1e-5)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=name)
    assert not grads["transformer.wte.weight"][37:].any()  # the padded rows: no gradient


def test_torch_without_linear_cross_entropy_runs_our_chunk_loop(small_chunks, monkeypatch):
    """torch < 2.13 (the floor is 2.9, the GPU machine's 2.11) has neither name: the chunked
    loss falls back to ChunkedCrossEntropy, with the full loss's value and gradients."""
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions", raising=False)
    assert chunked_loss.chunked_loss_impl(torch.float32) == "ours"
    full, chunked = twins()
    x, y = batch(full.config, ignored=True)
    _, loss_full, grads_full = loss_and_grads(full, x, y)
    _, loss, grads = loss_and_grads(chunked, x, y)
    torch.testing.assert_close(loss, loss_full, rtol=0, atol=1e-5)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=name)


def test_compiled_model_runs_our_chunk_loop_eagerly_with_the_same_loss(small_chunks,
                                                                      monkeypatch):
    """The chunk loop is kept out of the graph (wrapped on first use, not at import)."""
    monkeypatch.setattr(chunked_loss, "chunked_loss_impl",
                        lambda dtype, cap=0.0, padded=False: "ours")
    full, chunked = twins()
    x, y = batch(full.config)
    _, loss_full, grads_full = loss_and_grads(full, x, y)
    torch._dynamo.reset()
    compiled = torch.compile(chunked, backend="eager")
    _, loss, grads = loss_and_grads(compiled, x, y)
    torch.testing.assert_close(loss, loss_full, rtol=0, atol=1e-5)
    for name, g in grads_full.items():
        torch.testing.assert_close(grads["_orig_mod." + name], g, rtol=0, atol=1e-5)


def test_chunked_under_bf16_autocast_matches_full(small_chunks):
    """Both paths run the head's matmuls in bf16 and the softmax in float32, from the same
    bf16-rounded logits: the loss agrees to float32 rounding (it is not rounded to bf16, as
    torch's fused op returns it). The gradients agree to bf16 rounding: the chunked path rounds
    the head's gradient per chunk, the full path once over all tokens, and bf16 matmuls of other
    shapes sum in another order (measured 2e-3 of each gradient's largest entry; float32
    gradients differ from these by 1e-2, so the bound still tells the two precisions apart)."""
    full, chunked = twins(64)
    x, y = batch(full.config, ignored=True)
    _, loss_full, grads_full = loss_and_grads(full, x, y, autocast=True)
    _, loss, grads = loss_and_grads(chunked, x, y, autocast=True)
    assert chunked_loss.chunked_loss_impl(torch.bfloat16) == "ours"
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_full, rtol=0, atol=1e-5)
    for name, g in grads_full.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[name], g, rtol=0, atol=5e-3 * scale + 1e-6, msg=name)


@pytest.mark.skipif(not HAS_TORCH_LCE, reason="needs torch's F.linear_cross_entropy (>= 2.13)")
def test_fallback_equals_torch_linear_cross_entropy(small_chunks):
    """ChunkedCrossEntropy (for torch < 2.13) against torch's own, inputs and weight gradients."""
    torch.manual_seed(0)
    x = torch.randn(23, 8, requires_grad=True)
    weight = torch.randn(37, 8, requires_grad=True)
    targets = torch.randint(0, 37, (23,))
    targets[::4] = IGNORE_INDEX
    results = []
    for run in (lambda: ChunkedCrossEntropy.apply(x, weight, targets),
                lambda: F.linear_cross_entropy(x, weight, targets, ignore_index=IGNORE_INDEX,
                                               options=torch.nn.LinearCrossEntropyOptions())):
        loss = run()
        (loss * 3.0).backward()  # a scaled loss (accumulation, GradScaler) scales the gradients
        results.append((loss.detach(), x.grad.clone(), weight.grad.clone()))
        x.grad = weight.grad = None
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_fallback_without_grad_computes_only_the_loss():
    x, weight = torch.randn(10, 8), torch.randn(37, 8)
    targets = torch.randint(0, 37, (10,))
    with torch.no_grad():
        loss = ChunkedCrossEntropy.apply(x, weight, targets)
    torch.testing.assert_close(loss, F.cross_entropy(x @ weight.T, targets), rtol=0, atol=1e-5)


def test_train_step_with_chunked_loss_equals_full(small_chunks):
    """engine.training.step.train_step, 2 micro-steps and clipping: the same loss, gradient norm and
    updated weights (SGD: AdamW's first step, g / |g|, would blow up rounding in near-zero
    gradients)."""
    full, chunked = twins(64)
    rt = machine.Runtime(torch.device("cpu"), torch.float32, False, [])
    x, y = batch(full.config, B=4, ignored=True)
    results = []
    for model in (full, chunked):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        feed = type("Feed", (), {"next": lambda self: (x[2:], y[2:])})()
        trainer = Trainer(model, model, optimizer, scaler, feed, rt, accum_steps=2, grad_clip=0.5)
        r = train_step(trainer, (x[:2], y[:2]), 1.0)
        results.append((r.loss_sum, r.norm))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-5)
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)


def test_chunked_model_gives_logits_without_targets():
    """Generation and HellaSwag call without targets: the chunked model's logits are the full
    model's."""
    full, chunked = twins(64)
    x, _ = batch(full.config)
    with torch.no_grad():
        torch.testing.assert_close(chunked(x)[0], full(x)[0], rtol=0, atol=0)


def test_logits_at_equals_the_full_logits_at_those_positions():
    torch.manual_seed(0)
    model = GPT(tiny_model_config(vocab_pad_multiple=64)).eval()
    x, y = batch(model.config)
    at = torch.tensor([15, 3, 0])
    with torch.no_grad():
        full, _ = model(x)
        part, loss = model(x, logits_at=at)
        assert part.shape == (3, 3, model.vocab_size) and loss is None
        torch.testing.assert_close(part, full[:, at], rtol=0, atol=1e-5)
        cache = new_kv_cache(model, 3)
        positions = torch.arange(12)  # the head at a prefill's last position, as sampling's
        last, _ = model(x[:, :12], kv_cache=cache, input_pos=positions, logits_at=positions[-1:])
        torch.testing.assert_close(last, full[:, 11:12], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="pass targets or logits_at, not both"):
        model(x, y, logits_at=at)


def test_memory_estimate_counts_one_chunk():
    """GPT-2's head at 4 x 1024 tokens: the full path's logits term is the whole (tokens, vocab)
    three times; the chunked one chunk of 667 tokens' float32 logits (+ a bf16 copy under
    autocast), the input gradient and the float32 head gradient."""
    cfg, _ = load_config(["--config", "gpt2_124m", "--batch_size=4", "--dtype=float32"])
    assert cfg.model.loss == "chunked"
    tokens, C, V, padded = 4 * 1024, 768, 50257, 50304
    chunked = memory_estimate.estimate(cfg).logits  # the padded head, multiplied whole
    assert chunked == 667 * padded * 4 + 4 * tokens * C + 4 * padded * C  # 287 MiB
    cfg.system.dtype = "bfloat16"
    assert memory_estimate.estimate(cfg).logits == (667 * padded * 6 + 2 * tokens * C
                                                    + 4 * padded * C)
    cfg.system.dtype, cfg.model.loss = "float32", "full"
    assert memory_estimate.estimate(cfg).logits == tokens * (4 * padded + 8 * V)  # 2.30 GiB
    assert memory_estimate.estimate(cfg).logits > 8 * chunked


def test_loss_choice_is_validated():
    assert Config().model.loss == "full"  # the reference path stays the default
    with pytest.raises(ConfigError, match="model.loss=.fused. is not one of full, chunked"):
        load_config(["--config", "tiny", "--loss=fused"])
