"""The GPU check's environment reading and its summary page (scripts/gpu_check.py). Standard
library only.

    python3 scripts/gpu_check_report.py env --json ENV.json [--cpu] [--nvidia-smi TEXT]

`env` prints the device, versions, nvidia-smi's TEXT and the missing packages (and what each
one skips), and writes them as JSON. write_summary() gathers what the parts wrote into the
results folder into gpu_check_<gpu>.md and .json: the headline first, then what each speedup
buys, time to a target loss, decoding, memory, the CUDA tests, the cumulative chain, the parts.
"""
from __future__ import annotations

import collections
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

# what this check needs: without them no part can start
REQUIRED = {
    "torch": "everything",
    "numpy": "the data loader",
    "safetensors": "checkpoint.py, imported by train.py",
}
# what each missing optional package skips
OPTIONAL = {
    "tiktoken": "on a GPU every measuring part is skipped (their data is in GPT-2 tokens)",
    "pytest": "the CUDA tests are skipped (part tests)",
    "torchao": "the int8 tests skip",
    "transformers": "tests/test_gpt2.py is not collected",
    "triton": "the compile tests skip; every compiled row fails with the fix",
    "matplotlib": "bench.py writes no PNG",
    "pydantic": "the decode part's engine row (serve.py's BatchEngine) is skipped",
    "accelerate": "not used by this check (multi-GPU launch)",
    "datasets": "not used by this check (data/shards.py needs it)",
    "wandb": "not used by this check (train.py's Weights & Biases logging needs it)",
    **{name: "serve.py's test modules are left out of the tests part (tests/conftest.py); "
             "serve.py needs fastapi, pydantic, starlette and uvicorn, its tests the openai "
             "client" for name in ("openai", "fastapi", "uvicorn", "starlette")},
}
# the ones this check imports, so a broken install counts as missing (the rest: looked up only)
USED = {"torch", "numpy", "safetensors", "tiktoken", "pytest", "torchao", "transformers",
        "triton", "matplotlib", "pydantic"}
# what people quote each speedup buys GPT-2 124M on a GPU, beside the leave-one-out rows
QUOTED = {"dtype": "~3x (bf16)", "compile": "~2.5x", "attention": "+40% (flash)",
          "vocab_pad": "+10%", "fused_adamw": "+5-10%"}
SECTIONS = [  # (heading, the part that writes it, its file: {slug} filled in)
    ("Time to a target val loss: gpt2_124m against gpt2_124m_speedrun", "to_loss",
     "to_loss_gpu_check_{slug}"),
    ("Decoding", "decode", "decode_device_gpu_check_{slug}"),
    ("Pruned Linears: 2:4 semi-structured and CSR against dense", "sparse", "prune_sparse_{slug}"),
    ("Memory strategies on the headline's config", "memory", "memory_gpu_check_{slug}"),
]


def package_version(name: str) -> str | None:
    """The installed version ('' when unknown), None when missing or (USED) not importable."""
    try:
        if name in USED:
            return str(getattr(importlib.import_module(name), "__version__", ""))
        return importlib.metadata.version(name) if importlib.util.find_spec(name) else None
    except importlib.metadata.PackageNotFoundError:
        return ""
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return None


