"""Reinforcement learning from verifiable rewards (GRPO): a model that partly solves a task
learns from its own samples, each judged by the task's checker (docs/rl.md).

    python train.py --config instruct_cpu --max_iters=450 --out_dir=out/sft_reverse  # first
    python rl.py --config rl_cpu                          # RL on reverse, a 2-core CPU
    python rl.py --config rl_cpu --lora.rank=8 --learning_rate=1e-3 --out_dir=out/rl_lora
    python rl.py --config rl_cpu --init_from=resume       # continue exactly where it stopped
    python eval.py --checkpoint out/rl_cpu --tasks reverse   # held-out problems, as before RL

Each step draws prompts_per_step problems from the task's training problems, samples
group_size completions of each in one batch over the KV cache, rewards each by the checker,
and makes updates_per_batch updates of the clipped policy-gradient loss with advantages relative
to each prompt's group (engine/rl/). Held-out pass@1 is measured at the start, every
eval_interval steps and at the end, a checkpoint written with each (the tokenizer and chat
template in it, as train.py's); max_iters or max_seconds, whichever comes first, ends the run.
"""
from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from config import ConfigError, help_first, load_config, opt
from engine.fields import NON_NEGATIVE, POSITIVE, Range


@dataclass
class RLOptions:
    """rl.py's own options, set in a config's [rl] table or on the command line; the rest is
    the config (train.init_from: the model to improve, learning_rate, lora, out_dir, ...)."""

    table: ClassVar[str] = "rl"
    task: str = opt("reverse", "the task whose checker rewards: a built-in generation task "
                    "(reverse, sort, add, copy4, copy8, copy16) or a .jsonl task file")
    eval_task: str = opt("", "the held-out problems measured; '' = a built-in task's test "
                         "split, or the tenth of a task file never trained on (by prompt hash)")
    group_size: int = opt(8, "completions sampled per prompt (G); advantages are relative to "
                          "the group", check=Range(ge=2))
    prompts_per_step: int = opt(8, "prompts a step", check=POSITIVE)
    max_new_tokens: int = opt(0, "a completion's token limit; 0 = the task's",
                              check=NON_NEGATIVE)
    temperature: float = opt(1.0, "sampling temperature; the policy trained is "
                             "softmax(logits / temperature)", check=Range(gt=0, le=2))
    clip_eps: float = opt(0.2, "PPO's ratio clip, acting on a batch's later updates",
                          check=Range(gt=0, lt=1))
    updates_per_batch: int = opt(1, "updates on each batch of samples", check=POSITIVE)
    kl_coef: float = opt(0.0, "weight of a KL penalty to the starting model; 0 = off (and no "
                         "reference forward)", check=NON_NEGATIVE)
    scale_by_std: bool = opt(True, "divide each group's advantages by its rewards' std")
    normalize: str = opt("token", "the loss's mean: over the batch's completion tokens, or "
                         "within each completion then over completions", ("token", "sequence"))
    shots: int = opt(-1, "few-shot examples in a prompt; -1 = the task's (0 with a chat "
                     "template)", check=Range(ge=-1))
    batch_rows: int = opt(64, "completions sampled together", check=POSITIVE)
    micro_rows: int = opt(0, "rows an update's forward takes (the gradient sums exactly); "
                          "0 = all", check=NON_NEGATIVE)
    max_seconds: float = opt(0.0, "a wall budget: stop after this many seconds of sampling and "
                             "updates (a resumed run's earlier parts count); 0 = none",
                             check=NON_NEGATIVE)
    eval_problems: int = opt(200, "held-out problems measured", check=POSITIVE)
    eval_samples: int = opt(0, "also sampled pass@1, from this many completions per held-out "
                            "problem at the RL temperature; 0 = greedy only", check=NON_NEGATIVE)


help_first("rl.py", RLOptions, main=__name__)

from data.dataset import DataError  # noqa: E402 (this and what follows: after --help)
from data.tokenizer import TokenizerError  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.device import SetupError, machine_line  # noqa: E402
from engine.rl.build import RLRun, build, evaluate, save  # noqa: E402
from engine.rl.rollout import RewardError, rollout  # noqa: E402
from engine.rl.update import update  # noqa: E402
from engine.training import metrics, resume  # noqa: E402
from engine.training.optim import lr_at, set_schedule  # noqa: E402


