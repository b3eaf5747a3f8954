"""Memory strategies: activation checkpointing, the memory estimate, int8 partial quantization,
the prefetching loader, empty_cache at phase boundaries only, and compiling without recompiles.
The ones that act on CUDA run on the CPU and, where there is one, on CUDA (marked `cuda`)."""
from __future__ import annotations

import math

import pytest
import torch

import train
from config import Config, ConfigError, load_config
from conftest import on_each_device, tiny_model_config
from data.loader import Batches, load_meta
from engine import compiling
from engine import device as machine
from engine.inference import quantize
from engine.inference.kv_cache import new_kv_cache
from engine.training import master_weights, memory_estimate, optim, step
from engine.training.recompute import checkpoint_plan
from model import ACTIVATIONS, GPT

MODES = ["all", "attention", "mlp", "every:2", "blocks:0,2"]


def grads_and_saved_bytes(spec: str, dropout: float, device: str = "cpu",
                          **model) -> tuple[dict, float, int]:
    """Gradients and loss of one forward/backward, and the bytes autograd kept for backward."""
    torch.manual_seed(0)
    cfg = tiny_model_config(n_layer=3, dropout=dropout, activation_checkpointing=spec, **model)
    model = GPT(cfg).to(device).train()
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size)).to(device)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(1)  # the same dropout masks for every mode
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    kept = sum(saved)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.item(), kept


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("spec", MODES)
@on_each_device
def test_checkpointing_gives_identical_gradients_and_keeps_less(spec, dropout, device):
    """The recomputed forward replays the same kernels and dropout masks (the RNG state is
    restored): the same loss and gradients, bit for bit on the CPU; on CUDA to float32 rounding,
    since its backward kernels may add up in another order."""
    plain, plain_loss, plain_kept = grads_and_saved_bytes("none", dropout, device)
    grads, loss, kept = grads_and_saved_bytes(spec, dropout, device)
    tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(plain_loss, rel=tol["rtol"], abs=tol["atol"])
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, **tol, msg=name)
    assert kept < plain_kept  # the recomputed parts' activations were not stored


@pytest.mark.parametrize("spec", MODES)
def test_checkpointing_passes_a_techniques_block_input_through(spec):
    """A block input a technique adds (value embeddings' table, weighted) reaches the recomputed
    attention as given: the same loss and gradients, bit for bit, the new weights' included."""
    model = dict(value_embeds=1, position="rotary", qk_norm=True)
    plain, plain_loss, _ = grads_and_saved_bytes("none", 0.2, **model)
    grads, loss, _ = grads_and_saved_bytes(spec, 0.2, **model)
    assert loss == plain_loss and "value_weights" in grads
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_checkpoint_plan_selection_and_errors():
    assert checkpoint_plan("none", 3) == ["", "", ""]
    assert checkpoint_plan("all", 2) == ["block", "block"]
    assert checkpoint_plan("attention", 2) == ["attention", "attention"]
    assert checkpoint_plan("every:2", 5) == ["block", "", "block", "", "block"]
    assert checkpoint_plan("blocks:1,3", 4) == ["", "block", "", "block"]
    with pytest.raises(ValueError, match=r"names blocks \[4\].*0..3"):
        checkpoint_plan("blocks:0,4", 4)
    with pytest.raises(ConfigError, match="activation_checkpointing='every:0' is not understood"):
        load_config(["--config", "tiny", "--activation_checkpointing=every:0"])


def test_checkpointing_is_off_without_grad_and_with_kv_cache():
    cfg = tiny_model_config(activation_checkpointing="all")
    model = GPT(cfg).eval()
    plain = GPT(tiny_model_config())
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    cache, plain_cache = new_kv_cache(model, 2), new_kv_cache(plain.eval(), 2)
    with torch.no_grad():
        torch.testing.assert_close(model(idx, kv_cache=cache)[0],
                                   plain(idx, kv_cache=plain_cache)[0])


