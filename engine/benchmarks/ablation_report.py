"""The ablation's page: the lines that say what was measured, the table, the chain's best line,
the kernel rows, and a bar chart of tokens/s and peak memory per row."""
from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from engine.benchmarks import kernels
from engine.benchmarks.report import (markdown_table, not_measured, pyplot, save_figure,
                                      write_report)

HEADER = ["#", "step", "tok/s", "vs prev", "vs base", "ms/step (est.)", "MFU", "MFU (meas.)",
          "peak memory", "loss", "attention kernel", "note"]


def row_note(r: dict, kernels_word: str = "", bf16_units: tuple = ()) -> str:
    """The chain's verdict, the micro-batch picked, compile time and kernels, bf16 kernels,
    the spread of the steps, new notes."""
    note = [r["chain"]] if r.get("chain", "").startswith("dropped") else []
    if r["flag"] == "batch_size_auto":
        note.append(f"micro-batch {r['micro_batch']}x{r['grad_accum_steps']}")
    if r["settings"].get("compile", "off") != "off":
        note.append(f"built and compiled in {r['build_s']:.0f} s")
        if r["flag"] == "compile" and kernels_word:
            note.append(kernels_word)
    if r["flag"] == "dtype" and r["dtype"] == "bfloat16" and r["settings"]["device"] == "cpu":
        note.append("oneDNN bf16 " + (f"on {', '.join(bf16_units)}" if bf16_units else
                                      "not native here: emulated"))
    fastest, slowest = (r["tokens_per_step"] / s for s in (min(r["step_s"]), max(r["step_s"])))
    if fastest > 1.2 * slowest:  # say so when the timed steps disagree
        note.append(f"steps ranged {slowest:,.0f}-{fastest:,.0f} tok/s")
    note += [f"a later pass failed: {e}" for e in r.get("later_pass_errors", [])]
    note += [n for n in r.get("notes", []) if r["previous"] is None or
             n not in r.get("previous_notes", [])]
    return "; ".join(note)


def cells(i: int, r: dict, ceiling: dict) -> list[str]:
    """One row of HEADER."""
    if r["status"] != "ok":
        return [str(i), r["label"], *["-"] * 9, not_measured(r)]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    times = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    ms = lambda x: f"{x:,.0f}" if x >= 10 else f"{x:.2g}"  # noqa: E731
    gib = lambda n: f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"  # noqa: E731
    m = r["memory"]
    memory = (f"{gib(m['allocated'])} / {gib(m['reserved'])} GiB" if "allocated" in m
              else f"{gib(m['rss'])} GiB RSS" if "rss" in m else "-")
    step_ms = ms(1000 * statistics.median(r["step_s"]))
    if "estimate_step_s" in r:
        step_ms += f" ({ms(1000 * r['estimate_step_s'])})"
    note = row_note(r, ceiling.get("compile_kernels", ""), tuple(ceiling.get("bf16_units", ())))
    if "chain" in r and r["previous"] not in (None, i - 1):  # the head it was tried on
        note = f"on row {r['previous']}" + (f"; {note}" if note else "")
    return [str(i), r["label"], f"{r['tokens_per_s']:,.0f}", times(r["vs_previous"]),
            times(r["vs_baseline"]), step_ms, pct(r["mfu"]), pct(r["mfu_measured"]), memory,
            f"{r['loss']:.4f}", ", ".join(r["kernels"]) or "-", note]


def table(rows: list[dict], ceiling: dict | None = None) -> str:
    return markdown_table(HEADER, [cells(i, r, ceiling or {}) for i, r in enumerate(rows)])


def best_line(report: dict) -> str:
    """The chain's outcome: the best combination this machine has, and what it left out."""
    rows, best = report["rows"], report.get("best")
    if best is None or rows[best]["status"] != "ok":
        return ""
    kept = [r["label"].removeprefix("+ ") for r in rows[1:best + 1] if r.get("chain") == "kept"]
    dropped = [f"{r['label'].removeprefix('+ ')}: {r['chain'].removeprefix('dropped: ')}"
               for r in rows if r.get("chain", "").startswith("dropped")]
    vs = f", {rows[best]['vs_baseline']:.2f}x the baseline" if best else ""
    return (f"best here: row {best} = baseline + {', '.join(kept) or 'nothing'}: "
            f"{rows[best]['tokens_per_s']:,.0f} tok/s{vs}"
            + (f" | dropped: {'; '.join(dropped)}" if dropped else ""))


