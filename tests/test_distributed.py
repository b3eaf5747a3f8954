"""Distributed training on the CPU: 2 processes under torchrun (gloo) train exactly as one process
with the same global batch, with DDP and with FSDP2; their checkpoint, written as each rank's
shards, resumes in one process, and FSDP2's bit for bit on two, or on one then two; a rank that
raises or hangs brings the whole job down. Then the pieces, without processes: each
rank's share of the data, the global batch in tokens, gradient sync on the last micro-step only,
stop signals shared by the ranks, the launcher's environment."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file

import train
from config import Config, ConfigError, TrainConfig, load_config
from conftest import tiny_model_config
from data.loader import Batches, load_meta
from engine import checkpoint, loading, sharded
from engine import device as machine
from engine.training import launch, parallel, processes, restore, resume, speedups, step
from engine.training.optim import make_optimizer
from model import GPT

ROOT = Path(__file__).resolve().parents[1]
# 4 steps of 2 micro-steps, evaluated (and saved) every 2; the global micro-batch is 4 sequences:
# --batch_size=4 in one process, --batch_size=2 in each of two
RUN = ["--config", "tiny", "--device=cpu", "--threads=1", "--max_iters=4", "--eval_interval=2",
       "--eval_iters=2", "--log_interval=1", "--grad_accum_steps=2", "--dropout=0"]
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Two processes on this machine; `timeout` only guards the test against a hang."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def run_one(char_dataset, out_dir, *extra) -> dict:
    cfg, _ = load_config([*RUN, f"--dataset={char_dataset}", f"--out_dir={out_dir}", *extra])
    return train.train(cfg)


def trajectory(out_dir) -> list[dict]:
    """Every logged step and evaluation, without timings."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    keep = ("kind", "step", "loss", "lr", "norm", "train", "val")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def assert_same_trajectory(got: list[dict], want: list[dict]) -> None:
    """The same logged rows (kind, step) with the same numbers to float tolerance."""
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for g, w in zip(got, want):
        numbers = {k: v for k, v in g.items() if k != "kind"}
        assert numbers.keys() == w.keys() - {"kind"}, (g, w)
        assert numbers == pytest.approx({k: w[k] for k in numbers}, rel=1e-5, abs=1e-6), (g, w)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, full (model.safetensors) or sharded."""
    if sharded.is_sharded(ckpt):
        return sharded.read_weights(ckpt)
    return load_file(str(ckpt / "model.safetensors"))


def moments(ckpt: Path) -> dict[str, dict]:
    """The optimizer state by parameter name: a sharded checkpoint's as stored; a full one's
    numbered in param_groups order, named by building the run's model and optimizer."""
    if sharded.is_sharded(ckpt):
        by_name: dict[str, dict] = {}
        for key, t in sharded.read_tensors(ckpt, "optim.state.").items():
            name, stat = key.removeprefix("optim.state.").rsplit(".", 1)
            by_name.setdefault(name, {})[stat] = t
        return by_name
    cfg = loading.read_config(ckpt)
    model = GPT(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in make_optimizer(model, cfg, torch.device("cpu")).param_groups
             for p in g["params"]]
    return {order[i]: s for i, s in loading.load_train_state(ckpt)["optimizer"]["state"].items()}


def assert_same_checkpoint(a: Path, b: Path, exact: bool = False) -> None:
    """Weights and AdamW moments equal to float tolerance (the sums run in another order), or
    bit for bit."""
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **tolerance, msg=k)
    sa, sb = moments(a), moments(b)
    assert sa.keys() == sb.keys()
    for name, state in sa.items():
        for stat in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state[stat], sb[name][stat], **tolerance,
                                       msg=f"{name}.{stat}")


@pytest.fixture(scope="module")
def single(char_dataset, tmp_path_factory) -> Path:
    """The reference: one process, micro-batch 4, 4 steps uninterrupted."""
    out = tmp_path_factory.mktemp("single")
    run_one(char_dataset, out, "--batch_size=4")
    return out