def test_estimate_matches_hand_count():
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd = 10, 8, 2, 2, 4
    m.attention, m.norm, m.activation_impl, m.dropout = "sdpa", "native", "native", 0.0
    cfg.train.batch_size, cfg.system.dtype = 3, "float32"
    C, V, T, B, L = 4, 10, 8, 3, 2
    per_block = (2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C)  # LayerNorms, attention
                 + (4 * C * C + 4 * C) + (4 * C * C + C))  # MLP
    params = V * C + T * C + L * per_block + 2 * C
    assert params == sum(p.numel() for p in GPT(m).parameters())
    e = memory_estimate.estimate(cfg)
    assert (e.weights, e.gradients, e.optimizer) == (4 * params, 4 * params, 8 * params)
    # per token per block, float32: ln_1 in, c_attn in, q k v, attention out, c_proj in,
    # ln_2 in, c_fc in, GELU in (4C), MLP c_proj in (4C): 17 C floats; then ln_f and lm_head in
    tokens = B * T
    assert e.activations == tokens * 4 * (17 * C * L + 2 * C)
    assert e.logits == tokens * (4 * V + 8 * V)
    assert e.recompute == 0
    cfg.model.activation_checkpointing = "all"
    e_all = memory_estimate.estimate(cfg)
    assert e_all.activations == tokens * 4 * (C * L + 2 * C)  # each block keeps its input
    assert e_all.recompute == tokens * 4 * 17 * C  # one block rebuilt at a time
    cfg.system.dtype, cfg.system.parallel = "bfloat16", "fsdp"
    e_half = memory_estimate.estimate(cfg, world_size=2)
    assert e_half.weights == 4 * params // 2
    assert e_half.recompute == tokens * (8 * C + 2 * 15 * C)  # LayerNorm inputs stay float32
    cfg.system.weights_dtype = "bfloat16"  # bf16 weights and grads, + a float32 master copy
    e_bf16 = memory_estimate.estimate(cfg, world_size=1)  # whose float32 gradients the step holds
    assert (e_bf16.weights, e_bf16.gradients, e_bf16.optimizer) == (2 * params, 6 * params,
                                                                    12 * params)


def test_estimate_memory_flag_prints_without_training(char_dataset, tmp_path, capsys):
    code = train.main(["--config", "tiny", f"--dataset={char_dataset}",
                       f"--out_dir={tmp_path / 'run'}", "--estimate-memory"])
    out = capsys.readouterr().out
    assert code == 0 and "memory estimate: weights" in out and "per process" in out
    assert not (tmp_path / "run").exists()


@on_each_device
def test_int8_quantizes_only_the_chosen_layers_and_stays_close(device):
    pytest.importorskip("torchao", reason="sample.quantize=int8 needs torchao (not installed)")
    torch.manual_seed(0)
    cfg = tiny_model_config(n_embd=32, n_layer=2)
    model = GPT(cfg).to(device).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size)).to(device)
    with torch.no_grad():
        ref = model(idx)[0]
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    before = quantize.weight_bytes(model)
    chosen = quantize.quantize_linears(model, "attn,mlp.c_proj")
    assert chosen == [f"transformer.h.{i}.{n}" for i in range(2)
                      for n in ("attn.c_attn", "attn.c_proj", "mlp.c_proj")]
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, torch.nn.Linear):
            is_int8 = "Int8" in type(module.weight).__name__
            assert is_int8 == (name in chosen), name
    assert "Int8" not in type(model.transformer.wte.weight).__name__
    for name, bias in biases.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), bias)
    assert quantize.weight_bytes(model) < before
    with torch.no_grad():
        quantized = model(idx)[0]
    assert (quantized - ref).abs().max() < 0.02 * ref.abs().max()
    assert not torch.equal(quantized, ref)


def test_quantize_layers_bad_name():
    with pytest.raises(ConfigError, match="'lm_head'.*is not a choice"):
        quantize.quantize_targets("attn,lm_head")


@on_each_device
def test_prefetch_loader_reads_the_same_batches(char_dataset, device):
    """data.prefetch: on CUDA the copy runs on a side stream and the compute stream waits for
    it, so work queued right after next() already sees the batch; elsewhere a plain copy."""
    meta = load_meta(str(char_dataset))
    plain = Batches(meta, "train", 4, 16, seed=3, device=device)
    fetched = Batches(meta, "train", 4, 16, seed=3, device=device, prefetch=True)
    if device == "cuda":
        assert fetched.copy_stream is not None and fetched.pin_memory
        assert fetched.prefetch_note == "on (side CUDA stream)"
    else:
        assert fetched.copy_stream is None
        assert fetched.prefetch_note.startswith("off (needs CUDA")
    weights = torch.randn(64, 64, device=device)
    for _ in range(3):
        expected = plain.next()
        busy = weights @ weights  # keeps the compute stream busy while the copy is issued
        x, y = fetched.next()
        checks = [(x == expected[0]).all(), (y == expected[1]).all()]  # queued on compute
        assert all(bool(c) for c in checks)
        assert x.device.type == device and busy.shape == (64, 64)


