"""The memory benchmark, `python bench.py --memory [--part train,quant,loader,decode]`: train:
peak memory and tokens/s per setting, beside the estimate; quant: an int8 model's bytes, decode
tok/s, val loss; loader: batches/s; decode: batch-1 tok/s, ours vs transformers, against the
memory-bandwidth limit. Output: RESULTS/memory_NAME.{json,md}."""
from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from config import Config, ConfigError, from_dict, load_config
from data.loader import Batches, load_meta
from engine import checkpoint, memory, quantize, runtime
from engine import hf as hf_weights
from engine.benchmark import (REPO_ROOT, build, hardware_name, markdown_table, run_worker, serve,
                              stepper, time_left, timed)
from engine.sampling import generate_tokens, huge_pages_for, set_matvec, set_weight_layout
from engine.step import evaluate
from model import GPT, ModelConfig, decode_linear

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
DECODE_ROUNDS = 5  # decode: ours and transformers take turns this many times; medians reported
TRAIN_HEADER = ["setting", "tokens/s", "step peak MiB (estimate)", "ratio",
                "whole peak MiB (estimate)", "ratio", "reserved MiB"]
# --decode-model: the shape of the random weights decoded (the same vocabulary, 50257)
DECODE_SHAPES = {
    "gpt2": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(block_size=128, vocab_size=50257, n_layer=2, n_head=2, n_embd=64),
}


def held(device: torch.device) -> int:
    """Bytes held now (CUDA allocated, or the RSS), with the peak reset to them."""
    memory.reset_peak_memory(device)
    return memory.peak_memory(device).get("allocated", memory.peak_memory(device).get("rss", 0))


def train_row(spec: dict) -> dict:
    """Build as train.py does, one step (AdamW's state appears), `steps` steps, an evaluation
    (then empty_cache as configured), `steps` more: the peak above what was held before them
    (the step's own memory), the peak above start-up, and tokens/s after the evaluation."""
    cfg, steps = from_dict(spec["config"]), spec["steps"]
    rt = runtime.setup(cfg.system)
    start = held(rt.device)
    parts, _ = build(cfg, rt)
    t = cfg.train
    val = Batches(parts["meta"], "val", t.batch_size, cfg.model.block_size, cfg.system.seed,
                  rt.device)
    step = stepper(parts, cfg, rt)
    parts["model"].train()
    timed(lambda: step(t.learning_rate), rt)
    resident = held(rt.device)
    times = []
    for i in range(2 * steps):
        if i == steps:
            evaluate(parts["model"], {"val": val}, {"val": val.fixed(2, seed=1)}, rt)
            memory.release_cached(rt.device, cfg.system.empty_cache)
        seconds, _ = timed(lambda: step(t.learning_rate), rt)
        times.append(seconds)
    peak = memory.peak_memory(rt.device)
    top, e = peak.get("allocated", peak.get("rss", 0)), memory.estimate(cfg)
    return {"tokens_per_s": t.batch_size * t.grad_accum_steps * cfg.model.block_size
            / statistics.median(times[steps:]), "step_peak": top - resident, "peak": top - start,
            "estimate_step": e.total - e.weights - e.optimizer, "estimate": e.total,
            **{k: v for k, v in peak.items() if k == "reserved"}}


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


def train_cells(r: dict) -> list[str]:
    """A train row as the cells of TRAIN_HEADER."""
    if r["status"] != "ok":
        why = r.get("reason") or r.get("error", "")
        return [r["setting"], f"{r['status']}{': ' + why if why else ''}", *[""] * 5]
    return [r["setting"], f"{r['tokens_per_s']:,.0f}",
            f"{r['step_peak'] / MIB:,.0f} ({r['estimate_step'] / MIB:,.0f})",
            f"{r['step_peak'] / r['estimate_step']:.2f}",
            f"{r['peak'] / MIB:,.0f} ({r['estimate'] / MIB:,.0f})",
            f"{r['peak'] / r['estimate']:.2f}",
            f"{r['reserved'] / MIB:,.0f}" if "reserved" in r else "-"]


