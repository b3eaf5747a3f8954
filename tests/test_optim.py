"""The optimizer: train.optimizer=muon puts torch.optim.Muon on the blocks' Linear weights and
AdamW on the rest, as one optimizer that follows the schedule, resumes bit for bit, trains under
DDP and FSDP as one process does, holds bf16 weights through float32 masters, and says so
where torch has no Muon."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from config import Config, ConfigError, TrainConfig, load_config
from conftest import tiny_model_config, train_whole_and_resumed
from engine import checkpoint, loading
from engine.training import adamw, master_weights, optim, polar_express
from engine.training import muon as muon_module
from model import GPT
from test_distributed import RUN as DIST_RUN
from test_distributed import assert_same_trajectory, output, torchrun, trajectory

HIDDEN = {f"transformer.h.{layer}.{name}.weight" for layer in range(2)
          for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def muon_config(**train_overrides) -> Config:
    cfg = Config()
    cfg.train.optimizer, cfg.train.learning_rate, cfg.train.muon_lr = "muon", 2e-3, 0.03
    for key, value in train_overrides.items():
        setattr(cfg.train, key, value)
    return cfg


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_model_config(bias=True, **overrides))


def fill_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def test_muon_takes_the_blocks_linear_weights_and_adamw_the_rest():
    model = tiny_gpt()
    optimizer = optim.make_optimizer(model, muon_config(), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head is wte here
    muon = [g for g in optimizer.param_groups if g.get("muon")]
    adamw = [g for g in optimizer.param_groups if not g.get("muon")]
    assert len(muon) == 1 and {names[id(p)] for p in muon[0]["params"]} == HIDDEN
    assert {names[id(p)] for g in adamw for p in g["params"]} == set(names.values()) - HIDDEN
    decayed = {names[id(p)] for g in adamw if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.state is optimizer.adamw.state is optimizer.muon.state
    assert type(optimizer.muon) is muon_module.Muon
    assert optimizer.muon.ns_dtype == torch.float32  # auto, on a CPU
    assert isinstance(optimizer.muon, torch.optim.Muon)  # torch's settings and state
    cuda = optim.make_optimizer(model, muon_config(), torch.device("cuda"))
    assert cuda.muon.ns_dtype == torch.bfloat16  # auto on CUDA: torch's bfloat16 iteration


def newton_schulz_float64(update: torch.Tensor, coefficients: tuple) -> torch.Tensor:
    a, b, c = coefficients
    x = update.double()
    x = x / x.norm()
    for _ in range(5):  # X <- aX + (bA + cA^2)X with A = XX^T; the same for X^T transposed
        gram = x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x
        poly = b * gram + c * gram @ gram
        x = a * x + (poly @ x if x.shape[0] <= x.shape[1] else x @ poly)
    return x


def test_float32_newton_schulz_orthogonalizes_like_bfloat16_and_float64():
    coefficients = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's
    gen = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 48), (24, 24)]:
        update = torch.randn(shape, generator=gen)
        got = muon_module.orthogonalize(update, coefficients, 5, 1e-7)
        exact = newton_schulz_float64(update, coefficients)
        bf16 = torch.optim._muon._zeropower_via_newtonschulz(update, coefficients, 5, 1e-7)
        assert got.shape == shape and got.dtype == torch.float32
        torch.testing.assert_close(got, exact.float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got, bf16.float(), rtol=0, atol=0.05)
        singular = torch.linalg.svdvals(got)  # the quintic leaves them in about (0.5, 1.5)
        assert 0.4 < singular.min() and singular.max() < 1.3


@pytest.mark.parametrize("ns_dtype", ["bfloat16", "float32"])
def test_a_step_is_torch_muon_and_adamw_applied_by_hand_at_each_scheduled_lr(ns_dtype,
                                                                             monkeypatch):
    """bfloat16 is torch.optim.Muon's update to the bit; float32 equals torch.optim.Muon with
    its Newton-Schulz swapped for the float32 one: the rest of the update is torch's."""
    if ns_dtype == "float32":
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz",
                            muon_module.orthogonalize)
    cfg = muon_config(warmup_iters=2, max_iters=5, muon_ns_dtype=ns_dtype)
    model, reference = tiny_gpt(), tiny_gpt()
    optimizer = optim.make_optimizer(model, cfg, torch.device("cpu"))
    hidden = muon_module.muon_params(reference)
    ids = {id(p) for p in hidden}
    t = cfg.train
    by_hand_muon = torch.optim.Muon(hidden, lr=t.muon_lr, weight_decay=t.weight_decay,
                                    momentum=t.muon_momentum, adjust_lr_fn=t.muon_adjust_lr)
    by_hand_adamw = torch.optim.AdamW(
        [{**g, "params": [p for p in g["params"] if id(p) not in ids]}
         for g in reference.optimizer_groups(t.weight_decay)],
        lr=t.learning_rate, betas=(t.beta1, t.beta2), foreach=False)
    for step in range(4):  # warmup, then decay: the Muon group follows at its own peak
        lr = optim.lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr  # what train_step does
        for group in by_hand_adamw.param_groups:
            group["lr"] = lr
        for group in by_hand_muon.param_groups:
            group["lr"] = lr * t.muon_lr / t.learning_rate
        fill_grads(model, step)
        fill_grads(reference, step)
        optimizer.step()
        by_hand_adamw.step()
        by_hand_muon.step()
        assert [g["lr"] for g in optimizer.param_groups] == [lr] * 3  # as set: never compounded
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if ns_dtype == "bfloat16" or id(q) not in ids:
                assert torch.equal(p, q), f"step {step}: {name}"
            else:  # float32 orthogonalizes the matrices together: the same to rounding
                torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=f"step {step}: {name}")


