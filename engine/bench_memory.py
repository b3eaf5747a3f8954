"""The memory benchmark: what each memory strategy costs and saves on this machine.

    python bench_memory.py                        # every part, bench_cpu (CPU) / bench_gpu config
    python bench.py --memory                      # the same, through bench.py
    python bench_memory.py --part train --config gpt2_124m --batch_size=4
    python bench_memory.py --part quant --checkpoint out/shakespeare_char
    python bench_memory.py --part decode          # ours vs transformers' generate, GPT-2 124M
    python bench_memory.py --part train --rows baseline,checkpointing=all --time-budget 60

Parts:
  train   one row per setting (activation checkpointing modes, bfloat16 autocast, empty_cache and
          prefetch on CUDA), each in its own process: a few training steps with an evaluation
          between them; peak memory, tokens/s, and the start-up estimate beside the measured peak
  quant   int8 weight-only attention + MLP Linears (sample.quantize): weight bytes, batch-1
          decode tokens/s and the validation loss, float vs int8, of a trained model (trains a
          small one first unless --checkpoint is given)
  loader  batches/s read by the in-process loader and by 1 and 2 shared-memory workers
          (data.loader_workers), beside the batches/s the baseline training row consumes
  decode  batch-1 greedy decoding with the KV cache on GPT-2 124M-shaped weights (random, the
          same ones for both), ours vs transformers' generate in one process, against the
          memory-bandwidth limit (weight bytes read per token vs measured copy bandwidth);
          the transformers row needs transformers and the int8 row torchao: without them they
          are reported skipped (--decode-model tiny: a 2-layer model of the same vocabulary)

Peak memory is CUDA max allocated/reserved, or on CPU the process's peak RSS above its RSS after
start-up (the allocator's high-water mark, rougher). Results go to bench_results/memory_NAME.json
and .md.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from engine import memory, quantize
from engine import runtime
from engine.optim import make_optimizer
from engine.sources import build_model
from engine.step import evaluate, train_step
from engine import speedups
from config import Config, ConfigError, from_dict, load_config
from data.loader import Batches, DataError, load_meta

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
PARTS = ("train", "quant", "loader", "decode")
# (label, overrides, needs CUDA)
TRAIN_ROWS = [
    ("baseline", [], False),
    ("checkpointing=all", ["--activation_checkpointing=all"], False),
    ("checkpointing=attention", ["--activation_checkpointing=attention"], False),
    ("checkpointing=mlp", ["--activation_checkpointing=mlp"], False),
    ("checkpointing=every:2", ["--activation_checkpointing=every:2"], False),
    ("dtype=bfloat16", ["--dtype=bfloat16"], False),
    ("dtype+weights_dtype=bfloat16", ["--dtype=bfloat16", "--weights_dtype=bfloat16"], False),
    ("empty_cache=off", ["--empty_cache=false"], True),
    ("prefetch=on", ["--prefetch=true"], True),
]
# --decode-model: the shape of the random weights decoded (the same vocabulary, 50257)
DECODE_SHAPES = {
    "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(block_size=128, vocab_size=50257, n_layer=2, n_head=2, n_embd=64),
}


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def in_use(device: torch.device) -> int:
    """Bytes held now: CUDA allocated, or the process's RSS."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_now()


def peak_in_use(device: torch.device) -> int:
    peak = speedups.peak_memory(device)
    return peak["allocated"] if device.type == "cuda" else peak.get("rss", 0)


def one_step(model, optimizer, batches: Batches, batch: tuple, cfg: Config,
             rt: runtime.Runtime) -> tuple:
    """train.py's step (no gradient scaler: the rows run float32 or bfloat16); the next batch."""
    t = cfg.train
    scaler = torch.amp.GradScaler(rt.device.type, enabled=False)
    result = train_step(model, model, optimizer, scaler, batches, batch, rt, t.learning_rate,
                        t.grad_accum_steps, t.grad_clip)
    result.loss_sum.item()
    return result.next_batch


