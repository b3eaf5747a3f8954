"""Prune a model's block Linear weights by magnitude (engine/pruning.py) into a new checkpoint that
holds its masks; finetuning it keeps the zeros, and generate.py can run it with sparse kernels.

    python prune.py --checkpoint out/shakespeare_char --sparsity 0.75 --out out/pruned75
    python prune.py --checkpoint out/shakespeare_char --pattern 2:4 --out out/pruned24
    python train.py --init_from=out/pruned75 --out_dir=out/pruned75_ft --max_iters=100
    python generate.py --checkpoint out/pruned75 --sparse auto
    python prune.py --checkpoint out/shakespeare_char --sweep 0.5,0.75,0.9,2:4 --out out/sweep \
        --table cpu_char   # val loss per variant before/after a finetune: bench_results/prune_*
"""
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from config import Config, ConfigError, load_options, opt
from engine import checkpoint, loading, pruning, saving, sources
from engine.inference import sparse


@dataclass
class PruneOptions:
    """prune.py's options."""

    checkpoint: str = opt("", "what to prune: a checkpoint or run directory (its latest "
                          "checkpoint), or a GPT-2 (gpt2, hf:ORG/NAME, a local HF directory)")
    sparsity: float = opt(0.5, "fraction of each block matrix's weights set to zero, in (0, 1); "
                          "2:4 is 0.5")
    pattern: str = opt("unstructured", "unstructured: the smallest magnitudes of each matrix | "
                       "2:4: 2 of every 4 weights along the input dimension kept "
                       f"[{' | '.join(pruning.PATTERNS)}]")
    out: str = opt("", "new directory for the pruned checkpoint (a run directory: train.py "
                   "--init_from=OUT finetunes it)")
    sweep: str = opt("", "measure instead: a comma list of sparsities and 2:4 (0.5,0.75,0.9,2:4)"
                     "; each is pruned into OUT/NAME and finetuned there by train.py, beside a "
                     "dense control, and the val losses go to bench_results/prune_TABLE.*")
    finetune_iters: int = opt(50, "--sweep: train.py steps of each finetune")
    table: str = opt("", "--sweep: name of the results, bench_results/prune_NAME.{md,json}")
    train_args: str = opt("", "--sweep: more train.py arguments for every finetune, "
                          "space-separated (e.g. --learning_rate=1e-3 --threads=1)")


def prune_checkpoint(o: PruneOptions) -> Path:
    """Load o.checkpoint, prune it, save it under o.out; returns the checkpoint written."""
    missing = [flag for flag, value in (("--checkpoint", o.checkpoint), ("--out", o.out))
               if not value]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "needed: python prune.py --checkpoint RUN_OR_CKPT --sparsity 0.5 "
                          "--out NEW_DIR")
    pruning.check_request(o.sparsity, o.pattern)  # before the loading
    saving.check_out_dir(o.out, "--out")
    if (latest := checkpoint.latest_checkpoint(o.out)) is not None:
        raise ConfigError(f"--out {o.out} already holds a checkpoint ({latest.name}); pass a new "
                          "directory")
    model, cfg, meta, label = sources.load_source(o.checkpoint, Config(), "cpu")
    pruning.prune(model, o.sparsity, o.pattern)
    cfg.train.out_dir, cfg.train.init_from = o.out, "scratch"
    info = {key: meta[key] for key in ("tokenizer", "dataset", "tokens_seen") if key in meta}
    info["pruned"] = {"from": label, "sparsity": o.sparsity, "pattern": o.pattern}
    path = saving.save(o.out, meta.get("step", 0), model, cfg, info, out_flag="--out")
    print(f"{label} ({o.pattern}, sparsity {o.sparsity}) -> {pruning.describe(model)}; "
          f"embeddings, head, biases and norms untouched -> {path}")
    return path


