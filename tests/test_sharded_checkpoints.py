"""Sharded checkpoints (engine/sharded.py) in one process: a run saved as shards resumes bit for
bit, in the background too; generate.py, the Hugging Face export and a finetune read them
directly; a save that fails or is killed midway never leaves a checkpoint that loads as
complete; what sharding cannot hold is refused in one line. The several-process cases (FSDP2
writing from each rank, 2 -> 1 -> 2 processes) are in test_distributed.py."""
from __future__ import annotations

import errno
import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import generate
import load_gpt2_weights
import train
from config import load_config
from conftest import kill_when_stalled, on_each_device, tiny_model_config, train_args
from engine import checkpoint, loading, saving, sharded
from engine.checkpoint import CheckpointError
from engine.training.processes import Dist
from model import GPT

RUN = ["--max_iters=6", "--eval_interval=3", "--log_interval=1", "--dropout=0.1",
       "--checkpoint_format=sharded"]


def run_train(char_dataset, out_dir, *extra) -> dict:
    cfg, _ = load_config(train_args(char_dataset, out_dir, *RUN, *extra))
    return train.train(cfg)


def trajectory(out_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    keep = ("kind", "step", "loss", "lr", "norm", "train", "val", "train_bpb", "val_bpb")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def assert_same_shards(a: Path, b: Path) -> None:
    """Every stored tensor (weights, optimizer state) equal bit for bit."""
    ta, tb = sharded.read_tensors(a), sharded.read_tensors(b)
    assert ta.keys() == tb.keys() and any(k.startswith("optim.state.") for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def whole(char_dataset, tmp_path_factory) -> Path:
    """6 steps in one go, saved as shards at steps 3 and 6."""
    out = tmp_path_factory.mktemp("whole")
    run_train(char_dataset, out)
    return out


def test_a_sharded_run_resumes_bit_for_bit(whole, char_dataset, tmp_path):
    ckpt = whole / "ckpt_0000006"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "meta.json", "shards",
                                                      "train_state.pt"]
    assert "optimizer" not in loading.load_train_state(ckpt)  # the shards hold it
    assert json.loads((ckpt / "meta.json").read_text())["shards"]["world_size"] == 1
    run_train(char_dataset, tmp_path, "--stop_after_iters=3")
    run_train(char_dataset, tmp_path, "--init_from=resume")
    assert trajectory(tmp_path) == trajectory(whole)
    assert_same_shards(tmp_path / "ckpt_0000006", ckpt)


def test_a_background_save_holds_the_state_of_its_step(whole, char_dataset, tmp_path):
    run_train(char_dataset, tmp_path, "--checkpoint_async=true")
    assert trajectory(tmp_path) == trajectory(whole)
    for step in (3, 6):  # step 3's was written while steps 4-6 trained
        assert_same_shards(tmp_path / f"ckpt_{step:07d}", whole / f"ckpt_{step:07d}")


@on_each_device
@pytest.mark.parametrize("background", [False, True])
def test_the_weights_and_moments_saved_are_those_of_the_save(device, background, tmp_path):
    """In the background: the weights change right after save() returns, the saved ones do not
    (on CUDA the copy is to host memory). Read back whole in one process."""
    torch.manual_seed(0)
    model = GPT(tiny_model_config()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 37, (2, 16), device=device)
    model(x, x)[1].backward()
    optimizer.step()
    before = {k: v.cpu().clone() for k, v in checkpoint.model_state(model).items()}
    moments = {name: optimizer.state[p]["exp_avg"].cpu().clone()
               for name, p in model.named_parameters()}
    writer = sharded.ShardedWriter(Dist(), str(tmp_path), 2, background=background)
    writer.save(1, model, optimizer, load_config([])[0], {}, {"x": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            optimizer.state[p]["exp_avg"].add_(1.0)
    writer.wait()
    saved = sharded.read_tensors(tmp_path / "ckpt_0000001")
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == before.keys()
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in before.items())
    assert all(torch.equal(saved[f"optim.state.{k}.exp_avg"], v) for k, v in moments.items())


def test_generate_export_and_finetune_read_shards_directly(whole, char_dataset, tmp_path,
                                                           capsys):
    ckpt = whole / "ckpt_0000006"
    assert checkpoint.resolve(whole) == ckpt
    model, _, _ = loading.load_model(whole)
    stored = sharded.read_weights(ckpt)
    assert "lm_head.weight" not in stored  # the tied head once
    assert all(torch.equal(v, stored[k]) for k, v in checkpoint.model_state(model).items())
    args = ["--config", "tiny", f"--checkpoint={whole}", "--prompt", "ROMEO:",
            "--max_new_tokens=20", "--seed=3", "--device=cpu"]
    assert generate.main(args) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    hf_dir = tmp_path / "hf"
    assert load_gpt2_weights.main(["--export", str(whole), "--out", str(hf_dir), "--verify"]) == 0
    exported = load_file(str(hf_dir / "model.safetensors"))
    assert torch.equal(exported["transformer.wte.weight"], stored["transformer.wte.weight"])
    summary = train.train(load_config(train_args(
        char_dataset, tmp_path / "ft", "--max_iters=1", "--eval_interval=1",
        f"--init_from={ckpt}"))[0])  # a new run from its weights, saved as usual
    assert summary["step"] == 1
    assert (tmp_path / "ft" / "ckpt_0000001" / "model.safetensors").is_file()


def test_a_failed_save_leaves_the_last_checkpoint_and_says_why(whole, char_dataset, tmp_path,
                                                              monkeypatch, capsys):
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    shutil.rmtree(out / "ckpt_0000006")
    real = sharded.dcp.FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        real(self, plan, planner)  # half the files are there when the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded.dcp.FileSystemWriter, "write_data", disk_full)
    for background in ("false", "true"):
        rc = train.main(train_args(char_dataset, out, *RUN, "--init_from=resume",
                                   f"--checkpoint_async={background}"))
        err = capsys.readouterr().err
        assert rc == 2 and "no space left on device" in err, err
        assert "saving the sharded checkpoint of step 6 failed" in err
        assert f"{out / 'ckpt_0000003'}, is intact" in err
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(("ckpt", ".tmp"))) \
            == ["ckpt_0000003"]


def test_a_background_save_failing_as_it_is_published_raises_at_the_next_wait(tmp_path,
                                                                             monkeypatch):
    model = GPT(tiny_model_config())
    optimizer = torch.optim.AdamW(model.parameters())
    writer = sharded.ShardedWriter(Dist(), str(tmp_path), 2, background=True)
    writer.save(1, model, optimizer, load_config([])[0], {}, {"step": 1})

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "write_rest", disk_full)
    deadline = time.monotonic() + 60
    while not writer.pending.error:  # training goes on: poll() keeps the error for wait()
        assert time.monotonic() < deadline
        writer.poll()
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="step 1 failed .*no space left on device"):
        writer.wait()
    assert list(tmp_path.iterdir()) == []


