"""bench.py's CPU kernel rows: on the chain's best combination, what this CPU's kernels give for
training and for batch-1 decoding, measured rather than assumed: the thread count, torch.compile's
inductor C++ kernels (vectorized for the ISA inductor picks), and oneDNN bf16 where the CPU runs it
natively (AMX or AVX512-BF16; elsewhere the row says "not native here" and is not run).

    python bench.py                      # after the chain, on a CPU
    python bench.py --kernels on --order attention    # the kernel rows on a chosen combination

Each measurement is its own process (engine/benchmark.py: kind "row" or "decode").
"""
from __future__ import annotations

import torch

from config import Config, apply_override, from_dict
from engine import runtime
from engine.benchmark import markdown_table, run_worker


def variants(threads: int, bf16_units: list[str]) -> list[dict]:
    """The rows: (label, overrides on the best combination, what the ISA allowed); the first is
    the reference (eager float32, every thread)."""
    isa = torch.backends.cpu.get_cpu_capability()
    eager = {"system.compile": "false", "system.dtype": "float32"}
    rows = [{"label": f"eager float32, {threads} threads", "set": {**eager, "system.threads": "0"},
             "isa": f"ATen / oneDNN float32 kernels for {isa}"}]
    if threads > 1:
        rows.append({"label": "eager float32, 1 thread", "set": {**eager, "system.threads": "1"},
                     "isa": f"the same kernels on one core ({isa})"})
    rows.append({"label": f"inductor C++ (compile), float32, {threads} threads",
                 "set": {**eager, "system.compile": "true", "system.threads": "0"},
                 "isa": "compile"})  # the ceiling's compile_kernels, filled in by markdown
    bf16 = {"label": "oneDNN bf16 (autocast), eager", "set": {**eager, "system.dtype": "bfloat16",
                                                              "system.threads": "0"}}
    if bf16_units:
        rows.append({**bf16, "isa": f"oneDNN bf16 on {', '.join(bf16_units)}"})
    else:
        rows.append({**bf16, "isa": f"not native here ({isa}: no AMX / AVX512-BF16, bf16 "
                     "matmuls are emulated); not run, --order dtype=bfloat16 measures it",
                     "skip": True})
    return rows


def configured(best: Config, overrides: dict[str, str]) -> Config:
    """A copy of the best combination with the variant's settings."""
    cfg = from_dict(best.to_dict())
    problems: list[str] = []
    for key, value in overrides.items():
        apply_override(cfg, key, value, problems)
    if problems:
        raise ValueError("; ".join(problems))
    return cfg


def run(best: Config, opts, tmp, left) -> list[dict]:
    """Each variant's training row and batch-1 decode run, in fresh processes, by the wall
    clock (the thread rows compare wall time; a process's CPU time would add its threads')."""
    rows = variants(torch.get_num_threads(), runtime.cpu_bf16_units())
    for i, row in enumerate(rows):
        if row.get("skip"):
            print(f"[kernels] {row['label']}: {row['isa']}", flush=True)
            continue
        if left() <= 0:
            row["train"] = row["decode"] = {"status": "skipped",
                                            "reason": "the --time-budget ran out"}
            continue
        cfg = configured(best, row["set"])
        print(f"[kernels] {row['label']}: training", flush=True)
        row["train"] = run_worker("engine.benchmark", {
            "kind": "row", "config": cfg.to_dict(), "clock": "wall", "previous": None,
            "warmup": opts.warmup_steps, "measure": opts.measure_steps}, tmp, f"k{i}t", left())
        print(f"[kernels] {row['label']}: batch-1 decoding", flush=True)
        row["decode"] = run_worker("engine.benchmark", {
            "kind": "decode", "config": cfg.to_dict(), "new_tokens": opts.decode_tokens,
            "rounds": opts.decode_rounds}, tmp, f"k{i}d", left())
    return rows


def markdown(rows: list[dict], ceiling: dict) -> str:
    """The kernel table: training and decode tokens/s against the first (reference) row."""
    ref = rows[0]

    def cell(row: dict, part: str) -> list[str]:
        got, base = row.get(part, {}), ref.get(part, {})
        if row.get("skip"):
            return ["-", "-"]
        if got.get("status") != "ok":
            return [f"{got.get('status', 'not run')}: {got.get('error', got.get('reason', ''))}"
                    [:80], "-"]
        vs = (f"{got['tokens_per_s'] / base['tokens_per_s']:.2f}x"
              if base.get("status") == "ok" else "-")
        return [f"{got['tokens_per_s']:,.0f}", vs]

    out = [[r["label"], *cell(r, "train"), *cell(r, "decode"),
            ceiling.get("compile_kernels", "inductor") if r["isa"] == "compile" else r["isa"]]
           for r in rows]
    decode = next((r["decode"] for r in rows if r.get("decode", {}).get("status") == "ok"), {})
    return (f"CPU kernels on the best combination, by the wall clock (training: tok/s of the "
            "timed steps; decoding: "
            f"batch 1, greedy, KV cache, {decode.get('new_tokens', '?')} new tokens, the median "
            "of the runs; each in its own process):\n\n"
            + markdown_table(["kernels", "train tok/s", "vs first", "decode tok/s", "vs first",
                              "what the ISA allowed"], out))
