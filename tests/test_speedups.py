"""The speedup flags not covered in test_model.py: fused AdamW, torch.compile, autocast precision
and the gradient scaler, TF32, pinned memory, the auto micro-batch search, which SDPA kernel runs,
the banner and peak memory. Each runs on the CPU and, where there is one, on CUDA against the
same reference; what exists only on CUDA (TF32, the Flash kernel, the auto micro-batch search,
CUDA peak memory) is tested there (marked `cuda`, skipped elsewhere), each beside a CPU half that
checks what needs no GPU (settings, arguments, the search's arithmetic) with torch.cuda's
questions answered as a GPU would (conftest's as_a_gpu).

(Mask buffer vs on the fly, scratch vs SDPA attention, scratch vs native LayerNorm/GELU and padded
vs unpadded vocab are checked against the reference in test_model.py.)
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

from config import Config, SystemConfig
from conftest import (HAS_CXX, narrowed_below_amx, on_each_device, tiny_default_model_config,
                      tiny_model_config)
from data.loader import Batches, load_meta
from engine import compiling
from engine import device as machine
from engine.benchmarks import measure, timing
from engine.training import auto_batch, optim, speedups
from engine.training.step import Trainer, train_step
from model import GPT

HAS_TRITON = importlib.util.find_spec("triton") is not None


def tiny_batch(cfg, B=4, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same tokens on every device
    x = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g)
    return x.to(device), y.to(device)


def device_runtime(device: str = "cpu", dtype: str = "float32", **system) -> machine.Runtime:
    return machine.setup(SystemConfig(device=device, dtype=dtype, **system))


def cpu_runtime(dtype: str = "float32") -> machine.Runtime:
    return device_runtime("cpu", dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor (float32 norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@on_each_device
def test_fused_adamw_matches_the_per_parameter_loop(device):
    """Same weights, same gradients, five steps: fused=True lands on the same parameters."""
    cfg = Config()
    cfg.model = tiny_model_config()
    reference = GPT(cfg.model).to(device)
    fused = GPT(cfg.model)
    fused.load_state_dict(reference.state_dict())
    fused.to(device)
    start = [p.detach().clone() for p in reference.parameters()]
    opt_ref = optim.make_optimizer(reference, cfg, torch.device(device))
    note_ref = optim.fused_note(opt_ref, cfg)
    cfg.train.fused_adamw = True
    opt_fused = optim.make_optimizer(fused, cfg, torch.device(device))
    assert (note_ref, optim.fused_note(opt_fused, cfg)) == ("off", "on")
    assert opt_fused.defaults["fused"] and not opt_ref.defaults["foreach"]
    for step in range(5):
        x, y = tiny_batch(cfg.model, seed=step, device=device)
        for model, opt in ((reference, opt_ref), (fused, opt_fused)):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    moved = [not torch.allclose(a, p) for a, p in zip(start, reference.parameters())]
    assert all(moved)  # the updates really changed every parameter
    tol = dict(atol=1e-6, rtol=1e-5) if device == "cpu" else dict(atol=1e-5, rtol=1e-4)
    for (name, p_ref), (_, p_fused) in zip(reference.named_parameters(),
                                           fused.named_parameters()):
        torch.testing.assert_close(p_fused, p_ref, **tol, msg=name)


@on_each_device
def test_compiled_matches_eager(device):
    """Forward only: compiling the backward too would double the suite's longest test."""
    if device == "cpu" and not HAS_CXX:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    if device == "cuda" and not HAS_TRITON:
        pytest.skip("torch.compile on CUDA needs Triton (pip install triton)")
    cfg = tiny_model_config(n_layer=1, attention="sdpa", causal_mask="on_the_fly")
    rt = device_runtime(device)
    eager = GPT(cfg).to(device)
    twin = GPT(cfg)
    twin.load_state_dict(eager.state_dict())
    twin.to(device)
    compiled, note = compiling.compile_model(twin, SystemConfig(compile=True), rt)
    assert note == "default" and compiled is not twin
    x, y = tiny_batch(cfg, device=device)
    logits, loss = eager(x, y)
    c_logits, c_loss = compiled(x, y)
    torch.testing.assert_close(c_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_logits, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not HAS_CXX, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_default_model_matches_eager_with_every_gradient():
    """The default run's model (tiny_default_model_config) training through inductor: logits,
    loss and every parameter's gradient as eager's, to float32 rounding (each gradient within
    1e-4 of its largest; 6e-6 seen here). The U-net skip and smear weights are drawn away from
    their 0, else their paths add nothing to the forward or to the other gradients. One
    compile: the forward and its backward."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # a fresh cache: no earlier test's graphs, no recompile limit reached
    eager = GPT(tiny_default_model_config())
    with torch.no_grad():
        eager.skip_weights.normal_()
        eager.smear_weights.normal_()
    twin = GPT(eager.config)
    twin.load_state_dict(eager.state_dict())
    compiled, _ = compiling.compile_model(twin, SystemConfig(compile=True), cpu_runtime())
    x, y = tiny_batch(eager.config)
    logits, loss = eager(x, y)
    c_logits, c_loss = compiled(x, y)
    loss.backward()
    c_loss.backward()
    assert counters["stats"]["unique_graphs"] >= 1  # inductor ran (not a silent fallback)
    torch._dynamo.reset()
    torch.testing.assert_close(c_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_logits, logits, atol=1e-5, rtol=1e-4)
    for (name, p), (_, c) in zip(eager.named_parameters(), twin.named_parameters()):
        scale = p.grad.abs().max()
        assert scale > 0, name  # every parameter takes part
        torch.testing.assert_close(c.grad, p.grad, rtol=0, atol=1e-4 * float(scale),
                                   msg=lambda detail: f"{name}: {detail}")


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 2e-2), ("float16", 5e-3)])
@on_each_device
def test_autocast_loss_close_to_float32(dtype, tolerance, device):
    cfg = tiny_model_config(n_embd=32, vocab_size=65)
    model = GPT(cfg).to(device)
    x, y = tiny_batch(cfg, device=device)
    _, loss32 = model(x, y)
    rt = device_runtime(device, dtype)
    with rt.autocast():
        logits, loss = model(x, y)
    assert logits.dtype == machine.DTYPES[dtype]  # the matmuls really ran in low precision
    assert loss.dtype == torch.float32  # the loss is always computed in float32
    assert loss.item() != loss32.item()
    assert abs(loss.item() - loss32.item()) < tolerance * loss32.item()


@on_each_device
def test_float16_training_step_with_grad_scaler(device):
    """float16 scales the loss before backward and unscales before the update: the step lands
    close to the float32 one."""
    cfg = Config()
    cfg.model = tiny_model_config(n_embd=32)
    cfg.train.grad_clip = 0.0
    models, losses = {}, {}
    for dtype in ("float32", "float16"):
        torch.manual_seed(0)
        model = GPT(cfg.model).to(device)
        rt = device_runtime(device, dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10,
                                      enabled=rt.dtype == torch.float16)
        x, y = tiny_batch(cfg.model, device=device)
        with rt.autocast():
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        if dtype == "float16":  # the gradients carry the scale until unscaled
            assert model.lm_head.weight.grad.abs().max() > 10
        scaler.step(opt)
        scaler.update()
        if dtype == "float16":  # no overflow: the step was taken and the scale kept
            assert scaler.get_scale() == 2.0**10
        models[dtype], losses[dtype] = model, loss.item()
    assert math.isfinite(losses["float16"])
    for (name, p), (_, q) in zip(models["float32"].named_parameters(),
                                 models["float16"].named_parameters()):
        torch.testing.assert_close(q, p, atol=2e-3, rtol=1e-2, msg=name)


@on_each_device
def test_grad_scaler_skips_an_overflowing_float16_step(device):
    """A loss scale so large that the float16 gradients overflow: the update is skipped (the
    weights stay as they were) and the scale halves, which is what train.optimizer_step relies
    on when it calls scaler.update() after a skipped step."""
    cfg = tiny_model_config(n_embd=32)
    model = GPT(cfg).to(device)
    before = [p.detach().clone() for p in model.parameters()]
    rt = device_runtime(device, "float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**40)
    x, y = tiny_batch(cfg, device=device)
    with rt.autocast():
        _, loss = model(x, y)
    scaler.scale(loss).backward()  # ~2**40 / 64 per logit: past float16's 65504
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    for name, (p0, p) in zip([n for n, _ in model.named_parameters()],
                             zip(before, model.parameters())):
        assert torch.equal(p0, p), name


def test_tf32_switch_sets_the_cuda_matmul_precision(as_a_gpu):
    """The CPU half of test_tf32_switch_acts_on_cuda_matmuls: machine.setup on a CUDA device
    sets cuBLAS's and cuDNN's TF32 switches to system.tf32 (off unless asked for, also when a
    previous setup left them on), and the banner says so; on a GPU older than Ampere they stay
    off with the reason."""
    cfg = Config()
    cfg.model = tiny_model_config()
    rt = device_runtime("cuda", tf32=True)
    assert (rt.device.type, rt.dtype, rt.tf32, rt.notes) == ("cuda", torch.float32, True, [])
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert speedups.settings(cfg, rt, speedups.Notes())["tf32"] == "on"
    rt = device_runtime("cuda")
    assert not rt.tf32 and rt.notes == []
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert speedups.settings(cfg, rt, speedups.Notes())["tf32"] == "off"
    as_a_gpu((7, 0), "Tesla V100-SXM2-16GB")
    torch.backends.cuda.matmul.allow_tf32 = True
    rt = device_runtime("cuda", tf32=True)
    assert not rt.tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert rt.notes == ["tf32 needs an Ampere or newer GPU, not Tesla V100-SXM2-16GB: off"]


@pytest.mark.cuda
def test_tf32_switch_acts_on_cuda_matmuls():
    """system.tf32, read in machine.setup: off keeps float32 matmuls exact to float32 rounding;
    on lets cuBLAS round the inputs to TF32 (10-bit mantissa): close to float32, not equal.
    (The GPU half: what the switches do to the products.)"""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"TF32 needs an Ampere or newer GPU, not {torch.cuda.get_device_name()}")
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1024, 1024, generator=g).cuda() for _ in range(2))
    exact = a.double() @ b.double()
    rt = device_runtime("cuda", tf32=False)
    assert not rt.tf32 and not torch.backends.cuda.matmul.allow_tf32
    full = a @ b
    rt = device_runtime("cuda", tf32=True)
    assert rt.tf32 and torch.backends.cuda.matmul.allow_tf32
    fast = a @ b
    full_error = (full.double() - exact).abs().max().item()
    fast_error = (fast.double() - exact).abs().max().item()
    assert fast_error > 10 * full_error  # TF32 really ran
    assert relative_error(fast, full) < 1e-2  # and stayed close
    cfg = tiny_model_config(n_embd=64, vocab_size=65)
    model = GPT(cfg).cuda()
    x, y = tiny_batch(cfg, device="cuda")
    _, loss_tf32 = model(x, y)
    device_runtime("cuda", tf32=False)
    _, loss32 = model(x, y)
    assert loss_tf32.item() == pytest.approx(loss32.item(), rel=1e-3)


@on_each_device
def test_pinned_batches_equal_the_plain_ones(char_dataset, device):
    """data.pin_memory: rows in page-locked host memory copied with non_blocking=True are the
    batches the plain loader reads; off CUDA the flag falls back to the plain copy and says so."""
    meta = load_meta(str(char_dataset))
    plain = Batches(meta, "train", 4, 16, seed=3)  # CPU tensors, no pinning
    pinned = Batches(meta, "train", 4, 16, seed=3, device=device, pin_memory=True)
    assert pinned.pin_memory == (device == "cuda")
    for _ in range(3):
        x, y = pinned.next()
        assert x.device.type == device
        # .cpu() is queued on the stream behind the non-blocking copy: it sees the copied rows
        for a, b in zip(plain.next(), (x, y)):
            assert torch.equal(a, b.cpu())
    cfg = Config()
    cfg.model = tiny_model_config()
    cfg.data.pin_memory = True
    values = speedups.settings(cfg, device_runtime(device), speedups.Notes(batch="8x1"))
    assert values["pin_memory"] == ("on" if device == "cuda" else "off (needs CUDA)")


def test_micro_batch_search_finds_largest_divisor_in_few_trials():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 13

    assert auto_batch.split_global_batch(48, fits) == (12, 4)  # 16 does not fit, 12 divides 48
    assert len(tried) <= 4  # binary search over the 10 divisors of 48
    assert auto_batch.split_global_batch(64, lambda b: True) == (64, 1)
    assert auto_batch.split_global_batch(64, lambda b: False) is None


@on_each_device
def test_gradient_accumulation_keeps_the_global_batch(device):
    """4 micro-batches of 2 then one update == one micro-batch of 8: what batch_size_auto relies
    on to change the micro-batch without changing the training."""
    cfg = Config()
    cfg.model = tiny_model_config()
    x, y = tiny_batch(cfg.model, B=8, device=device)
    rt = device_runtime(device)

    class Feed:  # hands out the micro-batches in order, as Batches.next() would
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def next(self):
            return self.chunks.pop(0) if self.chunks else (x[:1], y[:1])

    results = []
    for micro, accum in ((8, 1), (2, 4)):
        torch.manual_seed(0)
        model = GPT(cfg.model).to(device)
        cfg.train.batch_size, cfg.train.grad_accum_steps = micro, accum
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device, enabled=False)
        chunks = list(zip(x.split(micro), y.split(micro)))
        trainer = Trainer(model, model, opt, scaler, Feed(chunks[1:]), rt, accum,
                          cfg.train.grad_clip)
        r = train_step(trainer, chunks[0], 1e-2)
        results.append((r.loss_sum / accum, r.norm, model))
    (loss_a, norm_a, a), (loss_b, norm_b, b) = results
    tol = dict(atol=1e-6, rtol=1e-5) if device == "cpu" else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss_b, loss_a, **tol)
    torch.testing.assert_close(norm_b, norm_a, **tol)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q, p, **tol, msg=name)


def test_auto_micro_batch_off_cuda_says_what_it_kept():
    cfg = Config()
    cfg.model = tiny_model_config()
    cfg.train.batch_size, cfg.train.grad_accum_steps = 8, 3
    model = GPT(cfg.model)
    assert auto_batch.auto_micro_batch(cfg, model, cpu_runtime()) == "8x3"
    cfg.train.batch_size_auto = True
    note = auto_batch.auto_micro_batch(cfg, model, cpu_runtime())
    assert note == "8x3 (batch_size_auto needs CUDA: kept)"
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (8, 3)


def test_batch_search_counts_a_library_allocation_failure_as_not_fitting(monkeypatch):
    """The trial step's device half, on a CPU: cuBLAS failing to allocate its workspace (a plain
    RuntimeError) means "does not fit", as OutOfMemoryError does; any other error propagates."""
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 100)
    model, rt = GPT(tiny_model_config()), cpu_runtime()
    errors = {4: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                              "`cublasCreate(handle)`"),
              8: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
              16: RuntimeError("CUDA error: an illegal memory access was encountered")}

    def trial(model, rt, micro_batch):
        if micro_batch in errors:
            raise errors[micro_batch]

    monkeypatch.setattr(auto_batch, "_trial_step", trial)
    assert auto_batch._fits(model, rt, 2, budget=1000)
    assert not auto_batch._fits(model, rt, 4, budget=1000)  # cuBLAS could not allocate
    assert not auto_batch._fits(model, rt, 8, budget=1000)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        auto_batch._fits(model, rt, 16, budget=1000)  # a real error is not "too big"


def test_auto_micro_batch_searches_a_fake_memory_probe(as_a_gpu, monkeypatch, capsys):
    """The CPU half of test_auto_micro_batch_finds_the_largest_size_that_fits: the search on a
    CUDA runtime (torch.cuda's answers a GPU would give), its trial step replaced by one that
    'reserves' 12 MiB a sequence and leaves gradients. The budget is MEMORY_HEADROOM x (free +
    reserved) = 0.9 x 120 MiB: 8 sequences fit, 16 do not; with no room for one, the error
    says what to do; the trials' gradients never stay."""
    per_sequence, peak, tried = 12 * 2**20, [0], []
    memory = {"mem_get_info": lambda device=None: (100 * 2**20, 140 * 2**30),
              "memory_reserved": lambda device=None: 20 * 2**20,
              "max_memory_reserved": lambda device=None: peak[0],
              "empty_cache": lambda: None, "reset_peak_memory_stats": lambda device=None: None,
              "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
              "set_rng_state": lambda state, device="cuda": None}
    for name, answer in memory.items():
        monkeypatch.setattr(torch.cuda, name, answer)

    def trial(model, rt, micro_batch):
        assert rt.device.type == "cuda"
        tried.append(micro_batch)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        peak[0] = micro_batch * per_sequence

    monkeypatch.setattr(auto_batch, "_trial_step", trial)
    cfg = Config()
    cfg.model = tiny_model_config()
    model, rt = GPT(cfg.model), device_runtime("cuda")
    cfg.train.batch_size, cfg.train.grad_accum_steps = 4, 16
    assert auto_batch.auto_micro_batch(cfg, model, rt) == "4x16" and tried == []  # flag off
    cfg.train.batch_size_auto = True
    assert auto_batch.auto_micro_batch(cfg, model, rt) == "8x8 (auto, of 64 per step)"
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (8, 8)
    assert tried == [8, 32, 16]  # a binary search over the 7 divisors of 64
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert "largest micro-batch dividing 64 that fits" in capsys.readouterr().out
    per_sequence = 2**30
    with pytest.raises(machine.SetupError, match=r"not even a micro-batch of 1 sequence of 16 "
                       r"tokens fits in 0\.1 GiB; use a smaller model"):
        auto_batch.auto_micro_batch(cfg, model, rt)


def test_trial_step_trains_at_the_micro_batch_and_leaves_no_gradients(monkeypatch):
    """The CPU half of the search's trial step (_fits around _trial_step, unchanged): a forward
    and backward at the micro-batch, waiting for the runtime's device; fitting is the peak it
    reserved against the budget; the gradients go."""
    synced, batches, backward = [], [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 100)
    model = GPT(tiny_model_config())
    model.transformer.wte.register_forward_hook(lambda m, i, o: batches.append(i[0].shape))
    model.lm_head.weight.register_hook(lambda grad: backward.append(grad.dtype))
    rt = cpu_runtime()
    assert auto_batch._fits(model, rt, 3, budget=100)
    assert not auto_batch._fits(model, rt, 3, budget=99)
    assert batches == [(3, model.config.block_size)] * 2
    assert backward == [torch.float32] * 2 and synced == [torch.device("cpu")] * 2
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.cuda
def test_auto_micro_batch_finds_the_largest_size_that_fits(monkeypatch):
    """train.batch_size_auto on CUDA: with room for all of it, the whole global batch in one
    micro-batch; with room for 8 sequences (what a trial step at 8 reserved, +10%), 8 x 8.
    (The GPU half: real trial steps against the allocator's peaks.)"""
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=4096, block_size=256, n_embd=64)  # ~12 MiB/sequence
    rt = device_runtime("cuda")
    model = GPT(cfg.model).to(rt.device)
    cfg.train.batch_size, cfg.train.grad_accum_steps = 4, 16
    assert auto_batch.auto_micro_batch(cfg, model, rt) == "4x16"  # the flag is off: kept
    cfg.train.batch_size_auto = True
    assert auto_batch.auto_micro_batch(cfg, model, rt) == "64x1 (auto, of 64 per step)"
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (64, 1)
    assert all(p.grad is None for p in model.parameters())  # the trials leave no gradients
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    auto_batch._trial_step(model, rt, 8)
    need = torch.cuda.max_memory_reserved()
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    # auto_micro_batch's budget is MEMORY_HEADROOM x (free + reserved): make it 1.1 x need
    monkeypatch.setattr(auto_batch, "MEMORY_HEADROOM",
                        1.1 * need / (free + torch.cuda.memory_reserved()))
    cfg.train.batch_size, cfg.train.grad_accum_steps = 4, 16
    assert auto_batch.auto_micro_batch(cfg, model, rt) == "8x8 (auto, of 64 per step)"
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (8, 8)


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
    assert measure.profiled_attention_kernels(lambda: model(x, y)[1].backward()) == expected
    assert speedups.attention_kernels(lambda: model(x, y)[1].backward()) == expected