def test_a_gpu_runs_adamw_is_torchs_foreach_update_and_skips_a_flagged_step():
    """adamw.AdamW (a GPU run's non-fused AdamW) against torch's default GPU AdamW,
    AdamW(foreach=True), run on a CPU: the same weights and state to float32 rounding over steps
    of changing lr, with and without weight decay, taking over torch's state (its step counts
    on the host) halfway; a step flagged in found_inf, its gradients NaN, leaves every weight
    and state tensor as it was, bit for bit, the first step included."""
    model, reference = tiny_gpt(), tiny_gpt()
    groups = model.optimizer_groups(0.1)
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}
    optimizer = adamw.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False)
    by_hand = torch.optim.AdamW(reference.optimizer_groups(0.1), lr=1e-2, betas=(0.9, 0.95),
                                foreach=True)

    def skipped_step_changes_nothing(step: int) -> None:
        before = [t.clone() for t in [*model.parameters(), *(
            t for s in optimizer.state.values() for t in s.values())]]
        for p in model.parameters():
            p.grad = torch.full_like(p, math.nan)
        next(model.parameters()).grad[0] = math.inf
        optimizer.found_inf = torch.ones(())
        optimizer.step()
        after = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]
        if len(before) < len(after):  # the first step: the state is made, all zeros
            assert not any(t.any() for t in after[len(before):])
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"step {step}"
        assert all(not p.grad.any() for p in model.parameters())  # zeroed, never read again

    for step in range(6):
        lr = 1e-2 * (1 + step) / 3
        if step == 3:  # resumed from torch's state: its step counts on the host (a GPU: moved once)
            optimizer = adamw.AdamW(model.optimizer_groups(0.1), lr=lr)
            optimizer.load_state_dict(copy.deepcopy(by_hand.state_dict()))
        for group in [*optimizer.param_groups, *by_hand.param_groups]:
            group["lr"] = lr
        if step == 0:
            skipped_step_changes_nothing(step)  # before any state exists: the state is made
        fill_grads(model, step)
        fill_grads(reference, step)
        optimizer.found_inf = torch.zeros(())
        optimizer.step()
        by_hand.step()
        skipped_step_changes_nothing(step)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
    ours, torchs = optimizer.state_dict()["state"], by_hand.state_dict()["state"]
    for i in torchs:
        assert torch.equal(ours[i]["step"].cpu(), torchs[i]["step"].float())
        for key in ("exp_avg", "exp_avg_sq"):
            scale = torchs[i][key].abs().max().item()  # m * b1 + (1 - b1) * g, not one lerp
            torch.testing.assert_close(ours[i][key], torchs[i][key], rtol=0, atol=1e-6 * scale)


