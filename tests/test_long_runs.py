"""Long runs: exact resume, stop signals, atomic checkpoints under SIGKILL, safe loading,
non-finite steps, run logging, and bad input reaching the user as one line."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import generate
import train
from config import load_config
from conftest import kill_when_stalled, train_args
from engine import checkpoint, loading, saving
from engine.training import metrics, restore, resume
from model import GPT

ROOT = Path(__file__).resolve().parents[1]
# 12 steps, evaluated every 4, with dropout so the torch RNG matters
RUN = ["--max_iters=12", "--eval_interval=4", "--log_interval=1", "--dropout=0.1"]


def run_train(char_dataset, out_dir, *extra) -> dict:
    cfg, _ = load_config(train_args(char_dataset, out_dir, *extra))
    return train.train(cfg)


def records(out_dir, kind=None) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def trajectory(out_dir) -> list[tuple]:
    """Everything a run measured, without timings."""
    return [(r["kind"], r["step"], r.get("loss"), r.get("lr"), r.get("norm"), r.get("train"),
             r.get("val")) for r in records(out_dir)]


def final_state(out_dir) -> tuple[dict, dict]:
    ckpt = checkpoint.latest_checkpoint(out_dir)
    return (load_file(str(ckpt / "model.safetensors")),
            torch.load(ckpt / "train_state.pt", weights_only=True))


def assert_same_tensors(a, b, where=""):
    """Nested dicts/lists of tensors and numbers, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (p, q) in enumerate(zip(a, b)):
            assert_same_tensors(p, q, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def uninterrupted(char_dataset, tmp_path_factory):
    """12 steps in one go; stdout kept, and every loss-curve redraw counted."""
    out = tmp_path_factory.mktemp("whole")
    plots, real_plot = [], metrics.plot_losses

    def counting_plot(rows, path, title):
        plots.append(max(r["step"] for r in rows))
        real_plot(rows, path, title)

    metrics.plot_losses = counting_plot
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            summary = run_train(char_dataset, out, *RUN)
    finally:
        metrics.plot_losses = real_plot
    return out, summary, stdout.getvalue(), plots


def test_every_rng_round_trips_through_a_safe_load(tmp_path):
    state = resume.rng_state(torch.device("cpu"))
    torch.save(state, tmp_path / "rng.pt")
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    restore.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True),
                               torch.device("cpu"))
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == draws


def test_resume_is_bit_exact(uninterrupted, char_dataset, tmp_path):
    whole, whole_summary, _, _ = uninterrupted
    out = tmp_path / "parts"
    first = run_train(char_dataset, out, *RUN, "--stop_after_iters=6")
    assert first["stop_reason"] == "stop_after_iters" and first["step"] == 6
    assert checkpoint.latest_checkpoint(out).name == "ckpt_0000006"  # between evaluations
    with open(out / "metrics.jsonl", "a") as f:  # what a killed run logged after its checkpoint
        f.write(json.dumps({"kind": "train", "step": 7, "loss": 99.0}) + '\n{"kind": "tr')
    second = run_train(char_dataset, out, *RUN, "--init_from=resume")
    assert second["steps"] == 6 and second["stop_reason"] == "done"
    assert trajectory(out) == trajectory(whole)  # every loss, lr and grad norm, each step once
    weights, state = final_state(out)
    whole_weights, whole_state = final_state(whole)
    assert_same_tensors(weights, whole_weights, "weights")
    for key in ("optimizer", "scaler", "data", "rng", "next_batch"):
        assert_same_tensors(state[key], whole_state[key], key)
    assert second["tokens_seen"] == whole_summary["tokens_seen"] == 12 * 8 * 32
    assert second["best_val"] == whole_summary["best_val"]