def test_no_room_for_the_shards_is_said_before_any_is_written(tmp_path, monkeypatch):
    model = GPT(tiny_model_config())
    optimizer = torch.optim.AdamW(model.parameters())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(sharded.shutil, "disk_usage",
                        lambda path: usage._replace(free=1000))  # bytes: less than the state
    writer = sharded.ShardedWriter(Dist(), str(tmp_path), 2, background=False)
    with pytest.raises(saving.DiskFullError,
                       match="needs about [0-9,]+ bytes and 1,000 bytes are free"):
        writer.save(1, model, optimizer, load_config([])[0], {}, {"step": 1})
    assert list(tmp_path.iterdir()) == []


KILL_DURING_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    import torch
    from config import load_config
    from conftest import tiny_model_config
    from engine import saving, sharded
    from engine.training.processes import Dist
    from model import GPT

    out, phase = Path(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = GPT(tiny_model_config())
    optimizer = torch.optim.AdamW(model.parameters())
    writer = sharded.ShardedWriter(Dist(), str(out), 2, background=phase == "background")
    writer.save(1, model, optimizer, load_config([])[0], {}, {"step": 1})
    writer.wait()

    def stall(*args, **kwargs):
        (out / "STALLED").touch()
        time.sleep(600)

    if phase == "background":  # every shard written by the writing thread, .metadata not yet
        sharded.dcp.FileSystemWriter.finish = stall
    else:  # the shards complete, train_state.pt and the rename not yet
        saving.write_rest = stall
    writer.save(2, model, optimizer, load_config([])[0], {}, {"step": 2})
    writer.wait()
""")


def test_a_kill_during_a_save_never_leaves_a_checkpoint_that_looks_complete(tmp_path):
    kill_when_stalled(KILL_DURING_SAVE, tmp_path, ("background", "publish"))
    for phase in ("background", "publish"):
        out = tmp_path / phase
        assert (out / f"{sharded.STAGING}0000002").is_dir()  # killed midway
        assert checkpoint.latest_checkpoint(out).name == "ckpt_0000001", phase
        assert loading.load_train_state(out / "ckpt_0000001") == {"step": 1}
        sharded.read_weights(out / "ckpt_0000001")
        saving.recover(out)  # what the next save or resume does first
        assert sorted(p.name for p in out.iterdir()) == ["STALLED", "ckpt_0000001"], phase


def test_a_resume_with_another_optimizer_is_one_clear_line(whole, char_dataset, tmp_path,
                                                           capsys):
    shutil.copytree(whole, tmp_path / "run")
    rc = train.main(train_args(char_dataset, tmp_path / "run", *RUN, "--init_from=resume",
                               "--max_iters=9", "--optimizer=muon"))
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit this model and optimizer" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--checkpoint_async=true"], "add --checkpoint_format=sharded"),
    (["--checkpoint_format=sharded", "--lora.rank=4", "--init_from=WHOLE"],
     "a LoRA run saves its adapters"),
    (["--checkpoint_format=sharded", "--weights_dtype=bfloat16", "--dtype=bfloat16"],
     "the optimizer holds float32 copies"),
])
def test_what_shards_cannot_do_is_refused_in_one_line(args, message, whole, char_dataset,
                                                      tmp_path, capsys):
    args = [a.replace("WHOLE", str(whole / "ckpt_0000006")) for a in args]
    rc = train.main(train_args(char_dataset, tmp_path, "--max_iters=1", *args))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("ckpt_*"))


def test_a_corrupt_shard_is_refused_in_one_line(whole, tmp_path):
    ckpt = tmp_path / "ckpt_0000006"
    shutil.copytree(whole / "ckpt_0000006", ckpt)
    (ckpt / "shards" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="unreadable .* incomplete or corrupt"):
        loading.load_model(ckpt)