def evaluate_at_a_big_batch(char_dataset, rt: machine.Runtime) -> tuple[GPT, dict]:
    """(the model, its losses) after an evaluation whose activations dwarf the model: 2 batches
    of 64 x 128 tokens, the attention scores (64, 4, 128, 128) each."""
    meta = load_meta(str(char_dataset))
    model = GPT(tiny_model_config(vocab_size=65, block_size=128, n_embd=64, n_head=4))
    model = model.to(rt.device)
    val = Batches(meta, "val", 64, 128, seed=1, device=rt.device)
    return model, step.evaluate(model, {"val": val}, {"val": val.fixed(2, seed=1)}, rt)


def test_empty_cache_empties_the_cuda_cache_only_when_on(char_dataset, as_a_gpu, monkeypatch):
    """The CPU half of test_empty_cache_returns_what_an_evaluation_left_cached: its evaluation
    runs (here on the CPU), and on a CUDA device release_cached calls torch.cuda.empty_cache
    once when the switch is on, never when it is off."""
    from config import SystemConfig
    _, losses = evaluate_at_a_big_batch(char_dataset, machine.setup(SystemConfig(device="cpu")))
    assert abs(losses["val"] - math.log(65)) < 0.3  # an untrained model: about uniform
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    rt = machine.setup(SystemConfig(device="cuda"))
    assert rt.device == torch.device("cuda")
    assert machine.release_cached(rt.device, enabled=False) is False and calls == []
    assert machine.release_cached(rt.device, enabled=True) is True
    assert calls == ["empty_cache"]


@pytest.mark.cuda
def test_empty_cache_returns_what_an_evaluation_left_cached(char_dataset):
    """system.empty_cache: after an evaluation at a bigger batch, the blocks its activations used
    stay reserved by the caching allocator until release_cached hands them back; the model's
    own memory stays allocated. With the switch off it does nothing. (The GPU half: the
    allocator's numbers.)"""
    from config import SystemConfig
    rt = machine.setup(SystemConfig(device="cuda"))
    model, _ = evaluate_at_a_big_batch(char_dataset, rt)  # held: its weights stay allocated
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert reserved - allocated > 16 * 2**20  # the evaluation's blocks, free but still held
    assert machine.release_cached(rt.device, enabled=False) is False
    assert torch.cuda.memory_reserved() == reserved
    assert machine.release_cached(rt.device, enabled=True) is True
    assert torch.cuda.memory_reserved() < reserved - 16 * 2**20
    assert torch.cuda.memory_allocated() == allocated


def test_empty_cache_is_a_no_op_off_cuda():
    assert machine.release_cached(torch.device("cpu"), enabled=True) is False


def test_empty_cache_only_at_phase_boundaries(char_dataset, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(machine, "release_cached",
                        lambda device, enabled: calls.append(enabled) or False)
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                          f"--out_dir={tmp_path}", "--device=cpu", "--max_iters=6",
                          "--eval_interval=3", "--empty_cache=false"])
    train.train(cfg)
    assert calls == [False, False, False]  # after the evaluations at steps 0, 3 and 6 only


def test_config_switches_exist_with_defaults():
    cfg = Config()
    assert cfg.model.activation_checkpointing == "none"
    assert cfg.system.empty_cache and not cfg.data.prefetch and cfg.sample.quantize == "none"