def print_banner(run: RLRun) -> None:
    o, s, m = run.o, run.sampling, run.model
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    print(f"config:\n{run.cfg.to_json()}")
    print(f"machine: {machine_line(run.rt.device)} | device {run.rt.device} | dtype "
          f"{run.cfg.system.dtype}")
    print(f"model: {m.num_params(False) / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trained "
          f"| from {run.label}")
    print(f"rl: task {run.train_task.name} ({len(run.train_task.problems):,} training "
          f"problems; {len(run.eval_task.problems)} held out, from {run.eval_task.source}) | "
          f"{o.prompts_per_step} prompts x {o.group_size} samples a step at temperature "
          f"{o.temperature}, {s.max_new_tokens} tokens at most, {s.shots} shots, "
          f"{'chat' if run.template else 'plain'} prompts | {o.updates_per_batch} update(s) a "
          f"batch, clip {o.clip_eps}, kl {o.kl_coef or 'off'}, advantages "
          f"{'/ std' if o.scale_by_std else 'centred'}, {o.normalize} mean")
    stops = [f"max_iters {run.cfg.train.max_iters}"] + (
        [f"max_seconds {o.max_seconds:g}"] if o.max_seconds else [])
    print(f"stops at {' or '.join(stops)}; evaluates every {run.cfg.train.eval_interval} steps")
    for line in run.notes:
        print(f"note: {line}")


def report_eval(run: RLRun, log: metrics.RunLog) -> None:
    result = evaluate(run)
    run.counters.evals.append(result)
    low, high = result["ci95"]
    sampled = (f" | sampled pass@1 {100 * result['sampled_pass@1']:.1f}%"
               if "sampled_pass@1" in result else "")
    print(f"eval {result['step']:5d} | held-out pass@1 {100 * result['pass@1']:.1f}% "
          f"[{100 * low:.1f}, {100 * high:.1f}] of {result['n']}{sampled} | "
          f"{result['seconds']:.1f}s")
    log.write(kind="eval", step=result["step"], **{k: v for k, v in result.items() if not
                                                  isinstance(v, list) and k != "step"},
              ci_low=low, ci_high=high)


def rl_step(run: RLRun) -> dict:
    """One step: its lr, a batch of samples and their rewards, then the update(s)."""
    lr = lr_at(run.counters.step, run.cfg)
    set_schedule(run.optimizer, lr)
    indices = run.order.take(run.o.prompts_per_step)
    batch = rollout(run.model, run.tokenizer, run.template, run.train_task, indices,
                    run.sampling, run.generator)
    stats = update(run.model, run.optimizer, batch, run.updating)
    generated = sum(batch.lengths)
    return {"lr": lr, "reward": batch.rewards.mean().item(),
            "pass_rate": (batch.rewards >= 1).float().mean().item(),
            "length": generated / len(batch.lengths), "sample_s": batch.seconds,
            "sample_tok_s": generated / batch.seconds, "update_s": stats["seconds"],
            "update_tok_s": stats["tokens"] / stats["seconds"], **stats}


def train(cfg, o, argv: list[str]) -> dict:
    run = build(cfg, o, argv)
    print_banner(run)
    t, c = cfg.train, run.counters
    start_step, streak, window = c.step, 0, []
    log = metrics.RunLog(cfg, c.step, resumed=c.step > 0, train_seconds=c.seconds,
                         wandb_id=c.wandb_id)
    log.draws, log.max_iters, c.wandb_id = False, t.max_iters, log.wandb_id
    with resume.StopRequest() as stop, log:
        if not c.evals:
            report_eval(run, log)
        while c.step < t.max_iters and not stop:
            if o.max_seconds and c.seconds >= o.max_seconds:
                stop.request("max_seconds")
                break
            s = rl_step(run)
            c.step += 1
            c.seconds += s["sample_s"] + s["update_s"]
            c.sample_seconds += s["sample_s"]
            c.update_seconds += s["update_s"]
            c.skipped_steps += s["skipped"]
            streak = streak + 1 if s["skipped"] else 0
            if streak >= t.max_nonfinite_steps:
                stop.request("nonfinite")
                break
            log.write(kind="train", step=c.step, **{k: v for k, v in s.items()
                                                   if k != "skipped"},
                      ms=1000 * (s["sample_s"] + s["update_s"]))
            window.append(s)
            if c.step % t.log_interval == 0 or c.step == t.max_iters:  # means since the last
                mean = {k: sum(w[k] for w in window) / len(window) for k in s}
                print(log_line(c.step, mean) + progress(run, log))
                window = []
            if c.step % t.eval_interval == 0 and c.step < t.max_iters:
                report_eval(run, log)
                save(run)
        if stop.reason != "nonfinite":
            if c.evals[-1]["step"] != c.step:
                report_eval(run, log)
            path = save(run)
        else:
            path = checkpoint.latest_checkpoint(t.out_dir)
    return summarize(run, stop.reason or "done", start_step, path)


