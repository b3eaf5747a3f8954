"""The report card: the checkpoint (its config, step, tokenizer sha256), the settings, and per
task its headline metric with a 95% interval and the number of problems; written as JSON and
markdown, and two reports side by side (eval.py --compare A B).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import platform
from pathlib import Path

import torch


def tokenizer_sha256(tokenizer) -> str:
    """Of the vocabulary itself: its kind and every token's bytes in id order (a BPE's merges
    follow from its ranks' order), so the same digest means the same tokens for the same ids."""
    digest = hashlib.sha256(tokenizer.kind.encode())
    if tokenizer.kind == "char":
        digest.update(json.dumps(tokenizer.chars).encode())
    else:
        digest.update(getattr(tokenizer.enc, "_pat_str", "").encode())
        for i in range(tokenizer.vocab_size):
            digest.update(len(tokenizer.decode_bytes([i])).to_bytes(4, "little"))
            digest.update(tokenizer.decode_bytes([i]))
    digest.update(str(getattr(tokenizer, "eot_id", None)).encode())
    return digest.hexdigest()


def header(label: str, model, stored, meta: dict, tokenizer, fmt: str, settings, machine: str,
           argv: list[str]) -> dict:
    """The report's head: what was evaluated (the model's config as loaded, the checkpoint's
    whole stored config, its tokenizer), how, where and by which command."""
    return {"checkpoint": label, "step": meta.get("step"),
            "model": dataclasses.asdict(model.config),
            "config": dataclasses.asdict(stored) if stored is not None else None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                          "sha256": tokenizer_sha256(tokenizer)},
            "format": fmt,
            "settings": {k: v for k, v in vars(settings).items() if k != "autocast"},
            "machine": machine, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python eval.py " + " ".join(argv)}


def cell(result: dict) -> str:
    """'43.5% [36.8, 50.4]' for an accuracy, '2.216' for bits per byte, 'skipped' ..."""
    if result.get("skipped"):
        return "skipped"
    if result["metric"] == "bpb":
        return f"{result['value']:.3f}"
    low, high = result["ci95"]
    return f"{100 * result['value']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def markdown(report: dict) -> str:
    h = report
    tok = h["tokenizer"]
    lines = [f"# Evaluation: {h['checkpoint']}", "",
             f"- step {h['step']}, {h['parameters']:,} parameters, "
             f"{h['model']['n_layer']} layers x {h['model']['n_embd']} wide, context "
             f"{h['model']['block_size']}; prompts {h['format']}",
             f"- tokenizer {tok['kind']} ({tok['vocab_size']:,} ids), sha256 {tok['sha256'][:16]}",
             f"- {h['machine']}; torch {h['torch']}; {h['date']}",
             f"- settings: {json.dumps(h['settings'])}",
             f"- `{h['command']}`; {h['seconds']:.1f} s in all", "",
             "| task | kind | metric | value [95% interval] | n | shots | seconds | other |",
             "|---|---|---|---|---|---|---|---|"]
    for r in h["tasks"]:
        if r.get("skipped"):
            lines.append(f"| {r['task']} | {r['kind']} | {r['metric']} | skipped | 0 | | | "
                         f"{r['skipped'][:120]} |")
            continue
        other = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v:,}"
                          for k, v in r["metrics"].items() if k != r["metric"])
        n = f"{r['n']:,} bytes" if r["kind"] == "bpb" else f"{r['n']:,}"
        shots = r.get("shots", "")
        if r.get("mean_shots_kept", shots) < shots:  # examples dropped to fit the context
            shots = f"{shots} ({r['mean_shots_kept']:.1f} fit)"
        lines.append(f"| {r['task']} | {r['kind']} | {r['metric']} | {cell(r)} | {n} | "
                     f"{shots} | {r['seconds']:.1f} | {other} |")
    lines += ["", "Intervals: Wilson's score interval for accuracies (each problem right or "
              "wrong), a normal interval for means of pass@k estimates or rewards."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> tuple[Path, Path]:
    """OUT.json and OUT.md (out without its suffix)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


def read(path: str | Path) -> dict:
    from engine.evaluation.tasks import TaskError

    try:
        report = json.loads(Path(path).read_text())
        if not isinstance(report["tasks"], list) or "checkpoint" not in report:
            raise KeyError("tasks")
    except FileNotFoundError:
        raise TaskError(f"report {path} not found; eval.py --out PATH writes PATH.json") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise TaskError(f"{path} is not an eval.py report ({type(e).__name__}: {e})") from None
    return report


def compare(a: dict, b: dict) -> str:
    """Two reports side by side: each task both ran, its values, the difference, and whether the
    95% intervals overlap; a task whose items differ (sha256) is marked, not compared."""
    rows = ["| task | metric | A | B | B - A | note |", "|---|---|---|---|---|---|"]
    theirs = {r["task"]: r for r in b["tasks"]}
    for r in a["tasks"]:
        o = theirs.pop(r["task"], None)
        if o is None:
            rows.append(f"| {r['task']} | {r['metric']} | {cell(r)} | - | | only in A |")
            continue
        note = ""
        if r["sha256"] != o["sha256"] or r["metric"] != o["metric"]:
            note = "different items or metric: not comparable"
        elif r.get("skipped") or o.get("skipped"):
            where = [name for name, x in (("A", r), ("B", o)) if x.get("skipped")]
            note = "skipped in " + " and ".join(where)
        diff = ""
        if not note:
            scale = 1 if r["metric"] == "bpb" else 100
            diff = f"{scale * (o['value'] - r['value']):+.{3 if scale == 1 else 1}f}"
            if r["ci95"] and o["ci95"]:
                apart = r["ci95"][1] < o["ci95"][0] or o["ci95"][1] < r["ci95"][0]
                note = "intervals apart" if apart else "intervals overlap"
            for key in ("shots", "samples"):  # asked differently: said beside the numbers
                if r.get(key) != o.get(key):
                    note += f"; {key} {r.get(key)} vs {o.get(key)}"
        rows.append(f"| {r['task']} | {r['metric']} | {cell(r)} | {cell(o)} | {diff} | {note} |")
    rows += [f"| {r['task']} | {r['metric']} | - | {cell(r)} | | only in B |"
             for r in theirs.values()]
    names = [f"{x}: {r['checkpoint']} (step {r['step']}, tokenizer "
             f"{r['tokenizer']['sha256'][:12]}, {r['format']} prompts)"
             for x, r in (("A", a), ("B", b))]
    return "\n".join(names) + "\n\n" + "\n".join(rows) + "\n"
