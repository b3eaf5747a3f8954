"""Decoding per weight format, `python bench.py decode`: batch-1 greedy tokens/s per format
(sample.weights) beside transformers and llama.cpp (GGUF files, in their own Python), each row
against its ceiling: a token reads every weight once, so tokens/s <= read bandwidth (summing a
buffer of the row's size) / bytes a token. Per format also a checkpoint's held-out perplexity
and greedy agreement with the first format. RESULTS/decode_NAME.{json,md}.

    python bench.py decode --checkpoint DIR --gguf f32.gguf,q8_0.gguf --llama-python VENV/bin/python
    python bench.py decode --parts quality --quality out/shakespeare_char,out/gpt2_shaped
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from config import ConfigError, opt
from data.loader import Batches, load_meta
from engine import hf as hf_weights
from engine import loading
from engine.benchmarks import checks
from engine.benchmarks.report import MIB, section, write_report
from engine.benchmarks.timing import REPO_ROOT, take_turns, timed
from engine.device import Runtime, machine_line
from engine.inference import packed
from engine.inference.matvec import huge_pages_for, set_matvec, set_weight_layout
from engine.inference.sampling import generate_tokens
from engine.training.step import evaluate
from model import GPT, ModelConfig

LLAMA_WORKER = REPO_ROOT / "scripts" / "llama_decode.py"
DECODE_SHAPES = {  # the shapes of the random weights decoded (GPT-2's vocabulary)
    "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(block_size=128, vocab_size=50257, n_layer=2, n_head=2, n_embd=64),
}
CPU = Runtime(torch.device("cpu"), torch.float32, False, [])
EVAL_BATCH_SIZE = 4  # quality: windows of block_size per held-out batch


@dataclass
class DecodeOptions:
    checkpoint: str = opt("", "the weights decoded (a run directory); '': random GPT-2 124M")
    formats: str = opt("torch,float32,bfloat16,int8,int4", "sample.weights, a row each (the "
                       "first: the reference of the greedy tokens and the perplexity)")
    prompt_tokens: int = opt(10, "prompt length (random token ids, seed 0)")
    new_tokens: int = opt(128, "greedy tokens per timed run (the prompt's prefill included)")
    rounds: int = opt(3, "timed runs per row, every row taking its turn each round; medians")
    threads: int = opt(0, "torch threads (and llama.cpp's); 0: every core")
    hf: bool = opt(True, "a transformers generate row (float32) where transformers imports")
    gguf: str = opt("", "llama.cpp rows: GGUF files of the same weights, a comma list")
    llama_python: str = opt("", "the Python with llama-cpp-python (default: this one)")
    llama_extra_buffers: bool = opt(False, "let ggml use its AMX weight buffers (off: SIGILL "
                                    "on a KVM guest with AMX)")
    parts: str = opt("speed,quality", "speed (tokens/s per row) and/or quality (--quality)")
    quality: str = opt("", "quality: checkpoints scored per format, a comma list")
    eval_batches: int = opt(20, "quality: held-out batches per checkpoint")
    agreement_tokens: int = opt(256, "quality: greedy tokens compared with the first format's")
    name: str = opt("cpu", "results go to RESULTS/decode_NAME.{md,json}")
    results: str = opt("bench_results", "the results directory")


def random_gpt2(shape: str = "gpt2", device: torch.device | str = "cpu") -> GPT:
    """A random-weight model of DECODE_SHAPES[shape] (seed 0) with the fast paths, for decoding."""
    torch.manual_seed(0)
    return GPT(ModelConfig(**DECODE_SHAPES[shape], attention="sdpa", causal_mask="on_the_fly",
                           norm="native", activation_impl="native")).to(device).eval()


def our_generate(model: GPT, prompt: torch.Tensor, rt: Runtime
                 ) -> Callable[[int], torch.Tensor]:
    """run(n): n greedy tokens after the prompt, with our KV cache, as generate.py decodes."""
    return lambda n: generate_tokens(model, prompt, n, temperature=0, autocast=rt.autocast)


def hf_generate(ours: GPT, prompt: torch.Tensor, rt: Runtime) -> tuple[object, dict]:
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


def prepared(base: GPT, fmt: str, device: torch.device = CPU.device) -> tuple[GPT, str]:
    """A copy of base held in fmt as generate.py holds it -> (model, its note)."""
    model = copy.deepcopy(base)
    note = packed.convert(model, fmt, device)
    layout = set_weight_layout(model, "auto", huge_pages=True)
    return model, (f"{note}, {layout} weight layout, huge pages "
                   f"{huge_pages_for(True, device)[1]}, matvec {set_matvec(model, 'auto')}")


def token_row(engine: str, fmt: str, model: GPT, note: str) -> dict:
    """A speed row of `model`: the weight bytes one token reads are every Linear (packed or
    not, the LM head included) and the norms, one row of each embedding."""
    t = model.transformer
    rows = {id(t.wpe.weight)} if "wpe" in t else set()
    if not (isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is t.wte.weight):
        rows.add(id(t.wte.weight))  # the head is its own (packed) copy: one row read
    params = {id(p): p for p in model.parameters()}
    nbytes = sum(p.nbytes for i, p in params.items() if i not in rows)
    nbytes += sum(m.nbytes() for m in model.modules() if isinstance(m, packed.PackedLinear))
    nbytes += t.wte.weight[0].nbytes + (t.wpe.weight[0].nbytes if "wpe" in t else 0)
    return {"engine": engine, "format": fmt, "note": note, "bytes": nbytes}


def time_rows(rows: dict[str, dict], runs: dict[str, Callable], new: int, rounds: int,
              rt: Runtime) -> None:
    """The runs take turns; each row gets its seconds, tok/s, ceiling (the best of 8 reads of
    a buffer of its bytes / its bytes), its time over the first row's (median of the rounds'
    ratios) and how many greedy tokens equal the first row's."""
    turns, bandwidth = take_turns(runs, new, rounds, rt), {}
    first = turns[next(iter(turns))]
    for label, row in rows.items():
        seconds, tokens, size = turns[label]["seconds"], turns[label]["tokens"], row["bytes"]
        if size not in bandwidth:
            buffer = torch.ones(max(size // 4, 1024), device=rt.device)
            bandwidth[size] = max(buffer.nbytes / timed(buffer.sum, rt)[0] for _ in range(8))
        row.update(seconds=seconds, bandwidth=bandwidth[size], ceiling=bandwidth[size] / size,
                   tok_per_s=new / statistics.median(seconds),
                   time_vs_first=statistics.median(
                       s / f for s, f in zip(seconds, first["seconds"])),
                   same_tokens=sum(a == b for a, b in zip(tokens, first["tokens"])))
        row["share"] = row["tok_per_s"] / row["ceiling"]
        print(f"  {label}: {row['tok_per_s']:.1f} tok/s, {size / MIB:.0f} MiB a token, "
              f"ceiling {row['ceiling']:.0f} ({100 * row['share']:.0f}%)", flush=True)


class LlamaRow:
    """One GGUF file decoded by llama.cpp in a worker process (scripts/llama_decode.py) that
    keeps it loaded; run(n) -> the n greedy tokens as a (1, n) tensor."""

    def __init__(self, path: str, o: DecodeOptions, prompt: list[int]):
        self.proc = subprocess.Popen(
            [o.llama_python or sys.executable, str(LLAMA_WORKER), path,
             f"--threads={torch.get_num_threads()}", "--prompt=" + ",".join(map(str, prompt)),
             *["--extra-buffers"] * o.llama_extra_buffers],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.row = {"engine": "llama.cpp", "format": Path(path).stem,
                    "note": f"llama-cpp-python {self._read()['ready']}, the GGUF file's bytes",
                    "bytes": Path(path).stat().st_size}

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


def llama_imports(python: str) -> bool:
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def speed_part(o: DecodeOptions) -> dict:
    """Every format of ours, transformers and each GGUF file taking turns (time_rows)."""
    if o.checkpoint:
        base, cfg, _ = loading.load_model(o.checkpoint, "cpu")
        m = cfg.model
        about = f"{o.checkpoint}: {m.n_layer} x {m.n_embd}, vocab {m.vocab_size}"
    else:
        base, about = random_gpt2(), "random GPT-2 124M-shaped weights (seed 0)"
    base.float().eval()
    torch.manual_seed(0)
    prompt = torch.randint(0, base.config.vocab_size, (1, o.prompt_tokens))
    rows, runs = {}, {}
    for fmt in checks.comma_list(o.formats):
        model, note = prepared(base, fmt)
        rows[f"ours {fmt}"] = token_row("ours", fmt, model, note)
        runs[f"ours {fmt}"] = our_generate(model, prompt, CPU)
    hf_run = hf_generate(base, prompt, CPU)[0] if o.hf else None
    if hf_run is not None:
        rows["transformers"] = token_row("transformers", "float32", base,
                                         "GPT2LMHeadModel.generate")
        runs["transformers"] = hf_run
    files, python = checks.comma_list(o.gguf), o.llama_python or sys.executable
    if files and not llama_imports(python):
        print(f"  llama.cpp rows skipped: llama_cpp does not import in {python} (give "
              "--llama-python)", flush=True)
        files = []
    llamas = [LlamaRow(path, o, prompt[0].tolist()) for path in files]
    for llama in llamas:
        rows[f"llama.cpp {llama.row['format']}"] = llama.row
        runs[f"llama.cpp {llama.row['format']}"] = llama.run
    new = min(o.new_tokens, base.config.block_size - o.prompt_tokens)
    try:
        time_rows(rows, runs, new, o.rounds, CPU)
    finally:
        for llama in llamas:
            llama.proc.stdin.close()
            llama.proc.wait(timeout=60)
    return {"model": about, "prompt_tokens": o.prompt_tokens, "new_tokens": new,
            "rounds": o.rounds, "threads": torch.get_num_threads(), "rows": rows}


def quality_rows(o: DecodeOptions, path: str) -> list[dict]:
    """Per format: perplexity on fixed held-out batches and its change from the first format's,
    and how many of agreement_tokens greedy tokens after 16 held-out ones equal the first's."""
    base, cfg, _ = loading.load_model(path, "cpu")
    base.float().eval()
    block, new, out = base.config.block_size, o.agreement_tokens, []
    val = Batches(load_meta(cfg.data.dataset), "val", EVAL_BATCH_SIZE, block, 0, CPU.device)
    starts = val.fixed(o.eval_batches, seed=1)
    prompt = val.windows(starts[0])[0][:1, :16]
    for fmt in checks.comma_list(o.formats):
        model, note = prepared(base, fmt)
        ppl = math.exp(evaluate(model, {"val": val}, {"val": starts}, CPU)["val"])
        # past the context: the newest half re-read, as generate.py does
        tokens = generate_tokens(model, prompt, new, temperature=0)[0, -new:]
        first = out[0] if out else {"perplexity": ppl, "tokens": tokens}
        differ = (tokens != first["tokens"]).nonzero()
        out.append({"checkpoint": path, "dataset": cfg.data.dataset, "format": fmt,
                    "note": note, "params": base.num_params(False), "perplexity": ppl,
                    "change": ppl / first["perplexity"] - 1, "new_tokens": new,
                    "tokens": tokens, "same_tokens": int((tokens == first["tokens"]).sum()),
                    "first_difference": int(differ[0]) if len(differ) else None,
                    "eval_tokens": o.eval_batches * EVAL_BATCH_SIZE * block})
        print(f"  {path} {fmt}: perplexity {ppl:.4f} ({100 * out[-1]['change']:+.2f}%), "
              f"{out[-1]['same_tokens']}/{new} greedy tokens as the first", flush=True)
    return [{k: v for k, v in row.items() if k != "tokens"} for row in out]


def speed_markdown(s: dict) -> list[str]:
    """The speed table, bench.py decode's and bench.py memory's decode part's."""
    header = ["engine", "weights", "MiB a token", "tokens/s", "read GB/s at that size",
              "ceiling tokens/s", "share of ceiling", "time vs the first row",
              "greedy tokens as the first row"]
    rows = [[r["engine"], r["format"], f"{r['bytes'] / MIB:.0f}", f"{r['tok_per_s']:.1f}",
             f"{r['bandwidth'] / 1e9:.1f}", f"{r['ceiling']:.0f}", f"{100 * r['share']:.0f}%",
             f"{r['time_vs_first']:.2f}x", f"{r['same_tokens']}/{s['new_tokens']}"]
            for r in s["rows"].values()]
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
    parts = checks.check_list(o, "parts", ("speed", "quality"))
    for fmt in checks.comma_list(o.formats):
        if fmt not in packed.FORMATS[1:]:
            raise ConfigError(f"--formats: {fmt!r} is not one of {', '.join(packed.FORMATS[1:])}")
    if o.threads:
        torch.set_num_threads(o.threads)
    report = {"name": o.name, "machine": machine_line(CPU.device), "command": command}
    page = [f"# Decode benchmark ({o.name})", "", f"Machine: {report['machine']}", "",
            f"Command: `{command}`", ""]
    if "speed" in parts:
        report["speed"] = speed_part(o)
        page += speed_markdown(report["speed"])
    if "quality" in parts and o.quality:
        report["quality"] = [q for path in checks.comma_list(o.quality)
                             for q in quality_rows(o, path)]
        page += quality_markdown(report["quality"])
    print("\n".join(page))
    write_report(report, "\n".join(page), o.results, f"decode_{o.name}")
    return 0