def train_row(cfg: Config, steps: int) -> dict:
    """Build as train.py does and take one step (AdamW's state appears); then `steps` steps, an
    evaluation (then empty_cache as configured) and `steps` more. Reports the peak over those
    above what was held before them (weights + AdamW state: the step's own memory), the whole
    peak, and tokens/s over the steps after the evaluation."""

    rt = runtime.setup(cfg.system)
    meta = load_meta(cfg.data.dataset)
    start = in_use(rt.device)
    model, _ = build_model(cfg, meta, rt.device)
    optimizer, _ = make_optimizer(model, cfg, rt.device)
    t = cfg.train
    batches = Batches(meta, "train", t.batch_size, cfg.model.block_size, cfg.system.seed,
                      rt.device, cfg.data.pin_memory, prefetch=cfg.data.prefetch)
    val = Batches(meta, "val", t.batch_size, cfg.model.block_size, cfg.system.seed, rt.device)
    model.train()
    batch = one_step(model, optimizer, batches, batches.next(), cfg, rt)
    rt.synchronize()
    resident = in_use(rt.device)
    speedups.reset_peak_memory(rt.device)
    times = []
    for i in range(2 * steps):
        if i == steps:
            evaluate(model, {"val": val}, {"val": val.fixed(2, seed=1)}, rt)
            memory.release_cached(rt.device, cfg.system.empty_cache)
        rt.synchronize()
        t0 = time.perf_counter()
        batch = one_step(model, optimizer, batches, batch, cfg, rt)
        rt.synchronize()
        if i >= steps:
            times.append(time.perf_counter() - t0)
    peak = peak_in_use(rt.device)
    e = memory.estimate(cfg)
    result = {"tokens_per_s": t.batch_size * t.grad_accum_steps * cfg.model.block_size
              / statistics.median(times),
              "step_peak": peak - resident, "peak": peak - start,
              "estimate_step": e.total - e.weights - e.optimizer, "estimate": e.total}
    if rt.device.type == "cuda":
        result["reserved"] = torch.cuda.max_memory_reserved(rt.device)
    return result