def test_orthogonalizing_all_at_once_is_one_by_one():
    """orthogonalize_all (matrices of a shape as one batch, 4:1 ones through their Gram matrix)
    gives orthogonalize's result for each: tall, wide, square, a nearly rank-2 and a zero
    matrix among them."""
    coefficients = (3.4445, -4.7750, 2.0315)
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(16, 2, generator=gen) @ torch.randn(2, 64, generator=gen)
    updates = [torch.randn(shape, generator=gen) for shape in
               [(64, 16), (16, 64), (48, 16), (24, 24), (16, 64), (16, 20)]]
    updates += [low_rank + 1e-4 * torch.randn(16, 64, generator=gen), torch.zeros(64, 16)]
    got = muon_module.orthogonalize_all(updates, coefficients, 5, 1e-7)
    for update, result in zip(updates[:-1], got):
        one = muon_module.orthogonalize(update, coefficients, 5, 1e-7)
        assert result.shape == update.shape and result.dtype == torch.float32
        torch.testing.assert_close(result, one, rtol=0, atol=2e-5)
        torch.testing.assert_close(result.double(), newton_schulz_float64(update, coefficients),
                                   rtol=0, atol=2e-5)
    assert got[-1].shape == (64, 16) and not got[-1].any()


def with_singular_values(values: torch.Tensor, rows: int, cols: int, seed: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U diag(values) V^T in float64 with random orthonormal U (rows) and V (cols)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, len(values), generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, len(values), generator=gen, dtype=torch.float64))[0]
    return u @ torch.diag(values) @ v.T, u, v


def quintics(schedule, s):
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return s


def test_each_polar_express_quintic_is_the_closest_to_one_where_the_values_are_by_then():
    """Step k's quintic alternates its error 1 - p at four points with the largest size it has
    anywhere on its interval (so no quintic is closer: Chebyshev), and maps the interval into
    [1 - E, 1 + E], the next step's interval. The whole schedule takes [1e-3, 1] there."""
    schedule = polar_express.polar_express_coefficients(5)
    lo, hi = polar_express.POLAR_EXPRESS_LOWER, 1.0
    for a, b, c in schedule:
        s = torch.logspace(math.log10(lo), math.log10(hi), 200_001, dtype=torch.float64)
        miss = 1 - (a * s + b * s**3 + c * s**5)
        size = miss.abs().max().item()
        turns = torch.nonzero(torch.diff(torch.sign(torch.diff(miss)))).flatten() + 1
        extremes = torch.cat([miss[:1], miss[turns], miss[-1:]])
        assert len(extremes) == 4 and (extremes[:-1] * extremes[1:] < 0).all()
        torch.testing.assert_close(extremes.abs(), torch.full((4,), size, dtype=torch.float64),
                                   rtol=1e-6, atol=0)
        gen = torch.Generator().manual_seed(0)  # and any nearby quintic is farther from 1
        for _ in range(20):
            da, db, dc = (1e-3 * torch.randn(3, generator=gen, dtype=torch.float64)).tolist()
            other = 1 - ((a + da) * s + (b + db) * s**3 + (c + dc) * s**5)
            assert other.abs().max().item() > size
        lo, hi = 1 - size, 1 + size
    s = torch.logspace(-3, 0, 10_001, dtype=torch.float64)
    end = quintics(schedule, s)  # five steps: within [0.89, 1.11], where torch's five are not
    assert lo - 1e-9 < end.min() and end.max() < hi + 1e-9 and 0.88 < lo and hi < 1.12
    torch_five = quintics(muon_module.per_step((3.4445, -4.7750, 2.0315), 5), s)
    assert torch_five.min() < 0.48 and torch_five.max() > 1.2
    many = polar_express.polar_express_coefficients(12)  # past ~6 steps: the quintics' limit at 1
    assert many[:5] == schedule and many[-1] == polar_express.NEAR_ONE
    assert (quintics(many, s) - 1).abs().max() < 1e-12


