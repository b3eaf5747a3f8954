"""What rl.py's loop works on, built once: the model (train.init_from's checkpoint, or out_dir's
latest to resume), its tokenizer and chat template, LoRA when lora.rank is set, the optimizer,
the training and held-out problems, the sampler's generator and the prompt order; a resumed
run's state put back. Also its checkpoints (as train.py writes them) and evaluation.

    run = build(cfg, options, argv)
    save(run)                       # out_dir/ckpt_NNNNNNN: weights, train_state.pt, meta.json
    evaluate(run)                   # {"pass@1": ..., "ci95": [...], "sampled_pass@1": ...}
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from config import Config, ConfigError, command_line_keys
from engine import checkpoint, device, saving, sources
from engine.evaluation.tasks import Task, TaskError, builtin_task, load_task
from engine.rl.rollout import PromptOrder, RolloutSettings
from engine.rl.update import UpdateSettings
from engine.training import resume
from engine.training.optim import make_optimizer

TRAIN_PROBLEMS = 100_000  # a built-in task's training split, whole (the word tasks: ~8,000)


@dataclass
class Counters:
    """The loop's own state, saved with every checkpoint."""

    step: int = 0
    seconds: float = 0.0  # sampling and updates, over every resume: what max_seconds counts
    sample_seconds: float = 0.0
    update_seconds: float = 0.0
    skipped_steps: int = 0
    evals: list = field(default_factory=list)  # {"step", "pass@1", "ci95", ...} each
    wandb_id: str = ""


@dataclass
class RLRun:
    cfg: Config
    o: object  # rl.py's RLOptions
    rt: device.Runtime
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    template: object
    meta: dict  # what every checkpoint's meta.json carries: tokenizer, template, the start
    train_task: Task
    eval_task: Task
    sampling: RolloutSettings
    updating: UpdateSettings
    order: PromptOrder
    generator: torch.Generator
    counters: Counters
    label: str  # where the weights came from
    notes: list[str]


def tasks_for(o, seed: int) -> tuple[Task, Task]:
    """(training problems, held-out problems). A built-in task: its train and test splits; a
    task file: its problems, those whose prompt's crc32 is a multiple of 10 held out (as the
    built-in generated tasks split), unless eval_task names the held-out problems."""
    from data import instruct_tasks

    if o.task in instruct_tasks.BUILTIN:
        train = builtin_task(o.task, seed, TRAIN_PROBLEMS, split="train")
        held = builtin_task(o.task, seed, o.eval_problems)
    else:
        train = held = load_task(o.task, seed, 0)
        if not o.eval_task and train.kind == "generate":
            out = [instruct_tasks.held_out(p["prompt"]) for p in train.problems]
            train, held = (dataclasses.replace(train, problems=[
                p for p, h in zip(train.problems, out) if h == test], wheres=[
                w for w, h in zip(train.wheres, out) if h == test]) for test in (False, True))
    if o.eval_task:
        held = load_task(o.eval_task, seed, o.eval_problems)
    held.problems, held.wheres = held.problems[:o.eval_problems], held.wheres[:o.eval_problems]
    for task, what in ((train, "train on"), (held, "measure on")):
        if task.kind != "generate" or not task.problems:
            raise TaskError(f"task {task.name} has {len(task.problems)} {task.kind} problems to "
                            f"{what}; RL needs generation problems (\"prompt\", \"answer\" or a "
                            "checker of its own)" + (" (a task file's held-out tenth is empty: "
                            "pass --eval_task)" if what == "measure on" else ""))
    return train, held