def run_in_process(kind: str, spec: dict, timeout: float | None = None) -> dict:
    """One row in a fresh Python process: its own peak memory, nothing cached from before.
    Stopped after timeout seconds (what is left of --time-budget)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps({"kind": kind, **spec}))
        # large CPU buffers straight from mmap, so freed tensors leave the RSS at once and the
        # peak RSS follows live tensors (glibc otherwise keeps freed memory in its heap)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        try:
            proc = subprocess.run([sys.executable, "-m", "engine.bench_memory", "--worker", str(path)],
                                  cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                                  timeout=None if timeout is None else max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            return {"status": "failed",
                    "reason": f"stopped after {max(timeout, 1.0):.0f} s: the --time-budget ran out"}
        out = Path(tmp) / "result.json"
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"status": "failed", "reason": " | ".join(tail)}
        return {"status": "ok", **json.loads(out.read_text())}


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    cfg = from_dict(spec["config"])
    if spec["kind"] == "train":
        result = train_row(cfg, spec["steps"])
    else:
        raise ValueError(spec["kind"])
    (Path(spec_path).parent / "result.json").write_text(json.dumps(result))
    return 0


def train_rows(chosen: str) -> list[tuple[str, list[str], bool]]:
    """TRAIN_ROWS, or the ones --rows names (a comma list of their labels)."""
    if not chosen:
        return TRAIN_ROWS
    labels = [label for label, _, _ in TRAIN_ROWS]
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    unknown = [n for n in names if n not in labels]
    if unknown or not names:
        raise ConfigError(f"--rows={chosen!r}: {unknown or 'nothing'} is not a row; use a comma "
                          f"list of {', '.join(labels)}")
    return [row for row in TRAIN_ROWS if row[0] in names]


def bench_train(argv: list[str], steps: int, device: torch.device,
                rows_wanted: list[tuple[str, list[str], bool]] = TRAIN_ROWS,
                time_left: Callable[[], float | None] = lambda: None) -> list[dict]:
    rows = []
    for label, overrides, needs_cuda in rows_wanted:
        left = time_left()
        if needs_cuda and device.type != "cuda":
            rows.append({"setting": label, "status": "needs CUDA"})
        elif left is not None and left <= 0:
            rows.append({"setting": label, "status": "skipped",
                         "reason": "the --time-budget ran out before this row"})
        else:
            cfg, _ = load_config(argv + overrides, prog="bench_memory.py")
            result = run_in_process("train", {"config": cfg.to_dict(), "steps": steps}, left)
            rows.append({"setting": label, **result})
        print(f"  train {label}: {row_text(rows[-1])}", flush=True)
    return rows


def row_text(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']} {row.get('reason', '')}"
    return (f"{row['tokens_per_s']:,.0f} tok/s, step peak {row['step_peak'] / MIB:,.0f} MiB "
            f"(estimate {row['estimate_step'] / MIB:,.0f}), whole peak {row['peak'] / MIB:,.0f} "
            f"MiB (estimate {row['estimate'] / MIB:,.0f})")


@torch.no_grad()
def decode_rate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int,
                rt: runtime.Runtime) -> tuple[float, torch.Tensor]:
    """Batch-1 greedy decoding with our KV cache: (tokens/s after the prompt, the tokens)."""
    from generate import generate_tokens

    generate_tokens(model, prompt, 4, temperature=0, autocast=rt.autocast)  # warm-up
    rt.synchronize()
    t0 = time.perf_counter()
    out = generate_tokens(model, prompt, new_tokens, temperature=0, autocast=rt.autocast)
    rt.synchronize()
    return new_tokens / (time.perf_counter() - t0), out


def copy_bandwidth(device: torch.device, mib: int = 256) -> float:
    """Bytes/s of a large device-memory copy (read + write), the best of a few."""
    src = torch.empty(mib * MIB // 4, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t0))
    return best


def trained_model(args, cfg: Config, rt: runtime.Runtime):
    """The checkpoint to score, or a small model trained here for args.quant_steps steps."""
    from engine import checkpoint
    import train

    if args.checkpoint:
        model, stored, _ = checkpoint.load_model(args.checkpoint, rt.device)
        return model, stored
    cfg = copy.deepcopy(cfg)
    out = tempfile.mkdtemp(prefix="bench_memory_")
    cfg.train.out_dir, cfg.train.max_iters = out, args.quant_steps
    cfg.train.eval_interval, cfg.train.log_interval = args.quant_steps, args.quant_steps
    cfg.train.warmup_iters, cfg.train.init_from = min(20, args.quant_steps), "scratch"
    cfg.system.compile = False
    print(f"  quant: training {args.quant_steps} steps to have a model to quantize ...",
          flush=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            train.train(cfg)
        model, stored, _ = checkpoint.load_model(out, rt.device)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return model, stored


def bench_quant(args, cfg: Config, rt: runtime.Runtime) -> dict:

    model, stored = trained_model(args, cfg, rt)
    model.eval()
    meta = load_meta(stored.data.dataset)
    val = Batches(meta, "val", 8, model.config.block_size, 0, rt.device)
    eval_set = {"val": val.fixed(args.eval_batches, seed=1)}
    prompt = torch.zeros((1, 1), dtype=torch.long, device=rt.device)
    new = min(args.decode_tokens, model.config.block_size - 1)
    rows = {}
    for label in ("float32", "int8"):
        if label == "int8":
            chosen = quantize.quantize_linears(model, args.quantize_layers)
        rate, _ = decode_rate(model, prompt, new, rt)
        rows[label] = {"weight_bytes": quantize.weight_bytes(model), "decode_tokens_per_s": rate,
                       "val_loss": evaluate(model, {"val": val}, eval_set, rt)["val"]}
        print(f"  quant {label}: {rows[label]}", flush=True)
    return {"layers": args.quantize_layers, "quantized": len(chosen),
            "params": model.num_params(False), "rows": rows}


def bench_loader(cfg: Config, args, trainer_rows: list[dict] | None) -> dict:
    """Batches/s the in-process loader and the shared-memory workers produce (data reading
    alone, nothing else running), beside what the trainer consumes (the baseline train row)."""
    from data.workers import SharedMemoryBatches

    meta = load_meta(cfg.data.dataset)
    t = cfg.train

    def rate(loader, n: int = args.loader_batches) -> float:
        loader.next()  # first batch: worker start-up is not throughput
        t0 = time.perf_counter()
        for _ in range(n):
            loader.next()
        return n / (time.perf_counter() - t0)

    make = lambda: Batches(meta, "train", t.batch_size, cfg.model.block_size, cfg.system.seed)
    rows = {"in-process": rate(make())}
    for workers in (1, 2):
        shared = SharedMemoryBatches(make(), meta, "train", workers)
        try:
            rows[f"{workers} worker(s)"] = rate(shared)
        finally:
            shared.close()
    baseline = next((r for r in trainer_rows or [] if r.get("setting") == "baseline"
                     and r["status"] == "ok"), None)
    consumed = (baseline["tokens_per_s"] / (t.batch_size * cfg.model.block_size)
                if baseline else None)
    result = {"batch": [t.batch_size, cfg.model.block_size], "batches_per_s": rows,
              "trainer_batches_per_s": consumed}
    print(f"  loader: {result}", flush=True)
    return result


def hf_decode(ours: torch.nn.Module, prompt: torch.Tensor, new: int,
              rt: runtime.Runtime) -> dict:
    """transformers' GPT2LMHeadModel.generate on our weights, batch 1, greedy, with its cache."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        print(f"  decode transformers: skipped: transformers is not installed ({e})", flush=True)
        return {"hf_skipped": "transformers is not installed"}
    import load_gpt2_weights

    hf = GPT2LMHeadModel(GPT2Config(**load_gpt2_weights.hf_config(ours.config)))
    missing, _ = hf.load_state_dict(load_gpt2_weights.ours_to_hf(ours), strict=False)
    hf = hf.to(rt.device).eval()
    kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, use_cache=True,
                  pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        hf.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        rt.synchronize()
        t0 = time.perf_counter()
        tokens = hf.generate(prompt, **kwargs)
        rt.synchronize()
    return {"hf_tokens_per_s": new / (time.perf_counter() - t0), "hf_tokens": tokens,
            "hf_missing_keys": [k for k in missing  # buffers, and the head HF ties itself
                                if not k.endswith("attn.bias") and k != "lm_head.weight"]}


