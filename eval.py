"""Evaluate a model on tasks: multiple choice by log-likelihood, generation judged by checkers,
bits per byte; a report card with 95% intervals, comparable across checkpoints
(docs/evaluation.md).

    python eval.py --checkpoint out/shakespeare_char                 # the built-in suite
    python eval.py --checkpoint out/instruct_cpu --tasks reverse,sort --limit 100
    python eval.py --checkpoint gpt2 --tasks hellaswag,mine.jsonl --out eval/gpt2
    python eval.py --checkpoint X --tasks add --samples 10 --temperature 0.8 --pass-k 1,5
    python eval.py --compare eval/a.json eval/b.json                 # two reports side by side
"""
import sys
import time
from dataclasses import dataclass

from config import Config, ConfigError, command_line_keys, load_config, opt
from data.dataset import DataError
from data.tokenizer import TokenizerError
from engine import checkpoint, sources
from engine.device import SetupError, machine_line, setup

FORMATS = ("auto", "plain", "chat")


@dataclass
class EvalOptions:
    """eval.py's own options; the rest of the command line is the config (--device, --dtype,
    --attention, --kv_cache, ...)."""

    checkpoint: str = opt("", "the model: our checkpoint or run directory (a LoRA run's merged), "
                          "or a GPT-2 (gpt2, hf:ORG/NAME, a local HF directory); '' = out_dir")
    tasks: str = opt("builtin", "comma-separated: built-in tasks (reverse, sort, add, copy4, "
                     "copy8, copy16, add_choice, shakespeare_bpb; builtin = all), hellaswag, "
                     "task files (.jsonl), text files (.txt: bits per byte)")
    limit: int = opt(0, "the first N problems of each task; 0 = all (built-in tasks: 200)")
    shots: int = opt(-1, "few-shot examples per problem; -1 = each task's own (3 for the "
                     "built-in ones; 0 for generation through a chat template)")
    format: str = opt("auto", "prompts as plain text or through the checkpoint's chat template; "
                      "auto = chat when the checkpoint has one", FORMATS)
    samples: int = opt(1, "completions per generation problem (with --temperature > 0)")
    temperature: float = opt(0.0, "0 = greedy")
    top_k: int = opt(0, "sample from the k most likely tokens; 0 = all")
    top_p: float = opt(1.0, "sample from the smallest set of tokens holding this probability")
    pass_k: str = opt("1", "pass@k to report, comma-separated (k <= --samples)")
    batch_rows: int = opt(32, "rows a forward: choices, or samples being generated")
    out: str = opt("", "write the report to OUT.json and OUT.md")


def settings_from(cfg: Config, o: EvalOptions):
    from engine.evaluation.runner import Settings

    try:
        pass_k = tuple(sorted({int(k) for k in o.pass_k.split(",") if k.strip()}))
    except ValueError:
        pass_k = ()
    problems = []
    if not pass_k or pass_k[0] < 1 or pass_k[-1] > o.samples:
        problems.append(f"--pass-k={o.pass_k!r}: give k values from 1 to --samples ({o.samples})")
    if o.samples < 1 or o.batch_rows < 1 or o.limit < 0:
        problems.append("--samples and --batch-rows must be >= 1, --limit >= 0")
    if o.samples > 1 and o.temperature == 0:
        problems.append(f"--samples={o.samples} at temperature 0 would repeat one greedy answer; "
                        "pass --temperature (e.g. 0.8)")
    if o.temperature < 0 or not 0 < o.top_p <= 1 or o.top_k < 0:
        problems.append("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    if problems:
        raise ConfigError("; ".join(problems))
    return Settings(cfg.system.seed, o.shots, o.samples, o.temperature, o.top_k, o.top_p, pass_k,
                    o.batch_rows, cfg.sample.kv_cache)


def evaluate(cfg: Config, o: EvalOptions, argv: list[str]) -> dict:
    """Load the model, run every task, print each result as it comes; -> the report."""
    from data.chat_template import from_meta as template_from
    from data.tokenizer import from_meta
    from engine.evaluation import report, runner
    from engine.evaluation.tasks import load_tasks

    settings = settings_from(cfg, o)
    rt = setup(cfg.system)
    settings.autocast = rt.autocast
    tasks = load_tasks(o.tasks, cfg.system.seed, o.limit, cfg.data.hellaswag_path)
    overrides = {k: getattr(cfg.model, k) for k in command_line_keys(argv, "model", EvalOptions)}
    source = o.checkpoint or cfg.train.out_dir
    model, stored, meta, label = sources.load_source(source, cfg, rt.device, overrides)
    model.eval()
    if meta["tokenizer"].get("kind", "unknown") == "unknown":
        raise TokenizerError(f"{source} has no tokenizer this project knows: nothing to write "
                             "its prompts with")
    tokenizer = from_meta(meta["tokenizer"])
    template = None
    if o.format == "chat" or (o.format == "auto" and meta.get("template")):
        if not meta.get("template"):
            raise ConfigError(f"--format=chat: {label} has no chat template (it was not "
                              "finetuned on instruction data); use --format=plain")
        template = template_from(meta["template"])
    fmt = "chat" if template else "plain"
    print(f"evaluating {label} (step {meta.get('step')}) on {rt.device}: {len(tasks)} tasks, "
          f"{fmt} prompts | {machine_line(rt.device)}", file=sys.stderr)
    card = report.header(label, model, stored, meta, tokenizer, fmt, settings,
                         machine_line(rt.device), argv)
    t0, card["tasks"] = time.perf_counter(), []
    for task in tasks:
        result = runner.run_task(model, tokenizer, template, task, settings)
        card["tasks"].append(result)
        print(f"{task.name:>16} | {result['metric']:>8} | {report.cell(result)} | "
              f"n {result['n']:,} | {result.get('seconds', 0):.1f}s"
              + (f" | {result['skipped']}" if result.get("skipped") else ""), file=sys.stderr)
    card["seconds"] = round(time.perf_counter() - t0, 2)
    return card


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    errors = (ConfigError, DataError, checkpoint.CheckpointError, SetupError, TokenizerError)
    try:
        if argv[:1] == ["--compare"]:
            from engine.evaluation import report

            if len(argv) != 3:
                raise ConfigError("--compare takes two reports: --compare A.json B.json")
            print(report.compare(report.read(argv[1]), report.read(argv[2])), end="")
            return 0
        cfg, o = load_config(argv, prog="eval.py", script=EvalOptions)
        card = evaluate(cfg, o, argv)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from engine.evaluation import report

    print(report.markdown(card), end="")
    if o.out:
        for path in report.write(card, o.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