def describe(r: dict) -> str:
    """The lines above the table: hardware, model, batch, steps, MFU denominators."""
    c, ceiling = r["config"], r["ceiling"]
    m, t = c["model"], c["train"]
    first = next((row for row in r["rows"] if "params" in row), {})
    datasheet = (f"{ceiling['datasheet'] / 1e12:.0f} TFLOP/s (dense bf16, datasheet)"
                 if ceiling.get("datasheet") else "no datasheet peak for this device")
    measured = (f"{ceiling['measured'] / 1e12:.2f} TFLOP/s measured ({ceiling['measured_dtype']} "
                f"{ceiling['matmul_n']}^3 matmul)" if ceiling.get("measured") else "not measured")
    load = r.get("load_average")
    shared = (f" | load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (other "
              "processes shared the machine)" if load and max(load) > 0.5 * os.cpu_count() else "")
    passes = f" x {r['repeat']} runs" if r.get("repeat", 1) > 1 else ""
    clock = ", timed by the process's CPU time (--clock=process)" * (r.get("clock") == "process")
    ratios = [statistics.median(row["step_s"]) / row["estimate_step_s"] for row in r["rows"]
              if row["status"] == "ok" and row.get("estimate_step_s")]
    estimate = ("ms/step (est.): the median step, and in brackets train.py's start-up estimate "
                "(FLOPs per step at the matmul rate measured in the row's dtype); measured / "
                f"estimate {min(ratios):.1f}-{max(ratios):.1f}x" if ratios else "")
    chain = ("chain: each flag is tried on the best combination so far and kept only when "
             f"faster by more than {100 * r.get('keep_margin', 0):.0f}% and than twice the "
             "standard error of the two medians' difference (from each row's interquartile "
             "range); a dropped row is shown, the chain goes on without it"
             if r["mode"] == "chain" else "")
    return "\n".join([
        f"hardware: {ceiling.get('hardware', r['device'])} | torch {r['torch']} | {r['date']}"
        + shared,
        f"model: {m['n_layer']} layers, {m['n_head']} heads, {m['n_embd']} wide, context "
        f"{m['block_size']}, vocab {first.get('settings', {}).get('vocab', m['vocab_size'])} "
        f"({first.get('params', 0) / 1e6:.1f}M parameters) | data: {c['data']['dataset']} | "
        f"{t['batch_size'] * t['grad_accum_steps']} sequences ({t['batch_size']} x "
        f"{t['grad_accum_steps']} accumulated) per step | {r['warmup']} warm-up + "
        f"{r['measure']} timed steps per row{passes}, each row in a fresh process{clock}",
        f"MFU: {first.get('flops_per_token', 0) / 1e6:,.1f}M FLOPs per token (6N + 12*L*H*Q*T) "
        f"x tokens/s, against {datasheet}; MFU (meas.) against {measured}",
        *filter(None, [estimate, chain]), f"command: {r['command']}"])


def results(report: dict) -> str:
    """The table, the chain's best line, and the CPU kernel rows when they ran."""
    text = table(report["rows"], report["ceiling"])
    if line := best_line(report):
        text += "\n\n" + line
    if report.get("kernels"):
        text += "\n\n" + kernels.markdown(report["kernels"], report["ceiling"])
    return text


def plot(report: dict, path: Path) -> Path | None:
    """Bar chart of tokens/s and peak memory per row."""
    if (plt := pyplot()) is None:
        return None
    rows = report["rows"]
    speed = [r.get("tokens_per_s", 0.0) for r in rows]
    memory = [r.get("memory", {}).get("allocated", r.get("memory", {}).get("rss", 0)) / 2**30
              for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.42 * len(rows)), sharey=True)
    ax1.barh(range(len(rows)), speed, color=["#9a9a9a" if r.get("chain", "").startswith(
        "dropped") else "#3b75af" for r in rows])
    ax2.barh(range(len(rows)), memory, color="#c6843a")
    for i, r in enumerate(rows):
        ok = r["status"] == "ok"
        vs = f"  ({r['vs_baseline']:.2f}x)" if r.get("vs_baseline") else ""
        if "chain" in r and r.get("vs_previous"):  # the side-by-side ratio decided the chain
            vs = f"  ({r['vs_previous']:.2f}x row {r['previous']}, {r['chain'][:7]})"
        ax1.text(speed[i], i, f" {speed[i]:,.0f}{vs}" if ok else f" {r['status']}",
                 va="center", fontsize=8)
        ax2.text(memory[i], i, f" {memory[i]:.2f}" if ok else "", va="center", fontsize=8)
    ax1.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax1.invert_yaxis()
    cuda = rows and "allocated" in rows[0].get("memory", {})
    for ax, what in ((ax1, "tokens/s (median of timed steps)"), (ax2, "peak memory, GiB ("
                     + ("CUDA max allocated" if cuda else "peak RSS") + ")")):
        ax.set_xlabel(what)
        ax.margins(x=0.25)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"bench.py {report['mode']}: {report['ceiling'].get('hardware', '')}"
                 + ("\nin brackets: against the row it was tried on, measured alongside; grey: "
                    "dropped" if report["mode"] == "chain" else ""), fontsize=10)
    return save_figure(plt, fig, path)


def write(report: dict, folder: Path, stem: str) -> list[Path]:
    """NAME.json, .md and .png; NAME by default the device (cpu, nvidia-h200), _only for --only."""
    if not stem:
        hardware = report["ceiling"].get("hardware", report["device"])
        stem = report["device"] if report["device"] == "cpu" else re.sub(
            r"[^a-z0-9]+", "-", hardware.removeprefix("GPU ").split(" (")[0].lower()).strip("-")
        stem += "_only" if report["mode"] == "only" else ""
    page = (f"# bench.py ({report['mode']})\n\n" + "\n".join(
        f"- {line}" for line in describe(report).splitlines()) + "\n\n" + results(report))
    paths = write_report(report, page, folder, stem)
    return paths + [p for p in [plot(report, folder / f"{stem}.png")] if p]