def test_init_from_auto_starts_fresh_then_resumes_exactly(uninterrupted, char_dataset, tmp_path):
    """The same command twice, as a job script that is preempted and resubmitted runs it: the
    first starts from scratch (no run there), the second resumes the run the first left."""
    whole = uninterrupted[0]
    out = tmp_path / "auto"
    first = run_train(char_dataset, out, *RUN, "--init_from=auto", "--stop_after_iters=6")
    assert (first["step"], first["steps"]) == (6, 6)
    second = run_train(char_dataset, out, *RUN, "--init_from=auto")
    assert (second["step"], second["steps"], second["stop_reason"]) == (12, 6, "done")
    assert trajectory(out) == trajectory(whole)
    assert_same_tensors(final_state(out)[0], final_state(whole)[0], "weights")


def test_sigint_saves_and_exits_then_resumes_exactly(uninterrupted, char_dataset, tmp_path,
                                                     monkeypatch, capsys):
    whole = uninterrupted[0]
    out = tmp_path / "interrupted"
    real_lr_at = train.lr_at

    def lr_at_with_ctrl_c(step, cfg):
        if step == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 3 -> 4
        return real_lr_at(step, cfg)

    monkeypatch.setattr(train, "lr_at", lr_at_with_ctrl_c)
    handler_before = signal.getsignal(signal.SIGINT)
    assert train.main(train_args(char_dataset, out, *RUN)) == 128 + signal.SIGINT
    assert "SIGINT received: saving a checkpoint" in capsys.readouterr().err
    assert checkpoint.latest_checkpoint(out).name == "ckpt_0000004"
    assert signal.getsignal(signal.SIGINT) is handler_before  # handler restored
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    assert train.main(train_args(char_dataset, out, *RUN, "--init_from=resume")) == 0
    assert trajectory(out) == trajectory(whole)
    assert_same_tensors(final_state(out)[0], final_state(whole)[0], "weights")


