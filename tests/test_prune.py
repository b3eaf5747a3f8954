"""Pruning (engine/pruning.py, prune.py) and sparse execution (engine/inference/sparse.py): the
masks' pattern and sparsity, the checkpoint's mask file, a finetune that keeps the zeros across a
resume, sparse and dense logits alike, and the user's mistakes in one line each."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
import prune as prune_script
import train
from config import Config, ConfigError, load_config
from conftest import tiny_model_config, train_args
from engine import checkpoint, loading, pruning, saving
from engine.inference import sparse
from engine.inference.matvec import set_weight_layout
from engine.training import optim
from model import GPT


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_model_config(bias=True, **overrides))


def config_of(model: GPT) -> Config:
    cfg = Config()
    cfg.model = model.config
    return cfg


def block_weight_names(model: GPT) -> set[str]:
    return {f"transformer.h.{layer}.{name}.weight" for layer in range(model.config.n_layer)
            for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


@pytest.fixture(scope="module")
def trained(char_dataset, tmp_path_factory):
    """A tiny model trained 8 steps: the checkpoint to prune."""
    out = tmp_path_factory.mktemp("dense")
    train.train(load_config(train_args(char_dataset, out, "--max_iters=8", "--eval_interval=8",
                                       "--log_interval=8"))[0])
    return checkpoint.latest_checkpoint(out)


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_unstructured_prunes_the_smallest_of_each_block_matrix_only(sparsity):
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masks = pruning.prune(model, sparsity, "unstructured")
    assert set(masks) == block_weight_names(model)
    after = model.state_dict()
    for name, weight in after.items():
        if name not in masks:  # embeddings, the tied head, biases, norms
            assert torch.equal(weight, before[name]), name
            continue
        mask = masks[name]
        assert int((~mask).sum()) == round(sparsity * weight.numel()), name
        assert torch.equal(weight, before[name] * mask)
        assert before[name][mask].abs().min() >= before[name][~mask].abs().max(), name


def test_two_four_keeps_the_two_largest_of_every_four_inputs():
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masks = pruning.prune(model, 0.5, "2:4")
    for name, mask in masks.items():
        groups = mask.reshape(mask.shape[0], -1, 4)  # along the input dimension
        assert bool((groups.sum(-1) == 2).all()), name
        magnitude = before[name].abs().reshape(groups.shape)
        kept = magnitude.masked_fill(~groups, float("inf")).amin(-1)
        dropped = magnitude.masked_fill(groups, -1.0).amax(-1)
        assert bool((kept >= dropped).all()), name
        assert sparse.is_two_four(model.state_dict()[name])
    assert torch.equal(model.transformer.wte.weight, before["transformer.wte.weight"])


def test_masks_are_saved_with_the_checkpoint_and_checked_on_load(tmp_path):
    model = tiny_gpt()
    masks = pruning.prune(model, 0.75, "unstructured")
    path = saving.save(tmp_path / "run", 3, model, config_of(model), {})
    stored = load_file(str(path / checkpoint.MASK_FILE))
    assert stored.keys() == masks.keys() and all(torch.equal(stored[k], masks[k]) for k in masks)
    loaded, _, _ = loading.load_model(path)
    assert all(torch.equal(pruning.masks_of(loaded)[k], masks[k]) for k in masks)
    weights = load_file(str(path / "model.safetensors"))
    name = "transformer.h.0.mlp.c_fc.weight"
    weights[name] = weights[name] + 1.0  # non-zero where the mask prunes
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match="non-zero where the masks prune them"):
        loading.load_model(path)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_finetune_keeps_the_zeros_and_resumes_bit_exact(optimizer, trained, char_dataset,
                                                          tmp_path):
    pruned = tmp_path / "pruned"
    assert prune_script.main(["--checkpoint", str(trained), "--sparsity", "0.75",
                              "--out", str(pruned)]) == 0
    masks = load_file(str(checkpoint.latest_checkpoint(pruned) / checkpoint.MASK_FILE))
    run = [f"--init_from={pruned}", f"--optimizer={optimizer}", "--max_iters=6",
           "--eval_interval=3", "--log_interval=1", "--weight_decay=0.1"]

    def finetune(out, *extra):
        return train.train(load_config(train_args(char_dataset, out, *run, *extra))[0])

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    finetune(whole)
    finetune(parts, "--stop_after_iters=3")
    assert finetune(parts, "--init_from=resume")["steps"] == 3
    a, b = (checkpoint.latest_checkpoint(out) for out in (whole, parts))
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # resumed = uninterrupted, bit for bit
    dense = load_file(str(trained / "model.safetensors"))
    for name, mask in masks.items():
        assert not wa[name][~mask].any(), f"{name}: a pruned weight moved"
        assert not torch.equal(wa[name][mask], dense[name][mask]), f"{name} did not train"
    again = load_file(str(b / checkpoint.MASK_FILE))
    assert all(torch.equal(again[k], masks[k]) for k in masks)


@pytest.mark.parametrize("setup", ["fused_adamw", "muon", "bf16_masters"])
def test_every_optimizer_keeps_the_zeros_and_sees_masked_gradients(setup):
    model = tiny_gpt()
    masks = pruning.prune(model, 0.75, "unstructured")
    cfg = config_of(model)
    cfg.train.weight_decay, cfg.train.fused_adamw = 0.1, setup == "fused_adamw"
    cfg.train.optimizer = "muon" if setup == "muon" else "adamw"
    if setup == "bf16_masters":
        model.to(torch.bfloat16)
    optimizer = optim.make_optimizer(model, cfg, torch.device("cpu"))
    assert pruning.hold_zeros(model, optimizer)[0].startswith("pruned: 8 block matrices, 75.0%")
    params = dict(model.named_parameters())
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    bf16 = torch.autocast("cpu", torch.bfloat16, enabled=setup == "bf16_masters")
    for _ in range(3):
        with bf16:
            _, loss = model(idx, idx)
        loss.backward()
        assert all(not params[n].grad[~m].any() for n, m in masks.items())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, mask in masks.items():
        assert not params[name][~mask].any(), name
        assert params[name][mask].all(), name  # the kept weights trained and stayed non-zero
    by_param = {id(p): name for name, p in params.items()}
    for param, master in zip(getattr(optimizer, "model_params", []),
                             getattr(optimizer, "masters", [])):
        if (name := by_param[id(param)]) in masks:  # the float32 copies hold the zeros too
            assert not master[~masks[name]].any(), name


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparse_and_dense_execution_give_the_same_logits(pattern):
    model = tiny_gpt(n_embd=32).eval()
    pruning.prune(model, 0.5 if pattern == "2:4" else 0.8, pattern)
    idx = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        dense_logits, _ = model(idx, idx)
    note = sparse.prepare_for_inference(model, "sparse", "cpu")
    assert "8 of 8 pruned Linears sparse" in note
    assert isinstance(model.transformer.h[0].mlp.c_fc, sparse.CSRLinear)
    with torch.no_grad():
        sparse_logits, _ = model(idx, idx)
    torch.testing.assert_close(sparse_logits, dense_logits, rtol=1e-5, atol=1e-5)


def test_auto_says_what_it_chose_and_dense_leaves_the_layers():
    model = tiny_gpt(n_embd=32).eval()
    assert sparse.prepare_for_inference(model, "auto", "cpu") == ""  # not pruned: left alone
    pruning.prune(model, 0.9, "unstructured")
    note = sparse.prepare_for_inference(model, "dense", "cpu")
    assert note.startswith("sparse kernels: off, dense weights with zeros")
    assert isinstance(model.transformer.h[0].mlp.c_fc, torch.nn.Linear)
    note = sparse.prepare_for_inference(model, "auto", "cpu", rows=4)
    chosen = sum(isinstance(m, sparse.CSRLinear) for m in model.modules())
    assert note.startswith(f"sparse kernels (auto, CSR at 4 rows): {chosen} of 8 pruned")
    assert "32x32:" in note and "128x32:" in note  # each shape's verdict, named


def test_generate_from_a_pruned_checkpoint_says_which_kernels_it_uses(trained, tmp_path,
                                                                     capsys):
    pruned = tmp_path / "pruned"
    assert prune_script.main(["--checkpoint", str(trained), "--pattern", "2:4",
                              "--out", str(pruned)]) == 0
    capsys.readouterr()
    common = ["--config", "tiny", f"--checkpoint={pruned}", "--max_new_tokens=5",
              "--temperature=0", "--device=cpu"]
    texts = {}
    for mode in ("sparse", "dense"):
        assert generate.main([*common, f"--sparse={mode}"]) == 0
        out = capsys.readouterr()
        texts[mode] = out.out
        assert (f"sparse kernels ({mode}, CSR): 8 of 8 pruned Linears sparse" if mode == "sparse"
                else "sparse kernels: off, dense weights with zeros") in out.err
    assert texts["sparse"] == texts["dense"]  # greedy: the same tokens either way


def two_four_model(device: str, n_embd: int = 128) -> tuple[GPT, torch.Tensor]:
    """The 2:4 tests' model, pruned 2:4 on `device`, and a batch for it."""
    model = GPT(tiny_model_config(n_embd=n_embd, n_head=4, block_size=64, vocab_size=128))
    model = model.to(device).eval()
    pruning.prune(model, 0.5, "2:4")
    return model, torch.randint(0, 128, (4, 64), device=device)