def environment(cpu_mode: bool, smi: str) -> dict:
    info = {"python": platform.python_version(), "executable": sys.executable,
            "nvidia_smi": smi, "has_cuda": False, "device": "cpu", "slug": "cpu-check",
            "packages": {name: package_version(name) for name in [*REQUIRED, *OPTIONAL]}}
    for key, wanted in (("missing_required", REQUIRED), ("missing", OPTIONAL)):
        info[key] = {n: why for n, why in wanted.items() if info["packages"][n] is None}
    cannot = ", ".join(f"{n} ({why})" for n, why in info["missing_required"].items())
    info["cannot_run"] = (f"required packages missing for {sys.executable}: {cannot}"
                          if cannot else "")
    if info["packages"]["torch"] is not None:
        import torch
        info.update(torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version()
                    if torch.backends.cudnn.is_available() else None)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(has_cuda=True, device=props.name, memory_gib=props.total_memory / 2**30,
                        capability=f"{props.major}.{props.minor}",
                        bf16=bool(torch.cuda.is_bf16_supported()),
                        device_count=torch.cuda.device_count(), slug="cpu-check" if cpu_mode
                        else re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-") or "gpu")
    return info


def cmd_env(args: dict) -> int:
    info = environment(args.get("cpu", False), args.get("nvidia-smi") or "not found")
    torch_version = info["packages"].get("torch")
    print("\n".join([
        f"nvidia-smi: {info['nvidia_smi']}", f"python {info['python']} ({info['executable']})",
        "torch: not importable" if torch_version is None else f"torch {torch_version} | CUDA "
        f"{info.get('torch_cuda') or '-'} | cuDNN {info.get('cudnn') or '-'}",
        f"device: {info['device']} ({info['memory_gib']:.1f} GiB, compute capability "
        f"{info['capability']}, bf16 {'yes' if info['bf16'] else 'no'}, "
        f"{info['device_count']} visible)" if info["has_cuda"] else
        "device: no CUDA device (torch.cuda.is_available() is False)",
        "present: " + ", ".join(f"{n} {v}".strip() for n, v in info["packages"].items()
                                if v is not None),
        *(f"MISSING (required) {n}: needed by {why}"
          for n, why in info["missing_required"].items()),
        *(f"missing {n}: {why}" for n, why in info["missing"].items())]))
    Path(args["json"]).write_text(json.dumps(info, indent=1) + "\n")
    return 0


def nvidia_smi() -> str:
    """The GPUs as nvidia-smi lists them, for the env part."""
    if not shutil.which("nvidia-smi"):
        return "not found"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed ({e})"
    text = (out.stdout or out.stderr).strip()
    return text.replace("\n", "; ") if out.returncode == 0 and text else f"failed ({text[:200]})"


def importable(python: str, name: str) -> bool:
    return subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_tests(path: Path) -> dict | None:
    """Counts and the failed/skipped test names from pytest's JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {k: sum(int(s.get(k, 0)) for s in root.iter("testsuite"))  # root too, if one
              for k in ("tests", "failures", "errors", "skipped")}
    cases = list(root.iter("testcase"))
    failed = [f"{c.get('classname', '')}::{c.get('name', '')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = collections.Counter((c.find("skipped").get("message") or "").strip()
                                  for c in cases if c.find("skipped") is not None)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "skip_reasons": dict(skipped)}


def table_of(md: Path) -> list[str]:
    """The tables and sentences of a page a benchmark wrote, without its headings."""
    if not md.is_file():
        return ["(nothing written yet)"]
    return [line for line in md.read_text().splitlines() if not line.startswith("#")]


def result_times(folder: Path) -> dict[str, float]:
    """Each result file's modification time: a change means a row landed."""
    return {p.name: p.stat().st_mtime for p in folder.glob("*.json") if p.is_file()}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def headline(folder: Path, slug: str) -> tuple[list[str], dict]:
    """The full recipe's row: the page's first section and its record."""
    bench = read_json(folder / f"gpu_check_{slug}_headline.json") or {}
    rows = bench.get("rows") or []
    lines = ["## Headline: GPT-2 124M, every GPU speedup on", ""]
    if not rows or rows[0].get("status") != "ok":
        why = rows[0].get("error") or rows[0].get("reason") if rows else "not measured yet"
        return lines + [f"Not measured: {why}."], {}
    r = rows[0]
    memory = r.get("memory", {})
    held = (f"{gib(memory['allocated'])} / {gib(memory['reserved'])} GiB" if "allocated" in
            memory else f"{gib(memory.get('rss', 0))} GiB peak RSS")
    mfu = (f"{100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e12:,.0f} TFLOP/s "
           f"({r['peak_precision']})" if r.get("mfu") else "- (no datasheet peak here)")
    step_ms = 1000 * statistics.median(r["step_s"])
    compiled = f"{r['compile_s']:.1f} s" if r.get("compile_s") else "- (not compiled)"
    record = {"tokens_per_s": r["tokens_per_s"], "step_ms": step_ms, "mfu": r.get("mfu"),
              "peak_precision": r.get("peak_precision"), "memory": memory,
              "compile_s": r.get("compile_s"), "first_step_s": r.get("first_step_s"),
              "loss": r["loss"], "steps": r.get("steps"), "settings": r.get("settings"),
              "kernels": r.get("kernels")}
    lines += ["| tok/s | step | MFU | peak allocated / reserved | compile warm-up | first step "
              "| loss after |", "|---:|---:|---|---|---:|---:|---|",
              f"| {r['tokens_per_s']:,.0f} | {step_ms:,.1f} ms | {mfu} | {held} | {compiled} | "
              f"{1000 * (r.get('first_step_s') or 0):,.0f} ms | {r['loss']:.4f} after "
              f"{r.get('steps', '?')} steps |", "",
              f"- {r.get('micro_batch')} x {bench['config']['model']['block_size']} tokens a "
              f"step; attention kernel: {', '.join(r.get('kernels') or []) or '-'}",
              "- speedups: " + " ".join(f"{k}={v}" for k, v in (r.get("settings") or {}).items())]
    return lines, record


def leave_one_out(folder: Path, slug: str) -> tuple[list[str], list[dict]]:
    """What each speedup buys in the full recipe, beside what people quote."""
    bench = read_json(folder / f"gpu_check_{slug}_without.json") or {}
    rows = bench.get("rows") or []
    lines = ["## What each speedup buys: the full recipe, then each turned off alone", ""]
    if not rows:
        return lines + ["Not measured yet."], []
    full = rows[0]
    cells, record = [], []
    for r in rows[1:]:
        measured = f"{r['buys']:.2f}x" if r.get("buys") else "-"
        if r["status"] == "ok":
            what = f"{r['tokens_per_s']:,.0f} tok/s"
            memory = r.get("memory", {})
            held = (f"{gib(memory['allocated'])} GiB" if "allocated" in memory else
                    f"{gib(memory.get('rss', 0))} GiB RSS")
        else:
            what, held = f"{r['status']}: {r.get('reason') or r.get('error', '')}", "-"
        cells.append(f"| {r['flag']} | {QUOTED.get(r['flag'], '-')} | {measured} | {what} | "
                     f"{held} | {r['label']} |")
        record.append({"flag": r["flag"], "status": r["status"], "buys": r.get("buys"),
                       "tokens_per_s": r.get("tokens_per_s"), "quoted": QUOTED.get(r["flag"])})
    base = (f"full recipe re-measured here: {full['tokens_per_s']:,.0f} tok/s"
            if full.get("status") == "ok" else f"full recipe: {full.get('status')}")
    lines += [f"{base}; it buys = the full recipe's tok/s over the row's (what turning the flag "
              "off costs, every other one on); the whole table: "
              f"`gpu_check_{slug}_without.md`", "",
              "| speedup | quoted | it buys | without it | peak allocated | row |",
              "|---|---|---:|---:|---:|---|", *cells]
    return lines, record


def tests_section(tests: dict | None, parts: list[dict]) -> list[str]:
    lines = ["## CUDA tests", ""]
    if tests is None:
        part = next((p for p in parts if p["part"] == "tests"), None)
        why = part["note"] if part and part["note"] else "the part did not run"
        return lines + [f"No report from pytest: {why}."]
    lines += [f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
              f"{tests['skipped']} skipped, of {tests['tests']} selected with `-m cuda`."]
    lines += [f"- FAILED {name}" for name in tests["failed"]]
    return lines + [f"- skipped x{n}: {reason}" for reason, n in tests["skip_reasons"].items()]


def summary(folder: Path, slug: str, env: dict, parts: list[dict], budget: int,
            elapsed: int, cpu: bool) -> tuple[str, dict]:
    """(the page, its record) from what the parts wrote so far."""
    missing = ", ".join(f"{n} ({why})" for n, why in env.get("missing", {}).items()) or "none"
    top = [f"# GPU check: {env.get('device', 'not known yet')}", "",
           f"- torch {env.get('packages', {}).get('torch')}, CUDA {env.get('torch_cuda') or '-'}"
           f", python {env.get('python')}; nvidia-smi: {env.get('nvidia_smi')}",
           f"- missing packages: {missing}",
           f"- {elapsed} s so far of the {budget} s budget"
           + ("; CPU pass: tiny sizes, what needs CUDA says so" if cpu else ""), ""]
    lines, best = headline(folder, slug)
    top += lines + [""]
    lines, buys = leave_one_out(folder, slug)
    top += lines + [""]
    record = {"device": env.get("device"), "slug": slug, "budget": budget, "elapsed": elapsed,
              "cpu_pass": cpu, "headline": best, "without": buys, "parts": parts, "env": env}
    for heading, part, stem in SECTIONS:
        data = read_json(folder / f"{stem.format(slug=slug)}.json")
        record[part] = data
        top += [f"## {heading}", ""] + (table_of(folder / f"{stem.format(slug=slug)}.md")
                                        if data else ["Not measured yet."]) + [""]
    record["tests"] = tests = read_tests(folder / f"gpu_check_{slug}_tests.xml")
    top += tests_section(tests, parts) + [""]
    if chain := read_json(folder / f"gpu_check_{slug}_chain.json"):
        record["chain"] = [{k: r.get(k) for k in ("label", "status", "tokens_per_s",
                                                   "vs_baseline")} for r in chain["rows"]]
        top += ["## The cumulative chain from GPT-2's reference path", ""]
        top += table_of(folder / f"gpu_check_{slug}_chain.md") + [""]
    top += ["## Parts", "", "| part | status | seconds | cap | note |", "|---|---|---:|---:|---|"]
    top += [f"| {p['part']} | {p['status']} | {p['seconds']} | {p['cap'] or 'rest'} | "
            f"{p['note']} |" for p in parts]
    return "\n".join(top) + "\n", record


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader, or a kill, never sees half a page


def write_summary(folder: Path, slug: str, env: dict, parts: list[dict], budget: int,
                  elapsed: int, cpu: bool, targets: list[Path]) -> None:
    """The page and its record, from what is in folder, as each target's .md and .json
    (a target: a path without its suffix)."""
    page, record = summary(folder, slug, env, parts, budget, elapsed, cpu)
    text = json.dumps(record, indent=1, default=str) + "\n"
    for target in targets:
        write_atomic(target.with_name(target.name + ".md"), page)
        write_atomic(target.with_name(target.name + ".json"), text)


def archive(folder: Path, slug: str, path: Path) -> None:
    """Every result file of this run (the slug in its name) in one .tar.gz, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(folder.iterdir()):
            if p.is_file() and slug in p.name and not p.name.endswith(".tmp"):
                tar.add(p, arcname=p.name)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, args, rest = (argv or [""])[0], {}, argv[1:]
    while rest:
        key = rest.pop(0).removeprefix("--")
        args[key] = True if key == "cpu" else (rest.pop(0) if rest else "")  # --cpu: no value
    if command != "env" or not args.get("json"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return cmd_env(args)


if __name__ == "__main__":
    sys.exit(main())