def test_sigterm_in_a_real_process_saves_and_exits(char_dataset, tmp_path):
    out = tmp_path / "term"
    cmd = [sys.executable, "-u", str(ROOT / "train.py"),
           *train_args(char_dataset, out, "--max_iters=100000", "--eval_interval=100000",
                 "--log_interval=1")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    watchdog = threading.Timer(180, proc.kill)  # never hang the suite
    watchdog.start()
    try:
        for line in proc.stdout:  # wait until it is training
            if line.startswith("step     2 "):
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received: saving a checkpoint" in stderr and "Traceback" not in stderr
    stopped = re.search(r"stopped \(SIGTERM\): step (\d+) of 100000", stdout)
    ckpt = checkpoint.latest_checkpoint(out)
    assert stopped and ckpt.name == f"ckpt_{int(stopped.group(1)):07d}"
    state = loading.load_train_state(ckpt)
    assert state["counters"]["step"] == int(stopped.group(1)) >= 2


# `python train.py ARGS` whose step 3 stalls (after ckpt_0000002 is saved), so that both signals
# land inside one step whatever the machine's speed: the first cannot reach its step boundary
STALL_IN_STEP_3 = textwrap.dedent("""
    import runpy, sys, time
    root, stalled = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    from engine.training import optim

    real_lr_at = optim.lr_at

    def lr_at(step, cfg):  # called as each step begins
        if step == 3:
            open(stalled, "w").close()
            time.sleep(600)
        return real_lr_at(step, cfg)

    optim.lr_at = lr_at  # train.py imports it from here
    sys.argv = [root + "/train.py", *sys.argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("first,second,status", [
    (signal.SIGINT, signal.SIGINT, 130),  # train.main's KeyboardInterrupt
    (signal.SIGTERM, signal.SIGTERM, -signal.SIGTERM),  # the default action: killed by it
], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once_without_saving(first, second, status, char_dataset,
                                                      tmp_path):
    """The first signal asks for a save at the end of the step; a second, in the same step,
    ends the process there: its status says how, and the last checkpoint stays the latest."""
    out, stalled, err = tmp_path / "run", tmp_path / "STALLED", tmp_path / "stderr.txt"
    script = tmp_path / "stall.py"
    script.write_text(STALL_IN_STEP_3)
    cmd = [sys.executable, "-u", str(script), str(ROOT), str(stalled),
           *train_args(char_dataset, out, "--max_iters=8", "--eval_interval=2")]
    with err.open("w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for(stalled.exists, "stall in step 3", proc)
        proc.send_signal(first)
        # the second must not reach the process before the first is handled: two of the same
        # signal pending at once are delivered as one
        wait_for(lambda: "received" in err.read_text(), "'received' line", proc)
        proc.send_signal(second)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)  # the stall has ~600 s left: only stopping at once ends it
        assert proc.poll() is not None, f"still running 60 s after the second signal:\n" \
                                        f"{err.read_text()}"
    finally:
        proc.kill()
        proc.wait()
    log = err.read_text()
    assert proc.returncode == status, log
    assert f"{first.name} received: saving a checkpoint after this step" in log
    assert f"{second.name} again: stopping now without saving" in log
    if status == 130:
        assert log.endswith("interrupted: nothing saved since the last checkpoint\n"), log
    assert "Traceback" not in log
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000002"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no .tmp_ckpt_*


KILL_DURING_SAVE = textwrap.dedent("""
    import os, sys, time, shutil
    import torch
    sys.path.insert(0, sys.argv[1])
    from engine import saving
    from config import Config, ModelConfig
    from model import GPT

    out, phase = sys.argv[2], sys.argv[3]
    cfg = Config()
    cfg.model = ModelConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16)

    def snapshot(step):
        torch.manual_seed(step)
        return GPT(cfg.model), {"step": torch.tensor(step)}

    for step in (1, 2):  # two complete checkpoints
        model, state = snapshot(step)
        saving.save(out, step, model, cfg, {}, state, keep=2)

    def stall():
        open(os.path.join(out, "STALLED"), "w").close()
        time.sleep(600)

    if phase == "weights":  # half the weights written
        def save_file(tensors, path):
            open(path, "wb").write(b"\\0" * 1000)
            stall()
        saving.save_file = save_file
    elif phase == "train_state":  # weights done, train state half written
        def torch_save(obj, path):
            open(path, "wb").write(b"PK\\3\\4" + b"\\0" * 100)
            stall()
        saving.torch.save = torch_save
    elif phase == "prune":  # new checkpoint in place, oldest half deleted
        real_rmtree = shutil.rmtree
        def rmtree(path, ignore_errors=False):
            if os.path.basename(path).startswith(".del_") and os.path.isdir(path):
                os.remove(os.path.join(path, "model.safetensors"))
                stall()
            real_rmtree(path, ignore_errors=ignore_errors)
        saving.shutil.rmtree = rmtree
    elif phase == "replace":  # same step saved again: old moved aside, new not yet in place
        real_rename = os.rename
        def rename(src, dst):
            real_rename(src, dst)
            if os.path.basename(str(dst)).startswith(".old_"):
                stall()
        saving.os.rename = rename
    step = 2 if phase == "replace" else 3
    model, state = snapshot(step)
    saving.save(out, step, model, cfg, {}, state, keep=2)
""")


def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    phases = {"weights": 2, "train_state": 2, "prune": 3, "replace": 1}  # phase -> latest step
    kill_when_stalled(KILL_DURING_SAVE, tmp_path, phases)
    for phase, step in phases.items():
        out = tmp_path / phase
        latest = checkpoint.latest_checkpoint(out)
        assert latest.name == f"ckpt_{step:07d}", phase
        model, _, _ = loading.load_model(latest)
        torch.manual_seed(step)
        expected = GPT(model.config)
        assert_same_tensors(checkpoint.model_state(model), checkpoint.model_state(expected))
        assert loading.load_train_state(latest)["step"].item() == step
        saving.recover(out)  # what the next save or resume does first
        left = sorted(p.name for p in out.iterdir() if p.name != "STALLED")
        assert left == (["ckpt_0000001", "ckpt_0000002"] if phase != "prune"
                        else ["ckpt_0000002", "ckpt_0000003"]), phase


class RunsCode:
    """Unpickling this would create `path`: a stand-in for any code a crafted file could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_crafted_train_state_is_refused_without_running_code(uninterrupted, char_dataset,
                                                             tmp_path, capsys):
    out = tmp_path / "crafted"
    shutil.copytree(uninterrupted[0], out)
    ckpt = checkpoint.latest_checkpoint(out)
    witness = tmp_path / "code_ran"
    torch.save({"optimizer": RunsCode(witness)}, ckpt / "train_state.pt")
    assert train.main(train_args(char_dataset, out, *RUN, "--max_iters=16",
                           "--init_from=resume")) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: refusing to load .*train_state.pt: it holds Python objects other "
                        r"than tensors .* could run code .*\n", err)
    assert not witness.exists()


