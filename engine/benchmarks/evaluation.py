"""bench.py eval: eval.py's built-in suite on several models, each in a fresh process and timed,
side by side; and its scores against an outside reference on the same items.

    python bench.py eval                                    # the default run's model, the
                                                            # finetuned one, a random GPT-2 124M
    python bench.py eval --checkpoints out/a,out/b --limit 50 --name zen3
    python bench.py eval --lmeval-python /path/venv/bin/python   # + lm-eval through serve.py

The agreement: the GPT-2-shaped checkpoint exported to Hugging Face's format
(load_gpt2_weights.py's export), then add_choice's items (3-shot contexts, four choices each)
scored by transformers' GPT2LMHeadModel and by eval.py's scoring (through the KV cache with
shared prefixes, and each row read whole): the largest difference in a choice's log-likelihood,
and how many picks (acc, acc_norm) agree.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, opt
from engine.benchmarks.report import markdown_table, utc_now, write_report
from engine.benchmarks.timing import REPO_ROOT, run_script
from engine.device import machine_line

GPT2_SHAPE = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
MAKE = {"out/shakespeare_char": "python train.py",
        "out/instruct_cpu": "python -m data.instruct_tasks reverse && python train.py --config "
                            "instruct_cpu"}


@dataclass
class EvalBenchOptions:
    checkpoints: str = opt("out/shakespeare_char,out/instruct_cpu,out/gpt2_random",
                           "models to evaluate, comma-separated; out/gpt2_random is made (GPT-2 "
                           "124M's shape, seeded random weights) if missing")
    tasks: str = opt("builtin", "eval.py --tasks")
    limit: int = opt(0, "eval.py --limit (0: each built-in task's 200 problems)")
    threads: int = opt(0, "eval.py --threads (0: torch's default)")
    agreement: int = opt(200, "add_choice problems scored by transformers too (0: skip)")
    lmeval_python: str = opt("", "a Python with lm-eval installed: the same items through "
                             "serve.py's completions API (lm-eval's local-completions)")
    work: str = opt("out/bench_eval", "where reports and the HF export go")
    results: str = opt("bench_results", "where the page goes")
    name: str = opt("", "the page is eval_NAME.{md,json} (eval.{md,json} without)")


def random_gpt2(out: Path) -> Path:
    """A GPT-2 124M-shaped checkpoint with seeded random weights and GPT-2's tokenizer."""
    from engine import checkpoint, saving
    from model import GPT

    if checkpoint.latest_checkpoint(out) is not None:
        return out
    cfg = Config()
    for key, value in GPT2_SHAPE.items():
        setattr(cfg.model, key, value)
    torch.manual_seed(0)
    saving.save(out, 0, GPT(cfg.model), cfg, {"tokenizer": {"kind": "gpt2"}})
    return out


def run_suite(o: EvalBenchOptions, source: str, work: Path) -> dict:
    """eval.py on one model in a fresh process: its report, and the process's wall time."""
    out = work / ("eval_" + Path(source).name)
    command = [sys.executable, "eval.py", "--checkpoint", source, "--tasks", o.tasks,
               "--limit", str(o.limit), "--out", str(out)]
    command += [f"--threads={o.threads}"] if o.threads else []
    t0 = time.perf_counter()
    run_script(command, f"eval.py on {source}")
    report = json.loads(out.with_suffix(".json").read_text())
    report["process_seconds"] = round(time.perf_counter() - t0, 1)
    report["shell"] = "python " + " ".join(command[1:])
    return report


def transformers_agreement(source: str, n: int, work: Path) -> dict:
    """add_choice's first n items scored three ways: eval.py through the cache, each row read
    whole, and transformers' GPT2LMHeadModel on the exported weights."""
    from transformers import GPT2LMHeadModel

    from data.tokenizer import from_meta
    from engine import hf, sources
    from engine.evaluation import prompts
    from engine.evaluation.scoring import choice_logprobs
    from engine.evaluation.tasks import load_tasks

    model, _, meta, _ = sources.load_source(source, Config(), "cpu")
    model.eval()
    tokenizer = from_meta(meta["tokenizer"])
    task = load_tasks("add_choice", seed=1337, limit=n)[0]
    requests = [prompts.choice_request(task, p, prompts.pick_shots(task, i, task.shots, 1337),
                                       tokenizer) for i, p in enumerate(task.problems)]
    t0 = time.perf_counter()
    cached = [[lp for lp, _ in q] for q in choice_logprobs(model, requests)]
    cached_s = time.perf_counter() - t0
    whole = [[lp for lp, _ in q] for q in choice_logprobs(model, requests, kv_cache=False)]
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        hf.export_hf(model, meta, Path(tmp) / "hf")
        reference = GPT2LMHeadModel.from_pretrained(str(Path(tmp) / "hf")).eval()
        t0 = time.perf_counter()
        theirs = [hf_logprobs(reference, ctx, choices) for ctx, choices in requests]
        hf_s = time.perf_counter() - t0
    return agreement_row(task, requests, cached, whole, theirs, cached_s, hf_s)


@torch.no_grad()
def hf_logprobs(reference, context: list[int], choices: list[list[int]]) -> list[float]:
    rows = [context + c for c in choices]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # right-padded: causal
    logp = torch.log_softmax(reference(ids).logits.float(), dim=-1)
    return [float(logp[i, len(context) - 1:len(r) - 1].gather(
        1, torch.tensor(c)[:, None]).sum()) for i, (r, c) in enumerate(zip(rows, choices))]


