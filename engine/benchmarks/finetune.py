"""bench.py finetune-task and finetune-step: what instruction finetuning learns, and what a step of
it costs, full or with LoRA, beside peft on transformers' GPT-2.

    python bench.py finetune-task [--base out/shakespeare_char]   # exact match on held-out words
    python bench.py finetune-task --tasks reverse,sort --steps 150,300,400,500,600,900
    python bench.py finetune-step [--rounds 2]                     # GPT-2 124M shape, each row in
                                                                   # a fresh process, taking turns

finetune-task: data/instruct_tasks.py's tasks (reversing words, sorting their letters) learned by
a character model trained here (--base; trained with `python train.py` first if missing), every
weight and with LoRA, the loss on the responses (and/or on every token), each step count a whole
run of configs/instruct_cpu.toml; then greedy answers to the 200 held-out words scored by exact
match: the curve of exact match against steps, as tables and a figure.

finetune-step: one step (forward, backward, AdamW) on one batch of GPT-2 124M-shaped random
weights and tokens with a third of the targets counted (a prompt, a response, padding per row),
its median time and the process's peak memory, for our full finetuning, our LoRA (r=8, r=16;
float32 and bfloat16 base) and peft's LoRA on transformers' GPT2LMHeadModel; and each one's
checkpoint size.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from config import ConfigError, opt
from engine.benchmarks.report import markdown_table, utc_now, write_report
from engine.benchmarks.timing import (REPO_ROOT, peak_memory, reset_peak_memory, run_script,
                                      run_worker)
from engine.device import machine_line

GPT2_SHAPE = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
TARGETS = "c_attn,c_proj,c_fc"


@dataclass
class TaskOptions:
    base: str = opt("out/shakespeare_char", "the character model to finetune (trained first with "
                    "python train.py if missing)")
    work: str = opt("out/bench_finetune", "where the task files and the runs go; a run found "
                    "finished there is scored again, not retrained")
    tasks: str = opt("reverse", "data/instruct_tasks.py's tasks, comma-separated: reverse, sort")
    steps: str = opt("900", "steps of each run (--max_iters, the whole cosine schedule); several, "
                     "comma-separated, draw exact match against steps")
    finetuning: str = opt("full,lora", "full (every weight, the config's lr) and/or lora (rank "
                          "--lora-rank at --lora-lr), comma-separated")
    loss_on: str = opt("responses", "responses and/or all: the loss on the answers or on every "
                       "token, comma-separated")
    seeds: int = opt(1, "runs per point (system.seed 1337, 1338, ...)")
    threads: int = opt(0, "threads of each training run (0: train.py's default)")
    lora_rank: int = opt(8, "LoRA's rank in the LoRA rows")
    lora_lr: float = opt(1e-2, "LoRA rows' learning rate (the full rows take the config's)")
    results: str = opt("bench_results", "folder for finetune_task_NAME.{json,md,png}")
    name: str = opt("cpu", "NAME in the result files")


@dataclass
class StepOptions:
    batch_size: int = opt(4, "rows of the batch")
    seq_len: int = opt(256, "tokens per row")
    steps: int = opt(3, "timed steps per row (after an untimed one)")
    rounds: int = opt(2, "times each row runs, in turns")
    rows: str = opt("ours_full,ours_lora8,ours_lora16,ours_lora8_bf16,ours_lora8_bf16_ac,"
                    "peft_lora8,peft_lora16,peft_lora8_ac", "rows to measure: ours_full, "
                    "ours_loraR[_bf16: the base in bfloat16][_ac: under bfloat16 autocast]"
                    "[_allpos: the LM head at every position], "
                    "peft_loraR[_ac]")
    results: str = opt("bench_results", "folder for finetune_step_NAME.{json,md}")
    name: str = opt("cpu", "NAME in the result files")


def exact_match(model, tokenizer, template, records: list[tuple[str, dict]],
                max_extra: int = 2) -> float:
    """The share of records whose greedy reply, up to the end-of-text token, is their answer."""
    from data.instruct import to_messages
    from engine.inference.sampling import generate_tokens

    end, right = template.end_id(tokenizer), 0
    for where, record in records:
        messages = to_messages(record, where)
        prompt, answer = template.prompt(tokenizer, messages[:-1]), messages[-1]["content"]
        budget = len(tokenizer.encode_ordinary(answer)) + max_extra
        idx = torch.tensor([prompt])
        out = generate_tokens(model, idx, budget, temperature=0)[0, len(prompt):].tolist()
        right += end in out and tokenizer.decode(out[:out.index(end)]) == answer
    return right / len(records)


@dataclass
class TaskRun:
    """One finetuning run of the curve and what train.py needs for it."""
    task: str
    finetuning: str  # full | lora
    loss_on: str
    steps: int
    seed: int

    def label(self, rank: int) -> str:
        return "full" if self.finetuning == "full" else f"LoRA r={rank}"

    def folder(self, work: Path) -> Path:
        return work / f"{self.task}_{self.finetuning}_{self.loss_on}_{self.steps}_{self.seed}"


def listed(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """A comma-separated option's values, each checked against `allowed`."""
    values = [v.strip() for v in value.split(",") if v.strip()]
    wrong = [v for v in values if v not in allowed]
    if wrong or not values:
        raise ConfigError(f"--{option}={value!r}: {', '.join(wrong) or 'nothing'} is not one of "
                          f"{', '.join(allowed)} (give them comma-separated)")
    return values


