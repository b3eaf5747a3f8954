"""The ablation's page: what was measured, the table, the chain's best line, the kernel rows,
and a bar chart of tokens/s and peak memory per row."""
from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from engine.benchmarks import kernels
from engine.benchmarks.report import (figure, markdown_table, not_measured, save_figure,
                                      write_report)

HEADER = ["#", "step", "tok/s", "vs prev", "vs base", "ms/step (est.)", "MFU", "MFU (meas.)",
          "peak memory", "loss", "attention kernel", "note"]
RATIOS = {"without": ("it buys", "vs full")}  # the two ratio columns' names per mode


def row_note(r: dict, ceiling: dict) -> str:
    """The chain's verdict, the micro-batch picked, compile time and kernels, bf16 kernels,
    steps that disagree, later runs that failed, notes new since the previous row."""
    note = [r["chain"]] if r.get("chain", "").startswith("dropped") else []
    if r["flag"] == "batch_size_auto":
        note.append(f"micro-batch {r['micro_batch']}x{r['grad_accum_steps']}")
    if r["settings"].get("compile", "off") != "off":
        note.append(f"built and compiled in {r['build_s']:.0f} s" + (
            f" (compile warm-up {r['compile_s']:.0f} s)" if r.get("compile_s") else ""))
        if r["flag"] == "compile" and ceiling.get("compile_kernels"):
            note.append(ceiling["compile_kernels"])
    if r["flag"] == "dtype" and r["dtype"] == "bfloat16" and r["settings"]["device"] == "cpu":
        units = ceiling.get("bf16_units")
        note.append(f"oneDNN bf16 on {', '.join(units)}" if units else
                    "oneDNN bf16 not native here: emulated")
    fastest, slowest = (r["tokens_per_step"] / s for s in (min(r["step_s"]), max(r["step_s"])))
    if fastest > 1.2 * slowest:
        note.append(f"steps ranged {slowest:,.0f}-{fastest:,.0f} tok/s")
    note += [f"a later pass failed: {e}" for e in r.get("later_pass_errors", [])]
    note += [n for n in r.get("notes", []) if r["previous"] is None or
             n not in r.get("previous_notes", [])]
    return "; ".join(note)


def cells(i: int, r: dict, ceiling: dict) -> list[str]:
    """One row of HEADER."""
    if r["status"] != "ok":
        return [str(i), r["label"], *["-"] * 9, not_measured(r)]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def ms(seconds: float) -> str:
        return f"{1000 * seconds:,.0f}" if seconds >= 0.01 else f"{1000 * seconds:.2g}"

    m = r["memory"]
    memory = (f"{m['allocated'] / 2**30:.2f} / {m['reserved'] / 2**30:.2f} GiB"
              if "allocated" in m else f"{m['rss'] / 2**30:.2f} GiB RSS" if "rss" in m else "-")
    step_ms = ms(statistics.median(r["step_s"]))
    if "estimate_step_s" in r:
        step_ms += f" ({ms(r['estimate_step_s'])})"
    note = row_note(r, ceiling)
    if "chain" in r and r["previous"] not in (None, i - 1):  # the head it was tried on
        note = f"on row {r['previous']}" + (f"; {note}" if note else "")
    first = r.get("buys") if "buys" in r else r["vs_previous"]
    ratios = ["-" if x is None else f"{x:.2f}x" for x in (first, r["vs_baseline"])]
    return [str(i), r["label"], f"{r['tokens_per_s']:,.0f}", *ratios, step_ms, pct(r["mfu"]),
            pct(r["mfu_measured"]), memory, f"{r['loss']:.4f}", ", ".join(r["kernels"]) or "-",
            note]


def table(rows: list[dict], ceiling: dict | None = None, mode: str = "chain") -> str:
    header = list(HEADER)
    header[3:5] = RATIOS.get(mode, header[3:5])
    return markdown_table(header, [cells(i, r, ceiling or {}) for i, r in enumerate(rows)])


