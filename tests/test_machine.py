"""Knowing the machine: dtype=auto's choice (CPU and CUDA, detection monkeypatched both ways), the
machine line in the banner and the benchmark headers, the matmul-rate probe and the start-up time
estimate train.py prints before step 1."""
from __future__ import annotations

import pytest
import torch

import train
from config import SystemConfig, load_config
from conftest import train_args
from engine import device as machine
from engine.training import memory_estimate, metrics, parallel, speedups
from model import GPT

EMULATED = {"model name": "Test CPU 9000", "cpu family": "25", "flags": "fpu sse avx2 fma"}
WITH_AMX = {**EMULATED, "flags": EMULATED["flags"] + " amx_tile amx_bf16 avx512f avx512_bf16"}


@pytest.fixture
def cpu_flags(monkeypatch):
    """cpu_flags(info): /proc/cpuinfo reads as info, and torch's own checks say no."""
    def use(info: dict) -> None:
        monkeypatch.setattr(machine, "cpu_info", lambda: info)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        monkeypatch.setattr(machine, "kernel_overrides", lambda: {})  # none of the run's
    return use


def test_auto_is_float32_on_a_cpu_without_native_bf16(cpu_flags, recwarn):
    cpu_flags(EMULATED)
    system = SystemConfig(device="cpu", dtype="auto")
    rt = machine.setup(system)
    assert rt.dtype == torch.float32 and system.dtype == "float32"  # what a checkpoint stores
    assert any("dtype=auto: float32" in n and "bf16 would be emulated" in n for n in rt.notes)
    assert not [w for w in recwarn if "emulated" in str(w.message)]  # no bf16, no warning


def test_auto_is_bfloat16_on_a_cpu_with_amx(cpu_flags):
    cpu_flags(WITH_AMX)
    assert machine.cpu_bf16_units() == ["AMX", "AVX512-BF16"]
    system = SystemConfig(device="cpu", dtype="auto")
    rt = machine.setup(system)
    assert rt.dtype == torch.bfloat16 and system.dtype == "bfloat16"
    assert any("dtype=auto: bfloat16 (native on this CPU: AMX, AVX512-BF16)" in n
               for n in rt.notes)


@pytest.mark.parametrize("cap, units", [("AVX2", []), ("AVX512_CORE_BF16", ["AVX512-BF16"]),
                                        ("AVX512_CORE_AMX", ["AMX", "AVX512-BF16"])])
def test_a_onednn_cap_below_the_bf16_units_makes_them_emulated(cpu_flags, monkeypatch, cap, units):
    cpu_flags(WITH_AMX)
    monkeypatch.setattr(machine, "kernel_overrides", lambda: {"ONEDNN_MAX_CPU_ISA": cap})
    assert machine.cpu_bf16_units() == units
    want = "bfloat16" if units else "float32"
    assert machine.resolve_dtype("auto", torch.device("cpu"))[0] == want


def test_explicit_bfloat16_on_an_emulating_cpu_still_warns(cpu_flags):
    cpu_flags(EMULATED)
    with pytest.warns(UserWarning, match="no native bfloat16"):
        rt = machine.setup(SystemConfig(device="cpu", dtype="bfloat16"))
    assert rt.dtype == torch.bfloat16 and "bf16 emulated on this CPU" in rt.notes


@pytest.mark.parametrize("capability, bf16, want", [((7, 5), False, "float32"),
                                                     ((8, 0), True, "bfloat16"),
                                                     ((9, 0), True, "bfloat16")])
