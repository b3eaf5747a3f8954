"""bench.py eval --lmeval-python PY: the same multiple-choice items scored by lm-eval (EleutherAI's
harness, installed in its own environment, never a dependency here) through serve.py's
completions API, and by eval.py's scoring in this process.

lm-eval's local-completions model sends each context + choice as token ids with echo, logprobs
and max_tokens=1, and sums the choice's token log-probabilities; its tokenizer is the exported
checkpoint's (tokenizer files written by the Hugging Face export), so nothing is downloaded. The
items are add_choice's, each context holding its 3 few-shot examples already, so both sides see
the same text. lm-eval's acc_norm divides by the choice's length in characters: eval.py's
acc_char.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from config import Config, ConfigError
from engine.benchmarks.timing import REPO_ROOT

TASK_YAML = """task: eval_items
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_items(tokenizer, n: int, folder: Path) -> tuple[Path, list[dict]]:
    """add_choice's first n problems with their few-shot examples written into the context."""
    from engine.evaluation import prompts
    from engine.evaluation.tasks import load_tasks

    task = load_tasks("add_choice", seed=1337, limit=n)[0]
    items = []
    for i, p in enumerate(task.problems):
        shots = prompts.pick_shots(task, i, task.shots, 1337)
        text = "".join(s["context"] + s["choices"][s["label"]] + task.separator for s in shots)
        items.append({"context": text + p["context"], "choices": p["choices"],
                      "label": p["label"]})
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path, items


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(source: str, port: int, name: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "serve.py", "--checkpoint", source, "--port", str(port),
               "--model_name", name, "--slots", "1", "--warmup=false", "--threads=1"]
    server = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log.open("w"),
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ConfigError(f"serve.py exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.terminate()
    raise ConfigError(f"serve.py did not report healthy in 300 s; see {log}")


def run_lmeval(python: str, port: int, hf_dir: Path, context: int, folder: Path
               ) -> tuple[dict, list[dict]]:
    """lm-eval on the items through serve.py -> (its results, its per-item samples)."""
    args = ",".join([f"model={hf_dir.name}", f"base_url=http://127.0.0.1:{port}/v1/completions",
                     f"max_length={context}",
                     f"tokenizer={hf_dir}", "tokenizer_backend=huggingface", "num_concurrent=1",
                     "max_retries=1", "tokenized_requests=True"])
    out = folder / "lm_eval_out"
    command = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
               "--tasks", "eval_items", "--include_path", str(folder), "--output_path", str(out),
               "--log_samples", "--batch_size", "1"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    log = folder / "lm_eval.log"
    with log.open("w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"lm-eval failed ({tail[0]}); see {log}")
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())
    samples = [json.loads(line) for line in
               sorted(out.rglob("samples_eval_items_*.jsonl"))[-1].read_text().splitlines()]
    return results["results"]["eval_items"], sorted(samples, key=lambda s: s["doc_id"])


def through_serve(python: str, source: str, n: int, work: Path) -> dict:
    """Accuracies and per-choice log-likelihoods: lm-eval through serve.py against eval.py."""
    from data.tokenizer import from_meta
    from engine import hf, sources
    from engine.evaluation.scoring import choice_logprobs

    folder = work / "lmeval"
    folder.mkdir(parents=True, exist_ok=True)
    model, _, meta, _ = sources.load_source(source, Config(), "cpu")
    model.eval()
    tokenizer = from_meta(meta["tokenizer"])
    items_path, items = write_items(tokenizer, n, folder)
    (folder / "eval_items.yaml").write_text(TASK_YAML.format(items=items_path.resolve()))
    hf_dir = folder / "hf"
    if not (hf_dir / "config.json").is_file():
        hf.export_hf(model, meta, hf_dir)
    ours = choice_logprobs(model, [([*tokenizer.encode_ordinary(it["context"])],
                                    [tokenizer.encode_ordinary(c) for c in it["choices"]])
                                   for it in items])
    port = free_port()
    server = start_server(source, port, hf_dir.name, folder / "serve.log")
    try:
        t0 = time.perf_counter()
        results, samples = run_lmeval(python, port, hf_dir.resolve(), model.config.block_size,
                                      folder)
        seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    theirs = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    diffs = [abs(lp - t) for q, ts in zip(ours, theirs) for (lp, _), t in zip(q, ts)]
    labels = [it["label"] for it in items]
    ours_acc = [max(range(len(q)), key=lambda j: q[j][0]) for q in ours]
    ours_char = [max(range(len(q)), key=lambda j: q[j][0] / len(it["choices"][j]))
                 for q, it in zip(ours, items)]
    return {"items": len(items), "choices": len(diffs),
            "lm_eval_acc": results.get("acc,none"), "eval_py_acc":
                sum(a == y for a, y in zip(ours_acc, labels)) / len(labels),
            "lm_eval_acc_norm (per character)": results.get("acc_norm,none"),
            "eval_py_acc_char": sum(a == y for a, y in zip(ours_char, labels)) / len(labels),
            "max_abs_loglik_diff": max(diffs), "mean_abs_loglik_diff": sum(diffs) / len(diffs),
            "lm_eval_seconds": round(seconds, 1), "lm_eval": lm_eval_version(python),
            "shell": f"{python} -m lm_eval --model local-completions ... (engine/benchmarks/"
                     "lmeval.py)"}


def lm_eval_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import importlib.metadata as m; "
                           "print(m.version('lm_eval'))"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"
