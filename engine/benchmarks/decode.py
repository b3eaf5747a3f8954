"""Decoding per weight format, `python bench.py decode`: batch-1 greedy tokens/s per format
(sample.weights) against this machine's memory-read limit, beside transformers and llama.cpp
(GGUF files, in their own Python) on the same weights; and per format the perplexity on a
checkpoint's held-out split and greedy agreement with the first row. RESULTS/decode_NAME.{json,md}.

    python bench.py decode --checkpoint DIR --gguf f32.gguf,q8_0.gguf --llama-python VENV/bin/python
    python bench.py decode --parts quality --quality out/shakespeare_char,out/gpt2_shaped

The limit: each token reads every weight once, so tokens/s cannot pass read bandwidth / bytes
per token; the bandwidth is measured with the benchmark's threads by summing a buffer the size
of each row's weights (a working set that fits a cache reads faster than memory).
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from config import ConfigError, opt
from data.loader import Batches, load_meta
from engine import checkpoint, runtime, weights
from engine import hf as hf_weights
from engine.benchmarks import options
from engine.benchmarks.report import MIB, section, write_report
from engine.benchmarks.runner import REPO_ROOT, take_turns
from engine.sampling import generate_tokens, set_matvec, set_weight_layout
from model import GPT, ModelConfig

LLAMA_WORKER = REPO_ROOT / "scripts" / "llama_decode.py"
# the shapes of the random weights decoded (GPT-2's vocabulary)
DECODE_SHAPES = {
    "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(block_size=128, vocab_size=50257, n_layer=2, n_head=2, n_embd=64),
}


@dataclass
class DecodeOptions:
    checkpoint: str = opt("", "the weights decoded (a run directory); '': random GPT-2 "
                          "124M-shaped weights, seed 0")
    formats: str = opt("torch,float32,bfloat16,int8,int4", "sample.weights, a row each (the "
                       "first: the reference of the greedy tokens and the perplexity)")
    prompt_tokens: int = opt(10, "prompt length (random token ids, seed 0)")
    new_tokens: int = opt(128, "greedy tokens per timed run (the prompt's prefill included)")
    rounds: int = opt(3, "timed runs per row, every row taking its turn each round; medians")
    threads: int = opt(0, "torch threads (and llama.cpp's); 0: every core")
    hf: bool = opt(True, "a transformers generate row (float32) where transformers imports")
    gguf: str = opt("", "llama.cpp rows: GGUF files of the same weights, a comma list")
    llama_python: str = opt("", "the Python with llama-cpp-python (default: this one)")
    llama_extra_buffers: bool = opt(False, "let ggml use its extra (AMX) weight buffers (off: "
                                    "SIGILL on a KVM guest with AMX)")
    parts: str = opt("speed,quality", "speed (tokens/s per row) and/or quality (--quality)")
    quality: str = opt("", "quality: checkpoints scored per format, a comma list")
    eval_batches: int = opt(20, "quality: held-out batches per checkpoint")
    eval_batch_size: int = opt(4, "quality: windows per batch (each the model's block_size)")
    agreement_tokens: int = opt(256, "quality: greedy tokens compared with the first format's")
    name: str = opt("cpu", "results go to RESULTS/decode_NAME.{md,json}")
    results: str = opt("bench_results", "the results directory")


def cpu_runtime() -> runtime.Runtime:
    return runtime.Runtime(torch.device("cpu"), torch.float32, False, [])


def random_gpt2(shape: str = "gpt2", device: torch.device | str = "cpu") -> GPT:
    """A random-weight model of DECODE_SHAPES[shape] (seed 0) with the fast paths, for decoding."""
    torch.manual_seed(0)
    return GPT(ModelConfig(**DECODE_SHAPES[shape], attention="sdpa", causal_mask="on_the_fly",
                           norm="native", activation_impl="native")).to(device).eval()


def our_generate(model: GPT, prompt: torch.Tensor, rt: runtime.Runtime
                 ) -> Callable[[int], torch.Tensor]:
    """run(n): n greedy tokens after the prompt, with our KV cache, as generate.py decodes."""
    return lambda n: generate_tokens(model, prompt, n, temperature=0, autocast=rt.autocast)


def hf_generate(ours: GPT, prompt: torch.Tensor, rt: runtime.Runtime) -> tuple[object, dict]:
    """(run(n), notes): transformers' GPT2LMHeadModel.generate on our weights, batch 1, greedy,
    with its cache; run is None where transformers is not installed."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        print(f"  transformers row skipped: transformers is not installed ({e})", flush=True)
        return None, {"hf_skipped": "transformers is not installed"}
    hf = GPT2LMHeadModel(GPT2Config(**hf_weights.hf_config(ours.config)))
    missing, _ = hf.load_state_dict(hf_weights.ours_to_hf(ours), strict=False)
    hf = hf.to(rt.device).eval()

    @torch.no_grad()
    def run(n: int) -> torch.Tensor:
        return hf.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           use_cache=True, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    return run, {"hf_missing_keys": [k for k in missing  # buffers, and the head HF ties itself
                                     if not k.endswith("attn.bias") and k != "lm_head.weight"]}