def bench_train(config_args: list[str], opts, device: torch.device, left) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for i, (label, overrides, needs_cuda) in enumerate(train_rows(opts.rows)):
            if needs_cuda and device.type != "cuda":
                rows.append({"setting": label, "status": "needs CUDA"})
            elif left() <= 0:
                rows.append({"setting": label, "status": "skipped",
                             "reason": "the --time-budget ran out before this row"})
            else:
                cfg, _ = load_config(config_args + overrides, prog="bench.py")
                # large CPU buffers straight from mmap, so freed tensors leave the RSS at once
                # and the peak RSS follows live tensors (glibc keeps freed memory in its heap)
                result = run_worker("engine.bench_memory", {
                    "kind": "train", "config": cfg.to_dict(), "steps": opts.steps},
                    Path(tmp), f"train{i}", left(), env={"MALLOC_MMAP_THRESHOLD_": "65536"})
                rows.append({"setting": label, **result})
            cells = train_cells(rows[-1])
            print(f"  train {label}: " + (", ".join(f"{h} {c}" for h, c in zip(
                TRAIN_HEADER[1:], cells[1:])) if rows[-1]["status"] == "ok" else cells[1]),
                flush=True)
    return rows


def our_generate(model: GPT, prompt: torch.Tensor, rt: runtime.Runtime, lean: bool = True,
                 sliced: bool | None = None):
    """run(n): n greedy tokens after the prompt, with our KV cache; lean=False: each token
    through forward() instead of GPT.decode_one; sliced: one slice per thread (True) or one
    F.linear (False) for the run instead of the model's matvec_slices."""
    def run(n: int) -> torch.Tensor:
        kept = model.matvec_slices
        if sliced is not None:
            model.matvec_slices = torch.get_num_threads() if sliced else 1
        try:
            return generate_tokens(model, prompt, n, temperature=0, autocast=rt.autocast,
                                   lean=lean)
        finally:
            model.matvec_slices = kept
    return run


def decode_rates(runs: dict, new_tokens: int, rt: runtime.Runtime,
                 rounds: int = DECODE_ROUNDS) -> dict[str, tuple[float, torch.Tensor, list]]:
    """name -> (median tokens/s after the prompt, the tokens, each round's seconds) of each
    run(n) generating n tokens, the runs taking turns round by round (A B A B: load on the
    machine hits each alike); run(4) first, to warm up."""
    for run in runs.values():
        run(4)
    seconds, tokens = {name: [] for name in runs}, {}
    for _ in range(rounds):
        for name, run in runs.items():
            took, tokens[name] = timed(lambda: run(new_tokens), rt)
            seconds[name].append(took)
    return {name: (new_tokens / statistics.median(s), tokens[name], s)
            for name, s in seconds.items()}


def round_ratio(rates: dict, fast: str, slow: str) -> float:
    """The median over rounds of slow's time / fast's in the same round (side by side)."""
    return statistics.median(b / a for a, b in zip(rates[fast][2], rates[slow][2]))


def decode_rate(model: GPT, prompt: torch.Tensor, new_tokens: int,
                rt: runtime.Runtime) -> tuple[float, torch.Tensor]:
    """(tokens/s after the prompt, the tokens) of our batch-1 greedy decoding."""
    return decode_rates({"ours": our_generate(model, prompt, rt)}, new_tokens, rt)["ours"][:2]