@pytest.mark.parametrize("steps", [3, 5])
def test_a_polar_express_iteration_maps_each_singular_value_by_its_quintics(steps):
    """orthogonalize_all with a schedule (plain, and through the Gram matrix at 4:1) and
    orthogonalize give U q(S) V^T, q the schedule's quintics composed, of an update U S V^T
    divided by its Frobenius norm: singular values from 1 down to below the schedule's 1e-3."""
    schedule = polar_express.polar_express_coefficients(steps)
    values = torch.logspace(0, -4, 16, dtype=torch.float64)
    updates, expected = [], []
    for seed, (rows, cols) in enumerate([(64, 16), (16, 64), (16, 16), (16, 48)]):
        update, u, v = with_singular_values(values, rows, cols, seed)
        updates.append(update.float())
        scaled = values / values.norm()
        expected.append(u @ torch.diag(quintics(schedule, scaled)) @ v.T)
    got = muon_module.orthogonalize_all(updates, schedule, steps, 1e-7)
    close = 2e-5 if steps == 3 else 1e-3  # float32 rounding, grown ~1,000x by five steps' slopes
    for update, result, want in zip(updates, got, expected):
        torch.testing.assert_close(result.double(), want, rtol=0, atol=close)
        one = muon_module.orthogonalize(update, schedule, steps, 1e-7)
        torch.testing.assert_close(one.double(), want, rtol=0, atol=close)
    with pytest.raises(ValueError, match="3 Newton-Schulz quintics for 4 steps"):
        muon_module.orthogonalize_all(updates, polar_express.polar_express_coefficients(3), 4, 1e-7)