def build(cfg: Config, o, argv: list[str]) -> RLRun:
    from data.chat_template import from_meta as template_from
    from data.tokenizer import from_meta

    t = cfg.train
    saving.check_out_dir(t.out_dir)
    t.init_from = resume.resolve_init(t.init_from, t.out_dir)
    if t.init_from == "scratch":
        raise ConfigError("rl.py improves a model that already partly solves the task: set "
                          "--init_from=<its checkpoint> (docs/rl.md: finetune one first)")
    resuming = t.init_from == "resume"
    rt = device.setup(cfg.system)
    source = str(checkpoint.latest_checkpoint(t.out_dir)) if resuming else t.init_from
    overrides = {k: getattr(cfg.model, k) for k in command_line_keys(argv, "model", type(o))}
    model, _, meta, label = sources.load_source(source, cfg, "cpu", overrides,
                                                merge_adapters=not resuming)
    cfg.model = model.config  # what the checkpoints store: the model's own shape and options
    if meta["tokenizer"].get("kind", "unknown") == "unknown":
        raise ConfigError(f"{label} has no tokenizer this project knows: no prompts to write")
    tokenizer = from_meta(meta["tokenizer"])
    template = template_from(meta["template"]) if meta.get("template") else None
    start = meta["rl"]["start"] if resuming else label
    notes = []
    if cfg.lora.rank or getattr(model, "lora", None) is not None:
        from engine.lora import attach

        t.init_from = start  # the base the adapters record (lora.base_record)
        notes.append(attach(model, cfg, Path(start)))
    model.to(rt.device).eval()  # no dropout: the sampler's and the update's policy are one
    optimizer = make_optimizer(model, cfg, rt.device)
    train, held = tasks_for(o, cfg.system.seed)
    shots = o.shots if o.shots >= 0 else (0 if template is not None else train.shots)
    sampling = RolloutSettings(o.group_size, o.max_new_tokens or train.max_new_tokens,
                               o.temperature, shots, o.scale_by_std, cfg.system.seed,
                               o.batch_rows, rt.autocast)
    reference = None
    if o.kl_coef:  # the model the run started from, frozen
        reference = sources.load_source(start, cfg, rt.device, overrides)[0].eval()
        reference.requires_grad_(False)
    updating = UpdateSettings(o.temperature, o.clip_eps, o.updates_per_batch, o.kl_coef,
                              o.normalize, o.micro_rows, t.grad_clip, rt.autocast, reference)
    generator = torch.Generator(device=rt.device).manual_seed(cfg.system.seed)
    record = {"tokenizer": meta["tokenizer"],
              **({"template": meta["template"]} if meta.get("template") else {}),
              "rl": {"start": start, "task": o.task, "options": dataclasses.asdict(o)}}
    run = RLRun(cfg, o, rt, model, optimizer, tokenizer, template, record, train, held,
                sampling, updating, PromptOrder(len(train.problems), cfg.system.seed),
                generator, Counters(), label, notes)
    if resuming:
        restore(run, Path(source))
    return run


def restore(run: RLRun, ckpt: Path) -> None:
    """A checkpoint's train_state.pt put back: the optimizer, the counters, the prompt order,
    the sampler's generator and every other RNG, so the run continues as if never stopped."""
    from engine.loading import load_train_state
    from engine.training.restore import restore_rng_state

    state = load_train_state(ckpt)
    if "rl" not in state:
        raise checkpoint.CheckpointError(f"{ckpt} was not written by rl.py: nothing of an RL run "
                                         "to resume; start one with --init_from=<it>")
    run.optimizer.load_state_dict(state["optimizer"])
    run.counters = Counters(**state["rl"]["counters"])
    run.order.epoch, run.order.position = state["rl"]["order"]
    run.generator.set_state(state["rl"]["generator"])
    run.notes += restore_rng_state(state["rng"], run.rt.device)
    old = state["rl"]["options"]
    changed = [f"{k}: {old[k]} -> {v}" for k, v in dataclasses.asdict(run.o).items()
               if k in old and old[k] != v and k not in ("max_seconds", "eval_problems")]
    run.notes.append(f"resumed {ckpt} at step {run.counters.step}"
                     + (f"; with changed settings: {', '.join(changed)}" if changed else ""))


def save(run: RLRun) -> Path:
    step, c = run.counters.step, run.counters
    state = {"optimizer": run.optimizer.state_dict(), "rng": resume.rng_state(run.rt.device),
             "rl": {"counters": dataclasses.asdict(c),
                    "order": [run.order.epoch, run.order.position],
                    "generator": run.generator.get_state(),
                    "options": dataclasses.asdict(run.o)}}
    weights, extra = None, {}
    if getattr(run.model, "lora", None) is not None:  # the adapters, and the base they adapt
        from engine.lora import adapter_state

        weights, extra = adapter_state(run.model), {"lora": run.model.lora_record}
    last = c.evals[-1] if c.evals else {}
    meta = {**run.meta, **extra, "rl": {**run.meta["rl"], "last_eval": last}}
    return saving.save(run.cfg.train.out_dir, step, run.model, run.cfg, meta, state,
                       run.cfg.train.keep_checkpoints, weights=weights)


def evaluate(run: RLRun) -> dict:
    """Held-out pass@1, greedy (and sampled at the RL temperature when eval_samples > 0)."""
    from engine.evaluation.runner import Settings, run_task

    seed, shots = run.cfg.system.seed, run.sampling.shots
    greedy = run_task(run.model, run.tokenizer, run.template, run.eval_task,
                      Settings(seed, shots, autocast=run.rt.autocast))
    out = {"step": run.counters.step, "pass@1": greedy["value"], "ci95": greedy["ci95"],
           "n": greedy["n"], "seconds": greedy["seconds"],
           "per_problem": greedy["per_problem"]}
    if run.o.eval_samples:
        sampled = run_task(run.model, run.tokenizer, run.template, run.eval_task,
                           Settings(seed, shots, run.o.eval_samples, run.sampling.temperature,
                                    autocast=run.rt.autocast))
        out.update({"sampled_pass@1": sampled["value"], "sampled_ci95": sampled["ci95"],
                    "sampled_per_problem": sampled["per_problem"],
                    "seconds": out["seconds"] + sampled["seconds"]})
    return out
