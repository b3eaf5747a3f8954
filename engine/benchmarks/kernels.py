"""The ablation's CPU kernel rows, on the chain's best combination: training and batch-1
decoding per thread count, inductor C++ kernels (compile) and oneDNN bf16 where the CPU runs it
natively (AMX or AVX512-BF16). Each in its own process, by the wall clock."""
from __future__ import annotations

import torch

from config import Config, ConfigError, apply_override, from_dict
from engine.benchmarks.report import markdown_table, not_measured
from engine.device import cpu_bf16_units

DECODE_ROUNDS, DECODE_TOKENS = 3, 64  # timed batch-1 runs per row (the median), tokens per run


def variants(threads: int, bf16_units: list[str]) -> list[dict]:
    """The rows: label, overrides on the best combination, what the ISA allowed; the first is
    the reference (eager float32, every thread)."""
    isa = torch.backends.cpu.get_cpu_capability()
    eager = {"system.compile": "false", "system.dtype": "float32", "system.threads": "0"}
    rows = [{"label": f"eager float32, {threads} threads", "set": eager,
             "isa": f"ATen / oneDNN float32 kernels for {isa}"}]
    if threads > 1:
        rows.append({"label": "eager float32, 1 thread", "set": {**eager, "system.threads": "1"},
                     "isa": f"the same kernels on one core ({isa})"})
    rows.append({"label": f"inductor C++ (compile), float32, {threads} threads",
                 "set": {**eager, "system.compile": "true"}, "isa": "compile"})
    bf16 = {"label": "oneDNN bf16 (autocast), eager", "set": {**eager, "system.dtype": "bfloat16"}}
    if bf16_units:
        return rows + [{**bf16, "isa": f"oneDNN bf16 on {', '.join(bf16_units)}"}]
    return rows + [{**bf16, "skip": True, "isa": f"not native here ({isa}: no AMX / "
                    "AVX512-BF16, bf16 matmuls are emulated); not run, --order dtype=bfloat16 "
                    "measures it"}]


def configured(best: Config, overrides: dict[str, str]) -> Config:
    cfg, problems = from_dict(best.to_dict()), []
    for key, value in overrides.items():
        apply_override(cfg, key, value, problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def run(best: Config, measurer) -> list[dict]:
    """Each variant's training row and batch-1 decode run (measurer: ablation.Measurer)."""
    rows = variants(torch.get_num_threads(), cpu_bf16_units())
    for i, row in enumerate(r for r in rows if not r.get("skip")):
        cfg = configured(best, row["set"])
        print(f"[kernels] {row['label']}: training, then batch-1 decoding", flush=True)
        row["train"] = measurer.train(cfg, None, f"k{i}t", clock="wall")
        row["decode"] = measurer.once({"kind": "decode", "config": cfg.to_dict(),
                                       "rounds": DECODE_ROUNDS, "new_tokens": DECODE_TOKENS},
                                      f"k{i}d")
    return rows


def cell(row: dict, reference: dict, part: str) -> list[str]:
    """[tok/s, vs the reference row] of a row's train or decode part."""
    got, base = row.get(part, {}), reference.get(part, {})
    if row.get("skip"):
        return ["-", "-"]
    if got.get("status") != "ok":
        return [not_measured(got)[:80], "-"]
    vs = f"{got['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base.get("status") == "ok" else "-"
    return [f"{got['tokens_per_s']:,.0f}", vs]


def markdown(rows: list[dict], ceiling: dict) -> str:
    """The kernel table: training and decode tokens/s against the first (reference) row."""
    out = [[r["label"], *cell(r, rows[0], "train"), *cell(r, rows[0], "decode"),
            ceiling.get("compile_kernels", "inductor") if r["isa"] == "compile" else r["isa"]]
           for r in rows]
    return ("CPU kernels on the best combination, by the wall clock (training: tok/s of the timed "
            f"steps; decoding: batch 1, greedy, KV cache, the median of {DECODE_ROUNDS} runs of "
            f"up to {DECODE_TOKENS} tokens; each in its own process):\n\n"
            + markdown_table(["kernels", "train tok/s", "vs first", "decode tok/s", "vs first",
                              "what the ISA allowed"], out))