def call_text(source: str, start: int) -> str:
    """The text of the call whose '(' is at source[start], up to its matching ')'."""
    depth = 0
    for end in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start:end + 1]
    return source[start:]


def test_no_unsafe_deserialisation_in_the_code():
    """Nothing may unpickle beyond torch.load(weights_only=True)."""
    unsafe = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if any(part.startswith(".") or part in ("out", "site-packages") for part in parts):
            continue
        source = path.read_text(encoding="utf-8")
        for m in re.finditer(r"\bpickle\.loads?\(|allow_pickle\s*=\s*True|\bdill\.load|"
                             r"\bjoblib\.load|\btorch\.load(\()", source):
            if m.group(1) and "weights_only=True" in call_text(source, m.start(1)):
                continue
            line = source.count("\n", 0, m.start()) + 1
            unsafe.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert unsafe == []


def nan_loss_from(call: int, poison_weights: bool = False):
    """A GPT.forward whose training losses turn NaN from the call-th training call on (or whose
    weights are poisoned with NaN at that call)."""
    real_forward, calls = GPT.forward, {"n": 0}

    def forward(self, idx, targets=None, *rest, **kwargs):
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] == call and poison_weights:
                with torch.no_grad():
                    self.transformer.ln_f.weight[0] = math.nan
        logits, loss = real_forward(self, idx, targets, *rest, **kwargs)
        if self.training and loss is not None and calls["n"] >= call and not poison_weights:
            loss = loss * math.nan
        return logits, loss
    return forward


def optimizer_updates(ckpt) -> int:
    return int(loading.load_train_state(ckpt)["optimizer"]["state"][0]["step"])


def test_nonfinite_steps_are_skipped_and_counted(char_dataset, tmp_path, monkeypatch, capsys):
    real_forward = GPT.forward
    bad = {4, 6}
    calls = {"n": 0}

    def forward(self, idx, targets=None, *rest, **kwargs):
        logits, loss = real_forward(self, idx, targets, *rest, **kwargs)
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] in bad:
                loss = loss * math.inf
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "skips"
    summary = run_train(char_dataset, out, "--max_iters=8", "--eval_interval=4",
                        "--max_nonfinite_steps=2")
    assert summary["stop_reason"] == "done" and summary["skipped_steps"] == 2
    assert [r["step"] for r in records(out, "skip")] == [4, 6]
    assert re.search(r"step     4 \| skipped: loss inf, norm (nan|inf) \(1 non-finite in a row",
                     capsys.readouterr().out)
    assert optimizer_updates(checkpoint.latest_checkpoint(out)) == 8 - 2  # no update when skipped


def test_nonfinite_streak_stops_the_run_and_keeps_good_checkpoints(char_dataset, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setattr(GPT, "forward", nan_loss_from(4))
    out = tmp_path / "streak"
    assert train.main(train_args(char_dataset, out, "--max_iters=20", "--eval_interval=2",
                           "--max_nonfinite_steps=3")) == 3
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: stopped at step 6: the loss or gradient norm was NaN/inf for 3 "
                        r"steps in a row .*the last good checkpoint is .*ckpt_0000004: resume "
                        r"it with --init_from=resume.*\n", err)
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000002", "ckpt_0000004"]
    assert optimizer_updates(out / "ckpt_0000004") == 3  # steps 4.. were skipped
    assert records(out)[-1]["kind"] == "skip"


