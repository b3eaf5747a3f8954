"""Old names, kept until bench.py and engine/bench_memory.py switch: the kernel probe, automatic
micro-batch and banner live in engine/techniques.py, peak memory in engine/memory.py."""
from engine.memory import peak_memory, reset_peak_memory  # noqa: F401
from engine.techniques import (Notes, attention_kernels, auto_micro_batch, banner,  # noqa: F401
                               effective, probe_attention, split_global_batch)
from engine import techniques


def settings(cfg, rt, fused_note: str, compile_note: str, batch_note: str, kernels=None):
    return techniques.settings(cfg, rt, Notes(batch=batch_note, compile=compile_note,
                                              fused_adamw=fused_note, kernels=kernels or []))
