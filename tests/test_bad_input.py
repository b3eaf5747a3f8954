"""Bad input and a hostile filesystem reach the user as one line: an out_dir that is a file, a
disk that fills up during a checkpoint save or a Hugging Face import/export (the previous
checkpoint intact, nothing partial left), and output modes that follow the umask."""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError
from transformers import GPT2Config, GPT2LMHeadModel

import load_gpt2_weights as gpt2
import train
from config import Config
from conftest import tiny_model_config, train_args
from engine import checkpoint, hf, loading, saving
from engine.training import metrics
from model import GPT

FREE = 123_456_789  # what the patched shutil.disk_usage reports, so messages are exact
SAFETENSORS = (saving, "save_file")
TORCH_SAVE = (torch, "save")
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
# what safetensors 0.8 and torch 2.13 raise when the disk fills up (seen on a full tmpfs)
SAFETENSORS_FULL = SafetensorError("Error while serializing: I/O error: No space left on device "
                                   "(os error 28)")
FULL_DISK = {  # how a writer reports a full disk -> the cause the message gives
    "OSError ENOSPC": (SAFETENSORS, ENOSPC, "no space left on device"),
    "OSError EDQUOT": (TORCH_SAVE, OSError(errno.EDQUOT, "Disk quota exceeded"),
                       "disk quota exceeded"),
    "safetensors": (SAFETENSORS, SAFETENSORS_FULL, "no space left on device"),
    "torch.save": (TORCH_SAVE, RuntimeError("[enforce fail at inline_container.cc:672] . "
                                            "unexpected pos 576 vs 534"),
                   "the write failed, most likely because the disk is full"),
}


@pytest.fixture
def free_space(monkeypatch):
    """shutil.disk_usage reports FREE bytes free (set .free to change it)."""
    usage, report = shutil.disk_usage("."), SimpleNamespace(free=FREE)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=report.free))
    return report


def fail_writes(monkeypatch, writer: tuple, error: BaseException, after: int = 0) -> list:
    """Make a writer, (module, name), succeed `after` times, then write half a file and raise
    `error`, as a disk that fills up mid-write does. Returns the paths it was called with."""
    owner, name = writer
    real, calls = getattr(owner, name), []

    def write(obj, path, *args, **kwargs):
        calls.append(Path(path))
        if len(calls) <= after:
            return real(obj, path, *args, **kwargs)
        Path(path).write_bytes(b"\0" * 1000)
        raise error

    monkeypatch.setattr(owner, name, write)
    return calls


def one_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def size_of(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir())


def needed_bytes(message: str) -> int:
    return int(re.search(r"it needs about ([\d,]+) bytes", message).group(1).replace(",", ""))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("where", ["file", "parent"])
