"""The ablation's CPU kernel rows, on the chain's best combination: what this CPU's kernels give
for training and batch-1 decoding, measured: the thread count, torch.compile's inductor C++
kernels, and oneDNN bf16 where the CPU runs it natively (AMX or AVX512-BF16; elsewhere the row
says "not native here" and is not run). Each in its own process, by the wall clock (a process's
CPU time would add its threads')."""
from __future__ import annotations

import torch

from config import Config, ConfigError, apply_override, from_dict
from engine import runtime
from engine.benchmarks.report import markdown_table, not_measured
from engine.benchmarks.runner import run_worker


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
                 "set": {**eager, "system.compile": "true"},
                 "isa": "compile"})  # the ceiling's compile_kernels, filled in by markdown
    bf16 = {"label": "oneDNN bf16 (autocast), eager", "set": {**eager, "system.dtype": "bfloat16"}}
    if bf16_units:
        return rows + [{**bf16, "isa": f"oneDNN bf16 on {', '.join(bf16_units)}"}]
    return rows + [{**bf16, "skip": True, "isa": f"not native here ({isa}: no AMX / "
                    "AVX512-BF16, bf16 matmuls are emulated); not run, --order dtype=bfloat16 "
                    "measures it"}]


def configured(best: Config, overrides: dict[str, str]) -> Config:
    """A copy of the best combination with the variant's settings."""
    cfg, problems = from_dict(best.to_dict()), []
    for key, value in overrides.items():
        apply_override(cfg, key, value, problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def run(best: Config, opts, measurer) -> list[dict]:
    """Each variant's training row and batch-1 decode run (opts: ablation.AblationOptions,
    measurer: its Measurer, whose clock is the --time-budget)."""
    rows, left = variants(torch.get_num_threads(), runtime.cpu_bf16_units()), measurer.left
    for i, row in enumerate(rows):
        if row.get("skip"):
            print(f"[kernels] {row['label']}: {row['isa']}", flush=True)
            continue
        if left() <= 0:
            row["train"] = row["decode"] = {"status": "skipped",
                                            "reason": "the --time-budget ran out"}
            continue
        cfg = configured(best, row["set"]).to_dict()
        print(f"[kernels] {row['label']}: training", flush=True)
        row["train"] = run_worker({
            "kind": "train_row", "config": cfg, "clock": "wall", "previous": None,
            "warmup": opts.warmup_steps, "measure": opts.measure_steps},
            measurer.workdir, f"k{i}t", left())
        print(f"[kernels] {row['label']}: batch-1 decoding", flush=True)
        row["decode"] = run_worker({"kind": "decode", "config": cfg, "rounds": opts.decode_rounds,
                                    "new_tokens": opts.decode_tokens},
                                   measurer.workdir, f"k{i}d", left())
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
    decode = next((r["decode"] for r in rows if r.get("decode", {}).get("status") == "ok"), {})
    return ("CPU kernels on the best combination, by the wall clock (training: tok/s of the "
            f"timed steps; decoding: batch 1, greedy, KV cache, {decode.get('new_tokens', '?')} "
            "new tokens, the median of the runs; each in its own process):\n\n"
            + markdown_table(["kernels", "train tok/s", "vs first", "decode tok/s", "vs first",
                              "what the ISA allowed"], out))
