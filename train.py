"""Train a GPT from one config.

    python train.py                          # tiny Shakespeare, char-level, CPU friendly
    python train.py --config gpt2_124m       # GPT-2 124M recipe
    python train.py --help                   # every key with the value it resolves to
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_124m   # several GPUs

engine/training/build.py builds the run (data, the model with its speedups applied, optimizer, a
resumed run's state, the run log); train(cfg): build_run, then the loop (evaluate and checkpoint
every eval_interval steps; each step, one_step: the schedule, the micro-batches and the update of
engine/training/step.py) until max_iters or a stop request.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

from config import Config, ConfigError, help_first, load_config, opt


@dataclass
class TrainOptions:
    """train.py's own options (the rest of the command line is the config)."""

    estimate_memory: bool = opt(False, "print the memory estimate for this config and exit "
                                "without training")


# --help needs nothing more: it is answered here, before the imports of a run (torch, the model)
help_first("train.py", TrainOptions, main=__name__)

import torch  # noqa: E402 (this and what follows: after --help)

from data.dataset import DataError, load_or_prepare
from engine import checkpoint, device, saving
from engine.training import launch, metrics, processes, resume, speedups
from engine.training.build import Run, build_run
from engine.training.optim import lr_at, momentum_at, set_schedule
from engine.training.step import (NonFiniteGuard, StepResult, Trainer, evaluate,
                                  forward_backward, update)


def print_banner(run: Run) -> None:
    cfg, notes, m = run.cfg, run.notes, run.raw_model
    print(f"config:\n{cfg.to_json()}")
    print(speedups.banner(speedups.settings(cfg, run.rt, notes), run.rt.notes))
    print(run.dist.describe(notes.global_batch))
    print(f"model: {m.num_params() / 1e6:.2f}M parameters without embeddings, "
          f"{m.num_params(False) / 1e6:.2f}M with"
          + (f" | from {run.source}" if run.source else ""))
    print(f"memory: weights={notes.weights} "
          f"activation_checkpointing={cfg.model.activation_checkpointing} "
          f"empty_cache={'on' if cfg.system.empty_cache else 'off'} "
          f"prefetch={run.batches.prefetch_note} loader_workers={cfg.data.loader_workers}")
    if run.rt.device.type == "cuda" or m.num_params(False) * 16 > 2**30:  # memory may run short
        from engine.training import memory_estimate  # (weights, grads, AdamW: 16 B a parameter)

        print(memory_estimate.format_estimate(memory_estimate.estimate(cfg, run.dist.world_size),
                                              cfg))
    for line in notes.lines:
        print(f"note: {line}")


def save(run: Run, step: int, next_batch: tuple, stop: resume.StopRequest) -> None:
    """Checkpoint this step (next_batch: already fetched). Every rank calls it: FSDP gathers."""
    t, dist, counters = run.cfg.train, run.dist, run.counters
    if not t.save_checkpoints:
        return
    if not resume.weights_finite(run.raw_model, dist):
        print(f"step {step:5d} | weights hold NaN/inf: not saved; the last good checkpoint "
              f"is {checkpoint.latest_checkpoint(t.out_dir)}")
        stop.request("nonfinite")
        return
    counters.train_seconds = run.log.train_seconds
    state = resume.capture(dist, run.raw_model, run.optimizer, run.scaler, run.batches,
                           next_batch, counters, run.rt.device,
                           optimizer_too=run.shards is None)  # None on ranks > 0
    info = {"losses": counters.losses, "eval_step": counters.eval_step,
            "tokens_seen": counters.tokens_seen, "tokenizer": run.meta["tokenizer"],
            "dataset": run.cfg.data.dataset,
            **{key: run.meta[key] for key in ("template", "mixture") if key in run.meta}}
    if run.shards is not None:  # every rank writes its own shards (engine/sharded.py)
        run.shards.save(step, run.raw_model, run.optimizer, run.cfg, info, state)
        return
    weights, extra = run.checkpoint_weights()  # a LoRA run: its adapters and their base
    if dist.is_main:
        saving.save(t.out_dir, step, run.raw_model, run.cfg, {**extra, **info}, state,
                        t.keep_checkpoints, weights=weights)