def test_nonfinite_steps_are_read_at_log_intervals_without_stalling(char_dataset, tmp_path,
                                                                    monkeypatch, capsys):
    """The loop reads the skip flags only before a log line, evaluation or save: a streak that
    reaches the limit at step 4 stops the run at step 5, the next log line, with every skipped
    step (2..5) reported and counted."""
    monkeypatch.setattr(GPT, "forward", nan_loss_from(2))
    out = tmp_path / "deferred"
    assert train.main(train_args(char_dataset, out, "--max_iters=20", "--eval_interval=100",
                                 "--log_interval=5", "--max_nonfinite_steps=3",
                                 "--fused_adamw=true")) == 3
    captured = capsys.readouterr()
    assert "error: stopped at step 5:" in captured.err
    assert [r["step"] for r in records(out, "skip")] == [2, 3, 4, 5]
    assert "(4 non-finite in a row; the run stops at 3)" in captured.out


def test_nan_weights_are_never_saved(char_dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(GPT, "forward", nan_loss_from(4, poison_weights=True))
    out = tmp_path / "poisoned"
    assert train.main(train_args(char_dataset, out, "--max_iters=20", "--eval_interval=2",
                           "--max_nonfinite_steps=5")) == 3
    assert "weights hold NaN/inf: not saved" in capsys.readouterr().out
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["ckpt_0000002"]
    model, _, _ = loading.load_model(out)
    assert resume.weights_finite(model)
    model.transformer.ln_f.weight.data[0] = math.nan
    with pytest.raises(checkpoint.CheckpointError, match="refusing to save step 9: NaN/inf in 1 "
                                                         "weight tensor.*transformer.ln_f.weight"):
        saving.save(out, 9, model, load_config(train_args(char_dataset, out))[0], {})


def test_metrics_files_loss_curve_and_summary(uninterrupted):
    out, summary, stdout, plots = uninterrupted
    rows = records(out)
    with open(out / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["kind"], int(r["step"])) for r in table] == [(r["kind"], r["step"]) for r in rows]
    assert [float(r["val"]) for r in table if r["kind"] == "eval"] == \
        [r["val"] for r in rows if r["kind"] == "eval"]
    assert plots == [12]  # a short run: redrawn once, at the end (at most once a minute)
    from matplotlib.image import imread
    assert imread(out / "loss_curve.png").shape[2] in (3, 4)
    best = min(r["val"] for r in rows if r["kind"] == "eval")
    saved = json.loads((out / "summary.json").read_text())
    assert saved["best_val"] == summary["best_val"] == best
    assert saved["tokens_seen"] == 12 * 8 * 32 and saved["checkpoint"].endswith("ckpt_0000012")
    assert re.search(r"step    12 \| loss .* \| 100\.0% \| eta 0s\n", stdout)
    assert re.search(rf"done: step 12 of 12 \| 12 steps in \S+ \(\S+ in all\) \| 3,072 tokens "
                     rf"seen \| val [\d.]+ \(best {best:.4f}\) \| checkpoint .*ckpt_0000012\n",
                     stdout)


def test_a_run_without_the_start_evaluation_or_the_loss_curve(char_dataset, tmp_path):
    out = tmp_path / "run"
    summary = run_train(char_dataset, out, "--max_iters=6", "--eval_interval=4",
                        "--eval_at_start=false", "--loss_curve=false")
    assert [r["step"] for r in records(out, "eval")] == [4, 6]
    assert summary["step"] == 6 and not (out / "loss_curve.png").exists()
    assert (out / "metrics.csv").exists() and (out / "summary.json").exists()


def test_eta_from_recent_pace(tmp_path, monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["now"])
    cfg, _ = load_config(["--config", "tiny", f"--out_dir={tmp_path}", "--max_iters=1000"])
    run = metrics.RunLog(cfg, start_step=0, resumed=False)
    clock["now"] = 110.0
    assert run.progress(100) == " | 10.0% | eta 1m30s"  # 0.1 s per step, 900 steps to go
    assert [metrics.format_duration(s) for s in (59, 61, 7300, 200000)] == \
        ["59s", "1m01s", "2h01m", "2d07h"]