def agreement_row(task, requests, cached, whole, theirs, cached_s, hf_s) -> dict:
    def picks(scores, norm):
        return [max(range(len(s)), key=lambda j: s[j] / (len(cs[1][j]) if norm else 1))
                for s, cs in zip(scores, requests)]

    labels = [p["label"] for p in task.problems]
    diff = max(abs(a - b) for x, y in zip(cached, theirs) for a, b in zip(x, y))
    diff_whole = max(abs(a - b) for x, y in zip(whole, theirs) for a, b in zip(x, y))
    row = {"task": task.name, "items": len(requests),
           "choices": sum(len(c) for _, c in requests), "max_abs_diff_cached": diff,
           "max_abs_diff_whole": diff_whole, "ours_seconds": round(cached_s, 2),
           "transformers_seconds": round(hf_s, 2)}
    for name, norm in (("acc", False), ("acc_norm", True)):
        ours, ref = picks(cached, norm), picks(theirs, norm)
        row[f"{name}_picks_equal"] = sum(a == b for a, b in zip(ours, ref))
        row[f"{name}_ours"] = sum(a == y for a, y in zip(ours, labels)) / len(labels)
        row[f"{name}_transformers"] = sum(a == y for a, y in zip(ref, labels)) / len(labels)
    return row


def run(o: EvalBenchOptions, command: str) -> int:
    """Every model's suite, then the agreement (and lm-eval's, if asked); the page."""
    work = Path(o.work)
    work.mkdir(parents=True, exist_ok=True)
    sources = [s.strip() for s in o.checkpoints.split(",") if s.strip()]
    for source in sources:
        if source == "out/gpt2_random":
            random_gpt2(REPO_ROOT / source)
        elif not (REPO_ROOT / source).exists():
            make = MAKE.get(source, "train it, or leave it out of --checkpoints")
            raise ConfigError(f"{source} not found; make it first: {make}")
    reports, load = [], [round(os.getloadavg()[0], 2)]
    for source in sources:
        reports.append(run_suite(o, source, work))
        print(f"{source}: suite {reports[-1]['seconds']:.1f} s, process "
              f"{reports[-1]['process_seconds']:.1f} s", flush=True)
    gpt2 = next((s for s, r in zip(sources, reports) if r["tokenizer"]["kind"] == "gpt2"), None)
    agreement = transformers_agreement(gpt2, o.agreement, work) if gpt2 and o.agreement else None
    lmeval = None
    if o.lmeval_python and gpt2:
        from engine.benchmarks.lmeval import through_serve

        lmeval = through_serve(o.lmeval_python, gpt2, o.agreement or 50, work)
    load.append(round(os.getloadavg()[0], 2))
    # the machine as eval.py saw it (its threads), not as this process does
    machine = reports[0]["machine"] if reports else machine_line(torch.device("cpu"))
    page = {"machine": machine, "load_average": load, "date": utc_now(), "command": command,
            "reports": reports, "agreement": agreement, "lmeval": lmeval}
    stem = f"eval_{o.name}" if o.name else "eval"
    for path in write_report(page, markdown(page), o.results, stem):
        print(f"wrote {path}")
    return 0


def markdown(page: dict) -> str:
    from engine.evaluation.report import cell

    reports = page["reports"]
    names = [Path(r["checkpoint"]).parent.name or r["checkpoint"] for r in reports]
    tasks = list(dict.fromkeys(t["task"] for r in reports for t in r["tasks"]))
    rows = []
    for task in tasks:
        found = [next((t for t in r["tasks"] if t["task"] == task), None) for r in reports]
        metric = next(t["metric"] for t in found if t)
        rows.append([task, metric, *(f"{cell(t)}" + ("" if t.get("skipped") else
                                                     f" ({t['seconds']:.1f} s)")
                                     if t else "-" for t in found)])
    models = [[n, r["step"], f"{r['parameters']:,}", r["tokenizer"]["kind"], r["format"],
               f"{r['seconds']:.1f}", f"{r['process_seconds']:.1f}", f"`{r['shell']}`"]
              for n, r in zip(names, reports)]
    lines = [f"# eval.py's built-in suite on {len(reports)} models", "",
             f"{page['machine']}; torch {torch.__version__}; {page['date']}; the 1-minute load "
             f"average {' then '.join(map(str, page.get('load_average', [])))} at the start and "
             "the end (other processes share the CPUs).",
             f"`{page['command']}`", "",
             "Each model's suite ran in a fresh process (eval.py), its tasks one after another. "
             "Values: the task's headline metric with its 95% interval (Wilson's for "
             "accuracies), then the task's seconds. bpb: bits per byte (lower is better).", "",
             markdown_table(["task", "metric", *names], rows), "",
             markdown_table(["model", "step", "parameters", "tokenizer", "prompts",
                             "suite s", "process s", "command"], models), ""]
    if page["agreement"]:
        a = page["agreement"]
        lines += ["## Against transformers", "",
                  f"{a['items']} {a['task']} items ({a['choices']} choices) on the GPT-2-shaped "
                  "model exported to Hugging Face's format, scored by GPT2LMHeadModel and by "
                  "eval.py's scoring:", "",
                  markdown_table(["measure", "value"], [[k, v] for k, v in a.items()]), ""]
    if page["lmeval"]:
        lines += ["## Against lm-eval through serve.py", "",
                  markdown_table(["measure", "value"], [[k, v] for k, v in
                                                        page["lmeval"].items()]), ""]
    return "\n".join(lines)