def finetune(start: Path, out_dir: Path, o: PruneOptions) -> dict:
    """train.py from `start` for o.finetune_iters steps: val loss before and after, and the
    least sparsity among the finetuned masked weights (None when dense)."""
    stored = loading.read_config(checkpoint.resolve(start))
    command = [sys.executable, str(Path(__file__).with_name("train.py")), f"--init_from={start}",
               f"--out_dir={out_dir}", f"--dataset={stored.data.dataset}",
               f"--block_size={stored.model.block_size}", f"--max_iters={o.finetune_iters}",
               f"--eval_interval={o.finetune_iters}", "--keep_checkpoints=1", *o.train_args.split()]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_suffix(".log"), "w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise ConfigError(f"the finetune failed: see {out_dir.with_suffix('.log')}")
    evals = [e for e in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
             if e["kind"] == "eval"]
    model, _, _ = loading.load_model(out_dir)
    kept = pruning.sparsity_of(model)
    return {"val_before": evals[0]["val"], "val_after": evals[-1]["val"],
            "min_sparsity_after": min(kept.values()) if kept else None}


def sweep(o: PruneOptions) -> list[dict]:
    """Every variant of o.sweep (and dense) pruned, finetuned, measured; written as a table."""
    variants = [v.strip() for v in o.sweep.split(",")]
    for variant in variants:
        if variant != "2:4" and not variant.replace(".", "", 1).isdigit():
            raise ConfigError(f"--sweep entry {variant!r} is neither a sparsity nor 2:4; pass "
                              "e.g. --sweep 0.5,0.75,0.9,2:4")
        pruning.check_request(0.5 if variant == "2:4" else float(variant),
                            "2:4" if variant == "2:4" else "unstructured")
    source = checkpoint.resolve(o.checkpoint)
    rows = []
    for variant in ["dense", *variants]:
        pattern, sparsity = ("2:4", 0.5) if variant == "2:4" else ("unstructured", 0.0)
        if variant not in ("dense", "2:4"):
            sparsity = float(variant)
        where = Path(o.out) / variant.replace(":", "of")
        start = source if variant == "dense" else prune_checkpoint(
            replace(o, checkpoint=str(source), sparsity=sparsity, pattern=pattern,
                    out=str(where / "pruned")))
        row = {"variant": variant, **finetune(start, where / "finetune", o)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if o.table:
        write_table(rows, source, o)
    return rows


def write_table(rows: list[dict], source: Path, o: PruneOptions) -> None:
    dense = rows[0]
    lines = [f"# Pruning: val loss before and after a {o.finetune_iters}-step finetune", "",
             f"Source: `{source}` ({loading.read_config(source).model.n_layer} layers, "
             f"width {loading.read_config(source).model.n_embd}). Command: `python prune.py "
             f"--checkpoint {o.checkpoint} --sweep {o.sweep} --finetune_iters "
             f"{o.finetune_iters} --out {o.out} --table {o.table}"
             + (f" \"--train_args={o.train_args}\"" if o.train_args else "") + "`.", "",
             f"Machine: {sparse.machine()}.", "",
             "Both columns use the same evaluation batches. The dense row is finetuned the same "
             "way, as a control; 'cost' is the loss above the dense row's in the same column.",
             "", "| variant | val before | cost | val after finetune | cost | sparsity after |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        kept = "-" if r["min_sparsity_after"] is None else f"{r['min_sparsity_after']:.3f}"
        lines.append(f"| {r['variant']} | {r['val_before']:.4f} | "
                     f"{r['val_before'] - dense['val_before']:+.4f} | {r['val_after']:.4f} | "
                     f"{r['val_after'] - dense['val_after']:+.4f} | {kept} |")
    path = Path(__file__).with_name("bench_results") / f"prune_{o.table}"
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"source": str(source), "options": vars(o),
                                                     "rows": rows}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        options = load_options(sys.argv[1:] if argv is None else argv, PruneOptions,
                               "prune.py", __doc__)
        sweep(options) if options.sweep else prune_checkpoint(options)
    except (ConfigError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
