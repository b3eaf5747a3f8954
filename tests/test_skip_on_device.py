"""A non-finite step is skipped without the host reading the device: every optimizer a GPU run
builds takes found_inf and leaves the weights and its state, step counts included, as they were,
and the training loop reads the device only at log intervals. Each host read of a tensor's value
(bool(), .item(), .tolist(), .cpu(), ...) is a wait for the device on a GPU; here they are
counted by patching them, stepping on a CPU what make_optimizer builds for CUDA; on CUDA torch's
sync debug mode refuses them. A CPU run's non-fused AdamW is torch's, stepped after the host
reads the flag (which waits for nothing there)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import train
from config import Config, load_config
from conftest import tiny_model_config, train_args
from engine import device as machine
from engine.training import build, master_weights, optim, parallel
from engine.training.step import (Trainer, grad_sync, skips_on_device, train_step,
                                  update_unless_nonfinite)
from model import GPT
from test_distributed import process_group  # noqa: F401 (a fixture)

# the Python-level ways of reading a tensor's value on the host
HOST_READS = ("__bool__", "item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__")
# every optimizer make_optimizer builds: train.optimizer x train.fused_adamw x
# system.weights_dtype, and Muon's two Newton-Schulz dtypes
OPTIMIZERS = {
    "adamw": {},
    "adamw_fused": {"fused_adamw": True},
    "muon": {"optimizer": "muon", "muon_ns_dtype": "float32"},
    "muon_fused_adamw": {"optimizer": "muon", "fused_adamw": True},
    "muon_bfloat16_iteration": {"optimizer": "muon", "muon_ns_dtype": "bfloat16"},
    "bf16_weights": {"weights_dtype": "bfloat16"},
    "bf16_weights_muon": {"weights_dtype": "bfloat16", "optimizer": "muon"},
    "float16_grad_scaler": {"dtype": "float16"},
}


@contextlib.contextmanager
def counting_host_reads(sink=None):
    """Yields a list that each host read of a tensor's value appends its name to (or hands the
    name to sink)."""
    reads: list[str] = []
    record = sink or reads.append
    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            def counted(self, *args, _name=name, _real=getattr(torch.Tensor, name), **kwargs):
                record(_name)
                return _real(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counted)
        yield reads


def poisoned_loss(monkeypatch) -> dict:
    """GPT.forward's training loss turns NaN while the returned dict's "on" is True."""
    real_forward, poison = GPT.forward, {"on": False}

    def forward(self, idx, targets=None, *rest, **kwargs):
        logits, loss = real_forward(self, idx, targets, *rest, **kwargs)
        if self.training and loss is not None and poison["on"]:
            loss = loss * math.nan
        return logits, loss
    monkeypatch.setattr(GPT, "forward", forward)
    return poison


def trainer_for(choice: str, device: str = "cpu", built_for: str = "cuda",
                sharded: bool = False) -> Trainer:
    """A tiny GPT on `device` (sharded: under FSDP2) and the optimizer make_optimizer builds for
    `choice` on a `built_for` device, as train.py steps them."""
    settings = dict(OPTIMIZERS[choice])
    dtype = getattr(torch, settings.pop("dtype", "float32"))
    bf16_weights = settings.pop("weights_dtype", None) == "bfloat16"
    cfg = Config()
    cfg.train.learning_rate, cfg.train.muon_lr = 1e-2, 0.03
    for key, value in settings.items():
        setattr(cfg.train, key, value)
    rt = machine.Runtime(torch.device(device), torch.bfloat16 if bf16_weights else dtype, False, [])
    torch.manual_seed(0)
    model = GPT(tiny_model_config()).to(device)
    if bf16_weights:
        master_weights.hold_weights(model, "none", 1)
    if sharded:
        model = parallel.shard(model, cfg.system, rt)
    optimizer = optim.make_optimizer(model, cfg, torch.device(built_for))
    x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), device=device)
    feed = type("Feed", (), {"next": lambda self: (x, x)})()
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    return Trainer(model, model, optimizer, scaler, feed, rt, grad_clip=1.0,
                   grad_sync=grad_sync(model))


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    """Copies of the weights and every tensor of the optimizer's state (masters included); of
    a sharded one (FSDP's DTensors) the whole tensor."""
    state = trainer.optimizer.state_dict()
    tensors = [v for s in state["state"].values() for v in s.values() if torch.is_tensor(v)]
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for t in [*trainer.raw_model.state_dict().values(), *tensors,
                      *state.get("master_weights", [])]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("built_for", ["cuda", "cpu"])
@pytest.mark.parametrize("choice", OPTIMIZERS)
def test_every_optimizer_skips_a_nonfinite_step_without_reading_the_device(choice, built_for,
                                                                          monkeypatch):
    """Six steps, the fourth NaN: no step of a GPU run's optimizer reads the device (a CPU run's
    reads the flag once a step unless fused AdamW takes it, and torch's non-fused AdamW reads its
    step count, which it keeps on the host), the NaN step changes no weight and no state tensor
    (not the step counts either), and the run ends where one that never saw the NaN step ends,
    to the bit (float16: the loss scale halves, so the later steps differ)."""
    poison = poisoned_loss(monkeypatch)
    trainer, twin = (trainer_for(choice, built_for=built_for) for _ in range(2))
    on_device = skips_on_device(trainer.optimizer)
    assert on_device == (built_for == "cuda" or "fused" in choice)
    batch = trainer.batches.next()
    for step in range(6):
        poison["on"] = step == 3
        before = snapshot(trainer)
        with counting_host_reads() as reads:
            result = train_step(trainer, batch, 1e-2)
        if built_for == "cuda":
            assert reads == [], f"step {step} read the device: {reads}"
        assert reads.count("__bool__") == (not on_device)
        assert bool(result.finite) == (step != 3)
        if step == 3:
            assert same(snapshot(trainer), before)
        else:
            poison["on"] = False
            train_step(twin, batch, 1e-2)
    if choice == "float16_grad_scaler":
        assert trainer.scaler.get_scale() == twin.scaler.get_scale() / 2
    else:
        assert same(snapshot(trainer), snapshot(twin))


def test_an_optimizer_that_cannot_skip_on_the_device_is_stepped_after_one_read(monkeypatch):
    """An optimizer make_optimizer does not build (torch's SGD here) knows no found_inf: the host
    reads the flag, once a step, and a NaN step is still skipped."""
    poison = poisoned_loss(monkeypatch)
    trainer = trainer_for("adamw")
    trainer.optimizer = torch.optim.SGD(trainer.raw_model.parameters(), lr=0.1, momentum=0.9)
    assert not skips_on_device(trainer.optimizer)
    batch = trainer.batches.next()
    for step in range(3):
        poison["on"] = step == 2
        before = snapshot(trainer)
        with counting_host_reads() as reads:
            train_step(trainer, batch, 0.1)
        assert reads == ["__bool__"]
    assert same(snapshot(trainer), before)


def test_found_inf_is_handed_over_for_one_step_only():
    """After a skipped step the flag is gone from the optimizer and its inner ones: the next
    update is made."""
    trainer = trainer_for("bf16_weights_muon")
    inner = trainer.optimizer.inner
    for p in trainer.raw_model.parameters():
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()  # the state exists: a skipped step leaves every tensor of it
    before = snapshot(trainer)
    update_unless_nonfinite(trainer.optimizer, torch.tensor(False))
    assert same(snapshot(trainer), before)
    assert [getattr(o, "found_inf", None) for o in (trainer.optimizer, inner, inner.adamw,
                                                    inner.muon)] == [None] * 4
    trainer.optimizer.step()
    assert not same(snapshot(trainer), before)


@pytest.mark.parametrize("config", [[], ["--optimizer=muon"],
                                    ["--dtype=bfloat16", "--weights_dtype=bfloat16"]],
                         ids=["adamw", "muon", "bf16_weights"])
def test_the_loop_reads_the_device_only_at_log_intervals(config, char_dataset, tmp_path,
                                                         monkeypatch):
    """train.py over 10 steps with a GPU run's optimizer, logging every 5, the third step NaN:
    between log lines nothing is read; at the log line the skipped steps come in one transfer
    (NonFiniteGuard.read's .tolist()), beside the loss and norm the line prints."""
    poison, real_step, windows = poisoned_loss(monkeypatch), train.one_step, []
    monkeypatch.setattr(build, "make_optimizer", lambda model, cfg, device: optim.make_optimizer(
        model, cfg, torch.device("cuda")))

    def step_and_mark(*args):  # each step opens a window; its reads land in it
        windows.append([])
        poison["on"] = len(windows) == 3
        return real_step(*args)
    monkeypatch.setattr(train, "one_step", step_and_mark)
    cfg, _ = load_config(train_args(char_dataset, tmp_path / "run", "--max_iters=10",
                                    "--log_interval=5", "--eval_interval=100",
                                    "--save_checkpoints=false", *config))
    with counting_host_reads(lambda name: windows and windows[-1].append(name)):
        summary = train.train(cfg)  # what the start-up and the first evaluation read: no window
    assert summary["skipped_steps"] == 1 and len(windows) == 10
    assert [w for step, w in enumerate(windows, 1) if step not in (5, 10)] == [[]] * 8
    assert sorted(windows[4]) == ["item", "item", "tolist"]


@pytest.mark.usefixtures("process_group")
def test_a_sharded_run_skips_on_the_device_too(monkeypatch):
    """Under FSDP2 (one process here) weights, gradients and state are DTensors, and a GPU run's
    AdamW and Muon select on them as on plain tensors: without a read of the device, the NaN
    step changes nothing, and every step lands where the unsharded run's does (to float32
    rounding, as test_optim.py's two processes: a DTensor's Newton-Schulz runs matrix by matrix)."""
    poison = poisoned_loss(monkeypatch)
    plain, sharded = trainer_for("muon"), trainer_for("muon", sharded=True)
    assert type(next(sharded.raw_model.parameters())).__name__ == "DTensor"
    batch = plain.batches.next()
    for step in range(4):
        poison["on"] = step == 2
        before = snapshot(sharded)
        with counting_host_reads() as reads:
            train_step(sharded, batch, 1e-2)
        assert reads == []
        train_step(plain, batch, 1e-2)
        if step == 2:
            assert same(snapshot(sharded), before)
        for a, b in zip(snapshot(sharded), snapshot(plain)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("choice", OPTIMIZERS)
def test_every_optimizer_skips_on_cuda_without_a_sync(choice):
    """torch.cuda.set_sync_debug_mode("error") raises at any wait for the device: a finite and
    a non-finite update after a first one (which makes the state) raise nothing, and the
    non-finite one changes nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    trainer = trainer_for(choice, "cuda")  # built for CUDA
    optimizer, params = trainer.optimizer, list(trainer.raw_model.parameters())
    finite = torch.ones((), dtype=torch.bool, device="cuda")
    for update in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        before = snapshot(trainer)
        torch.cuda.set_sync_debug_mode("error" if update else "default")
        try:
            update_unless_nonfinite(optimizer, finite if update < 2 else ~finite)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert same(snapshot(trainer), before)