def evaluate_and_save(run: Run, step: int, next_batch: tuple, stop: resume.StopRequest,
                      keep: bool) -> None:
    losses = evaluate(run.model, run.loaders, run.eval_sets, run.rt, run.token_bytes)
    run.counters.record_eval(step, run.dist.mean_losses(losses))
    run.log.eval(step, run.counters.losses)  # prints it, redraws the loss curve
    if keep:
        save(run, step, next_batch, stop)
    device.release_cached(run.rt.device, run.cfg.system.empty_cache)  # a phase boundary


def cuda_peak_memory(device: torch.device) -> tuple[int, int] | None:
    """CUDA's peak allocated and reserved bytes since the last call (then reset: each log line's
    own peak); None off CUDA."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def one_step(run: Run, trainer: Trainer, batch: tuple, step: int,
             stop: resume.StopRequest) -> tuple[StepResult, float]:
    """Step `step` (0-based): its learning rate and Muon momentum, the micro-batches' forward
    and backward, their loss averaged over the ranks (a stop any rank received reaches every
    one), then the update, skipped on every rank alike when that loss or the gradients are
    non-finite -> (the step's result, its lr)."""
    lr = lr_at(step, run.cfg)
    set_schedule(trainer.optimizer, lr, momentum_at(step, run.cfg))
    loss_sum, next_batch = forward_backward(trainer, batch)
    loss_sum = run.dist.sync_step(loss_sum, stop)  # one process: as it is
    return StepResult(loss_sum, *update(trainer, loss_sum), next_batch), lr


def log_step(run: Run, step: int, result: StepResult, lr: float,
             since: tuple[int, float]) -> tuple[int, float]:
    """The log line, timed per step since `since` (step, time); returns the next `since`."""
    loss = result.loss_sum.item() / run.cfg.train.grad_accum_steps  # .item() syncs the device
    norm, now = result.norm.item(), time.perf_counter()
    dt = (now - since[1]) / max(1, step - since[0])
    flops_per_step = run.raw_model.flops_per_token() * run.tokens_per_step
    mfu = flops_per_step / dt / run.peak_flops if run.peak_flops else None
    tokens_per_s, memory = run.tokens_per_step / dt, cuda_peak_memory(run.rt.device)
    peak = (f" | peak {memory[0] / 2**30:.2f} GiB (reserved {memory[1] / 2**30:.2f})"
            if memory else "")
    print(metrics.log_line(step, loss, lr, norm, 1000 * dt, tokens_per_s, mfu, peak)
          + run.log.progress(step))
    peaks = {"peak_mib": memory[0] // 2**20, "reserved_mib": memory[1] // 2**20} if memory else {}
    run.log.write(kind="train", step=step, loss=loss, lr=lr, norm=norm, ms=1000 * dt,
                  tok_per_s=tokens_per_s, mfu=mfu, **peaks)
    return step, time.perf_counter()


def report_skips(run: Run, guard: NonFiniteGuard, stop: resume.StopRequest) -> None:
    """Read the steps skipped since the last read (one transfer); a long enough streak stops."""
    for step, loss, norm, in_a_row in guard.read(run.cfg.train.grad_accum_steps):
        run.counters.skipped_steps += 1
        print(f"step {step:5d} | skipped: loss {loss:.4g}, norm {norm:.4g} "
              f"({in_a_row} non-finite in a row; the run stops at {guard.limit})")
        run.log.write(kind="skip", step=step, loss=str(loss), norm=str(norm))
    if guard.exhausted:
        stop.request("nonfinite")


def train(cfg: Config) -> dict:
    """Train as configured (one process, or one rank of a launcher's job); returns the summary."""
    saving.check_out_dir(cfg.train.out_dir)  # a file there: say so before any work
    dist = launch.init(cfg)
    run = build_run(cfg, dist)
    print_banner(run)
    t, counters = cfg.train, run.counters
    run.model.train()
    x, y = run.next_batch
    start_step = step = counters.step
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    last_log = (step, time.perf_counter())  # (step, time) of the last log line
    with resume.StopRequest(synced=dist.enabled) as stop, run.log:
        trainer = run.trainer()
        while True:
            due = step % t.eval_interval == 0 and (step or t.eval_at_start)
            if (due or step == t.max_iters) and counters.eval_step != step:
                evaluate_and_save(run, step, (x, y), stop, keep=step > start_step)
                last_log = (step, time.perf_counter())  # the step times leave evaluations out
            if run.hellaswag and run.hellaswag.due(step) and (step > start_step or step == 0):
                run.log.write(kind="hellaswag", step=step,
                              **run.hellaswag.run(run.raw_model, step))
                device.release_cached(run.rt.device, cfg.system.empty_cache)
                last_log = (step, time.perf_counter())
            if step >= t.max_iters or stop:
                break
            result, lr = one_step(run, trainer, (x, y), step, stop)
            x, y = result.next_batch
            step += 1
            counters.step, counters.tokens_seen = step, counters.tokens_seen + run.tokens_per_step
            guard.record(step, result)  # nothing read yet: the device runs ahead
            if run.shards is not None:  # a background save that has finished: publish it
                run.shards.poll()
            if t.stop_after_iters and step - start_step >= t.stop_after_iters:
                stop.request("stop_after_iters")
            logs = step % t.log_interval == 0 or step == t.max_iters
            if logs or step % t.eval_interval == 0 or stop:  # before a log line, eval or save
                report_skips(run, guard, stop)
                if stop.reason == "nonfinite":
                    break
            if logs:
                last_log = log_step(run, step, result, lr, since=last_log)
        if stop and stop.reason != "nonfinite" and counters.eval_step != step:
            save(run, step, (x, y), stop)  # stopped between evaluations: keep this step
        if run.shards is not None:  # the last save on disk before the summary names it
            run.shards.wait()
        summary = run.log.finish(counters, stop.reason or "done", start_step,
                                 checkpoint.latest_checkpoint(t.out_dir))
    dist.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (or stopped by stop_after_iters), 2 bad input, 3 stopped on NaN/inf,
    4 another process of a distributed run died or hung, 128 + N stopped by signal N after
    saving (130 for Ctrl-C, 143 for SIGTERM)."""
    where, cfg = processes.error_prefix(), None
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="train.py",
                                   script=TrainOptions)
        if options.estimate_memory:  # without building the model: vocab_size from the data
            from engine.training import memory_estimate

            meta = {} if cfg.model.vocab_size else load_or_prepare(cfg.data.dataset)
            cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
            print(memory_estimate.describe(cfg, processes.launch_env()[2]))
            return 0
        summary = train(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError, device.SetupError) as e:
        return fail(f"{where}error: {e}", 2)
    except KeyboardInterrupt:
        return fail("interrupted: nothing saved since the last checkpoint", 130)
    except OSError as e:  # a full disk outside a checkpoint save (those say more): metrics, data
        if (cause := saving.disk_full_cause(e)) is None:
            raise
        return fail(f"{where}error: {cause} writing {e.filename or 'out_dir'}; free some "
                    "space there, or pass --out_dir=<a directory on a disk with room>", 2)
    except RuntimeError as e:
        if cfg is None or (message := launch.collective_failure(
                e, cfg.system.dist_timeout)) is None:
            raise
        return fail(f"{where}error: {message}", 4)
    reason = summary["stop_reason"]
    if reason == "nonfinite":
        return fail(f"error: stopped at step {summary['step']}: the loss or gradient norm was "
                    f"NaN/inf for {cfg.train.max_nonfinite_steps} steps in a row (or the weights "
                    f"were); nothing non-finite was saved; the last good checkpoint is "
                    f"{summary['checkpoint']}: resume it with --init_from=resume, perhaps with a "
                    "lower --learning_rate", 3)
    return 128 + signal.Signals[reason].value if reason.startswith("SIG") else 0


def fail(message: str, status: int) -> int:
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    launch.leave(launch.record(main)())
