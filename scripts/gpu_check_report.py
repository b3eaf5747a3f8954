"""The Python parts of scripts/gpu_check.sh: what this machine has, the speedrun part's table,
and the summary page (a table of the parts, env tests compile decode memory bench speedrun, with
each one's status, seconds and note: the compile part's holds the warm-up's seconds and each
step's time).

    python3 scripts/gpu_check_report.py env --json ENV.json --shell ENV.sh [--cpu] \\
        [--nvidia-smi TEXT]
    python3 scripts/gpu_check_report.py summary --results DIR --slug SLUG --env ENV.json \\
        --parts PARTS.tsv --budget SECONDS
    python3 scripts/gpu_check_report.py speedrun --runs NAME=RUN_DIR,... --out PATH_STEM

`env` prints the device, versions, nvidia-smi's TEXT and the missing packages (and what each
one skips), and writes them as JSON and shell assignments. `speedrun` reads each run
directory's metrics.jsonl into PATH_STEM.md and .json. `summary` gathers what the parts
wrote into DIR into gpu_check_SLUG.md and .json. Standard library only.
"""
from __future__ import annotations

import collections
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import shlex
import statistics
import sys
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
    "tiktoken": "on a GPU the compile, decode, memory, bench and speedrun parts are skipped "
                "(their data is in GPT-2 tokens)",
    "pytest": "the CUDA tests are skipped (part tests)",
    "torchao": "the int8 tests skip and the int8 decode row is skipped",
    "transformers": "the transformers decode row is skipped; tests/test_gpt2.py is not collected",
    "triton": "the compile tests skip; the compile part and bench.py's compile row fail with "
              "the fix",
    "matplotlib": "bench.py writes no PNG",
    "accelerate": "not used by this check (multi-GPU launch)",
    "datasets": "not used by this check (data/shards.py needs it)",
    "wandb": "not used by this check (train.py's Weights & Biases logging needs it)",
    **{name: "serve.py's test modules are left out of the tests part (tests/conftest.py); "
             "serve.py needs fastapi, pydantic, starlette and uvicorn, its tests the openai "
             "client" for name in ("openai", "fastapi", "pydantic", "uvicorn", "starlette")},
}
# the ones this check imports, so a broken install counts as missing (the rest: looked up only)
USED = {"torch", "numpy", "safetensors", "tiktoken", "pytest", "torchao", "transformers",
        "triton", "matplotlib"}


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
    cannot = ", ".join(f"{n} ({why})" for n, why in info["missing_required"].items())
    shell = {"GC_SLUG": info["slug"], "GC_HAS_CUDA": int(info["has_cuda"]),
             "GC_HAS_TIKTOKEN": int("tiktoken" not in info["missing"]),
             "GC_CANNOT_RUN": f"required packages missing for {sys.executable}: {cannot}"
             if cannot else ""}
    Path(args["shell"]).write_text("".join(f"{k}={shlex.quote(str(v))}\n"
                                           for k, v in shell.items()))
    return 0


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
    """A page bench.py wrote, without its own heading."""
    lines = md.read_text().splitlines() if md.is_file() else ["(no table written)"]
    return [line for line in lines if not line.startswith("# ")]


def bench_headline(bench: dict) -> dict:
    ok = [r for r in bench["rows"] if r["status"] == "ok"]
    if not ok:
        return {}
    best, ceiling = max(ok, key=lambda r: r["tokens_per_s"]), bench.get("ceiling", {})
    return {"best_row": best["label"], "best_tokens_per_s": best["tokens_per_s"],
            "best_mfu": best["mfu"], "best_mfu_measured": best["mfu_measured"],
            "baseline_tokens_per_s": ok[0]["tokens_per_s"],
            "datasheet_flops": ceiling.get("datasheet"), "measured_flops": ceiling.get("measured")}


def page_top(env: dict, parts: list[dict], tests: dict | None, budget: str) -> list[str]:
    """The page down to the CUDA tests: the machine, a table of the parts, the test results."""
    missing = ", ".join(f"{n} ({why})" for n, why in env.get("missing", {}).items()) or "none"
    lines = [f"# GPU check: {env.get('device', '?')}", "",
             f"- torch {env.get('packages', {}).get('torch')}, CUDA {env.get('torch_cuda') or '-'}"
             f", python {env.get('python')}; nvidia-smi: {env.get('nvidia_smi')}",
             f"- missing packages: {missing}",
             f"- {sum(p['seconds'] for p in parts)} s for the parts, budget {budget} s", "",
             "| part | status | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {p['part']} | {p['status']} | {p['seconds']} | {p['note']} |" for p in parts]
    lines += ["", "## CUDA tests", ""]
    if tests is None:
        part = next((p for p in parts if p["part"] == "tests"), None)
        why = part["note"] if part else "the part did not run"
        return lines + [f"No report from pytest: {why}."]
    lines += [f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
              f"{tests['skipped']} skipped, of {tests['tests']} selected with `-m cuda`."]
    lines += [f"- FAILED {name}" for name in tests["failed"]]
    return lines + [f"- skipped x{n}: {reason}" for reason, n in tests["skip_reasons"].items()]