def test_bf16_weights_keep_float32_islands_and_master_copy():
    torch.manual_seed(0)
    model = GPT(tiny_model_config(n_layer=2))
    master_weights.hold_weights(model, "ddp", 1)
    groups = model.optimizer_groups(0.1)
    optimizer = master_weights.MasterWeights(groups, torch.optim.AdamW, lr=1e-2)
    seen = {}
    model.transformer.h[1].register_forward_hook(lambda m, i, o: seen.update(block=o.dtype))
    model.transformer.ln_f.register_forward_hook(lambda m, i, o: seen.update(ln_f=o.dtype))
    idx = torch.randint(0, 37, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert seen == {"block": torch.float32, "ln_f": torch.float32} and loss.dtype == torch.float32
    assert model.lm_head.weight.grad.dtype == torch.bfloat16
    optimizer.step()
    assert all(m.dtype == torch.float32 for m in optimizer.masters)
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    for p, master in zip(optimizer.model_params, optimizer.masters):
        assert torch.equal(p, master.to(torch.bfloat16))  # the model holds the rounded masters
    # a resumed optimizer continues from the float32 masters, not from the rounded weights
    other = GPT(tiny_model_config(n_layer=2))
    master_weights.hold_weights(other, "ddp", 1)
    resumed = master_weights.MasterWeights(other.optimizer_groups(0.1), torch.optim.AdamW, lr=1e-2)
    resumed.load_state_dict(optimizer.state_dict())
    for a, b in zip(resumed.masters, optimizer.masters):
        assert torch.equal(a, b)


def test_bf16_weights_train_close_to_float32(char_dataset, tmp_path):
    finals = {}
    for weights in ("float32", "bfloat16"):
        cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                              f"--out_dir={tmp_path / weights}", "--device=cpu",
                              "--max_iters=30", "--eval_interval=30", "--dtype=bfloat16",
                              f"--weights_dtype={weights}", "--save_checkpoints=false"])
        finals[weights] = train.train(cfg)["final"]["val"]
    assert finals["bfloat16"] == pytest.approx(finals["float32"], rel=0.03)
    assert finals["float32"] < 3.6  # both learned (from ln(65) = 4.17)


def test_bf16_weights_need_bf16_autocast():
    with pytest.raises(ConfigError, match="weights_dtype=bfloat16 needs --dtype=bfloat16"):
        load_config(["--config", "tiny", "--weights_dtype=bfloat16"])


@on_each_device
def test_static_kv_cache_with_buckets_gives_the_same_tokens(device):
    import generate
    torch.manual_seed(0)
    for attention in ("scratch", "sdpa"):
        model = GPT(tiny_model_config(attention=attention)).to(device).eval()  # block_size 16
        prompt = torch.randint(0, 37, (2, 5)).to(device)
        plain = generate.generate_tokens(model, prompt, 20, temperature=0)  # overflows once
        static = generate.generate_tokens(model, prompt, 20, temperature=0, prompt_bucket=4)
        assert torch.equal(static, plain)


@on_each_device
def test_compiled_run_does_not_recompile_after_warm_up(device):
    import generate
    from config import SystemConfig
    compiles = []

    def counting_backend(gm, example_inputs):  # called once per (re)compiled graph
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = GPT(tiny_model_config(dropout=0.1)).to(device)  # block_size 16
    compiled = torch.compile(model, backend=counting_backend)
    rt = machine.setup(SystemConfig(device=device))
    compiling.warm_up(compiled, model, rt, batch_size=4)
    compiled.eval()
    generate.warm_up(compiled, prompt_length=6, max_new_tokens=20, bucket=8)
    warmed = len(compiles)
    assert warmed > 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):  # training steps and an evaluation
        compiled.train()  # the loader's layout: views into (B, T+1) rows
        rows = torch.randint(0, 37, (4, 17), device=device)
        idx, targets = rows[:, :-1], rows[:, 1:]
        compiled(idx, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        compiled.eval()
        with torch.no_grad():
            compiled(idx, targets)
    for length in (3, 7, 8):  # other prompts in the same bucket, with a context overflow
        prompt = torch.randint(0, 37, (1, length), device=device)
        generate.generate_tokens(compiled, prompt, 20, temperature=0, prompt_bucket=8)
    assert len(compiles) == warmed
    # the plain (dynamic) cache, by contrast, recompiles as its length changes
    generate.generate_tokens(compiled, torch.randint(0, 37, (1, 3), device=device), 6,
                             temperature=0)
    assert len(compiles) > warmed
    torch._dynamo.reset()


def test_shared_memory_workers_read_the_in_process_batches_and_resume(char_dataset):
    from data.loader_workers import SharedMemoryBatches
    meta = load_meta(str(char_dataset))
    plain = Batches(meta, "train", 4, 16, seed=5)
    shared = SharedMemoryBatches(Batches(meta, "train", 4, 16, seed=5), meta, "train", workers=2)
    try:
        for _ in range(3):
            for a, b in zip(plain.next(), shared.next()):
                assert torch.equal(a, b)
        state = shared.state_dict()  # workers are already several batches ahead
        expected = [plain.next() for _ in range(6)]
        got = [shared.next() for _ in range(6)]
        shared.load_state_dict(state)  # back to where the state was taken
        again = [shared.next() for _ in range(6)]
        for e, g, a in zip(expected, got, again):
            assert torch.equal(e[0], g[0]) and torch.equal(e[0], a[0])
            assert torch.equal(e[1], g[1]) and torch.equal(e[1], a[1])
    finally:
        shared.close()
    assert not any(p.is_alive() for p in shared.procs)


def test_training_with_loader_workers_matches_in_process(char_dataset, tmp_path):
    finals = []
    for workers in (0, 2):
        cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                              f"--out_dir={tmp_path / str(workers)}", "--device=cpu",
                              "--max_iters=8", "--eval_interval=8", "--save_checkpoints=false",
                              f"--loader_workers={workers}"])
        finals.append(train.train(cfg)["final"])
    assert finals[0] == finals[1]