def task_plan(o: TaskOptions) -> list[TaskRun]:
    """Every run, the cheapest step counts first (a curve that is stopped early still shows its
    start), each step count's runs side by side."""
    from data.instruct_tasks import TASKS

    try:
        steps = sorted({int(v) for v in o.steps.split(",") if v.strip()})
    except ValueError:
        steps = []
    if not steps or steps[0] < 1 or o.seeds < 1:
        raise ConfigError(f"--steps={o.steps!r} --seeds={o.seeds}: give step counts >= 1, "
                          "comma-separated (100,200,400), and --seeds >= 1")
    tasks = listed(o.tasks, tuple(TASKS), "tasks")
    kinds = listed(o.finetuning, ("full", "lora"), "finetuning")
    losses = listed(o.loss_on, ("responses", "all"), "loss-on")
    return [TaskRun(task, kind, loss_on, n, 1337 + seed) for n in steps
            for seed in range(o.seeds) for task in tasks for loss_on in losses for kind in kinds]


def train_args(o: TaskOptions, run: TaskRun, files: tuple[Path, Path], out: Path) -> list[str]:
    """train.py's command line for one run: configs/instruct_cpu.toml with the run's changes."""
    extra = [f"--lora.rank={o.lora_rank}", f"--learning_rate={o.lora_lr}"] \
        if run.finetuning == "lora" else []
    extra += ["--loss_on=all"] if run.loss_on == "all" else []
    extra += [f"--threads={o.threads}"] if o.threads else []
    return [sys.executable, "train.py", "--config", "instruct_cpu", f"--init_from={o.base}",
            f"--out_dir={out}", f"--dataset={files[0]}", f"--val_file={files[1]}",
            f"--max_iters={run.steps}", f"--seed={run.seed}", "--loss_curve=false", *extra]


def train_once(o: TaskOptions, run: TaskRun, files: tuple[Path, Path], work: Path
               ) -> tuple[Path, dict]:
    """The run's folder, trained now or found finished, and what was measured when it trained:
    its whole-run seconds and the 1-minute load average at its end (RUN/bench.json)."""
    out = run.folder(work)
    summary, measured = out / "summary.json", out / "bench.json"
    if summary.is_file() and json.loads(summary.read_text()).get("stop_reason") == "done":
        return out, json.loads(measured.read_text()) if measured.is_file() else {}
    shutil.rmtree(out, ignore_errors=True)  # an interrupted run of this bench's own
    t0 = time.perf_counter()
    run_script(train_args(o, run, files, out), "a finetuning run")
    record = {"seconds": round(time.perf_counter() - t0, 1),
              "load_average": round(os.getloadavg()[0], 2)}
    measured.write_text(json.dumps(record) + "\n")
    return out, record