FLASH_CASES = [
    ("bfloat16", "on_the_fly", True),
    ("float16", "on_the_fly", True),
    ("float32", "on_the_fly", False),  # the Flash kernel takes 16-bit inputs only
    ("bfloat16", "buffer", False),  # and no mask tensor: is_causal=True is what lets it run
]


def flash_case_model(mask: str) -> GPT:
    return GPT(tiny_model_config(n_embd=128, n_head=2, block_size=64, attention="sdpa",
                                 causal_mask=mask))  # head size 64, as GPT-2's


@pytest.mark.parametrize("dtype,mask,flash", FLASH_CASES)
def test_sdpa_inputs_suit_flash_where_cuda_should_pick_it(dtype, mask, flash, monkeypatch):
    """The CPU half of test_sdpa_picks_flash_on_cuda_for_16_bit_causal_attention: in that
    probe, what the model hands F.scaled_dot_product_attention meets the CUDA Flash kernel's
    conditions on its inputs (4-D query, key and value, all float16 or all bfloat16, head size
    a multiple of 8 up to 256, the last dimension contiguous, no mask tensor, is_causal)
    exactly in the cases that test expects Flash."""
    import model as model_module
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa, calls = model_module.F.scaled_dot_product_attention, []

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        calls.append((q, k, v, attn_mask, is_causal))
        with sdpa_kernel(SDPBackend.MATH):  # any kernel: the inputs are what is checked
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", recorded)
    kernels = speedups.probe_attention(flash_case_model(mask), cpu_runtime(dtype), micro_batch=2)
    assert len(calls) == 1 and kernels == []  # the math kernel decomposes out of sight
    q, k, v, attn_mask, is_causal = calls[0]
    assert q.dtype == k.dtype == v.dtype == machine.DTYPES[dtype]  # autocast reached them
    suits_flash = (q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None
                   and is_causal and all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v))
                   and q.size(-1) % 8 == 0 and q.size(-1) <= 256)
    assert suits_flash == flash


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,mask,flash", FLASH_CASES)
def test_sdpa_picks_flash_on_cuda_for_16_bit_causal_attention(dtype, mask, flash):
    """The GPU half: which kernel torch's dispatcher picks for those inputs."""
    if os.environ.get("TORCH_CUDNN_SDPA_PREFERRED") == "1":
        pytest.skip("TORCH_CUDNN_SDPA_PREFERRED=1 puts the cuDNN kernel ahead of Flash")
    model = flash_case_model(mask).cuda()
    kernels = speedups.probe_attention(model, device_runtime("cuda", dtype), micro_batch=2)
    assert kernels, "no scaled_dot_product_attention kernel was recorded"
    assert ("flash" in kernels) == flash, kernels


