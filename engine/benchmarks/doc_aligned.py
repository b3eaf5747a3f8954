"""bench.py doc-aligned: training rows that start at documents (--doc_aligned=true) against random
windows, at equal tokens, each model then scored on both kinds of validation rows.

    python bench.py doc-aligned                          # tiny Shakespeare, a speech a document
    python bench.py doc-aligned --dataset /tmp/local     # any prepared dataset with documents
    python bench.py doc-aligned --seeds 1,2,3 --max-iters 600

Each seed trains the default recipe twice in fresh processes, windows then documents, at the
same block size, batch and steps. Every final model is scored on the same validation batches of
both kinds: random windows (what train.py reports, many starting mid-document) and rows that
start at a document, packed as --doc_aligned packs them. Loss and bits per byte, per seed.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from config import ConfigError, opt
from data.dataset import DATA_DIR, load_meta, token_bytes
from data.loader import Batches
from engine.benchmarks import checks
from engine.benchmarks.report import markdown_table, utc_now, write_report
from engine.benchmarks.timing import REPO_ROOT
from engine.device import Runtime, machine_line

EVAL_SEED = 4242  # the validation batches, the same for every model


@dataclass
class DocAlignedOptions:
    dataset: str = opt("", "a prepared dataset whose documents end with <|endoftext|>; '' = "
                       "tiny Shakespeare's speeches, a document each, in a 2,048-id BPE "
                       "trained on that text (data/train_tokenizer.py)")
    work: str = opt("out/bench_doc_aligned", "where the prepared speeches and the runs go")
    seeds: str = opt("1337,1338", "a pair of runs (windows, then documents) per seed")
    max_iters: int = opt(400, "steps of each run (equal tokens: the same for both)")
    block_size: int = opt(256, "tokens per row")
    batch_size: int = opt(8, "rows per step")
    eval_batches: int = opt(20, "validation batches of each kind")
    results: str = opt("bench_results", "folder for doc_aligned_NAME.{json,md}")
    name: str = opt("cpu", "NAME in the result files")


def speeches(work: Path) -> Path:
    """Tiny Shakespeare cut at its blank lines (a speech a document) as shards, in the tokens of
    a 2,048-id BPE trained on it."""
    from data import train_tokenizer
    from data.shards import prepare
    from data.stream import Source

    out = work / "speeches"
    if (out / "meta.json").is_file():
        return out
    text = (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
    corpus = work / "speeches.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    with open(corpus, "w", encoding="utf-8") as f:
        for doc in filter(None, (d.strip() for d in text.split("\n\n"))):
            f.write(json.dumps({"text": doc}) + "\n")
    tok, _ = train_tokenizer.train([DATA_DIR / "tinyshakespeare.txt"], 2048, [], "gpt4",
                                   name="shakespeare_2k", progress=False)
    prepare(Source("json", data_files=[str(corpus)]), out, shard_tokens=1_000_000,
            val_tokens=30_000, workers=1, progress=False, tok=tok)
    return out


def train_arm(opts: DocAlignedOptions, dataset: str, seed: int, aligned: bool, out: Path) -> dict:
    """One train.py run in a fresh process: its summary and the flag's start-up note."""
    args = [f"--dataset={dataset}", f"--block_size={opts.block_size}",
            f"--batch_size={opts.batch_size}", f"--max_iters={opts.max_iters}",
            f"--eval_interval={opts.max_iters}", f"--eval_iters={opts.eval_batches}",
            f"--seed={seed}", f"--out_dir={out}", "--log_interval=100", "--loss_curve=false",
            "--eval_at_start=false", f"--doc_aligned={str(aligned).lower()}"]
    print(f"doc-aligned: seed {seed}, {'documents' if aligned else 'windows'}: python train.py "
          + " ".join(args), flush=True)
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO_ROOT, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        raise ConfigError(f"train.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    note = next((line for line in proc.stdout.splitlines() if "data.doc_aligned:" in line), "")
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "rows": "documents" if aligned else "windows", "out": str(out),
            "train_loss": summary["final"].get("train"), "note": note.strip()}