def semi_structured_on_a_cpu(dense: torch.Tensor) -> torch.Tensor:
    """Stands in for torch.sparse.to_sparse_semi_structured on a CPU: torch's own checks of the
    dense weight (2-D, contiguous, a dtype and shape its backend takes) with only the
    device's left out; returns the dense weight, so the layer multiplies as it would."""
    from torch.sparse import SparseSemiStructuredTensor as Base
    from torch.sparse import (SparseSemiStructuredTensorCUSPARSELT,
                              SparseSemiStructuredTensorCUTLASS)

    class OnCuda:  # the tensor, but saying it is on CUDA
        is_cuda = True

        def __getattr__(self, name):
            return getattr(dense, name)

    backend = SparseSemiStructuredTensorCUTLASS if Base._FORCE_CUTLASS else \
        SparseSemiStructuredTensorCUSPARSELT  # as to_sparse_semi_structured picks it
    backend._validate_device_dim_dtype_shape(OnCuda())
    return dense


def test_two_four_swap_meets_the_semi_structured_checks_on_a_cpu(monkeypatch):
    """The CPU half of test_two_four_runs_semi_structured_on_cuda_like_dense: with the CUDA
    answers a GPU would give (compute 9.0) and torch's checks of what 2:4 compression takes,
    prepare_for_inference swaps all 8 Linears, their weights in float16, and the model's logits
    stay the dense ones; a GPU older than Ampere and a width the kernels do not take stay dense
    and say so."""
    capability = (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", semi_structured_on_a_cpu)
    model, idx = two_four_model("cpu")
    set_weight_layout(model, "column")  # transposed views: compression needs them row-major
    with torch.no_grad():
        dense_logits, _ = model(idx, idx)
        note = sparse.prepare_for_inference(model, "sparse", "cuda")
        sparse_logits, _ = model(idx, idx)
    assert note == "sparse kernels (sparse, 2:4 semi-structured): 8 of 8 pruned Linears sparse"
    layer = model.transformer.h[0].mlp.c_fc
    assert isinstance(layer, sparse.SemiStructuredLinear)
    assert layer.weight.dtype == layer.bias.dtype == torch.float16
    assert sparse_logits.dtype == torch.float32
    torch.testing.assert_close(sparse_logits, dense_logits, rtol=2e-2, atol=2e-2)
    capability = (7, 5)
    note = sparse.prepare_for_inference(two_four_model("cpu")[0], "sparse", "cuda")
    assert note.startswith("sparse kernels (sparse, 2:4 semi-structured): 0 of 8 pruned")
    assert "384x128: dense (no sparse kernel for it here)" in note
    capability = (9, 0)  # 24 wide: not a multiple of the 16 columns float16 2:4 needs
    note = sparse.prepare_for_inference(two_four_model("cpu", n_embd=24)[0], "sparse", "cuda")
    assert "0 of 8 pruned" in note and "72x24: dense (no sparse kernel for it here)" in note


@pytest.mark.cuda
def test_two_four_runs_semi_structured_on_cuda_like_dense():
    """The GPU half: the real 2:4 kernels (the swap itself is checked on a CPU above)."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"2:4 sparse tensor cores need Ampere or newer, not "
                    f"{torch.cuda.get_device_name()}")
    model, idx = two_four_model("cuda")
    with torch.no_grad():  # the model stays float32 (its residual stream is float32 whatever
        # the weights): the 2:4 Linears multiply in float16 and hand float32 back
        dense_logits, _ = model(idx, idx)
        note = sparse.prepare_for_inference(model, "sparse", "cuda")
        sparse_logits, _ = model(idx, idx)
    assert "2:4 semi-structured" in note and "8 of 8" in note
    layer = model.transformer.h[0].mlp.c_fc
    assert isinstance(layer, sparse.SemiStructuredLinear)
    assert isinstance(layer.weight, torch.sparse.SparseSemiStructuredTensor)  # compressed
    torch.testing.assert_close(sparse_logits.float(), dense_logits.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("args, message", [
    (["--sparsity", "0"], "--sparsity=0.0 must be in (0, 1)"),
    (["--sparsity", "1.5"], "--sparsity=1.5 must be in (0, 1)"),
    (["--pattern", "2:4", "--sparsity", "0.75"], "keeps 2 of every 4 weights, sparsity 0.5"),
    (["--pattern", "3:4"], "--pattern='3:4' is not one of unstructured, 2:4"),
    (["--sweep", "0.5,half"], "--sweep entry 'half' is neither a sparsity nor 2:4"),
    (["--sweep", "0.5,1"], "--sparsity=1.0 must be in (0, 1)"),
])
def test_bad_requests_are_refused_in_one_line(args, message, trained, tmp_path, capsys):
    assert prune_script.main(["--checkpoint", str(trained), "--out", str(tmp_path / "o"),
                              *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_two_four_on_a_width_not_divisible_by_four_and_a_missing_checkpoint(tmp_path, capsys):
    model = GPT(tiny_model_config(n_embd=6, n_head=1))
    saving.save(tmp_path / "odd", 1, model, config_of(model), {})
    assert prune_script.main(["--checkpoint", str(tmp_path / "odd"), "--pattern", "2:4",
                              "--out", str(tmp_path / "o")]) == 2
    assert "needs input dimensions divisible by 4, but transformer.h.0.attn.c_attn.weight " \
           "has 6; use --pattern=unstructured" in capsys.readouterr().err
    assert prune_script.main(["--checkpoint", str(tmp_path / "nothing"), "--out",
                              str(tmp_path / "o")]) == 2
    assert f"checkpoint {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        prune_script.prune_checkpoint(prune_script.PruneOptions(str(tmp_path / "odd"), 0.5,
                                                                out=str(tmp_path / "odd")))
    assert json.loads((checkpoint.latest_checkpoint(tmp_path / "odd") / "meta.json")
                      .read_text())["step"] == 1