def int8_decode(ours: torch.nn.Module, prompt: torch.Tensor, new: int, rt: runtime.Runtime,
                layers: str, our_tokens: torch.Tensor) -> dict:
    """Our decoding again with the chosen block Linears in int8 (torchao); changes `ours`."""
    try:
        quantize.quantize_linears(ours, layers)
    except ConfigError as e:  # the layer names were checked at start: torchao is missing
        print(f"  decode int8: skipped: {e}", flush=True)
        return {"int8_skipped": str(e), "int8_layers": layers}
    rate, tokens = decode_rate(ours, prompt, new, rt)
    return {"int8_tokens_per_s": rate, "int8_layers": layers,
            "int8_weight_bytes_per_token": quantize.weight_bytes(ours)
            - ours.transformer.wpe.weight.numel() * 4,
            "int8_same_tokens": int(torch.eq(tokens, our_tokens).sum()) - prompt.numel()}


def bench_decode(args, rt: runtime.Runtime) -> dict:
    """Ours vs transformers' generate on the same GPT-2 124M-shaped weights, batch 1, greedy."""
    from config import ModelConfig
    from model import GPT

    torch.manual_seed(0)
    m = ModelConfig(**DECODE_SHAPES[args.decode_model], attention="sdpa",
                    causal_mask="on_the_fly", norm="native", gelu="native")
    ours = GPT(m).to(rt.device).eval()
    prompt = torch.randint(0, m.vocab_size, (1, args.prompt_tokens), device=rt.device)
    new = min(args.decode_tokens, m.block_size - args.prompt_tokens)
    our_rate, our_tokens = decode_rate(ours, prompt, new, rt)
    weight = quantize.weight_bytes(ours) - ours.transformer.wpe.weight.numel() * 4  # wpe: 1 row
    bandwidth = copy_bandwidth(rt.device)
    hf = hf_decode(ours, prompt, new, rt)
    hf_tokens = hf.pop("hf_tokens", None)
    result = {"model": args.decode_model, "device": rt.device.type,
              "params": ours.num_params(False), "weight_bytes_per_token": weight,
              "copy_bandwidth": bandwidth, "bandwidth_limit_tokens_per_s": bandwidth / weight,
              "ours_tokens_per_s": our_rate, **hf,
              "same_tokens": None if hf_tokens is None else bool(torch.equal(our_tokens,
                                                                             hf_tokens)),
              "prompt_tokens": args.prompt_tokens, "new_tokens": new}
    result.update(int8_decode(ours, prompt, new, rt, args.quantize_layers, our_tokens))
    print(f"  decode: {result}", flush=True)
    return result


