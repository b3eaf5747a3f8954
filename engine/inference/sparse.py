"""Running a pruned model's Linear layers with sparse kernels, where they measured faster here.

    note = prepare_for_inference(model, "auto", device)   # generate.py --sparse=auto
    python -m engine.inference.sparse       # CSR/BSR vs dense at GPT-2 124M shapes

Kernels: on CPU, the weight as a CSR tensor (torch.mm(csr, x^T)); on CUDA, 2:4 semi-structured
(torch.sparse.to_sparse_semi_structured, in float16, Ampere or newer). `auto` times dense
against sparse for each pruned weight shape at `rows` input rows (1 = a decode step) when the
model is prepared: every layer of that shape in turn, as a forward pass reads them, the two
kernels alternating. A shape goes sparse only where it was faster by SPEEDUP_NEEDED; the others
keep their dense weights with zeros.
"""
from __future__ import annotations

import copy
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from config import ConfigError, load_options, opt
from engine import pruning
from engine.inference.matvec import set_weight_layout
from engine.inference.sampling import generate_tokens
from model import BLOCK_LINEARS, GPT, ModelConfig

MODES = ("dense", "sparse", "auto")
SPEEDUP_NEEDED = 1.1  # auto: sparse must beat dense by this factor (timing noise)


def gpt2_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of each of GPT-2 124M's block Linears (a block made on the meta device)."""
    with torch.device("meta"):
        block = GPT(ModelConfig(vocab_size=50257, n_layer=1, n_head=12, n_embd=768)
                    ).transformer.h[0]
    return {name: tuple(block.get_submodule(name).weight.shape) for name in BLOCK_LINEARS}


def to_sparse(weight: torch.Tensor, layout: str, block: int = 16) -> torch.Tensor:
    """weight as a CSR or BSR tensor (torch's "in beta state" warning left out)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return weight.to_sparse_csr() if layout == "csr" else weight.to_sparse_bsr((block, block))


class CSRLinear(torch.nn.Module):
    """A Linear whose weight is a CSR tensor: y = x W^T + b computed as (W x^T)^T (CPU)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(to_sparse(linear.weight.detach(), "csr"),
                                         requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        y = torch.mm(self.weight, rows.t().contiguous()).t()  # (N, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class SemiStructuredLinear(torch.nn.Module):
    """A Linear with a 2:4 semi-structured weight (CUDA sparse tensor cores) in `dtype`; the
    input is cast to it and the output back to the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype = torch.float16):
        super().__init__()
        from torch.sparse import to_sparse_semi_structured

        self.in_features, self.out_features, self.dtype = (linear.in_features,
                                                           linear.out_features, dtype)
        # row-major whatever layout decoding chose (a column-major weight is a transposed view,
        # which the 2:4 compressor refuses)
        self.weight = torch.nn.Parameter(to_sparse_semi_structured(
            linear.weight.detach().to(dtype).contiguous()), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)  # (N, in)
        y = F.linear(rows, self.weight, self.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def is_two_four(weight: torch.Tensor) -> bool:
    """At most 2 non-zeros in every 4 consecutive weights along the input dimension."""
    if weight.shape[-1] % 4:
        return False
    return bool(((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 2).all())


def sparse_kind(device: torch.device) -> str:
    return "2:4 semi-structured" if device.type == "cuda" else "CSR"


def make_sparse(linear: torch.nn.Linear, device: torch.device) -> torch.nn.Module | None:
    """The sparse replacement this device has for `linear`, or None (with CUDA, a weight that
    is not 2:4 or a GPU older than Ampere)."""
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0) or not is_two_four(linear.weight):
            return None
        try:
            return SemiStructuredLinear(linear)
        except (RuntimeError, ValueError):  # a shape the kernels do not take
            return None
    return CSRLinear(linear) if device.type == "cpu" else None


def best_seconds(fn, calls: int, device: torch.device) -> float:
    """The fastest of `calls` calls: a busy machine only ever adds time. On one CPU thread the
    clock is that thread's CPU time, which leaves out the time other processes held the core."""
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 \
        else time.perf_counter
    best = float("inf")
    for _ in range(calls):
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, clock() - start)
    return best