def run_task(o: TaskOptions, command: str) -> int:
    """Every run of the plan, then greedy answers to the held-out words; the report is written
    after each run, so a stopped bench keeps what it measured."""
    from data.chat_template import from_meta as template_from
    from data.instruct import read_records
    from data.instruct_tasks import write_task
    from data.tokenizer import from_meta
    from engine.sources import load_source

    plan, work = task_plan(o), Path(o.work)
    if not Path(o.base).exists():
        subprocess.run([sys.executable, "train.py", f"--out_dir={o.base}"], cwd=REPO_ROOT,
                       check=True)
    files = {task: write_task(task, work / "tasks") for task in {r.task for r in plan}}
    rows = []
    for run in plan:
        out, measured = train_once(o, run, files[run.task], work)
        model, _, meta, _ = load_source(str(out), None)  # a LoRA run's: merged
        score = exact_match(model.eval(), from_meta(meta["tokenizer"]),
                            template_from(meta["template"]), read_records(files[run.task][1]))
        summary = json.loads((out / "summary.json").read_text())
        rows.append({**dataclasses.asdict(run), "label": run.label(o.lora_rank),
                     "seconds": measured.get("seconds"),
                     "train_seconds": round(summary["train_seconds"], 1),
                     "load_average": measured.get("load_average"),
                     "val_loss": summary["final"]["val"], "exact_match": score,
                     "checkpoint_bytes": sum(f.stat().st_size for f in
                                             Path(summary["checkpoint"]).iterdir())})
        print(f"{run.task}, {run.label(o.lora_rank)} ({run.loss_on}), {run.steps} steps, seed "
              f"{run.seed}: exact match {score:.1%}, trained in {summary['train_seconds']:.0f} s")
        task_report(rows, o, command, final=run is plan[-1])
    return 0


def curve_tables(rows: list[dict]) -> list[str]:
    """One table per task and loss: a row per step count, exact match (each seed's) and the
    training seconds of each kind of finetuning."""
    lines = []
    for task, loss_on in dict.fromkeys((r["task"], r["loss_on"]) for r in rows):
        mine = [r for r in rows if (r["task"], r["loss_on"]) == (task, loss_on)]
        labels = list(dict.fromkeys(r["label"] for r in mine))
        table = []
        for steps in sorted({r["steps"] for r in mine}):
            cells = [steps]
            for label in labels:
                runs = [r for r in mine if r["steps"] == steps and r["label"] == label]
                cells += [" / ".join(f"{r['exact_match']:.1%}" for r in runs) or "-",
                          " / ".join(f"{r['train_seconds']:.0f}" for r in runs) or "-"]
            table.append(cells)
        header = ["steps"] + [f"{label}: {what}" for label in labels
                              for what in ("exact match", "training (s)")]
        lines += [f"**{task}**, the loss on the {loss_on}:" if loss_on == "responses" else
                  f"**{task}**, the loss on every token:", "", markdown_table(header, table), ""]
    return lines


def plot_curve(rows: list[dict], path: Path) -> Path | None:
    """Exact match against steps, one panel per task, a line per finetuning and loss (the mean
    over seeds, each seed a dot)."""
    from engine.benchmarks.report import figure, save_figure

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig = figure(figsize=(5.5 * len(tasks), 4))
    if fig is None:
        return None
    for ax, task in zip(fig.subplots(1, len(tasks), squeeze=False)[0], tasks):
        mine = [r for r in rows if r["task"] == task]
        for label, loss_on in dict.fromkeys((r["label"], r["loss_on"]) for r in mine):
            runs = [r for r in mine if (r["label"], r["loss_on"]) == (label, loss_on)]
            steps = sorted({r["steps"] for r in runs})
            mean = [100 * statistics.mean(r["exact_match"] for r in runs if r["steps"] == n)
                    for n in steps]
            line, = ax.plot(steps, mean, marker="o", label=f"{label}, loss on {loss_on}",
                            linestyle="-" if loss_on == "responses" else "--")
            ax.scatter([r["steps"] for r in runs], [100 * r["exact_match"] for r in runs],
                       color=line.get_color(), s=10, alpha=0.5)
        ax.set(title=f"{task}: exact match, 200 held-out words", xlabel="steps (--max_iters)",
               ylabel="exact match (%)", ylim=(-2, 102))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def task_report(rows: list[dict], o: TaskOptions, command: str, final: bool = True) -> None:
    """finetune_task_NAME.{json,md,png}: the curve as tables and a figure."""
    loads = [r["load_average"] for r in rows if r["load_average"] is not None]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded"
    status = "" if final else (" **Incomplete: the bench is still running, or was stopped; "
                               "the figure is drawn at the end.**")
    page = "\n".join([
        f"# Instruction finetuning: exact match against steps ({utc_now()})", "",
        f"{machine_line(torch.device('cpu'))}, torch {torch.__version__}; each run at "
        + (f"--threads={o.threads}" if o.threads else "train.py's default threads"), "",
        f"`{command}`: the default run's character model ({o.base}) finetuned on "
        "data/instruct_tasks.py's tasks with configs/instruct_cpu.toml, each step count a whole "
        "run (`--max_iters=N`: 30 warm-up steps, then the cosine decay to 0.1x over N), LoRA at "
        f"rank {o.lora_rank} and lr {o.lora_lr:g}; then greedy replies to the 200 held-out "
        "words, stopped at the end-of-text token, scored by exact match. With several seeds "
        "each seed's result is given, ' / '-separated. Training seconds are train.py's own "
        "(start-up and evaluation excluded) on a machine that other jobs shared: the 1-minute "
        f"load average read after each run was {load} on "
        f"{os.cpu_count()} CPUs.{status}", "",
        *curve_tables(rows), f"![exact match against steps](finetune_task_{o.name}.png)"])
    paths = write_report({"rows": rows, "command": command, "complete": final}, page,
                         o.results, f"finetune_task_{o.name}")
    png = plot_curve(rows, Path(o.results) / f"finetune_task_{o.name}.png") if final else None
    for path in paths + ([png] if png else []):
        print(f"wrote {path}")