def test_auto_on_cuda_follows_the_compute_capability(monkeypatch, capability, bf16, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    dtype, why = machine.resolve_dtype("auto", torch.device("cuda"))
    assert dtype == want and f"compute {capability[0]}.{capability[1]}" in why
    assert machine.resolve_dtype("float16", torch.device("cuda")) == ("float16", "")


def test_banner_and_benchmark_header_name_cpu_isa_bf16_and_threads(cpu_flags):
    cpu_flags(EMULATED)
    torch.set_num_threads(1)  # the conftest fixture restores it
    values = {"device": "cpu", "dtype": "float32"}
    first, second = speedups.banner(values, ["a note"]).splitlines()
    isa = torch.backends.cpu.get_cpu_capability()
    assert first.startswith("machine: CPU Test CPU 9000 (family 25), ")
    assert f"ISA {isa}" in first and "bf16 emulated (no AMX / AVX512-BF16)" in first
    assert "1 thread of" in first
    assert second == "speedups: device=cpu dtype=float32  [a note]"
    # the benchmarks' header line is the banner's (engine/benchmarks/ call machine_line too)
    assert machine.machine_line(torch.device("cpu")) == first.removeprefix("machine: ")
    cpu_flags(WITH_AMX)
    assert "bf16 native (AMX, AVX512-BF16)" in machine.machine_line(torch.device("cpu"))


def test_the_machine_line_names_kernel_overrides(monkeypatch):
    monkeypatch.setattr(machine, "kernel_overrides", lambda: {"ONEDNN_MAX_CPU_ISA": "AVX2",
                                                              "MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert machine.machine_line(torch.device("cpu")).endswith(
        " (kernels narrowed: ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2)")


def test_matmul_probe_is_quick_cached_and_leaves_the_rng_alone():
    state = torch.get_rng_state()
    rate = metrics.matmul_rate(torch.device("cpu"), torch.float32, seconds=0.05)
    assert rate > 1e6 and torch.equal(torch.get_rng_state(), state)
    assert metrics.matmul_rate(torch.device("cpu"), torch.float32, seconds=0.05) == rate


def test_time_estimate_and_its_format():
    est = metrics.time_estimate(2e9, steps=100, eval_flops=5e9, rate=1e10)
    assert est["step_s"] == pytest.approx(0.2) and est["run_s"] == pytest.approx(20.5)
    assert [metrics.format_seconds(s) for s in (0.0123, 12.34, 245, 3 * 3600 + 720)] == \
        ["12 ms", "12.3 s", "4m05s", "3h12m"]


def test_train_prints_the_estimate_before_step_1(char_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(metrics, "matmul_rate", lambda device, dtype: 1e9)  # 1 GFLOP/s
    cfg, _ = load_config(train_args(char_dataset, tmp_path, "--max_iters=2", "--eval_interval=2",
                                    "--eval_iters=1", "--log_interval=1"))
    train.train(cfg)
    lines = capsys.readouterr().out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    at = next(i for i, line in enumerate(lines) if line.startswith("estimate: "))
    assert at < first_step
    model = GPT(cfg.model)
    step_flops = model.flops_per_token() * cfg.train.batch_size * cfg.model.block_size
    want = metrics.format_seconds(step_flops / 1e9)
    assert lines[at].startswith(f"estimate: ~{want} per step, ~")
    assert "for 2 steps and 2 evaluations" in lines[at] and "1.0 GFLOP/s" in lines[at]
    assert "float32 matmul rate measured here" in lines[at]


def test_auto_in_the_memory_estimate_and_with_accelerate(cpu_flags, monkeypatch):
    cpu_flags(EMULATED)
    cfg, _ = load_config(["--config", "tiny", "--device=cpu", "--dtype=auto"])
    cfg.model.vocab_size = 65
    assert ", float32, " in memory_estimate.describe(cfg, 1)  # resolved as the run would
    assert cfg.system.dtype == "auto"  # the estimate leaves the config alone
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # an explicit launcher choice wins
    parallel.apply_launcher_flags(cfg)
    assert cfg.system.dtype == "bfloat16"


def test_gpt2_recipes_use_auto():
    for name in ("gpt2_124m", "gpt2_medium", "gpt2_large", "gpt2_xl", "finetune_shakespeare"):
        assert load_config(["--config", name])[0].system.dtype == "auto", name
    assert load_config(["--config", "shakespeare_char"])[0].system.dtype == "float32"