@torch.no_grad()
def race(dense: list[torch.nn.Module], sparse: list[torch.nn.Module], rows: int,
         repeats: int = 7, calls: int = 3) -> tuple[float, float]:
    """(dense, sparse) seconds for one call of every layer in the list at `rows` input rows:
    they take turns, each turn the best of `calls`; the median of the turns. All the layers of a
    shape run one after another, as in a forward pass, so their weights stream from memory as
    they do when decoding instead of staying in the cache."""
    weight = dense[0].weight
    x = torch.randn(rows, dense[0].in_features, device=weight.device, dtype=weight.dtype)
    turns = {"dense": [], "sparse": []}
    for group in (dense, sparse):
        for layer in group:
            layer(x)  # warm up
    for _ in range(repeats):
        for name, group in (("dense", dense), ("sparse", sparse)):
            turns[name].append(best_seconds(lambda: [layer(x) for layer in group], calls,
                                            weight.device))
    return statistics.median(turns["dense"]), statistics.median(turns["sparse"])


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def prepare_for_inference(model: torch.nn.Module, mode: str, device: torch.device | str,
                          rows: int = 1) -> str:
    """Swap a pruned model's Linear layers for sparse ones: all that can (sparse), none
    (dense), or those whose weight shape ran faster sparse at `rows` input rows (auto). Returns
    one line saying what was chosen ('' for a model that is not pruned, left as it is)."""
    if mode not in MODES:
        raise ConfigError(f"--sparse={mode!r} is not one of {', '.join(MODES)}")
    device, masks = torch.device(device), pruning.masks_of(model)
    if not masks:
        return ""
    if mode == "dense":
        return f"sparse kernels: off, dense weights with zeros ({pruning.describe(model)})"
    layers = {name.removesuffix(".weight"): model.get_submodule(name.removesuffix(".weight"))
              for name in masks}
    by_shape: dict[tuple, list[str]] = {}
    for name, linear in layers.items():
        by_shape.setdefault(tuple(linear.weight.shape), []).append(name)
    verdicts: dict[tuple, str] = {}  # weight shape -> why it is sparse or dense
    swapped = 0
    for shape, names in by_shape.items():
        plain = all(type(layers[n].weight.data) is torch.Tensor for n in names)  # not int8
        candidates = [make_sparse(layers[n], device) if plain else None for n in names]
        if any(c is None for c in candidates):
            verdicts[shape] = "dense (no sparse kernel for it here)" if plain else \
                "dense (quantized)"
            continue
        faster = mode == "sparse"
        if mode == "auto":
            # one call per turn: a repeated call would find the weights still in the cache
            dense_s, sparse_s = race([layers[n] for n in names], candidates, rows, calls=1)
            faster = dense_s / sparse_s >= SPEEDUP_NEEDED
            verdicts[shape] = (f"{'sparse' if faster else 'dense'} ({sparse_kind(device)} "
                               f"ran at {dense_s / sparse_s:.2f}x dense's speed)")
        if faster:
            for name, candidate in zip(names, candidates):
                _set_module(model, name, candidate)
            swapped += len(names)
    shapes = ", ".join(f"{o}x{i}: {verdict}" for (o, i), verdict in verdicts.items())
    probe = f" at {rows} row{'s' * (rows != 1)}" if mode == "auto" else ""
    return (f"sparse kernels ({mode}, {sparse_kind(device)}{probe}): {swapped} of {len(layers)} "
            f"pruned Linears sparse" + (f"; {shapes}" if shapes else ""))


def pruned_weight(shape: tuple[int, int], sparsity: float, pattern: str,
                  generator: torch.Generator) -> torch.Tensor:
    weight = torch.randn(shape, generator=generator) * 0.02
    return weight * pruning.magnitude_mask(weight, sparsity, pattern)


def bench_shape(shape: tuple[int, int], sparsity: float, pattern: str, rows: int,
                device: torch.device, repeats: int) -> dict:
    """Dense vs CSR (vs BSR 16x16 on CPU; vs 2:4 semi-structured on CUDA) for one Linear."""
    weight = pruned_weight(shape, sparsity, pattern, torch.Generator().manual_seed(0))
    dense = torch.nn.Linear(shape[1], shape[0], bias=False)
    dense.weight.data = weight.to(device)
    row = {"shape": list(shape), "sparsity": sparsity, "pattern": pattern, "rows": rows}
    kernels = {"csr": lambda: CSRLinear(dense)}
    if device.type == "cpu":
        kernels["bsr16"] = lambda: BSRLinear(dense)
    elif pattern == "2:4":
        kernels = {"2:4": lambda: SemiStructuredLinear(dense, torch.float16)}
    for kernel, make in kernels.items():
        try:
            reference = dense if kernel != "2:4" else dense.half()
            dense_s, sparse_s = race([reference], [make()], rows, repeats)
            row[kernel] = round(dense_s / sparse_s, 3)
            row.setdefault("dense_us", round(1e6 * dense_s, 1))
        except (RuntimeError, NotImplementedError) as e:
            row[kernel] = f"unsupported: {str(e).splitlines()[0][:80]}"
        dense.float()
    return row


class BSRLinear(CSRLinear):
    """The same with a block-sparse (16 x 16 blocks) weight; only all-zero blocks are skipped."""

    def __init__(self, linear: torch.nn.Linear, block: int = 16):
        super().__init__(linear)
        self.weight = torch.nn.Parameter(to_sparse(linear.weight.detach(), "bsr", block),
                                         requires_grad=False)