def first_half(char_dataset, out: Path, parallel: str, *extra: str) -> subprocess.CompletedProcess:
    """2 processes train steps 1-2 of RUN (micro-batch 2 each) and stop, saving step 2."""
    return torchrun("train.py", *RUN, f"--dataset={char_dataset}", f"--out_dir={out}",
                    "--batch_size=2", f"--parallel={parallel}", "--stop_after_iters=2", *extra)


@pytest.fixture(scope="module")
def fsdp_half(char_dataset, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """first_half under FSDP2: its checkpoint is sharded (checkpoint_format=auto)."""
    out = tmp_path_factory.mktemp("fsdp_half") / "run"
    return out, first_half(char_dataset, out, "fsdp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_train_as_one_and_resume_in_one(parallel, char_dataset, single, fsdp_half,
                                                      tmp_path, capsys):
    out = tmp_path / "run"
    if parallel == "fsdp":
        shutil.copytree(fsdp_half[0], out)
        proc = fsdp_half[1]
    else:  # DDP's replicas: sharded, the writing is spread over the processes
        proc = first_half(char_dataset, out, parallel, "--checkpoint_format=sharded")
    assert proc.returncode == 0, output(proc)[-4000:]
    sizes = [f.stat().st_size for f in sorted((out / "ckpt_0000002" / "shards").glob("*.distcp"))]
    assert len(sizes) == 2 and min(sizes) > max(sizes) / 4, sizes  # each rank wrote its part
    log = proc.stdout
    assert f"distributed: {parallel} over 2 processes" in log
    assert ("global batch: 8 sequences = 256 tokens per step (2 micro-batch x 2 accumulation x "
            "2 processes)") in log
    assert log.count("eval     0 |") == 1  # rank 0 alone prints
    # each rank read its half of every global batch, and the losses, gradients and evaluations
    # were averaged over both: steps 1-2 equal the single process's
    want = trajectory(single)
    assert_same_trajectory(trajectory(out), want[:4])  # eval 0, steps 1-2, eval 2
    assert [c.name for c in checkpoint.list_checkpoints(out)] == ["ckpt_0000002"]
    assert_same_checkpoint(out / "ckpt_0000002", single / "ckpt_0000002")
    # one process (the same global batch) continues the run as if nothing had changed
    capsys.readouterr()
    summary = run_one(char_dataset, out, "--batch_size=4", "--init_from=resume")
    assert summary["step"] == 4 and summary["tokens_seen"] == 4 * 8 * 32
    assert "note:" not in capsys.readouterr().out  # nothing changed that changes the run
    assert_same_trajectory(trajectory(out), want)
    assert_same_checkpoint(out / "ckpt_0000004", single / "ckpt_0000004")


def test_fsdp_shards_resume_bit_for_bit_and_on_1_then_2_processes(fsdp_half, char_dataset,
                                                                    single, tmp_path):
    """Each rank writes its own shards; in the background they hold the same bits; resumed on
    2 processes the run is bit for bit the uninterrupted one; 2 -> 1 -> 2 processes it matches
    one process's to float tolerance."""
    half = fsdp_half[0]
    assert sorted(p.name for p in (half / "ckpt_0000002" / "shards").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    whole = tmp_path / "whole"  # uninterrupted, saving in the background while it trains
    proc = torchrun("train.py", *RUN, f"--dataset={char_dataset}", f"--out_dir={whole}",
                    "--batch_size=2", "--parallel=fsdp", "--checkpoint_async=true")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert_same_checkpoint(whole / "ckpt_0000002", half / "ckpt_0000002", exact=True)
    again = shutil.copytree(half, tmp_path / "again")
    proc = torchrun("train.py", *RUN, f"--dataset={char_dataset}", f"--out_dir={again}",
                    "--batch_size=2", "--parallel=fsdp", "--init_from=resume")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert trajectory(again) == trajectory(whole)
    assert_same_checkpoint(again / "ckpt_0000004", whole / "ckpt_0000004", exact=True)
    moved = shutil.copytree(half, tmp_path / "moved")  # step 3 in one process, step 4 in two
    run_one(char_dataset, moved, "--batch_size=4", "--init_from=resume", "--stop_after_iters=1",
            "--checkpoint_format=sharded")
    assert sharded.is_sharded(moved / "ckpt_0000003")
    proc = torchrun("train.py", *RUN, f"--dataset={char_dataset}", f"--out_dir={moved}",
                    "--batch_size=2", "--parallel=fsdp", "--init_from=resume")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert_same_trajectory(trajectory(moved), trajectory(single))
    assert_same_checkpoint(moved / "ckpt_0000004", single / "ckpt_0000004")


def accelerate_launch(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`accelerate launch` of 2 CPU processes, with no accelerate config file."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes=2", "--num_machines=1", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_accelerate_launch_runs_the_same_script(char_dataset, single, tmp_path):
    out = tmp_path / "run"
    proc = accelerate_launch("--mixed_precision=no", "--dynamo_backend=no", "train.py", *RUN,
                             f"--dataset={char_dataset}", f"--out_dir={out}", "--batch_size=2",
                             "--stop_after_iters=2", tmp_path=tmp_path)
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "distributed: ddp over 2 processes" in proc.stdout
    assert_same_trajectory(trajectory(out), trajectory(single)[:4])


def test_accelerate_mixed_precision_is_honoured(char_dataset, tmp_path):
    out = tmp_path / "run"
    proc = accelerate_launch("--mixed_precision=bf16", "train.py", *RUN,
                             f"--dataset={char_dataset}", f"--out_dir={out}", "--batch_size=2",
                             "--max_iters=1", "--eval_iters=1", tmp_path=tmp_path)
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "accelerate --mixed_precision=bf16: dtype=bfloat16" in proc.stdout
    assert json.loads((out / "ckpt_0000001" / "config.json").read_text())["system"]["dtype"] \
        == "bfloat16"


@pytest.mark.parametrize("env, message", [
    ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "--mixed_precision=fp8 is not supported"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "asks for bfloat16 but the config says "
                                             "dtype=float16"),
    ({"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"}, "--dynamo_backend=aot_eager is not supported"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "--use_deepspeed is not supported"),
])
def test_accelerate_flags_this_code_cannot_honour_are_refused(env, message, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg, _ = load_config(["--config", "tiny", "--dtype=float16"])
    with pytest.raises(machine.SetupError, match=message):
        parallel.apply_launcher_flags(cfg)


def test_accelerate_flags_set_the_config(monkeypatch):
    for key, value in {"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_DYNAMO_BACKEND":
                       "INDUCTOR", "ACCELERATE_DYNAMO_MODE": "max-autotune",
                       "ACCELERATE_USE_CPU": "True"}.items():
        monkeypatch.setenv(key, value)
    cfg, _ = load_config(["--config", "tiny", "--device=auto"])
    notes = parallel.apply_launcher_flags(cfg)
    assert (cfg.system.dtype, cfg.system.compile, cfg.system.compile_mode, cfg.system.device) \
        == ("float16", True, "max-autotune", "cpu")
    assert len(notes) == 3
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate's default: the config's
    cfg, _ = load_config(["--config", "tiny", "--dtype=bfloat16"])
    parallel.apply_launcher_flags(cfg)
    assert cfg.system.dtype == "bfloat16"


# rank 1 fails at its 5th batch (in step 4): it raises, or it hangs and dies only when killed
FAULTY_RANK = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import train
    from data import loader
    from engine.training import launch

    if os.environ["RANK"] == "1":
        fetch, fetched = loader.Batches.next, [0]

        def next_batch(self):
            fetched[0] += 1
            if fetched[0] == 5 and sys.argv[1] == "raise":
                raise ValueError("rank 1 failed on purpose")
            if fetched[0] == 5:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(600)
            return fetch(self)

        loader.Batches.next = next_batch
    sys.exit(launch.record(train.main)(sys.argv[2:]))
""")


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_rank_brings_the_job_down(fault, char_dataset, tmp_path):
    script = tmp_path / "faulty_rank.py"
    script.write_text(FAULTY_RANK.format(root=str(ROOT)))
    proc = torchrun(str(script), fault, "--config", "tiny", f"--dataset={char_dataset}",
                    f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--threads=1",
                    "--batch_size=2", "--max_iters=50", "--eval_interval=100",
                    "--eval_iters=1", "--log_interval=1", "--dist_timeout=3", timeout=150)
    text = output(proc)
    assert proc.returncode != 0, text[-4000:]
    assert "step     3 |" in proc.stdout and "step     4 |" not in proc.stdout
    # rank 0 was waiting for rank 1's gradients and says why it gave up
    assert "rank 0: error: waiting for the other processes failed" in text
    if fault == "raise":  # the launcher's summary shows the failed rank's own error
        assert "ValueError: rank 1 failed on purpose" in text
    else:  # nothing died: only the timeout ended the wait
        assert "--dist_timeout=3 seconds" in text


def test_each_rank_reads_its_share_of_the_global_batch(char_dataset):
    meta = load_meta(str(char_dataset))
    one = Batches(meta, "train", 4, 16, seed=5)
    ranks = [Batches(meta, "train", 2, 16, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, y = one.next()  # (4, 16)
        (x0, y0), (x1, y1) = (r.next() for r in ranks)
        assert not torch.equal(x0, x1)
        assert torch.equal(x[0::2], x0) and torch.equal(x[1::2], x1)
        assert torch.equal(y[0::2], y0) and torch.equal(y[1::2], y1)
    fixed = one.fixed(3, seed=9)
    shares = [r.fixed(3, seed=9) for r in ranks]
    for i, starts in enumerate(fixed):
        assert list(starts[0::2]) == list(shares[0][i]) and list(starts[1::2]) == list(shares[1][i])
    # the position in the stream is the same on every rank: rank 0's checkpoint serves all
    assert ranks[0].state_dict()["rng"] == ranks[1].state_dict()["rng"] == one.state_dict()["rng"]


def test_resume_hands_each_rank_its_rows_of_the_saved_batch(char_dataset, tmp_path):
    meta = load_meta(str(char_dataset))
    model = GPT(tiny_model_config(vocab_size=meta["vocab_size"]))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saved = Batches(meta, "train", 4, 16, seed=1)
    x, y = saved.next()  # the next global batch, as two processes save it
    state = resume.capture(processes.Dist(), model, optimizer, scaler, saved, (x, y),
                           resume.Counters(), torch.device("cpu"))
    cfg = Config()
    cfg.train.init_from = "resume"
    torch.save(state, tmp_path / "train_state.pt")
    (tmp_path / "config.json").write_text(cfg.to_json())
    for rank in range(2):
        batches = Batches(meta, "train", 2, 16, seed=1, rank=rank, world_size=2)
        _, (xr, yr), notes = restore.restore(tmp_path, cfg, processes.Dist(), model, optimizer,
                                            scaler, batches, torch.device("cpu"))
        assert torch.equal(xr, x[rank::2]) and torch.equal(yr, y[rank::2]) and notes == []


def test_tokens_per_step_sets_the_accumulation():
    for world, accum in ((1, 32), (2, 16), (8, 4)):
        t = TrainConfig(batch_size=16, grad_accum_steps=32, tokens_per_step=524288)
        note = speedups.set_global_batch(t, 1024, world)
        assert t.grad_accum_steps == accum
        assert (note == "") == (world == 1)
    t = TrainConfig(batch_size=16, grad_accum_steps=32, tokens_per_step=0)
    assert speedups.set_global_batch(t, 1024, 8) == "" and t.grad_accum_steps == 32
    with pytest.raises(ConfigError, match=r"16 x 1024 x 3 = 49,152; no batch_size fits 3 "):
        speedups.set_global_batch(TrainConfig(batch_size=16, tokens_per_step=524288), 1024, 3)
    with pytest.raises(ConfigError, match=r"use --batch_size=8"):
        speedups.set_global_batch(TrainConfig(batch_size=12, tokens_per_step=524288), 1024, 2)
    with pytest.raises(ConfigError, match=r"tokens_per_step=1000 must be a multiple of "
                                          r"batch_size x block_size = 4096"):
        load_config(["--config", "tiny", "--tokens_per_step=1000", "--batch_size=128"])


@pytest.fixture
def process_group(tmp_path):
    """A gloo group of this one process, so DDP can be built in the test process."""
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                  world_size=1)
    yield
    torch_dist.destroy_process_group()


def test_ddp_averages_gradients_on_the_last_micro_step_only(process_group):
    d = processes.Dist(parallel="ddp")
    rt = machine.Runtime(device=torch.device("cpu"), dtype=torch.float32, tf32=False, notes=[])
    ddp = parallel.wrap(GPT(tiny_model_config()), Config(), rt, d)
    reductions = []

    def count(state, bucket):  # a comm hook that records each all-reduce and does nothing
        reductions.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, count)
    idx = torch.randint(0, 37, (2, 16))
    seen = []
    for micro in range(3):
        with step.grad_sync(ddp)(micro == 2):
            _, loss = ddp(idx, idx)
            loss.backward()
        seen.append(len(reductions))
    assert seen[0] == seen[1] == 0 and seen[2] > 0


def test_a_stop_signal_waits_for_the_shared_step_boundary():
    stop = resume.StopRequest(synced=True)
    stop.request("SIGTERM")  # what the signal handler does on one rank
    assert not stop and stop.pending == "SIGTERM"  # no rank stops alone
    stop.commit("SIGTERM")  # sync_step found it on some rank: every rank stops here
    assert stop and stop.reason == "SIGTERM"
    other = resume.StopRequest(synced=True)
    other.request("stop_after_iters")  # the same step on every rank: at once
    assert other and other.reason == "stop_after_iters"
    alone = resume.StopRequest()
    alone.request("SIGTERM")  # one process: at once
    assert alone and alone.reason == "SIGTERM"


class TwoEqualRanks(parallel.ProcessGroup):
    """Dist as seen on rank 0 of two ranks that send the same values: the all-reduce doubles."""

    def _all_reduce(self, values, op=None):
        return values.detach().double() * 2


def test_sync_step_shares_a_signal_one_step_late_and_means_the_loss():
    dist, stop = TwoEqualRanks(world_size=2, parallel="ddp"), resume.StopRequest(synced=True)
    assert dist.sync_step(torch.tensor(3.0), stop).item() == 3.0  # the mean over two ranks
    stop.request("SIGTERM")  # arrives during step 2
    assert dist.sync_step(torch.tensor(1.0), stop).item() == 1.0
    assert not stop  # step 2's flags are not read yet: the host did not wait for them
    dist.sync_step(torch.tensor(1.0), stop)  # step 3 reads step 2's sums
    assert stop and stop.reason == "SIGTERM"


def test_launcher_environment_errors(monkeypatch):
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    assert processes.launch_env() == (0, 0, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(machine.SetupError, match="MASTER_ADDR, MASTER_PORT not set; start the "
                                                 "processes with torchrun"):
        processes.launch_env()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(machine.SetupError, match="must be integers"):
        processes.launch_env()
    with pytest.raises(machine.SetupError, match="several processes cannot share MPS"):
        parallel.rank_device("mps", 0)
    assert parallel.rank_device("cpu", 1) == ("cpu", "")
    assert processes.error_prefix() == "rank two: "


def test_a_launched_rank_leaves_without_the_interpreters_teardown(monkeypatch, capsys):
    """gloo's worker threads outlive destroy_process_group once DDP used the group: a launched
    rank exits with os._exit after flushing its output; one plain process exits as usual."""
    left = []
    monkeypatch.setattr(launch.os, "_exit", left.append)
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as plain:
        launch.leave(3)
    assert plain.value.code == 3 and left == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    print("the last line", end="")
    launch.leave(0)
    assert left == [0] and capsys.readouterr().out == "the last line"
