"""The speedup flags not covered in test_model.py: fused AdamW, torch.compile, autocast precision,
the auto micro-batch search, the SDPA kernel report, the banner and peak memory.

(Mask buffer vs on the fly, scratch vs SDPA attention, scratch vs native LayerNorm/GELU and padded
vs unpadded vocab are checked against the reference in test_model.py.)
"""
from __future__ import annotations

import math
import shutil
import sys

import pytest
import torch

import bench
import runtime
import speedups
from config import Config, SystemConfig
from conftest import tiny_model_config
from model import GPT


def tiny_batch(cfg, B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    return x, y


def cpu_runtime(dtype: str = "float32") -> runtime.Runtime:
    return runtime.setup(SystemConfig(device="cpu", dtype=dtype))


def test_fused_adamw_matches_the_per_parameter_loop():
    """Same weights, same gradients, five steps: fused=True lands on the same parameters."""
    import train
    cfg = Config()
    cfg.model = tiny_model_config()
    reference = GPT(cfg.model)
    fused = GPT(cfg.model)
    fused.load_state_dict(reference.state_dict())
    opt_ref, note_ref = train.make_optimizer(reference, cfg, torch.device("cpu"))
    cfg.train.fused_adamw = True
    opt_fused, note_fused = train.make_optimizer(fused, cfg, torch.device("cpu"))
    assert (note_ref, note_fused) == ("off", "on")
    assert opt_fused.defaults["fused"] and not opt_ref.defaults["foreach"]
    for step in range(5):
        x, y = tiny_batch(cfg.model, seed=step)
        for model, opt in ((reference, opt_ref), (fused, opt_fused)):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    start = GPT(cfg.model)  # the update really moved the weights
    assert not torch.allclose(start.lm_head.weight, reference.lm_head.weight)
    for (name, p_ref), (_, p_fused) in zip(reference.named_parameters(),
                                           fused.named_parameters()):
        torch.testing.assert_close(p_fused, p_ref, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_matches_eager():
    """Forward only: compiling the backward too would double the suite's longest test."""
    cfg = tiny_model_config(n_layer=1, attention="sdpa", causal_mask="on_the_fly")
    eager = GPT(cfg)
    twin = GPT(cfg)
    twin.load_state_dict(eager.state_dict())
    compiled, note = speedups.compile_model(twin, SystemConfig(compile=True), cpu_runtime())
    assert note == "default" and compiled is not twin
    x, y = tiny_batch(cfg)
    logits, loss = eager(x, y)
    c_logits, c_loss = compiled(x, y)
    torch.testing.assert_close(c_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_logits, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_autocast_loss_close_to_float32(dtype, tolerance):
    cfg = tiny_model_config(n_embd=32, vocab_size=65)
    model = GPT(cfg)
    x, y = tiny_batch(cfg)
    _, loss32 = model(x, y)
    rt = cpu_runtime(dtype)
    with rt.autocast():
        logits, loss = model(x, y)
    assert logits.dtype == runtime.DTYPES[dtype]  # the matmuls really ran in low precision
    assert loss.dtype == torch.float32  # the loss is always computed in float32
    assert loss.item() != loss32.item()
    assert abs(loss.item() - loss32.item()) < tolerance * loss32.item()


def test_float16_training_step_with_grad_scaler():
    """float16 scales the loss before backward and unscales before the update: the step lands
    close to the float32 one."""
    cfg = Config()
    cfg.model = tiny_model_config(n_embd=32)
    cfg.train.grad_clip = 0.0
    models, losses = {}, {}
    for dtype in ("float32", "float16"):
        torch.manual_seed(0)
        model = GPT(cfg.model)
        rt = cpu_runtime(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10,
                                      enabled=rt.dtype == torch.float16)
        x, y = tiny_batch(cfg.model)
        with rt.autocast():
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        if dtype == "float16":  # the gradients carry the scale until unscaled
            assert model.lm_head.weight.grad.abs().max() > 10
        scaler.step(opt)
        scaler.update()
        models[dtype], losses[dtype] = model, loss.item()
    assert math.isfinite(losses["float16"])
    for (name, p), (_, q) in zip(models["float32"].named_parameters(),
                                 models["float16"].named_parameters()):
        torch.testing.assert_close(q, p, atol=2e-3, rtol=1e-2, msg=name)


def test_micro_batch_search_finds_largest_divisor_in_few_trials():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 13

    assert speedups.split_global_batch(48, fits) == (12, 4)  # 16 does not fit, 12 divides 48
    assert len(tried) <= 4  # binary search over the 10 divisors of 48
    assert speedups.split_global_batch(64, lambda b: True) == (64, 1)
    assert speedups.split_global_batch(64, lambda b: False) is None


def test_gradient_accumulation_keeps_the_global_batch():
    """4 micro-batches of 2 then one update == one micro-batch of 8: what batch_size_auto relies
    on to change the micro-batch without changing the training."""
    cfg = Config()
    cfg.model = tiny_model_config()
    x, y = tiny_batch(cfg.model, B=8)
    rt = cpu_runtime()

    class Feed:  # hands out the micro-batches in order, as Batches.next() would
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def next(self):
            return self.chunks.pop(0) if self.chunks else (x[:1], y[:1])

    results = []
    for micro, accum in ((8, 1), (2, 4)):
        torch.manual_seed(0)
        model = GPT(cfg.model)
        cfg.train.batch_size, cfg.train.grad_accum_steps = micro, accum
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        chunks = list(zip(x.split(micro), y.split(micro)))
        loss, norm, _ = bench.train_step(model, model, opt, scaler, Feed(chunks[1:]), chunks[0],
                                         1e-2, cfg, rt)
        results.append((loss, norm, model))
    (loss_a, norm_a, a), (loss_b, norm_b, b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(norm_b, norm_a)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


def test_auto_micro_batch_off_cuda_says_what_it_kept():
    cfg = Config()
    cfg.model = tiny_model_config()
    cfg.train.batch_size, cfg.train.grad_accum_steps = 8, 3
    model = GPT(cfg.model)
    assert speedups.auto_micro_batch(cfg, model, cpu_runtime()) == "8x3"
    cfg.train.batch_size_auto = True
    note = speedups.auto_micro_batch(cfg, model, cpu_runtime())
    assert note == "8x3 (batch_size_auto needs CUDA: kept)"
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (8, 3)


@pytest.mark.parametrize("attention,mask,expected", [
    ("sdpa", "on_the_fly", ["flash (cpu)"]),
    ("sdpa", "buffer", ["flash (cpu)"]),  # on CPU the flash kernel takes a boolean mask too
    ("scratch", "buffer", []),
])
def test_attention_kernel_report(attention, mask, expected):
    model = GPT(tiny_model_config(attention=attention, causal_mask=mask))
    assert speedups.probe_attention(model, cpu_runtime(), micro_batch=2) == expected
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no trace
    x, y = tiny_batch(model.config)
    assert speedups.attention_kernels(lambda: model(x, y)[1].backward()) == expected


def test_banner_names_every_flag_and_each_fallback():
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=65, vocab_pad_multiple=64)
    cfg.system = SystemConfig(device="cpu", tf32=True)
    cfg.data.pin_memory = True
    cfg.train.batch_size_auto = True
    rt = runtime.setup(cfg.system)
    model = GPT(cfg.model)
    batch_note = speedups.auto_micro_batch(cfg, model, rt)
    values = speedups.settings(cfg, rt, "on", "off", batch_note, ["flash (cpu)"])
    assert list(values) == ["device", "causal_mask", "tf32", "fused_adamw", "pin_memory", "dtype",
                            "norm", "gelu", "attention", "compile", "vocab", "batch"]
    line = speedups.banner(values, rt.notes)
    for part in ("tf32=off", "pin_memory=off (needs CUDA)", "vocab=65->128",
                 "batch=32x1 (batch_size_auto needs CUDA: kept)", "attention=scratch [flash (cpu)]",
                 "[tf32 needs CUDA: off]"):
        assert part in line, part
    same = speedups.effective(values)
    assert same["pin_memory"] == "off" and same["batch"] == "32x1"


def test_compile_without_a_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(speedups.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    model = GPT(tiny_model_config())
    with pytest.raises(runtime.SetupError, match="--compile=false"):
        speedups.compile_model(model, SystemConfig(compile=True), cpu_runtime())
    assert speedups.compile_model(model, SystemConfig(compile=False), cpu_runtime()) == \
        (model, "off")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset is Linux's")
def test_cpu_peak_memory_tracks_and_resets():
    device = torch.device("cpu")
    speedups.reset_peak_memory(device)
    before = speedups.peak_memory(device)["rss"]
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    peak = speedups.peak_memory(device)["rss"]
    assert peak >= before + 200 * 2**20
    speedups.reset_peak_memory(device)
    assert speedups.peak_memory(device)["rss"] < peak - 100 * 2**20