class Ready:
    """A loader for evaluate() whose batches are already (x, y) tensors."""

    @staticmethod
    def windows(xy: tuple) -> tuple:
        return xy


@torch.no_grad()
def score(run: dict, meta: dict, opts: DocAlignedOptions) -> dict:
    """The run's final model on the same validation batches of both kinds: loss and bpb, by the
    evaluation train.py runs."""
    from data.doc_batches import DocBatches
    from data.shard_batches import ShardBatches
    from engine.loading import load_model
    from engine.training.step import evaluate

    model = load_model(run["out"])[0]
    kind = ShardBatches if "shards" in meta else Batches
    windows = kind(meta, "val", opts.batch_size, opts.block_size, EVAL_SEED)
    docs = DocBatches(meta, "val", opts.batch_size, opts.block_size, EVAL_SEED)
    out = evaluate(model, {"windows": windows, "documents": Ready},
                   {"windows": windows.fixed(opts.eval_batches, EVAL_SEED),
                    "documents": [docs.next() for _ in range(opts.eval_batches)]},
                   Runtime(torch.device("cpu"), torch.float32, False, []),
                   torch.from_numpy(token_bytes(meta)))
    for name in ("windows", "documents"):
        run[f"val_{name}"], run[f"bpb_{name}"] = out[name], out[f"{name}_bpb"]
    return run


def run(opts: DocAlignedOptions, command: str) -> int:
    checks.check(opts, {"max_iters": 1, "block_size": 2, "batch_size": 1, "eval_batches": 1})
    seeds = [int(s) for s in checks.comma_list(opts.seeds)]
    work = Path(opts.work)
    dataset = opts.dataset or str(speeches(work))
    meta = load_meta(dataset)
    runs = []
    for seed in seeds:
        for aligned in (False, True):  # in turns
            out = work / f"run_{seed}_{'docs' if aligned else 'windows'}"
            runs.append(score(train_arm(opts, dataset, seed, aligned, out), meta, opts))
    report = {"command": command, "date": utc_now(), "hardware": machine_line(
        torch.device("cpu")), "dataset": dataset, "options": vars(opts), "runs": runs}
    text = page(report, opts)
    print("\n" + text)
    write_report(report, text, opts.results, f"doc_aligned_{opts.name}")
    return 0


def page(report: dict, opts: DocAlignedOptions) -> str:
    tokens = opts.max_iters * opts.batch_size * opts.block_size
    rows = [[r["rows"], r["seed"], f"{r['train_loss']:.4f}", f"{r['val_windows']:.4f}",
             f"{r['bpb_windows']:.4f}", f"{r['val_documents']:.4f}", f"{r['bpb_documents']:.4f}"]
            for r in report["runs"]]
    for kind in ("windows", "documents"):
        mine = [r for r in report["runs"] if r["rows"] == kind]
        rows.append([f"**{kind}, median**", "", "", *(
            f"**{statistics.median(r[key] for r in mine):.4f}**"
            for key in ("val_windows", "bpb_windows", "val_documents", "bpb_documents"))])
    note = next((r["note"] for r in report["runs"] if r["note"]), "")
    return "\n".join([
        f"# bench.py doc-aligned ({report['date']})", "",
        f"- {report['hardware']}", f"- `{report['command']}`",
        f"- data: `{report['dataset']}`; every run {opts.max_iters} steps x {opts.batch_size} "
        f"rows x {opts.block_size} tokens = {tokens:,} training tokens, the default recipe",
        f"- validation: the same {opts.eval_batches} batches of each kind for every model: "
        "random windows (train.py's, most starting mid-document) and rows that start at a "
        "document, packed best-fit as --doc_aligned packs training rows",
        f"- the flag's note: {note}", "",
        markdown_table(["training rows", "seed", "train loss (eval)", "val loss, windows",
                        "val bpb, windows", "val loss, doc rows", "val bpb, doc rows"], rows)])
