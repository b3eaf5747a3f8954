"""Shared fixtures: tiny configs, a char dataset prepared once per session in a temp dir, and the
devices a test runs on.

Device-aware tests take a `device` argument through `@on_each_device`: "cpu" always, and "cuda"
marked `cuda`. Tests that only exist on CUDA carry `@pytest.mark.cuda` themselves, each beside a
CPU half (the same set-up, arguments and Python logic, with torch.cuda's questions answered by
`as_a_gpu`), so a GPU's time is spent on what only it can show. Without a CUDA
device every `cuda` test is skipped with the reason below, so the CPU suite costs nothing more;
on a GPU, `python -m pytest -m cuda` runs exactly them (scripts/gpu_check.sh does). The marker,
the per-test timeout and the strict settings are in pyproject.toml.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from config import ModelConfig  # noqa: E402
from engine import device as machine  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# torch.compile on a CPU (TorchInductor) builds C++ kernels
HAS_CXX = bool(os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++")))
NO_CUDA = "needs a CUDA device and torch.cuda.is_available() is False here " \
          "(bash scripts/gpu_check.sh runs these on a GPU)"
# serve.py's tests need its HTTP stack and the openai client. Where one is missing (the GPU
# machine has none of them) those modules are left out of the collection, said in the header,
# rather than failing it.
SERVER_PACKAGES = ("openai", "fastapi", "pydantic", "uvicorn", "starlette")
MISSING_SERVER = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
SERVER_TESTS = ["test_serve.py", "test_serve_chat.py", "test_serve_logprobs.py",
                "test_serve_production.py", "test_playground.py"]
collect_ignore = SERVER_TESTS if MISSING_SERVER else []


def pytest_report_header(config):
    if MISSING_SERVER:
        return (f"left out: {', '.join(SERVER_TESTS)} ({', '.join(MISSING_SERVER)} not "
                "installed)")
    return None


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
on_each_device = pytest.mark.parametrize("device", DEVICES)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _no_api_key_from_the_shell():
    """A GPT2S_API_KEY in the shell running the tests would guard every server they start; the
    tests that want a key set it themselves."""
    saved = os.environ.pop("GPT2S_API_KEY", None)
    yield
    if saved is not None:
        os.environ["GPT2S_API_KEY"] = saved


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory) -> Path:
    """tiny Shakespeare prepared char-level into a temp folder (the repo's data/ is untouched)."""
    from data.shakespeare_char.prepare import prepare
    out = tmp_path_factory.mktemp("shakespeare_char")
    prepare(out_dir=out)
    return out


def tiny_model_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_default_model_config() -> ModelConfig:
    """The default run's model (configs/shakespeare_char.toml: rotary, QK-norm, native relu^2,
    soft-capped logits, U-net skips, smear, SDPA) at tiny_model_config's size."""
    from config import load_config
    cfg, _ = load_config(["--config", "shakespeare_char", "--block_size=16", "--vocab_size=37",
                          "--n_layer=2", "--n_head=2", "--n_embd=16"])
    return cfg.model


@pytest.fixture
def as_a_gpu(monkeypatch):
    """For the CPU halves of the CUDA tests: torch.cuda's questions answered as one GPU would
    answer them, an H200 unless the test calls the fixture's value with another compute
    capability and name (no CUDA kernel runs). The TF32 switches setup writes are put back."""
    def answer(capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H200") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args: capability >= (8, 0))

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    answer()
    yield answer
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def narrowed_below_amx() -> bool:
    """A CPU whose AMX oneDNN may use, but whose torch kernels ATEN_CPU_CAPABILITY narrowed
    below AVX-512."""
    return "AMX" in machine.cpu_bf16_units() and torch.backends.cpu.get_cpu_capability() != "AVX512"


def cuda_matmul_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@pytest.fixture(autouse=True)
def _deterministic():
    """Same seed for every test; on CUDA, full float32 matmuls (TF32 off) unless a test switches
    TF32 on itself, and never carried over into the next test."""
    torch.manual_seed(0)
    if HAS_CUDA:
        cuda_matmul_tf32(False)
    yield
    if HAS_CUDA:
        cuda_matmul_tf32(False)


def train_args(char_dataset, out_dir, *extra) -> list[str]:
    """The tiny config on the test dataset, on one CPU thread (tiny models gain nothing from
    more, and a busy machine slows them down a lot)."""
    return ["--config", "tiny", f"--dataset={char_dataset}", f"--out_dir={out_dir}",
            "--device=cpu", "--threads=1", *extra]


@pytest.fixture(autouse=True)
def _restore_threads():
    """Runs set torch's thread count (--threads); the next test gets it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train_whole_and_resumed(char_dataset, tmp_path, *run: str) -> tuple[Path, Path]:
    """The same run trained whole, and stopped at step 6 then resumed; their metrics (loss, lr,
    norm, val per logged step) must be identical -> (whole, parts) run directories."""
    import json

    import train
    from config import load_config

    def run_train(out, *extra):
        return train.train(load_config(train_args(char_dataset, out, *run, *extra))[0])

    def trajectory(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["kind"], r["step"], r.get("loss"), r.get("lr"), r.get("norm"), r.get("val"))
                for r in rows]

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_train(whole)
    assert run_train(parts, "--stop_after_iters=6")["step"] == 6
    assert run_train(parts, "--init_from=resume")["steps"] == 2
    assert trajectory(parts) == trajectory(whole)
    return whole, parts


def kill_when_stalled(script: str, tmp_path: Path, phases) -> None:
    """Run the Python `script` once per phase, all at once (argv: the repository root, a folder
    tmp_path/PHASE, the phase), and SIGKILL each once it has touched STALLED in its folder: it
    then waits in the middle of a save, which the caller inspects."""
    (tmp_path / "kill.py").write_text(script)
    procs = {}
    for phase in phases:
        (tmp_path / phase).mkdir()
        procs[phase] = subprocess.Popen([sys.executable, str(tmp_path / "kill.py"), str(ROOT),
                                         str(tmp_path / phase), phase], stderr=subprocess.PIPE)
    for phase, proc in procs.items():
        marker, deadline = tmp_path / phase / "STALLED", time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