def log_line(step: int, s: dict) -> str:
    kl = f" | kl {s['kl']:.4f}" if s["kl"] else ""
    return (f"step {step:5d} | reward {s['reward']:.3f} | pass {100 * s['pass_rate']:.1f}% | "
            f"len {s['length']:.1f} | loss {s['loss']:+.4f} | clip {100 * s['clip_frac']:.1f}%"
            f"{kl} | norm {s['norm']:.2f} | lr {s['lr']:.1e} | sample {s['sample_s']:.2f}s "
            f"({s['sample_tok_s']:,.0f} tok/s) | update {s['update_s']:.2f}s "
            f"({s['update_tok_s']:,.0f} tok/s)")


def progress(run: RLRun, log: metrics.RunLog) -> str:
    """' | 42.0% | eta 3m12s' of max_iters, or of the wall budget where that ends it first."""
    steps = log.progress(run.counters.step)
    if not run.o.max_seconds:
        return steps
    left = max(0.0, run.o.max_seconds - run.counters.seconds)
    c, t = run.counters, run.cfg.train
    if c.step and (t.max_iters - c.step) * c.seconds / c.step < left:
        return steps
    return (f" | {100 * c.seconds / run.o.max_seconds:.1f}% of the budget | "
            f"{metrics.format_duration(left)} left")


def summarize(run: RLRun, reason: str, start_step: int, path) -> dict:
    c, evals = run.counters, run.counters.evals
    first, last = evals[0], evals[-1]
    summary = {"stop_reason": reason, "step": c.step, "steps": c.step - start_step,
               "seconds": c.seconds, "sample_seconds": c.sample_seconds,
               "update_seconds": c.update_seconds, "skipped_steps": c.skipped_steps,
               "first_eval": first, "last_eval": last, "evals": evals,
               "checkpoint": str(path) if path else None}
    label = "done" if reason == "done" else f"stopped ({reason})"
    share = c.sample_seconds / max(c.seconds, 1e-9)
    print(f"{label}: step {c.step} | {metrics.format_duration(c.seconds)} of sampling and "
          f"updates ({100 * share:.0f}% sampling) | held-out pass@1 "
          f"{100 * first['pass@1']:.1f}% at step {first['step']} -> {100 * last['pass@1']:.1f}% "
          f"at step {last['step']} | checkpoint {summary['checkpoint']}")
    (Path(run.cfg.train.out_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (or the budget spent), 2 bad input or a failing checker, 3 stopped on
    NaN/inf, 128 + N stopped by signal N after saving."""
    argv = sys.argv[1:] if argv is None else argv
    errors = (ConfigError, DataError, checkpoint.CheckpointError, SetupError, TokenizerError)
    if hasattr(sys.stdout, "reconfigure"):  # each line as it comes, into a log file too
        sys.stdout.reconfigure(line_buffering=True)
    try:
        cfg, o = load_config(argv, prog="rl.py", script=RLOptions)
        summary = train(cfg, o, argv)
    except errors as e:
        return fail(f"error: {e}", 2)
    except RewardError as e:
        return fail(f"error: {e}; the run stopped, its last checkpoint (if any) is intact", 2)
    except KeyboardInterrupt:
        return fail("interrupted: nothing saved since the last checkpoint", 130)
    reason = summary["stop_reason"]
    if reason == "nonfinite":
        return fail(f"error: stopped at step {summary['step']}: {cfg.train.max_nonfinite_steps} "
                    "updates in a row had a NaN/inf loss or gradient; nothing non-finite was "
                    f"saved; the last checkpoint is {summary['checkpoint']}", 3)
    return 128 + signal.Signals[reason].value if reason.startswith("SIG") else 0


def fail(message: str, status: int) -> int:
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