def markdown(report: dict) -> str:
    lines = [f"Memory benchmark on {report['hardware']} (`{report['command']}`)", ""]
    if "train" in report:
        lines += ["| setting | tokens/s | step peak MiB (estimate) | whole peak MiB (estimate) |",
                  "|---|---:|---:|---:|"]
        for row in report["train"]:
            if row["status"] != "ok":
                why = f": {row['reason']}" if row.get("reason") else ""
                lines.append(f"| {row['setting']} | {row['status']}{why} | | |")
                continue
            lines.append(f"| {row['setting']} | {row['tokens_per_s']:,.0f} | "
                         f"{row['step_peak'] / MIB:,.0f} ({row['estimate_step'] / MIB:,.0f}) | "
                         f"{row['peak'] / MIB:,.0f} ({row['estimate'] / MIB:,.0f}) |")
        lines.append("")
    if "quant" in report:
        q = report["quant"]
        lines += [f"int8 weight-only ({q['layers']}, {q['quantized']} Linears, "
                  f"{q['params'] / 1e6:.2f}M-parameter model):", "",
                  "| weights | bytes | decode tok/s (batch 1) | val loss |", "|---|---:|---:|---:|"]
        for label, r in q["rows"].items():
            lines.append(f"| {label} | {r['weight_bytes'] / MIB:,.2f} MiB | "
                         f"{r['decode_tokens_per_s']:,.0f} | {r['val_loss']:.4f} |")
        lines.append("")
    if "loader" in report:
        lo = report["loader"]
        lines += [f"Batches of {lo['batch'][0]}x{lo['batch'][1]} tokens produced per second "
                  "(reading alone):", "", "| producer | batches/s |", "|---|---:|"]
        lines += [f"| {k} | {v:,.0f} |" for k, v in lo["batches_per_s"].items()]
        if lo["trainer_batches_per_s"]:
            consumed = lo["trainer_batches_per_s"]
            lines.append(f"| trainer consumes (baseline row) | {consumed:,.1f} |")
        lines.append("")
    if "decode" in report:
        d = report["decode"]
        shape = "GPT-2 124M shape" if d.get("model", "gpt2") == "gpt2" else \
            f"{d['params'] / 1e6:.1f}M-parameter '{d['model']}' shape"
        lines += [f"Batch-1 greedy decode, {shape}, {d['prompt_tokens']}-token prompt, "
                  f"{d['new_tokens']} new tokens (same tokens from both: {d['same_tokens']}):", "",
                  "| implementation | tokens/s | share of the bandwidth limit |", "|---|---:|---:|"]
        limit = d["bandwidth_limit_tokens_per_s"]
        for label, key in (("ours (KV cache)", "ours_tokens_per_s"),
                           ("transformers generate", "hf_tokens_per_s")):
            if key in d:
                lines.append(f"| {label} | {d[key]:,.1f} | {100 * d[key] / limit:.0f}% |")
        if "hf_skipped" in d:
            lines.append(f"| transformers generate | skipped: {d['hf_skipped']} | |")
        if "int8_skipped" in d:
            lines.append(f"| ours, int8 {d.get('int8_layers', '')} | skipped: "
                         f"{d['int8_skipped']} | |")
        if "int8_tokens_per_s" in d:
            int8_limit = d["copy_bandwidth"] / d["int8_weight_bytes_per_token"]
            int8_mib = d["int8_weight_bytes_per_token"] / MIB
            lines.append(f"| ours, int8 {d['int8_layers']} ({int8_mib:,.0f} MiB/token; {d['int8_same_tokens']}/{d['new_tokens']} greedy tokens "
                         f"as float) | {d['int8_tokens_per_s']:,.1f} | "
                         f"{100 * d['int8_tokens_per_s'] / int8_limit:.0f}% of its own "
                         f"{int8_limit:,.1f} |")
        lines.append(f"| limit: {d['copy_bandwidth'] / 1e9:.1f} GB/s copy bandwidth / "
                     f"{d['weight_bytes_per_token'] / MIB:,.0f} MiB of weights per token | "
                     f"{limit:,.1f} | 100% |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="bench_memory.py", allow_abbrev=False,
                                description="Memory strategies: peak memory and speed.",
                                epilog="Other arguments are config overrides, as for train.py.")
    p.add_argument("--part", default=",".join(PARTS), help=f"a comma list of {', '.join(PARTS)}")
    p.add_argument("--loader-batches", type=int, default=200, help="loader: batches timed")
    p.add_argument("--steps", type=int, default=3, help="train: steps before and after the eval")
    p.add_argument("--checkpoint", default="", help="quant: the trained model to quantize")
    p.add_argument("--quant-steps", type=int, default=300,
                   help="quant: training steps when no --checkpoint is given")
    p.add_argument("--quantize-layers", default="attn,mlp", help="quant: sample.quantize_layers")
    p.add_argument("--eval-batches", type=int, default=20, help="quant: val batches of 8")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode run")
    p.add_argument("--decode-model", default="gpt2", choices=sorted(DECODE_SHAPES),
                   help="decode: the shape of the random weights (gpt2: GPT-2 124M)")
    p.add_argument("--rows", default="", metavar="LABEL,...",
                   help="train: only these rows (" + ", ".join(r[0] for r in TRAIN_ROWS) + ")")
    p.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                   help="train: stop a row still running after this many seconds in all and "
                        "skip the rest (default: no limit)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="decode: prompt length")
    p.add_argument("--results", default="bench_results", help="output folder")
    p.add_argument("--name", default="", help="output file stem after memory_ (default: device)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    try:
        if not set(parts) <= set(PARTS) or not parts:
            raise ConfigError(f"--part={args.part!r}: use a comma list of {', '.join(PARTS)}")
        rows_wanted = train_rows(args.rows)
        quantize.quantize_targets(args.quantize_layers)
        device = runtime.resolve_device(load_config(rest)[0].system.device)
        if not any(a.startswith("--config") for a in rest):
            rest = ["--config", "bench_gpu" if device.type == "cuda" else "bench_cpu"] + rest
        cfg, _ = load_config(rest, prog="bench_memory.py")
        rt = runtime.setup(cfg.system)
        import bench
        bench.ensure_dataset(cfg)
    except (ConfigError, DataError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"hardware": runtime.device_name(rt), "command": "python bench_memory.py "
              + shlex.join(argv), "config": cfg.to_dict()}
    deadline = time.monotonic() + args.time_budget if args.time_budget else None

    def time_left() -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    if "train" in parts:
        report["train"] = bench_train(rest, args.steps, rt.device, rows_wanted, time_left)
    if "quant" in parts:
        report["quant"] = bench_quant(args, cfg, rt)
    if "loader" in parts:
        report["loader"] = bench_loader(cfg, args, report.get("train"))
    if "decode" in parts:
        report["decode"] = bench_decode(args, rt)
    text = markdown(report)
    print("\n" + text)
    folder = REPO_ROOT / args.results
    folder.mkdir(parents=True, exist_ok=True)
    stem = "memory_" + (args.name or rt.device.type)
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (folder / f"{stem}.md").write_text(text)
    print(f"wrote {folder / stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