def test_checkpointing_composes_with_fsdp2(char_dataset, tmp_path):
    """2 FSDP2 processes recomputing every block train exactly as one plain process."""
    from test_distributed import RUN, assert_same_trajectory, output, run_one, torchrun, trajectory
    run_one(char_dataset, tmp_path / "single", "--batch_size=4", "--max_iters=2",
            "--save_checkpoints=false")
    out = tmp_path / "fsdp"
    proc = torchrun("train.py", *RUN, f"--dataset={char_dataset}", f"--out_dir={out}",
                    "--batch_size=2", "--parallel=fsdp", "--max_iters=2",
                    "--activation_checkpointing=all", "--save_checkpoints=false")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "activation_checkpointing=all" in proc.stdout
    assert_same_trajectory(trajectory(out), trajectory(tmp_path / "single"))


def test_bf16_weights_resume_exactly(char_dataset, tmp_path):
    """The float32 masters travel in the checkpoint: stop + resume equals one straight run."""
    def run(out, *extra):
        cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                              f"--out_dir={out}", "--device=cpu", "--max_iters=6",
                              "--eval_interval=3", "--dtype=bfloat16",
                              "--weights_dtype=bfloat16", *extra])
        return train.train(cfg)
    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped", "--stop_after_iters=3")
    resumed = run(tmp_path / "stopped", "--init_from=resume")
    assert resumed["final"] == straight["final"]


@pytest.mark.parametrize("activation,impl", [("gelu_tanh", "scratch"), ("gelu_tanh", "native"),
                                             ("gelu_erf", "scratch"), ("relu2", "scratch")])
def test_each_activation_keeps_what_it_says_for_backward(activation, impl):
    """The tensors autograd keeps of the activation alone (each storage once) are the count
    model.Activation.saved_tensors gives the memory estimate."""
    x = torch.randn(3, 16, requires_grad=True)
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ACTIVATIONS[activation](x, native=impl == "native").sum().backward()
    assert sum(kept.values()) == ACTIVATIONS[activation].saved_tensors(impl == "native") * 48


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_optimizers_state_is_what_the_estimate_counts(name):
    """After one step, the float32 numbers the optimizer holds are what optim.STATE_TENSORS
    says, which the memory estimate adds up."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd = 10, 8, 2, 2, 8
    cfg.train.optimizer = name
    model = GPT(m)
    optimizer = optim.make_optimizer(model, cfg, torch.device("cpu"))
    tokens = torch.zeros((1, 8), dtype=torch.long)
    model(tokens, tokens)[1].backward()
    optimizer.step()
    held = sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)
    params, matrices = model.num_params(False), 12 * m.n_embd ** 2 * m.n_layer
    hidden, rest = optim.STATE_TENSORS[name]
    assert held == hidden * matrices + rest * (params - matrices)
    assert memory_estimate.estimate(cfg).optimizer == 4 * held