def bench(device: torch.device, rows_list: list[int], repeats: int) -> list[dict]:
    """Every GPT-2 124M block shape at 50/75/90% unstructured and 2:4, at each row count."""
    cases = [(0.5, "unstructured"), (0.75, "unstructured"), (0.9, "unstructured"), (0.5, "2:4")]
    results = []
    for rows in rows_list:
        for sparsity, pattern in cases:
            for name, shape in gpt2_shapes().items():
                row = {"layer": name, **bench_shape(shape, sparsity, pattern, rows, device,
                                                    repeats)}
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


@torch.no_grad()
def decode_race(sparsity: float, tokens: int, rounds: int = 3) -> list[str]:
    """Batch-1 greedy decoding of a GPT-2 124M-shaped model (random weights) pruned at
    `sparsity`: dense, auto and sparse in turns; tok/s per mode, median of the rounds."""
    torch.manual_seed(0)
    base = GPT(ModelConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12,
                           n_embd=768)).eval()
    pruning.prune(base, sparsity, "unstructured")
    lines, models = [], {}
    for mode in MODES:
        models[mode] = copy.deepcopy(base)
        setattr(models[mode], pruning.MASKS, pruning.masks_of(base))
        set_weight_layout(models[mode], "auto", huge_pages=True)  # generate.py's defaults
        lines.append(f"{mode}: {prepare_for_inference(models[mode], mode, 'cpu')}")
    idx, speeds, out = torch.zeros((1, 16), dtype=torch.long), {m: [] for m in MODES}, {}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(rounds):
        for mode, model in models.items():
            start = clock()
            out[mode] = generate_tokens(model, idx, tokens, temperature=0.0)
            speeds[mode].append(tokens / (clock() - start))
    same = all(torch.equal(out["dense"], out[m]) for m in MODES)
    return lines + [f"{mode}: {statistics.median(v):.1f} tok/s" for mode, v in speeds.items()] \
        + [f"the same tokens in every mode: {same}"]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").is_file() else platform.processor()
    return (f"{cpu}, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")


def write_table(results: list[dict], device: torch.device, path: Path, command: str) -> None:
    kernels = [k for k in ("csr", "bsr16", "2:4") if any(k in r for r in results)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    lines = [f"# Sparse vs dense Linear at GPT-2 124M block shapes ({device.type})", "",
             f"Machine: {where}. Command: `{command}`.",
             "Each cell: dense time / sparse time for one Linear call (above 1 = sparse faster):",
             "they take turns, each turn the best of 3 calls, the median of the turns; on one",
             "thread the clock is the thread's CPU time (the machine was shared). Weights:",
             "random, pruned by magnitude; dense us is the dense call's time.", "",
             "| rows | pattern | sparsity | layer (out x in) | dense us | "
             + " | ".join(kernels) + " |", "|" + " --- |" * (5 + len(kernels))]
    for r in results:
        cells = [str(r.get(k, "")) if not isinstance(r.get(k), float) else f"{r[k]:.2f}x"
                 for k in kernels]
        lines.append(f"| {r['rows']} | {r['pattern']} | {r['sparsity']} | {r['layer']} "
                     f"{r['shape'][0]}x{r['shape'][1]} | {r.get('dense_us', '')} | "
                     + " | ".join(cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps(
        {"machine": where, "command": command, "results": results}, indent=1) + "\n")


@dataclass
class BenchOptions:
    """python -m engine.inference.sparse's options."""

    device: str = opt("cpu", "cpu | cuda | cuda:N")
    rows: str = opt("1,16,128", "input rows per call, a comma list (1 = a decode step)")
    repeats: int = opt(5, "turns each kernel takes (the median is kept)")
    threads: int = opt(1, "CPU threads; 1 times with the thread's CPU time; 0 = torch's default")
    out: str = opt("", "write OUT.md and OUT.json (e.g. bench_results/prune_sparse_cpu); '' = "
                   "print the rows only")
    decode: float = opt(0.0, "instead: batch-1 decode tok/s of a GPT-2 124M-shaped model pruned "
                        "at this sparsity, dense vs auto vs sparse (CPU); 0 = off")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        o = load_options(argv, BenchOptions, "-m engine.inference.sparse", __doc__)
        if not all(r.strip().isdigit() and int(r) > 0 for r in o.rows.split(",")):
            raise ConfigError(f"--rows={o.rows!r} must be a comma list of positive integers, "
                              "e.g. 1,16,128")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if o.threads:
        torch.set_num_threads(o.threads)
    if o.decode:
        print("\n".join(decode_race(o.decode, 32)))
        return 0
    device = torch.device(o.device)
    results = bench(device, [int(r) for r in o.rows.split(",")], o.repeats)
    if o.out:
        write_table(results, device, Path(o.out),
                    " ".join(["python -m engine.inference.sparse", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