def test_out_dir_that_is_a_file_stops_before_any_work(where, char_dataset, tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a run directory")
    out = blocker if where == "file" else blocker / "run"
    assert train.main(train_args(char_dataset, out)) == 2
    captured = capsys.readouterr()
    problem = ("exists and is a file" if where == "file"
               else f"cannot be created: {blocker} is a file")
    assert one_line(captured.err) == (f"error: out_dir {out} {problem}, not a directory; pass "
                                      "--out_dir=<a new or existing directory>")
    assert captured.out == ""  # no banner, no data preparation, no model
    assert blocker.read_text() == "not a run directory"


def test_gpt2_out_that_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "hf.txt"
    blocker.write_text("")
    assert gpt2.main(["--export", str(tmp_path / "no_run"), "--out", str(blocker)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"error: out {blocker} exists and is a file, not a directory; pass --out=<a new or "
        "existing directory>")


def tiny_save(out: Path, step: int, **kwargs) -> Path:
    cfg = Config()
    cfg.model = tiny_model_config()
    torch.manual_seed(step)
    state = {"optimizer": {"exp_avg": torch.randn(3000)}, "step": torch.tensor(step)}
    return saving.save(out, step, GPT(cfg.model), cfg, {}, state, **kwargs)


@pytest.mark.parametrize("form", FULL_DISK)
def test_full_disk_during_save_keeps_the_previous_checkpoint(form, tmp_path, monkeypatch,
                                                             free_space):
    writer, error, cause = FULL_DISK[form]
    out = tmp_path / "run"
    previous = tiny_save(out, 1)
    fail_writes(monkeypatch, writer, error)
    with pytest.raises(saving.DiskFullError) as raised:
        tiny_save(out, 2)
    message = str(raised.value)
    needed = needed_bytes(message)
    assert message == (f"cannot write checkpoint {out}/ckpt_0000002: {cause}: it needs about "
                       f"{needed:,} bytes and {FREE:,} bytes (117.7 MiB) are free there; free "
                       "some space, or pass --out_dir=<a directory on a disk with room>; the "
                       f"last complete checkpoint, {previous}, is intact")
    assert abs(needed - size_of(previous)) < 0.1 * size_of(previous)  # the same-sized state
    assert checkpoint.list_checkpoints(out) == [previous] and leftovers(out) == []
    monkeypatch.undo()
    model, _, meta = loading.load_model(out)
    assert meta["step"] == 1 and loading.load_train_state(previous)["step"].item() == 1


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch, free_space):
    out = tmp_path / "run"
    previous = tiny_save(out, 1)
    calls = fail_writes(monkeypatch, SAFETENSORS, AssertionError("nothing may be written"))
    free_space.free = 1000
    with pytest.raises(saving.DiskFullError, match=r"^cannot write checkpoint .*ckpt_0000002: "
                       r"not enough free space: it needs about [\d,]+ bytes and 1,000 bytes are "
                       "free there; free some space, or pass --out_dir=<a directory on a disk "
                       "with room>; the last complete checkpoint, .*ckpt_0000001, is intact$"):
        tiny_save(out, 2)
    assert calls == [] and leftovers(out) == [] and checkpoint.list_checkpoints(out) == [previous]


def test_a_failure_that_is_not_a_full_disk_is_not_disguised(tmp_path, monkeypatch, free_space):
    out = tmp_path / "run"
    previous = tiny_save(out, 1)
    fail_writes(monkeypatch, TORCH_SAVE, RuntimeError("Can't pickle local object"))
    with pytest.raises(RuntimeError, match="^Can't pickle local object$"):
        tiny_save(out, 2)
    assert leftovers(out) == [] and checkpoint.list_checkpoints(out) == [previous]


@pytest.mark.parametrize("form", ["OSError ENOSPC", "torch.save"])
def test_full_disk_while_training_is_one_line_and_exit_2(form, char_dataset, tmp_path,
                                                         monkeypatch, free_space, capsys):
    writer, error, cause = FULL_DISK[form]
    out = tmp_path / "run"
    fail_writes(monkeypatch, writer, error, after=1)  # the step-4 save works, step 8 fails
    rc = train.main(train_args(char_dataset, out, "--max_iters=8", "--eval_interval=4"))
    err = one_line(capsys.readouterr().err)
    assert rc == 2
    previous = out / "ckpt_0000004"
    assert err == (f"error: cannot write checkpoint {out}/ckpt_0000008: {cause}: it needs about "
                   f"{needed_bytes(err):,} bytes and {FREE:,} bytes (117.7 MiB) are free there; "
                   "free some space, or pass --out_dir=<a directory on a disk with room>; the "
                   f"last complete checkpoint, {previous}, is intact")
    assert abs(needed_bytes(err) - size_of(previous)) < 0.1 * size_of(previous)
    assert checkpoint.list_checkpoints(out) == [previous] and leftovers(out) == []
    monkeypatch.undo()
    assert loading.load_train_state(previous)["counters"]["step"] == 4
    loading.load_model(out)


def test_full_disk_for_the_run_files_is_one_line(char_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"

    def write(self, **record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.jsonl))

    monkeypatch.setattr(metrics.RunLog, "write", write)
    assert train.main(train_args(char_dataset, out, "--max_iters=4")) == 2
    assert one_line(capsys.readouterr().err) == (
        f"error: no space left on device writing {out}/metrics.jsonl; free some space there, or "
        "pass --out_dir=<a directory on a disk with room>")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=37)
    path = tmp_path_factory.mktemp("hf_tiny")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_full_disk_during_gpt2_import(hf_dir, tmp_path, monkeypatch, free_space, capsys):
    run = tmp_path / "run"
    fail_writes(monkeypatch, SAFETENSORS, ENOSPC)
    assert gpt2.main([str(hf_dir), "--out", str(run)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == (f"error: cannot write checkpoint {run}/ckpt_0000000: no space left on device: "
                   f"it needs about {needed_bytes(err):,} bytes and {FREE:,} bytes (117.7 MiB) "
                   "are free there; free some space, or pass --out=<a directory on a disk with "
                   "room>")
    assert list(run.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True])
def test_full_disk_during_gpt2_export_leaves_out_as_it_was(existing, hf_dir, tmp_path,
                                                           monkeypatch, free_space, capsys):
    run, export = tmp_path / "run", tmp_path / "export"
    assert gpt2.main([str(hf_dir), "--out", str(run)]) == 0
    if existing:  # an earlier export, and a file of the user's
        assert gpt2.main(["--export", str(run), "--out", str(export)]) == 0
        (export / "README.md").write_text("mine")
    before = {f.name: f.read_bytes() for f in export.iterdir()} if existing else None
    capsys.readouterr()
    fail_writes(monkeypatch, (hf, "save_file"), SAFETENSORS_FULL)
    assert gpt2.main(["--export", str(run), "--out", str(export)]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == (f"error: cannot write Hugging Face export {export}: no space left on device: "
                   f"it needs about {needed_bytes(err):,} bytes and {FREE:,} bytes (117.7 MiB) "
                   "are free there; free some space, or pass --out=<a directory on a disk with "
                   "room>")
    if existing:
        assert {f.name: f.read_bytes() for f in export.iterdir()} == before
    else:
        assert not export.exists()
    assert leftovers(tmp_path) == [] and (not existing or leftovers(export) == [])


def modes(directory: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(directory.stat().st_mode)}
    found.update({f.name: stat.S_IMODE(f.stat().st_mode) for f in directory.iterdir()})
    return found


@pytest.mark.parametrize("umask, dir_mode, file_mode", [
    pytest.param(0o022, 0o755, 0o644, id="umask 022"),
    pytest.param(0o027, 0o750, 0o640, id="umask 027")])
def test_outputs_follow_the_umask(umask, dir_mode, file_mode, tmp_path):
    old = os.umask(umask)
    try:
        ckpt = tiny_save(tmp_path / "run", 1)
        model, _, _ = loading.load_model(ckpt)
        hf.write_hf_dir(model, tmp_path / "fresh_export", tokenizer=None)
        (tmp_path / "existing_export").mkdir()
        hf.write_hf_dir(model, tmp_path / "existing_export", tokenizer=None)
    finally:
        os.umask(old)
    for directory in (ckpt, tmp_path / "fresh_export", tmp_path / "existing_export"):
        found = modes(directory)
        assert found.pop(".") == dir_mode, directory
        assert found and set(found.values()) == {file_mode}, (directory, found)