def test_wandb_offline_logs_and_resumes_the_same_run(char_dataset, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "wb"
    extra = ["--max_iters=4", "--eval_interval=2", "--wandb.enabled=true", "--project=test"]
    run_train(char_dataset, out, *extra, "--stop_after_iters=2")
    run_train(char_dataset, out, *extra, "--init_from=resume")
    wandb.teardown()  # finish() returns before the wandb service has flushed the run's file
    # one folder per invocation, named by start second and run id (two invocations within the
    # same second share a folder)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) >= 1
    assert len({p.name.rsplit("-", 1)[1] for p in runs}) == 1  # one W&B run, continued
    logged = b"".join(p.read_bytes() for r in runs for p in r.glob("*.wandb"))
    for key in (b"train/loss", b"train/lr", b"eval/val", b"eval/train", b"tokens_seen"):
        assert key in logged


def test_wandb_failure_is_one_clear_line(char_dataset, tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    assert train.main(train_args(char_dataset, tmp_path / "wb", "--wandb.enabled=true")) == 2
    assert capsys.readouterr().err == (
        "error: could not start Weights & Biases logging (api_key not configured (no-tty)); run "
        "`wandb login`, or log offline with WANDB_MODE=offline (then `wandb sync`), or set "
        "--wandb.enabled=false\n")


def other_alphabet_dataset(tmp_path) -> Path:
    from data.writing import write_dataset
    from data.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghij \n")
    ids = tok.encode("abc defg hij\n" * 40)
    write_dataset(tmp_path / "letters", tok, ids, ids)
    return tmp_path / "letters"


BAD_TRAIN_INPUT = {
    "negative lr": (["--learning_rate=-1"],
                    "error: invalid config: train.learning_rate must be > 0, got -1.0"),
    "zero batch": (["--batch_size=0"],
                   "error: invalid config: train.batch_size must be > 0, got 0"),
    "mistyped key": (["--max_iter=3"], "error: invalid config: unknown key 'max_iter' in command "
                                       "line; did you mean max_iters"),
    "wrong type": (["--eval_interval=often"], "error: invalid config: train.eval_interval "
                                              "(command line): expected an integer, got 'often'"),
    "longer context than the checkpoint": (["--init_from=resume", "--block_size=64"],
                                           "error: block_size 64 is larger than the checkpoint's "
                                           "context 32; use a block_size <= 32"),
    "start over a run": ([], "already holds a run (latest checkpoint ckpt_0000012); continue it "
                             "with --init_from=resume, or start a new run in another --out_dir"),
    "data from another vocabulary": (["--init_from=resume", "--dataset=LETTERS"],
                                     "use different char vocabularies (12 vs 65 characters): "
                                     "token ids would mean different text"),
    "truncated train state": (["--init_from=resume"], "train_state.pt is unreadable "
                                                     "(RuntimeError: PytorchStreamReader"),
}


@pytest.mark.parametrize("case", BAD_TRAIN_INPUT)
def test_bad_input_is_one_clear_line(case, uninterrupted, char_dataset, tmp_path, capsys):
    extra, message = BAD_TRAIN_INPUT[case]
    out = tmp_path / "run"
    shutil.copytree(uninterrupted[0], out)
    if case == "truncated train state":
        state = checkpoint.latest_checkpoint(out) / "train_state.pt"
        state.write_bytes(state.read_bytes()[:500])
    extra = [e.replace("LETTERS", str(other_alphabet_dataset(tmp_path))) for e in extra]
    assert train.main(train_args(char_dataset, out, *RUN, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_prompt_file_that_is_not_text(uninterrupted, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"ROMEO:\xff\xfe")
    rc = generate.main([f"--checkpoint={uninterrupted[0]}", f"--prompt=FILE:{prompt}",
                        "--device=cpu"])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: prompt file {prompt} is not UTF-8 text (byte 0xff "
                                       "at offset 6); save it as UTF-8\n")