def cmd_summary(args: dict) -> int:
    folder, slug, tsv = Path(args["results"]), args["slug"], Path(args["parts"])
    env = read_json(Path(args["env"])) or {}
    parts = [dict(zip(("part", "status", "seconds", "note"), (line.split("\t") + [""] * 3)[:4]))
             for line in (tsv.read_text().splitlines() if tsv.is_file() else [])]
    for p in parts:
        p["seconds"] = int(p["seconds"] or 0)
    tests = read_tests(folder / f"gpu_check_{slug}_tests.xml")
    lines = page_top(env, parts, tests, args.get("budget", "0"))
    summary = {"device": env.get("device"), "slug": slug, "parts": parts, "tests": tests,
               "env": env}
    if bench := read_json(folder / f"gpu_check_{slug}_bench.json"):
        summary["bench"] = headline = bench_headline(bench)
        lines += ["", "## bench.py chain: tok/s and MFU per flag", ""]
        lines += table_of(folder / f"gpu_check_{slug}_bench.md")
        if headline:
            lines += ["", f"Fastest: {headline['best_row']}, {headline['best_tokens_per_s']:,.0f} "
                      "tok/s (MFU in the table)."]
    if decode := (read_json(folder / f"memory_{slug}_decode.json") or {}).get("decode"):
        summary["decode"] = {k: decode.get(k) for k in (
            "ours_tokens_per_s", "hf_tokens_per_s", "int8_tokens_per_s",
            "bandwidth_limit_tokens_per_s")}
        lines += ["", "## Decoding", ""] + table_of(folder / f"memory_{slug}_decode.md")
    if train := (read_json(folder / f"memory_{slug}_train.json") or {}).get("train"):
        summary["memory"] = [{"setting": r["setting"], "step_ratio": r["step_peak"]
                              / r["estimate_step"], "whole_ratio": r["peak"] / r["estimate"]}
                             for r in train if r["status"] == "ok"]
        lines += ["", "## Memory estimate vs measured peak", "",
                  "step peak: the peak during the steps minus what was held before them (weights "
                  "+ AdamW); whole: everything above the process's start; ratio: measured / "
                  "estimate", ""] + table_of(folder / f"memory_{slug}_train.md")
    if speedrun := read_json(folder / f"gpu_check_{slug}_speedrun.json"):
        summary["speedrun"] = speedrun
        lines += ["", "## The speedrun config beside GPT-2's (a short run each)", ""]
        lines += table_of(folder / f"gpu_check_{slug}_speedrun.md")
    text = "\n".join(lines) + "\n"
    (folder / f"gpu_check_{slug}.md").write_text(text)
    (folder / f"gpu_check_{slug}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    print(f"wrote {folder / f'gpu_check_{slug}.md'}, .json")
    return 0


def cmd_speedrun(args: dict) -> int:
    """Per run: its config, steps done, the median step time (the first, compiling, left out)
    and val at each evaluation."""
    rows = []
    for run in args["runs"].split(","):
        name, _, folder = run.partition("=")
        log_file = Path(folder) / "metrics.jsonl"
        log = [json.loads(line) for line in log_file.read_text().splitlines()
               ] if log_file.is_file() else []
        steps = [r for r in log if r.get("kind") == "train"]
        evals = [(r["step"], r["val"]) for r in log if r.get("kind") == "eval"]
        rows.append({"config": name, "steps": steps[-1]["step"] if steps else 0,
                     "step_ms": statistics.median(r["ms"] for r in steps[1:]) if steps[1:]
                     else None, "val": evals})
    lines = ["| config | steps | median step ms | val at step |", "|---|---|---|---|"]
    for r in rows:
        ms = f"{r['step_ms']:.1f}" if r["step_ms"] else "-"
        vals = ", ".join(f"{v:.4f} @ {s}" for s, v in r["val"]) or "-"
        lines.append(f"| {r['config']} | {r['steps']} | {ms} | {vals} |")
    out = Path(args["out"])
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0 if all(r["val"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    needs = {"env": ("json", "shell"), "summary": ("results", "slug", "env", "parts"),
             "speedrun": ("runs", "out")}
    command, args, rest = (argv or [""])[0], {}, argv[1:]
    while rest:
        key = rest.pop(0).removeprefix("--")
        args[key] = True if key == "cpu" else (rest.pop(0) if rest else "")  # --cpu: no value
    if command not in needs or not all(args.get(k) for k in needs[command]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return {"env": cmd_env, "summary": cmd_summary, "speedrun": cmd_speedrun}[command](args)


if __name__ == "__main__":
    sys.exit(main())