def base_model(path: str) -> tuple[GPT, str]:
    """(float32 model in eval mode, its description): a checkpoint, or random GPT-2 weights."""
    if not path:
        return random_gpt2(), "random GPT-2 124M-shaped weights (seed 0)"
    model, cfg, _ = checkpoint.load_model(path, "cpu")
    m = cfg.model
    return model.float().eval(), f"{path}: {m.n_layer} x {m.n_embd}, vocab {m.vocab_size}"


def prepared(base: GPT, fmt: str) -> tuple[GPT, str]:
    """A copy of base held in fmt as generate.py holds it (the format, then the float32 weight
    layout and products where they stay float32) -> (model, the banner's note)."""
    model = copy.deepcopy(base)
    note = weights.convert(model, fmt, torch.device("cpu"))
    set_weight_layout(model, "auto", huge_pages=True)
    set_matvec(model, "auto")
    return model, note


def token_bytes(model: GPT) -> int:
    """The weight bytes one decoded token reads: every Linear (packed or not, the LM head
    included) and the norms, one row of each embedding."""
    t = model.transformer
    rows = {id(t.wpe.weight)}
    if not (isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is t.wte.weight):
        rows.add(id(t.wte.weight))  # the head is its own (packed) copy: one row read
    params = {id(p): p for p in model.parameters()}
    total = sum(p.nbytes for i, p in params.items() if i not in rows)
    total += sum(m.nbytes() for m in model.modules() if isinstance(m, weights.PackedLinear))
    return total + t.wpe.weight[0].nbytes + t.wte.weight[0].nbytes


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes/s summing a float32 buffer of nbytes with this process's threads: the best of
    `repeats` passes after one to warm up (the same working set a token's weights make)."""
    buffer = torch.ones(max(nbytes // 4, 1024))
    buffer.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


class LlamaRow:
    """One GGUF file decoded by llama.cpp in a worker process (scripts/llama_decode.py) that
    keeps it loaded; run(n) -> the n greedy tokens as a (1, n) tensor."""

    def __init__(self, path: str, python: str, threads: int, prompt: list[int], extra: bool):
        command = [python, str(LLAMA_WORKER), path, f"--threads={threads}",
                   "--prompt=" + ",".join(map(str, prompt)), *["--extra-buffers"] * extra]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.version = self._read()["ready"]
        self.nbytes = Path(path).stat().st_size

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited ({self.proc.wait()}); run "
                               f"{LLAMA_WORKER.name} by hand to see why")
        return json.loads(line)

    def run(self, n: int) -> torch.Tensor:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return torch.tensor([self._read()["tokens"]])

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def llama_imports(python: str) -> bool:
    """Whether llama-cpp-python imports in that Python."""
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def llama_rows(o: DecodeOptions, threads: int, prompt: list[int]) -> dict[str, LlamaRow]:
    """label -> LlamaRow for each --gguf file; none where llama_cpp does not import."""
    files, python = options.comma_list(o.gguf), o.llama_python or sys.executable
    if files and not llama_imports(python):
        print(f"  llama.cpp rows skipped: llama_cpp does not import in {python} (give "
              "--llama-python)", flush=True)
        return {}
    return {f"llama.cpp {Path(p).stem}": LlamaRow(p, python, threads, prompt,
                                                  o.llama_extra_buffers) for p in files}


def speed_rows(o: DecodeOptions, base: GPT, prompt: torch.Tensor) -> tuple[dict, dict, dict]:
    """(label -> row, label -> run(n), the llama.cpp rows to stop) of every engine and format."""
    rows, runs = {}, {}
    for fmt in options.comma_list(o.formats):
        model, note = prepared(base, fmt)
        rows[f"ours {fmt}"] = {"engine": "ours", "format": fmt, "note": note,
                               "bytes": token_bytes(model)}
        runs[f"ours {fmt}"] = our_generate(model, prompt, cpu_runtime())
    hf_run = hf_generate(base, prompt, cpu_runtime())[0] if o.hf else None
    if hf_run is not None:
        rows["transformers"] = {"engine": "transformers", "format": "float32",
                                "note": "GPT2LMHeadModel.generate", "bytes": token_bytes(base)}
        runs["transformers"] = hf_run
    llamas = llama_rows(o, torch.get_num_threads(), prompt[0].tolist())
    for label, row in llamas.items():
        rows[label] = {"engine": "llama.cpp", "format": label.split(" ", 1)[1],
                       "note": f"llama-cpp-python {row.version}, the GGUF file's bytes",
                       "bytes": row.nbytes}
        runs[label] = row.run
    return rows, runs, llamas


def speed_part(o: DecodeOptions) -> dict:
    """Every row taking turns, each against the read bandwidth at its own size."""
    base, about = base_model(o.checkpoint)
    torch.manual_seed(0)
    prompt = torch.randint(0, base.config.vocab_size, (1, o.prompt_tokens))
    new = min(o.new_tokens, base.config.block_size - o.prompt_tokens)
    rows, runs, llamas = speed_rows(o, base, prompt)
    try:
        timed = take_turns(runs, new, o.rounds, cpu_runtime())
    finally:
        for row in llamas.values():
            row.stop()
    bandwidth, reference = {}, timed[next(iter(timed))]["tokens"]
    for label, row in rows.items():
        size = row["bytes"]
        bandwidth[size] = bandwidth.get(size) or read_bandwidth(size)
        row.update(seconds=timed[label]["seconds"], bandwidth=bandwidth[size],
                   tok_per_s=new / statistics.median(timed[label]["seconds"]),
                   ceiling=bandwidth[size] / size,
                   same_tokens=sum(a == b for a, b in zip(timed[label]["tokens"], reference)))
        row["share"] = row["tok_per_s"] / row["ceiling"]
        print(f"  {label}: {row['tok_per_s']:.1f} tok/s, {size / MIB:.0f} MiB a token, "
              f"ceiling {row['ceiling']:.0f} ({100 * row['share']:.0f}%)", flush=True)
    return {"model": about, "prompt_tokens": o.prompt_tokens, "new_tokens": new,
            "rounds": o.rounds, "threads": torch.get_num_threads(), "rows": rows}


@torch.no_grad()
def perplexity(model: GPT, loader: Batches, starts: list) -> float:
    """exp(mean cross-entropy) over fixed held-out batches, from the logits (float32)."""
    losses = []
    for batch in starts:
        x, y = loader.windows(batch)
        logits = model(x)[0]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item())
    return math.exp(sum(losses) / len(losses))


def quality_rows(o: DecodeOptions, path: str) -> list[dict]:
    """One checkpoint per format: perplexity on the held-out split and its change from the
    first format's (torch: as trained), and how many of agreement_tokens greedy tokens equal
    the first's (and the first that differs), from the first 16 held-out tokens."""
    base, cfg, _ = checkpoint.load_model(path, "cpu")
    base.float().eval()
    block, new, out = base.config.block_size, o.agreement_tokens, []
    val = Batches(load_meta(cfg.data.dataset), "val", o.eval_batch_size, block, 0,
                  torch.device("cpu"))
    starts = val.fixed(o.eval_batches, seed=1)
    prompt = val.windows(starts[0])[0][:1, :16]
    for fmt in options.comma_list(o.formats):
        model, note = prepared(base, fmt)
        ppl = perplexity(model, val, starts)
        # past the context: the newest half re-read, as generate.py does
        tokens = generate_tokens(model, prompt, new, temperature=0)[0, -new:]
        first = out[0] if out else {"perplexity": ppl, "tokens": tokens}
        differ = (tokens != first["tokens"]).nonzero()
        out.append({"checkpoint": path, "dataset": cfg.data.dataset, "format": fmt,
                    "note": note, "params": base.num_params(False), "perplexity": ppl,
                    "change": ppl / first["perplexity"] - 1, "new_tokens": new,
                    "tokens": tokens, "same_tokens": int((tokens == first["tokens"]).sum()),
                    "first_difference": int(differ[0]) if len(differ) else None,
                    "eval_tokens": o.eval_batches * o.eval_batch_size * block})
        print(f"  {path} {fmt}: perplexity {ppl:.4f} ({100 * out[-1]['change']:+.2f}%), "
              f"{out[-1]['same_tokens']}/{new} greedy tokens as the first", flush=True)
    return [{k: v for k, v in row.items() if k != "tokens"} for row in out]


def speed_markdown(s: dict) -> list[str]:
    header = ["engine", "weights", "MiB a token", "tokens/s", "read GB/s at that size",
              "ceiling tokens/s", "share of ceiling", "greedy tokens as the first row"]
    rows = [[r["engine"], r["format"], f"{r['bytes'] / MIB:.0f}", f"{r['tok_per_s']:.1f}",
             f"{r['bandwidth'] / 1e9:.1f}", f"{r['ceiling']:.0f}", f"{100 * r['share']:.0f}%",
             f"{r['same_tokens']}/{s['new_tokens']}"] for r in s["rows"].values()]
    notes = "; ".join(f"{label}: {r['note']}" for label, r in s["rows"].items())
    return [*section(f"Batch 1, greedy, {s['model']}, a {s['prompt_tokens']}-token prompt then "
                     f"{s['new_tokens']} tokens (the prefill counted), {s['threads']} threads; "
                     f"medians of {s['rounds']} rounds, the rows taking turns.", header, rows),
            f"Rows: {notes}.", ""]


def quality_markdown(quality: list[dict]) -> list[str]:
    header = ["checkpoint", "weights", "perplexity", "vs the first", "greedy tokens as the "
              "first", "first difference"]
    rows = [[f"{q['checkpoint']} ({q['params'] / 1e6:.1f}M, {q['dataset']})", q["format"],
             f"{q['perplexity']:.4f}", f"{100 * q['change']:+.2f}%",
             f"{q['same_tokens']}/{q['new_tokens']}",
             "none" if q["first_difference"] is None else q["first_difference"]]
            for q in quality]
    return section(f"Quality: perplexity over {quality[0]['eval_tokens']:,} held-out tokens per "
                   "checkpoint (the same windows for every format), greedy tokens after 16 "
                   "held-out ones.", header, rows)


def run(o: DecodeOptions, command: str) -> int:
    """The parts asked for; the page to stdout and RESULTS/decode_NAME.{json,md}."""
    parts = options.check_list(o, "parts", ("speed", "quality"))
    for fmt in options.comma_list(o.formats):
        if fmt not in weights.FORMATS[1:]:
            raise ConfigError(f"--formats: {fmt!r} is not one of {', '.join(weights.FORMATS[1:])}")
    if o.threads:
        torch.set_num_threads(o.threads)
    report = {"name": o.name, "machine": runtime.machine_line(torch.device("cpu")),
              "command": command}
    page = [f"# Decode benchmark ({o.name})", "", f"Machine: {report['machine']}", "",
            f"Command: `{command}`", ""]
    if "speed" in parts:
        report["speed"] = speed_part(o)
        page += speed_markdown(report["speed"])
    if "quality" in parts and o.quality:
        report["quality"] = [q for path in options.comma_list(o.quality)
                             for q in quality_rows(o, path)]
        page += quality_markdown(report["quality"])
    print("\n".join(page))
    write_report(report, "\n".join(page), o.results, f"decode_{o.name}")
    return 0