def best_line(report: dict) -> str:
    """The chain's outcome: the best combination this machine has, and what it left out;
    cumulative: the last row measured, every flag on."""
    rows, best = report["rows"], report.get("best")
    if report["mode"] == "cumulative":
        last = next((r for r in reversed(rows[1:]) if r["status"] == "ok"), None)
        return "" if last is None or not last.get("vs_baseline") else (
            f"every flag on ({last['label'].removeprefix('+ ')} last): "
            f"{last['tokens_per_s']:,.0f} tok/s, {last['vs_baseline']:.2f}x the baseline")
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
    """The lines above the table: hardware, model, batch, steps, MFU denominators, the rule."""
    c, ceiling, load = r["config"], r["ceiling"], r.get("load_average")
    m, t = c["model"], c["train"]
    first = next((row for row in r["rows"] if "params" in row), {})
    shared = " | the machine was shared (load average {:.1f}, then {:.1f})".format(*load) if (
        load and max(load) > 0.5 * os.cpu_count()) else ""
    clock = ", timed by CPU time (--clock=process)" if r.get("clock") == "process" else ""
    peaks = sorted({(row["peak_precision"], row["peak_flops"]) for row in r["rows"]
                    if row.get("peak_flops")}, key=lambda p: -p[1])
    peak = ", ".join(f"{p / 1e12:,.0f} TFLOP/s {name}" for name, p in peaks) and (
        "each row's datasheet peak in its precision (" + ", ".join(
            f"{name} {p / 1e12:,.0f} TFLOP/s" for name, p in peaks) + ")")
    if not peak and ceiling.get("datasheet"):
        peak = f"{ceiling['datasheet'] / 1e12:.0f} TFLOP/s (datasheet)"
    measured = ceiling.get("measured") and (f"{ceiling['measured'] / 1e12:.2f} TFLOP/s measured "
                                            f"({ceiling.get('measured_dtype', '')} matmuls)")
    ratios = [statistics.median(row["step_s"]) / row["estimate_step_s"] for row in r["rows"]
              if row["status"] == "ok" and row.get("estimate_step_s")]
    lines = [
        f"hardware: {ceiling.get('hardware', r['device'])} | torch {r['torch']} | {r['date']}"
        + shared,
        f"model: {m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, context "
        f"{m['block_size']}, {first.get('params', 0) / 1e6:.1f}M parameters | "
        f"{c['data']['dataset']}, {t['batch_size']} x {t['grad_accum_steps']} sequences a step | "
        f"{r['warmup']} warm-up + {r['measure']} timed steps x {r.get('repeat', 1)} run(s) a "
        f"row, each in a fresh process{clock}",
        f"MFU: {first.get('flops_per_token', 0) / 1e6:,.1f}M FLOPs a token x tokens/s, against "
        f"{peak or 'no datasheet peak'}; MFU (meas.) against {measured or 'not measured'}"]
    if ratios:
        lines.append("ms/step (est.): the median step (train.py's start-up estimate); measured "
                     f"/ estimate {min(ratios):.1f}-{max(ratios):.1f}x")
    if r["mode"] == "chain":
        lines.append("chain: a flag is kept when faster than the best so far by more than "
                     f"{100 * r['keep_margin']:.0f}% and twice the standard error of the "
                     "difference; a dropped row is shown, the chain goes on without it")
    elif r["mode"] == "cumulative":
        lines.append("cumulative: each row adds its flag to the row before, kept whatever it "
                     "measured; vs prev: against that row, measured in its own process")
    elif r["mode"] == "without":
        lines.append("without: row 0 is the full recipe (every flag on); each row turns one off; "
                     "it buys: the full recipe's tok/s over the row's, what that flag is worth "
                     "with all the others on")
    return "\n".join(lines + [f"command: {r['command']}"])


def results(report: dict) -> str:
    """The table, the chain's best line, and the CPU kernel rows when they ran."""
    text = table(report["rows"], report["ceiling"], report["mode"])
    if line := best_line(report):
        text += "\n\n" + line
    if report.get("kernels"):
        text += "\n\n" + kernels.markdown(report["kernels"], report["ceiling"])
    return text


def plot(report: dict, path: Path) -> Path | None:
    """Bar chart of tokens/s and peak memory per row."""
    rows = report["rows"]
    if (fig := figure(figsize=(13, 1.6 + 0.42 * len(rows)))) is None:
        return None
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    speed = [r.get("tokens_per_s", 0.0) for r in rows]
    memory = [max(r.get("memory", {}).get(k, 0) for k in ("allocated", "rss")) / 2**30
              for r in rows]
    ax1.barh(range(len(rows)), speed, color=["#9a9a9a" if r.get("chain", "").startswith(
        "dropped") else "#3b75af" for r in rows])
    ax2.barh(range(len(rows)), memory, color="#c6843a")
    for i, r in enumerate(rows):
        vs = f"  ({r['vs_baseline']:.2f}x)" if r.get("vs_baseline") else ""
        if "chain" in r and r.get("vs_previous"):  # the side-by-side ratio decided the chain
            vs = f"  ({r['vs_previous']:.2f}x row {r['previous']}, {r['chain'][:7]})"
        ok = r["status"] == "ok"
        ax1.text(speed[i], i, f" {speed[i]:,.0f}{vs}" if ok else f" {r['status']}",
                 va="center", fontsize=8)
        ax2.text(memory[i], i, f" {memory[i]:.2f}" if ok else "", va="center", fontsize=8)
    ax1.set_yticks(range(len(rows)), [r["label"] for r in rows])
    ax1.invert_yaxis()
    for ax, what in ((ax1, "tokens/s (median of timed steps)"),
                     (ax2, "peak memory, GiB (CUDA max allocated, or peak RSS)")):
        ax.set_xlabel(what)
        ax.margins(x=0.25)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"bench.py {report['mode']}: {report['ceiling'].get('hardware', '')}"
                 + ("\nin brackets: against the row it was tried on, measured alongside; grey: "
                    "dropped" if report["mode"] == "chain" else ""), fontsize=10)
    return save_figure(fig, path)


def write(report: dict, folder: Path, stem: str, plot_too: bool = True) -> list[Path]:
    """NAME.json, .md and (plot_too) .png; NAME by default the device (cpu, nvidia-h200),
    _MODE added for the modes other than the chain."""
    if not stem:
        hardware = report["ceiling"].get("hardware", report["device"])
        stem = report["device"] if report["device"] == "cpu" else re.sub(
            r"[^a-z0-9]+", "-", hardware.removeprefix("GPU ").split(" (")[0].lower()).strip("-")
        stem += "" if report["mode"] == "chain" else f"_{report['mode']}"
    page = (f"# bench.py ({report['mode']})\n\n" + "\n".join(
        f"- {line}" for line in describe(report).splitlines()) + "\n\n" + results(report))
    paths = write_report(report, page, folder, stem)
    return paths + [p for p in [plot(report, folder / f"{stem}.png") if plot_too else None] if p]
