"""serve.py's supervisor forks its workers from a process that has not started CUDA: a forked
child of one that has cannot use CUDA. This torch may have no CUDA, so the GPU is mocked as NVML
would report it, and every call that would start CUDA in the supervisor is recorded. Needs none
of the server's packages (nothing here is served), so it runs where they are missing."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import serve
from config import Config, ModelConfig, load_config
from engine import saving
from engine.serving import supervisor
from engine.serving.options import ServeOptions
from model import GPT

# what would start CUDA in this process: the runtime's device count (cuInit), torch's lazy init,
# and the device queries and calls that run it
STARTS_CUDA = ("_lazy_init", "init", "current_device", "set_device", "get_device_properties",
               "get_device_capability", "get_device_name", "is_bf16_supported", "synchronize",
               "mem_get_info", "empty_cache")


class Forked(Exception):
    """Raised where the supervisor would fork its first worker."""


def tiny_checkpoint(out_dir) -> str:
    chars = "\nabcdefgh"
    cfg = Config()
    cfg.model = ModelConfig(block_size=16, vocab_size=len(chars), n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    return str(saving.save(out_dir, 1, GPT(cfg.model), cfg,
                               {"tokenizer": {"kind": "char", "chars": chars}}))


def test_the_supervisor_never_starts_cuda_before_it_forks(tmp_path, monkeypatch):
    """serve.py --device=cuda on a machine where NVML counts one GPU: up to the first fork no
    call that starts CUDA runs in the supervisor, torch.cuda.is_initialized() stays False, the
    weights wait on the CPU for each worker to move them, and the environment is as it was."""
    started: list[str] = []

    def starting(name):
        def record(*args, **kwargs):
            started.append(name)
            return 1  # as if CUDA answered: the test reads `started`, not a crash
        return record
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", starting("cudaGetDeviceCount"),
                        raising=False)
    for name in STARTS_CUDA:
        monkeypatch.setattr(torch.cuda, name, starting(name))
    monkeypatch.delenv(supervisor.NVML_CHECK, raising=False)
    at_fork = {}
    real_spawn = supervisor.Supervisor._spawn

    def spawn(self, index):
        at_fork["weights on"] = next(self.loaded.model.parameters()).device.type
        return real_spawn(self, index)

    def fork():
        at_fork.update(started=list(started), initialized=torch.cuda.is_initialized(),
                       nvml_check=os.environ.get(supervisor.NVML_CHECK))
        raise Forked
    monkeypatch.setattr(supervisor.Supervisor, "_spawn", spawn)
    monkeypatch.setattr(supervisor.os, "fork", fork)
    cfg, options = load_config(["--checkpoint", tiny_checkpoint(tmp_path / "run"),
                                "--device=cuda", "--port=0", "--workers=1", "--threads=1"],
                               prog="serve.py", script=ServeOptions, lead=("sample", "system"))
    options.check()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(Forked):
            serve.serve(cfg, options)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert at_fork == {"weights on": "cpu", "started": [], "initialized": False,
                       "nvml_check": None}


def test_a_plain_cuda_check_would_have_been_seen(monkeypatch):
    """The mock above sees what it guards against: torch.cuda.is_available() without the NVML
    check asks the CUDA runtime (which starts CUDA); device_before_fork does not."""
    asked = []
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: asked.append(1) or 1,
                        raising=False)
    monkeypatch.delenv(supervisor.NVML_CHECK, raising=False)
    assert torch.cuda.is_available() and asked == [1]
    assert supervisor.device_before_fork("cuda") == torch.device("cuda") and asked == [1]