def step_batch(batch_size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; per row a prompt (not counted), a response (counted) and padding: about a
    third of the targets counted, as in instruction data. The same batch for every row."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, vocab, (batch_size, seq_len)))
    y = torch.full_like(x, -1)
    for r in range(batch_size):
        prompt = int(rng.integers(seq_len // 4, seq_len // 2))
        end = int(rng.integers(prompt + seq_len // 8, seq_len))
        y[r, prompt:end] = torch.from_numpy(rng.integers(0, vocab, end - prompt))
    return x, y


def ours(kind: str):
    """(model, loss(x, y)) for our rows: GPT-2 124M's shape as configs/gpt2_124m computes it."""
    from config import Config
    from engine.training.finetune import head_at_counted_positions
    from model import GPT, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(**GPT2_SHAPE, vocab_pad_multiple=64, attention="sdpa",
                            causal_mask="on_the_fly", norm="native", activation_impl="native")
    model = GPT(cfg.model)
    if "_allpos" not in kind:  # the LM head at the counted positions only, as train.py runs it
        head_at_counted_positions(model)
    if "lora" in kind:
        from engine.lora import apply_lora

        cfg.lora.rank = int(kind.split("lora")[1].split("_")[0])
        cfg.lora.targets, cfg.lora.base_dtype = TARGETS, \
            "bfloat16" if "_bf16" in kind else "float32"
        apply_lora(model, cfg.lora)
    return model, lambda x, y: model(x, y)[1]


def autocast_if_asked(kind: str, loss):
    """loss under bfloat16 autocast for the rows named ..._ac."""
    if not kind.endswith("_ac"):
        return loss

    def under_autocast(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(x, y)

    return under_autocast


def peft_model(kind: str):
    """(model, loss(x, y)) for peft's LoRA on transformers' GPT2LMHeadModel, as its docs do it."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257,
                    attn_implementation="sdpa",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # ours: no dropout either
    model = get_peft_model(GPT2LMHeadModel(hf),
                           LoraConfig(r=int(kind.split("lora")[1].split("_")[0]), lora_alpha=16,
                                      lora_dropout=0.0, target_modules=TARGETS.split(","),
                                      fan_in_fan_out=True))

    def loss(x, y):  # transformers shifts labels itself: label t+1 is predicted at t
        labels = torch.cat([torch.full_like(y[:, :1], -100), y[:, :-1]], 1).masked_fill(
            y.eq(-1).roll(1, 1), -100)
        return model(input_ids=x, labels=labels).loss

    return model, loss


def checkpoint_bytes(model, kind: str) -> int:
    """The size of what a checkpoint of this row stores: weights or adapters, as safetensors."""
    with tempfile.TemporaryDirectory() as tmp:
        if kind.startswith("peft"):
            model.save_pretrained(tmp)
        else:
            from safetensors.torch import save_file

            from engine.checkpoint import model_state
            state = model_state(model)
            if "lora" in kind:
                from engine.lora import adapter_state
                state = adapter_state(model)
            save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/w.safetensors")
        return sum(f.stat().st_size for f in Path(tmp).rglob("*.safetensors"))


def step_row(spec: dict) -> dict:
    """One row of finetune-step in this fresh process: median step time and peak memory."""
    torch.manual_seed(0)
    kind, device = spec["row"], torch.device("cpu")
    base = peak_memory(device).get("rss", 0)
    model, loss_fn = peft_model(kind) if kind.startswith("peft") else ours(kind)
    loss_fn = autocast_if_asked(kind, loss_fn)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    x, y = step_batch(spec["batch_size"], spec["seq_len"], GPT2_SHAPE["vocab_size"])
    reset_peak_memory(device)
    times = []
    for i in range(spec["steps"] + 1):
        t0 = time.perf_counter()
        loss_fn(x, y).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = peak_memory(device).get("rss", 0)
    return {"row": kind, "step_s": statistics.median(times[1:]), "peak_rss": peak,
            "peak_over_start": peak - base, "trainable": sum(p.numel() for p in trainable),
            "checkpoint_bytes": checkpoint_bytes(model, kind)}


def run_step(o: StepOptions, command: str) -> int:
    """Each row in a fresh process, the rows in turns (reversed every other round)."""
    rows, results = o.rows.split(","), {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(o.rounds):
            for kind in rows if round_ % 2 == 0 else rows[::-1]:
                spec = {"kind": "finetune_step", "row": kind, "batch_size": o.batch_size,
                        "seq_len": o.seq_len, "steps": o.steps}
                result = run_worker(spec, Path(tmp), f"{kind}_{round_}")
                print(f"{kind} round {round_ + 1}: {result}")
                results.setdefault(kind, []).append(result)
    return step_report(results, o, command)


def step_report(results: dict[str, list[dict]], o: StepOptions, command: str) -> int:
    def median(kind: str, key: str) -> float:
        values = [r[key] for r in results.get(kind, []) if r.get("status") == "ok"]
        return statistics.median(values) if values else float("nan")

    table = [[kind, f"{median(kind, 'trainable'):,.0f}",
              " / ".join(f"{r['step_s'] * 1e3:,.0f}" for r in runs if r.get("status") == "ok"),
              f"{median(kind, 'peak_rss') / 2**20:,.0f}",
              f"{median(kind, 'peak_over_start') / 2**20:,.0f}",
              f"{median(kind, 'checkpoint_bytes') / 2**20:,.2f}"] for kind, runs in results.items()]
    ratios = {f"{key}: {a} / {b}": median(a, key) / median(b, key) for a, b, key in (
        ("ours_lora8", "peft_lora8", "step_s"), ("ours_lora8_bf16", "peft_lora8", "step_s"),
        ("ours_lora8_bf16_ac", "peft_lora8", "step_s"),
        ("ours_lora8_bf16_ac", "peft_lora8_ac", "step_s"),
        ("ours_lora16", "peft_lora16", "step_s"), ("ours_lora8", "ours_full", "peak_over_start"),
        ("ours_lora8_bf16", "ours_full", "peak_over_start"),
        ("ours_lora8_bf16_ac", "ours_full", "peak_over_start"),
        ("ours_lora8", "ours_full", "checkpoint_bytes")) if a in results and b in results}
    page = (f"# Finetuning step at GPT-2 124M shape ({utc_now()})\n\n"
            f"{machine_line(torch.device('cpu'))}, torch {torch.__version__}\n\n"
            f"`{command}`: one step (forward, backward, clipping, fused AdamW over the trainable "
            f"parameters) on {o.batch_size} x {o.seq_len} random tokens with about a third of the "
            "targets counted, random GPT-2 124M-shaped weights; each row in a fresh process, "
            f"{o.rounds} rounds in turns, {o.steps} timed steps each after an untimed one "
            f"(median). LoRA on {TARGETS} (alpha 16); peft on transformers' GPT2LMHeadModel "
            "(SDPA attention, no "
            "dropout, float32). Peak memory: the process's peak RSS, and its rise over the RSS "
            "before the model was built.\n\n"
            + markdown_table(["row", "trainable parameters", "step (ms), each round",
                              "peak RSS (MiB)", "peak over start (MiB)", "checkpoint (MiB)"],
                             table)
            + "\n\n" + markdown_table(["ratio", "value"],
                                        [[k, f"{v:.3f}"] for k, v in ratios.items()]))
    report = {"rows": results, "ratios": ratios, "command": command}
    for path in write_report(report, page, o.results, f"finetune_step_{o.name}"):
        print(f"wrote {path}")
    return 0