def test_an_attention_kernel_that_cannot_run_is_one_line_with_the_fix(monkeypatch):
    import model as model_module

    def fails(*args, **kwargs):
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", fails)
    # not the variable itself: torch reads it once, at its first kernel choice in the process
    monkeypatch.setattr(speedups, "kernel_overrides", lambda: {"ATEN_CPU_CAPABILITY": "avx2"})
    model = GPT(tiny_model_config(attention="sdpa"))
    with pytest.raises(machine.SetupError) as error:
        speedups.probe_attention(model, cpu_runtime(), micro_batch=2)
    assert str(error.value) == (
        "--attention=sdpa: torch's attention kernel failed at the training shape in float32 "
        "(pack_vnni2 is only supported when avx512 is supported); ATEN_CPU_CAPABILITY=avx2 "
        "narrows torch's kernels below what its attention code expects of this CPU: unset it, "
        "or use --attention=scratch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@on_each_device
def test_flash_kernel_matches_the_math_kernel_and_the_reference(dtype, device):
    """Forced onto the Flash kernel (no silent fallback: sdpa_kernel raises if it cannot run), a
    training forward+backward gives the math kernel's loss, logits and gradients to 16-bit
    precision, and the loss of the float32 scratch-attention reference. (The CPU has a Flash
    kernel of its own.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = tiny_model_config(n_embd=128, n_head=2, block_size=64, attention="sdpa",
                            causal_mask="on_the_fly")
    model = GPT(cfg).to(device)
    reference = GPT(tiny_model_config(n_embd=128, n_head=2, block_size=64)).to(device)
    reference.load_state_dict(model.state_dict())
    rt = device_runtime(device, dtype)
    x, y = tiny_batch(cfg, device=device)

    def run(backend):
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(backend):
            with rt.autocast():
                logits, loss = model(x, y)
            loss.backward()
        return logits.float(), loss.item(), [p.grad.clone() for p in model.parameters()]

    out = {}
    if device == "cpu" and dtype == "bfloat16" and narrowed_below_amx():  # speedups.sdpa_failure
        with pytest.raises(RuntimeError, match="pack_vnni2 is only supported when avx512"):
            run(SDPBackend.FLASH_ATTENTION)
        pytest.xfail("torch's CPU Flash kernel takes its AMX path by the CPU, built only for "
                     "AVX-512: it raises under ATEN_CPU_CAPABILITY="
                     f"{torch.backends.cpu.get_cpu_capability().lower()}")
    kernels = speedups.attention_kernels(lambda: out.update(flash=run(SDPBackend.FLASH_ATTENTION)))
    assert kernels == (["flash"] if device == "cuda" else ["flash (cpu)"])
    out["math"] = run(SDPBackend.MATH)
    (f_logits, f_loss, f_grads), (m_logits, m_loss, m_grads) = out["flash"], out["math"]
    assert relative_error(f_logits, m_logits) < 2e-2
    assert f_loss == pytest.approx(m_loss, rel=5e-3)
    everything = [torch.cat([g.flatten() for g in grads]) for grads in (f_grads, m_grads)]
    assert relative_error(*everything) < 3e-2
    for name, g_flash, g_math in zip([n for n, _ in model.named_parameters()], f_grads, m_grads):
        assert relative_error(g_flash, g_math) < 1e-1, name  # each tensor, 16-bit rounding
    _, ref_loss = reference(x, y)  # float32, scratch attention
    assert f_loss == pytest.approx(ref_loss.item(), rel=2e-2)


def test_banner_names_every_flag_and_each_fallback():
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=65, vocab_pad_multiple=64)
    cfg.system = SystemConfig(device="cpu", tf32=True)
    cfg.data.pin_memory = True
    cfg.train.batch_size_auto = True
    rt = machine.setup(cfg.system)
    model = GPT(cfg.model)
    batch_note = auto_batch.auto_micro_batch(cfg, model, rt)
    values = speedups.settings(cfg, rt, speedups.Notes(batch=batch_note, fused_adamw="on",
                                                       kernels=["flash (cpu)"]))
    # every field that states a fast value (config.py), in its order, between these
    assert list(values) == ["device", "attention", "causal_mask", "norm", "activation_impl",
                            "vocab_pad_multiple", "loss", "pin_memory", "batch_size_auto",
                            "fused_adamw", "optimizer", "dtype", "tf32", "compile", "batch",
                            "recipe"]
    line = speedups.banner(values, rt.notes)
    for part in ("tf32=off", "pin_memory=off (needs CUDA)", "vocab_pad_multiple=64 (65->128)",
                 "batch=32x1 (batch_size_auto needs CUDA: kept)", "attention=scratch [flash (cpu)]",
                 "[tf32 needs CUDA: off]"):
        assert part in line, part
    same = speedups.effective(values)
    assert same["pin_memory"] == "off" and same["batch"] == "32x1"


def test_compile_without_a_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    model = GPT(tiny_model_config())
    with pytest.raises(machine.SetupError, match="--compile=false"):
        compiling.compile_model(model, SystemConfig(compile=True), cpu_runtime())
    assert compiling.compile_model(model, SystemConfig(compile=False), cpu_runtime()) == \
        (model, "off")


def test_compile_warm_up_feeds_the_strides_the_loader_hands_out(char_dataset):
    """torch.compile specialises on strides: the warm-up's inputs must be laid out as the
    loader's (views into (B, T+1) rows), else step 1 compiles the training step again. No
    compile here: the model records what it is given."""
    meta = load_meta(str(char_dataset))
    x, y = Batches(meta, "train", 4, 16, seed=0).next()
    model = GPT(tiny_model_config(block_size=16, vocab_size=meta["vocab_size"]))
    seen = []
    real_forward = model.forward
    model.forward = lambda idx, targets=None: (seen.append((idx.shape, idx.stride(),
                                                             targets.stride())),
                                                real_forward(idx, targets))[1]
    compiling.warm_up(model, model, cpu_runtime(), 4)
    assert seen and all(s == (x.shape, x.stride(), y.stride()) for s in seen), (seen, x.stride())
    assert x.stride() != x.contiguous().stride()  # the case at issue: not contiguous


@pytest.mark.parametrize("evaluates", [True, False])
def test_compile_warm_up_runs_the_eval_step_only_for_runs_that_evaluate(evaluates):
    """A benchmark's timed steps never evaluate (build_training(evaluates=False)): its warm-up
    compiles the training step alone, saving the eval graph's compile (a no-grad forward is a
    graph of its own). No compile here: the model records the modes it is called in."""
    model = GPT(tiny_model_config())
    modes = []
    real_forward = model.forward
    model.forward = lambda idx, targets=None: (modes.append(
        (model.training, torch.is_grad_enabled())), real_forward(idx, targets))[1]
    compiling.warm_up(model, model, cpu_runtime(), 2, evaluates)
    assert modes == [(True, True), (False, False)][:1 + evaluates]


@pytest.mark.parametrize("isa, folder", [("VecAVX2", "isa_avx2"),
                                         ("VecAMX", "isa_avx512_avx512_vnni_amx_tile"),
                                         ("invalid_vec_isa", "isa_scalar")])
def test_compiled_code_is_cached_per_vector_isa(monkeypatch, tmp_path, isa, folder):
    """torch's FX graph cache ignores the ISA ATEN_CPU_CAPABILITY picks: one folder per ISA."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    picked = getattr(cpu_vec_isa, isa)  # a class, or the invalid (falsy) instance
    picked = picked() if isinstance(picked, type) else picked
    # what inductor would pick under ATEN_CPU_CAPABILITY (not the variable itself: torch's own
    # kernels read it once per process)
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: picked)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = GPT(tiny_model_config())
    compiling.compile_model(model, SystemConfig(compile=True), cpu_runtime())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default_cache_dir(), folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice stays
    assert compiling.inductor_cache_per_isa() == str(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset is Linux's")
def test_cpu_peak_memory_tracks_and_resets():
    device = torch.device("cpu")
    timing.reset_peak_memory(device)
    before = timing.peak_memory(device)["rss"]
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    peak = timing.peak_memory(device)["rss"]
    assert peak >= before + 200 * 2**20
    timing.reset_peak_memory(device)
    assert timing.peak_memory(device)["rss"] < peak - 100 * 2**20


def test_cuda_peak_memory_reads_the_caching_allocator(monkeypatch):
    """The CPU half of test_cuda_peak_memory_tracks_and_resets: on a CUDA device peak_memory
    reads the caching allocator's peaks for that device (allocated, reserved) and
    reset_peak_memory resets them, not the process's peak RSS."""
    asked = []

    def answer(question, value=None):
        return lambda device=None: asked.append((question, device)) or value

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", answer("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", answer("allocated", 1))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", answer("reserved", 2))
    device = torch.device("cuda", 0)
    timing.reset_peak_memory(device)
    assert timing.peak_memory(device) == {"allocated": 1, "reserved": 2}
    assert asked == [("reset", device), ("allocated", device), ("reserved", device)]


@pytest.mark.cuda
def test_cuda_peak_memory_tracks_and_resets():
    """The GPU half: the allocator's real peaks."""
    device = torch.device("cuda")
    timing.reset_peak_memory(device)
    before = timing.peak_memory(device)
    assert set(before) == {"allocated", "reserved"}
    big = torch.ones(64 * 2**20, device=device)  # 256 MiB
    del big
    peak = timing.peak_memory(device)
    assert peak["allocated"] >= before["allocated"] + 256 * 2**20
    assert peak["reserved"] >= peak["allocated"]
    timing.reset_peak_memory(device)
    assert timing.peak_memory(device)["allocated"] < peak["allocated"] - 200 * 2**20