def test_polar_express_is_float32_muon_on_any_device_and_refused_with_bfloat16():
    cfg = muon_config(muon_ns_coefficients="polar_express", muon_ns_steps=3)
    for device in ("cpu", "cuda"):
        optimizer = optim.make_optimizer(tiny_gpt(), cfg, torch.device(device))
        assert optimizer.muon.ns_dtype == torch.float32
    group = optimizer.param_groups[-1]
    assert group["ns_coefficients"] == polar_express.polar_express_coefficients(3)
    plain = optim.make_optimizer(tiny_gpt(), muon_config(), torch.device("cpu"))
    assert plain.param_groups[-1]["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    with pytest.raises(ConfigError, match="polar_express iterates in float32"):
        load_config(["--optimizer=muon", "--muon_ns_coefficients=polar_express",
                     "--muon_ns_dtype=bfloat16"])


def test_muon_run_resumes_bit_exact(char_dataset, tmp_path):
    run = ["--optimizer=muon", "--muon_lr=0.03", "--max_iters=8", "--eval_interval=4",
           "--log_interval=1", "--dropout=0.1"]

    whole, parts = train_whole_and_resumed(char_dataset, tmp_path, *run)
    a, b = (checkpoint.latest_checkpoint(out) for out in (whole, parts))
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(c / "train_state.pt", weights_only=True)["optimizer"] for c in (a, b))
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    muon_ids = sa["param_groups"][-1]["params"]
    assert all(sa["state"][i].keys() == {"momentum_buffer"} for i in muon_ids)
    for i, moments in sa["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, sb["state"][i][name]), f"{i}.{name}"


@pytest.fixture(scope="module")
def single_muon(char_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single_muon")
    cfg, _ = load_config([*DIST_RUN, f"--dataset={char_dataset}", f"--out_dir={out}",
                          "--batch_size=4", "--optimizer=muon"])
    train.train(cfg)
    return out


def assert_near_run(out: Path, want: Path, since: int = 0) -> None:
    """The same logged numbers and final weights and momenta to float32 tolerance (the sums
    run in another order; on a CPU the Newton-Schulz is float32's)."""
    assert_same_trajectory(trajectory(out), [r for r in trajectory(want) if r["step"] >= since])
    a, b = out / "ckpt_0000004", want / "ckpt_0000004"
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)
    sa, sb = (loading.load_train_state(c)["optimizer"] for c in (a, b))
    as_json = json.loads(json.dumps(sa["param_groups"]))  # a sharded load gives lists, not tuples
    assert as_json == json.loads(json.dumps(sb["param_groups"]))
    for i, moments in sa["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(value, sb["state"][i][key], rtol=1e-4, atol=1e-6,
                                       msg=f"{i}.{key}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_train_muon_as_one(parallel, char_dataset, single_muon, tmp_path):
    """2 processes, then resumed in one, equal one process throughout. Under FSDP each rank holds
    row shards (DTensors): the Newton-Schulz iteration runs through DTensor ops, which compute
    on the whole matrix (all-reducing Gram matrices or gathering shards as needed)."""
    out = tmp_path / "run"
    args = (*DIST_RUN, f"--dataset={char_dataset}", "--optimizer=muon")
    proc = torchrun("train.py", *args, f"--out_dir={out}", "--batch_size=2",
                    f"--parallel={parallel}", "--stop_after_iters=2")
    assert proc.returncode == 0, output(proc)[-4000:]
    train.train(load_config([*args, f"--out_dir={out}", "--batch_size=4",
                             "--init_from=resume"])[0])
    assert_near_run(out, single_muon)
    if parallel == "fsdp":  # each rank loads its shards of the single process's state, and
        # all of it is gathered on rank 0 to save (checkpoint_format=full)
        resumed = tmp_path / "resumed"
        resumed.mkdir()
        shutil.copytree(single_muon / "ckpt_0000002", resumed / "ckpt_0000002")
        proc = torchrun("train.py", *args, f"--out_dir={resumed}", "--batch_size=2",
                        "--parallel=fsdp", "--init_from=resume", "--checkpoint_format=full")
        assert proc.returncode == 0, output(proc)[-4000:]
        assert_near_run(resumed, single_muon, since=3)


def test_bf16_weights_step_muon_on_float32_masters():
    cfg = muon_config()
    model, reference = tiny_gpt(), tiny_gpt()
    model.to(torch.bfloat16)
    optimizer = optim.make_optimizer(model, cfg, torch.device("cpu"))
    by_hand = optim.make_optimizer(reference, cfg, torch.device("cpu"))
    assert isinstance(optimizer, master_weights.MasterWeights)
    with torch.no_grad():  # the reference starts from the same (bf16-rounded) weights
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(p)
    for step in range(2):
        fill_grads(model, step)
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.float()
        optimizer.step()
        by_hand.step()
    twin = {id(p): q for p, q in zip(model.parameters(), reference.parameters())}
    for p, master in zip(optimizer.model_params, optimizer.masters):
        assert torch.equal(master, twin[id(p)]) and torch.equal(p, master.bfloat16())


def test_a_torch_without_muon_is_refused_in_one_line(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"^train.optimizer=muon needs torch.optim.Muon, which "
                       r"torch \S+ lacks; upgrade torch or use --optimizer=adamw$"):
        optim.make_optimizer(tiny_gpt(), muon_config(), torch.device("cpu"))


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ConfigError, match="train.optimizer='sgd' is not one of adamw, muon"):
        load_config(["--optimizer=sgd"])


def choices(section: type, name: str) -> tuple:
    return next(f.metadata["choices"] for f in dataclasses.fields(section) if f.name == name)


def test_every_optimizer_and_schedule_config_offers_is_implemented():
    """Each choice of train.optimizer builds an optimizer of its own, each of train.lr_schedule
    draws a curve of its own: a choice added without its code falls through to another's (AdamW,
    cosine) and fails here."""
    made = {}
    for name in choices(TrainConfig, "optimizer"):
        assert name in optim.STATE_TENSORS  # what the memory estimate counts for it
        made[name] = type(optim.make_optimizer(tiny_gpt(), muon_config(optimizer=name),
                                               torch.device("cpu")))
    assert len(set(made.values())) == len(made), made
    curves = {}
    for name in choices(TrainConfig, "lr_schedule"):
        cfg = muon_config(lr_schedule=name, warmup_iters=2, max_iters=10)
        curves[name] = tuple(optim.lr_at(step, cfg) for step in range(10))
        assert all(0 < lr <= cfg.train.learning_rate for lr in curves[name]), (name, curves)
    assert len(set(curves.values())) == len(curves), curves