@torch.no_grad()
def matvec_seconds(models: dict[str, GPT], rt: runtime.Runtime, rounds: int = 5,
                   compare_blas: bool = False) -> dict:
    """name -> median seconds of one token's matrix-vector products alone (every Linear, the
    LM head included, on a fixed random input, as GPT.decode_one multiplies them), the models
    taking turns round by round; compare_blas adds 'blas': the first model through F.linear."""
    linears = {name: [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
               for name, model in models.items()}
    slices = {name: model.matvec_slices for name, model in models.items()}
    if compare_blas:
        first = next(iter(models))
        linears["blas"], slices["blas"] = linears[first], 1
    inputs = [torch.randn(1, 1, m.in_features, device=rt.device) for m in next(iter(
        linears.values()))]
    run = lambda mods, k: [decode_linear(m, x, k) for m, x in zip(mods, inputs)]  # noqa: E731
    seconds = {name: [] for name in linears}
    for _ in range(rounds):
        for name, mods in linears.items():
            seconds[name].append(timed(lambda: run(mods, slices[name]), rt)[0])
    return {name: statistics.median(s[1:]) for name, s in seconds.items()}  # round 1: warm-up


def bytes_per_token(model: GPT) -> int:
    """The weight bytes one decoded token reads: all but the position table (one row of it)."""
    return quantize.weight_bytes(model) - model.transformer.wpe.weight.numel() * 4


def trained_model(opts, config_args: list[str], rt: runtime.Runtime):
    """The checkpoint to score, or a small model train.py trains for --quant-steps steps."""
    if opts.checkpoint:
        return checkpoint.load_model(opts.checkpoint, rt.device)[:2]
    n = opts.quant_steps
    print(f"  quant: training {n} steps to have a model to quantize ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_memory_", ignore_cleanup_errors=True) as out:
        proc = subprocess.run([sys.executable, "train.py", *config_args, f"--out_dir={out}",
                               f"--max_iters={n}", f"--eval_interval={n}", f"--log_interval={n}",
                               f"--warmup_iters={min(20, n)}", "--init_from=scratch",
                               "--compile=false"], cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("train.py failed: " + (proc.stderr or proc.stdout)[-500:])
        return checkpoint.load_model(out, rt.device)[:2]


def bench_quant(opts, config_args: list[str], rt: runtime.Runtime) -> dict:
    model, stored = trained_model(opts, config_args, rt)
    model.eval()
    val = Batches(load_meta(stored.data.dataset), "val", 8, model.config.block_size, 0, rt.device)
    eval_set = {"val": val.fixed(opts.eval_batches, seed=1)}
    prompt = torch.zeros((1, 1), dtype=torch.long, device=rt.device)
    new = min(opts.decode_tokens, model.config.block_size - 1)
    rows, chosen = {}, []
    for label in ("float32", "int8"):
        if label == "int8":
            chosen = quantize.quantize_linears(model, opts.quantize_layers)
        rate, _ = decode_rate(model, prompt, new, rt)
        rows[label] = {"weight_bytes": quantize.weight_bytes(model), "decode_tokens_per_s": rate,
                       "val_loss": evaluate(model, {"val": val}, eval_set, rt)["val"]}
        print(f"  quant {label}: {rows[label]}", flush=True)
    return {"layers": opts.quantize_layers, "quantized": len(chosen),
            "params": model.num_params(False), "rows": rows}


def quant_markdown(q: dict) -> list[str]:
    rows = [[label, f"{r['weight_bytes'] / MIB:,.2f} MiB", f"{r['decode_tokens_per_s']:,.0f}",
             f"{r['val_loss']:.4f}"] for label, r in q["rows"].items()]
    return [f"int8 weight-only ({q['layers']}, {q['quantized']} Linears, {q['params'] / 1e6:.2f}M"
            "-parameter model):", "",
            markdown_table(["weights", "bytes", "decode tok/s (batch 1)", "val loss"], rows), ""]


def bench_loader(cfg: Config, opts, trainer_rows: list[dict] | None) -> dict:
    """Batches/s the in-process loader and the shared-memory workers produce (data reading
    alone, nothing else running), beside what the trainer consumes (the baseline train row)."""
    from data.workers import SharedMemoryBatches

    meta, t = load_meta(cfg.data.dataset), cfg.train

    def rate(loader) -> float:
        loader.next()  # first batch: worker start-up is not throughput
        t0 = time.perf_counter()
        for _ in range(opts.loader_batches):
            loader.next()
        return opts.loader_batches / (time.perf_counter() - t0)

    make = lambda: Batches(meta, "train", t.batch_size, cfg.model.block_size,  # noqa: E731
                           cfg.system.seed)
    rows = {"in-process": rate(make())}
    for workers in (1, 2):
        shared = SharedMemoryBatches(make(), meta, "train", workers)
        try:
            rows[f"{workers} worker(s)"] = rate(shared)
        finally:
            shared.close()
    baseline = next((r for r in trainer_rows or [] if r.get("setting") == "baseline"
                     and r["status"] == "ok"), None)
    result = {"batch": [t.batch_size, cfg.model.block_size], "batches_per_s": rows,
              "trainer_batches_per_s": baseline["tokens_per_s"] / (
                  t.batch_size * cfg.model.block_size) if baseline else None}
    print(f"  loader: {result}", flush=True)
    return result


def loader_markdown(lo: dict) -> list[str]:
    rows = [[k, f"{v:,.0f}"] for k, v in lo["batches_per_s"].items()]
    if lo["trainer_batches_per_s"]:
        rows.append(["trainer consumes (baseline row)", f"{lo['trainer_batches_per_s']:,.1f}"])
    return [f"Batches of {lo['batch'][0]}x{lo['batch'][1]} tokens produced per second (reading "
            "alone):", "", markdown_table(["producer", "batches/s"], rows), ""]


def hf_generate(ours: GPT, prompt: torch.Tensor, rt: runtime.Runtime) -> tuple[object, dict]:
    """(run(n), notes): transformers' GPT2LMHeadModel.generate on our weights, batch 1, greedy,
    with its cache; run is None where transformers is not installed."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        print(f"  decode transformers: skipped: transformers is not installed ({e})", flush=True)
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


def int8_decode(ours: GPT, prompt: torch.Tensor, new: int, rt: runtime.Runtime, layers: str,
                our_tokens: torch.Tensor) -> dict:
    """Our decoding again with the chosen block Linears in int8 (torchao) and the rest in the
    auto weight layout, as generate.py --quantize=int8 runs; changes `ours`."""
    try:
        quantize.quantize_linears(ours, layers)
    except ConfigError as e:  # the layer names were checked at start: torchao is missing
        print(f"  decode int8: skipped: {e}", flush=True)
        return {"int8_skipped": str(e), "int8_layers": layers}
    set_weight_layout(ours, "auto", huge_pages=True)
    rate, tokens = decode_rate(ours, prompt, new, rt)
    return {"int8_tokens_per_s": rate, "int8_layers": layers,
            "int8_weight_bytes_per_token": bytes_per_token(ours),
            "int8_same_tokens": int(torch.eq(tokens, our_tokens).sum()) - prompt.numel()}


def bench_decode(opts, rt: runtime.Runtime) -> dict:
    """Ours vs transformers' generate on the same random weights, batch 1, greedy."""
    torch.manual_seed(0)
    m = ModelConfig(**DECODE_SHAPES[opts.decode_model], attention="sdpa",
                    causal_mask="on_the_fly", norm="native", gelu="native")
    ours = GPT(m).to(rt.device).eval()
    prompt = torch.randint(0, m.vocab_size, (1, opts.prompt_tokens), device=rt.device)
    new = min(opts.decode_tokens, m.block_size - opts.prompt_tokens)
    src = torch.empty(256 * MIB // 4, device=rt.device)  # copy bandwidth: read + write, best of 5
    dst, weight = torch.empty_like(src), bytes_per_token(ours)
    bandwidth = max(2 * src.numel() * 4 / timed(lambda: dst.copy_(src), rt)[0] for _ in range(5))
    hf_run, hf = hf_generate(ours, prompt, rt)
    # as generate.py does; beside it the same with one change each: F.linear products, copies
    # as trained (row-major) and in 4 KiB pages
    huge, huge_note = huge_pages_for(True, rt.device)
    layout = set_weight_layout(ours, "auto", huge_pages=True)
    matvec = set_matvec(ours, "auto")
    row_major = copy.deepcopy(ours) if layout != "row" else None
    if row_major is not None:
        set_weight_layout(row_major, "row")  # a deep copy: 4 KiB pages
    small_pages = copy.deepcopy(ours) if huge else None
    runs = {"ours": our_generate(ours, prompt, rt), "hf": hf_run,
            "blas": matvec == "sliced" and our_generate(ours, prompt, rt, sliced=False),
            "forward": our_generate(ours, prompt, rt, lean=False),
            "row": row_major and our_generate(row_major, prompt, rt),
            "small_pages": small_pages and our_generate(small_pages, prompt, rt)}
    rates = decode_rates({name: run for name, run in runs.items() if run}, new, rt)
    if row_major is not None:
        hf["matvec_seconds"] = matvec_seconds(
            {"ours": ours, "row": row_major, **({"small_pages": small_pages} if huge else {})},
            rt, compare_blas=matvec == "sliced")
    hf.update(huge_pages=huge_note, matvec=matvec)
    our_rate, our_tokens, _ = rates["ours"]
    for name in ("hf", "blas", "forward", "row", "small_pages"):  # tok/s, ours' speed-up
        if name in rates:
            hf[f"{name}_tokens_per_s"] = rates[name][0]
            hf[f"over_{name}"] = round_ratio(rates, "ours", name)
    same = all(torch.equal(our_tokens, tokens) for _, tokens, _ in rates.values())
    result = {"model": opts.decode_model, "device": rt.device.type,
              "params": ours.num_params(False), "weight_bytes_per_token": weight,
              "copy_bandwidth": bandwidth, "bandwidth_limit_tokens_per_s": bandwidth / weight,
              "weight_layout": layout, "ours_tokens_per_s": our_rate, **hf, "same_tokens": same,
              "prompt_tokens": opts.prompt_tokens, "new_tokens": new, "rounds": DECODE_ROUNDS,
              **int8_decode(row_major or ours, prompt, new, rt, opts.quantize_layers, our_tokens)}
    print(f"  decode: {result}", flush=True)
    return result


def decode_markdown(d: dict) -> list[str]:
    limit = d["bandwidth_limit_tokens_per_s"]
    row = lambda name, key, limit=limit, of="": [  # noqa: E731
        name, f"{d[key]:,.1f}", f"{100 * d[key] / limit:.0f}%{of}"] if key in d else \
        [name, f"skipped: {d.get(key.split('_')[0] + '_skipped', '')}", ""]
    extra = "".join(f", {name} {d[key]}" for key, name in (
        ("huge_pages", "huge pages"), ("matvec", "matvec")) if key in d)
    rows = [row(f"ours (KV cache, {d.get('weight_layout', 'row')} weight layout{extra}, "
                "decode_one)", "ours_tokens_per_s"), row("transformers generate", "hf_tokens_per_s")]
    if "small_pages_tokens_per_s" in d:
        rows.insert(1, row("ours, the same weights in 4 KiB pages", "small_pages_tokens_per_s"))
    if "row_tokens_per_s" in d:
        rows.insert(1, row("ours, row-major weights (as trained)", "row_tokens_per_s"))
    if "forward_tokens_per_s" in d:
        rows.insert(1, row("ours, each token through forward() (not GPT.decode_one)",
                           "forward_tokens_per_s"))
    if "blas_tokens_per_s" in d:
        rows.insert(1, row("ours, one F.linear per weight (matvec blas)", "blas_tokens_per_s"))
    if "int8_tokens_per_s" in d:
        per_token = d["int8_weight_bytes_per_token"]
        own = d["copy_bandwidth"] / per_token
        rows.append(row(f"ours, int8 {d['int8_layers']} ({per_token / MIB:,.0f} MiB/token; "
                        f"{d['int8_same_tokens']}/{d['new_tokens']} greedy tokens as float)",
                        "int8_tokens_per_s", own, f" of its own {own:,.1f}"))
    else:
        rows.append(row(f"ours, int8 {d['int8_layers']}", "int8_tokens_per_s"))
    rows.append([f"limit: {d['copy_bandwidth'] / 1e9:.1f} GB/s copy bandwidth / "
                 f"{d['weight_bytes_per_token'] / MIB:,.0f} MiB of weights per token",
                 f"{limit:,.1f}", "100%"])
    shape = "GPT-2 124M shape" if d["model"] == "gpt2" else \
        f"{d['params'] / 1e6:.1f}M-parameter '{d['model']}' shape"
    versus = "".join(f", {d[key]:.2f}x {name}" for key, name in (
        ("over_hf", "transformers"), ("over_blas", "ours with F.linear products"),
        ("over_forward", "ours through forward()"),
        ("over_row", "ours with row-major weights"),
        ("over_small_pages", "ours in 4 KiB pages")) if key in d)
    versus = f"; ours, the median ratio of the rounds' times{versus}" if versus else ""
    lines = [f"Batch-1 greedy decode, {shape}, {d['prompt_tokens']}-token prompt, "
             f"{d['new_tokens']} new tokens, medians of {d.get('rounds', 1)} runs each taking "
             f"turns (the same tokens from all: {d['same_tokens']}{versus}):", "",
             markdown_table(["implementation", "tokens/s", "share of the bandwidth limit"], rows),
             ""]
    if "matvec_seconds" in d:
        ms = {name: 1e3 * s for name, s in d["matvec_seconds"].items()}
        ours = f"{d['weight_layout']}" + (f", {d['matvec']}" if "matvec" in d else "")
        others = "".join(f", {name} {ms[key]:.1f} ms ({ms[key] / ms['ours']:.2f}x)" for key, name in (
            ("blas", "the same through F.linear"), ("row", "row-major"),
            ("small_pages", "in 4 KiB pages")) if key in ms)
        lines += [f"One token's matrix-vector products alone (every Linear and the LM head, "
                  f"taking turns 4 times): {ours} {ms['ours']:.1f} ms{others}.", ""]
    return lines


def check(opts) -> None:
    """Raises ConfigError on a memory option that cannot be used, before anything runs."""
    parts = [p.strip() for p in opts.part.split(",") if p.strip()]
    if not parts or not set(parts) <= set(PARTS):
        raise ConfigError(f"--part={opts.part!r}: use a comma list of {', '.join(PARTS)}")
    train_rows(opts.rows)
    quantize.quantize_targets(opts.quantize_layers)


def run(cfg: Config, opts, config_args: list[str], command: str) -> int:
    """Every part asked for; the report to stdout and to RESULTS/memory_NAME.json and .md."""
    rt = runtime.setup(cfg.system)
    chosen = [p.strip() for p in opts.part.split(",")]
    report = {"hardware": hardware_name(rt.device), "command": command, "config": cfg.to_dict()}
    left = time_left(opts.time_budget)
    text = [f"Memory benchmark on {report['hardware']} (`{command}`)", ""]
    train_markdown = lambda rows: [  # noqa: E731
        markdown_table(TRAIN_HEADER, [train_cells(r) for r in rows]), ""]
    parts = {"train": (lambda: bench_train(config_args, opts, rt.device, left), train_markdown),
             "quant": (lambda: bench_quant(opts, config_args, rt), quant_markdown),
             "loader": (lambda: bench_loader(cfg, opts, report.get("train")), loader_markdown),
             "decode": (lambda: bench_decode(opts, rt), decode_markdown)}
    for part, (bench, markdown) in parts.items():
        if part in chosen:
            report[part] = bench()
            text += markdown(report[part])
    print("\n" + "\n".join(text))
    folder = REPO_ROOT / opts.results
    folder.mkdir(parents=True, exist_ok=True)
    stem = "memory_" + (opts.name or rt.device.type)
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (folder / f"{stem}.md").write_text("\n".join(text))
    print(f"wrote {folder / stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], {"train": train_row}))
