"""Train a GPT from one config.

    python train.py                          # tiny Shakespeare, char-level, CPU friendly
    python train.py --config gpt2_124m       # GPT-2 124M recipe
    python train.py --help                   # every key with its default

main(cfg): runtime setup -> data -> model -> optimizer -> one training loop -> checkpoints.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import checkpoint
from engine import distributed
from engine import hellaswag
from engine import memory
from engine import runlog
from engine import resume
from engine import runtime
from engine import speedups, techniques
from config import Config, ConfigError, TrainConfig, load_config, opt
from data.loader import Batches, DataError
from data.workers import SharedMemoryBatches
from engine.optim import lr_at, make_optimizer
from engine.runlog import log_line
from engine.sources import build_model, dataset_meta
from engine.step import evaluate, train_step
from model import GPT

def report_skip(run: runlog.RunLog, step: int, loss: torch.Tensor, norm: torch.Tensor,
                guard: resume.NonFiniteGuard) -> None:
    loss_value, norm_value = loss.item(), norm.item()
    print(f"step {step:5d} | skipped: loss {loss_value:.4g}, norm {norm_value:.4g} "
          f"({guard.in_a_row} non-finite in a row; the run stops at {guard.limit})")
    run.write(kind="skip", step=step, loss=str(loss_value), norm=str(norm_value))


def resolve_init(t: TrainConfig) -> None:
    """init_from=auto becomes resume or scratch; any other start refuses an out_dir that holds
    another run's checkpoints (it would mix with them, pruning would delete them, and its
    metrics would be overwritten)."""
    checkpoint.recover(t.out_dir)  # a save killed part-way: tidy up before looking
    latest = checkpoint.latest_checkpoint(t.out_dir)
    if t.init_from == "auto":
        t.init_from = "resume" if latest is not None else "scratch"
    if t.init_from != "resume" and latest is not None:
        raise ConfigError(f"{t.out_dir} already holds a run (latest checkpoint {latest.name}); "
                          "continue it with --init_from=resume, or start a new run in another "
                          "--out_dir (or delete that one)")


def train(cfg: Config) -> dict:
    """Run training as configured, as one process or as one rank of a torchrun / accelerate
    launch job (distributed.py); returns a summary (final losses, steps, time, checkpoint)."""
    checkpoint.check_out_dir(cfg.train.out_dir)  # a file there: say so before any work
    dist = distributed.init(cfg)
    summary = train_rank(cfg, dist)
    dist.close()
    return summary


def make_loaders(cfg: Config, meta: dict, rt: runtime.Runtime, dist: distributed.Dist
                 ) -> tuple[Batches, dict[str, Batches], dict[str, list]]:
    """The training batches (this rank's share, optionally prefetched or read ahead by worker
    processes), both splits' loaders, and the fixed evaluation batches."""
    t = cfg.train
    train_batches = Batches(meta, "train", t.batch_size, cfg.model.block_size, cfg.system.seed,
                            rt.device, cfg.data.pin_memory, dist.rank, dist.world_size,
                            prefetch=cfg.data.prefetch)
    if cfg.data.loader_workers:  # read ahead by worker processes, through shared memory
        train_batches = SharedMemoryBatches(train_batches, meta, "train", cfg.data.loader_workers)
    loaders = {"train": train_batches,
               "val": Batches(meta, "val", t.batch_size, cfg.model.block_size, cfg.system.seed,
                              rt.device, cfg.data.pin_memory, dist.rank, dist.world_size)}
    eval_sets = {split: b.fixed(t.eval_iters, seed=cfg.system.seed + 1 + i)
                 for i, (split, b) in enumerate(loaders.items())}
    return train_batches, loaders, eval_sets


def print_model_and_memory(cfg: Config, dist: distributed.Dist, raw_model: GPT,
                           source: Path | None, weights_note: str, train_batches) -> None:
    print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters without embeddings, "
          f"{raw_model.num_params(False) / 1e6:.2f}M with"
          + (f" | from {source}" if source else ""))
    print(f"memory: weights={weights_note} "
          f"activation_checkpointing={cfg.model.activation_checkpointing} "
          f"empty_cache={'on' if cfg.system.empty_cache else 'off'} "
          f"prefetch={train_batches.prefetch_note} loader_workers={cfg.data.loader_workers}")
    print(memory.format_estimate(memory.estimate(cfg, dist.world_size), cfg))


def train_rank(cfg: Config, dist: distributed.Dist) -> dict:
    rt = runtime.setup(dist.system(cfg.system))
    with dist.main_first():  # rank 0 prepares the data, tidies out_dir, downloads GPT-2 first
        meta = dataset_meta(cfg)
        resolve_init(cfg.train)
        raw_model, source = build_model(cfg, meta, rt.device)
    t = cfg.train
    dist.same_everywhere(checkpoint.read_meta(source)["step"] if t.init_from == "resume" else -1,
                         "the checkpoint to resume (put out_dir where every node sees it)")
    accum_note = distributed.set_global_batch(t, cfg.model.block_size, dist.world_size)
    batch_note = distributed.auto_micro_batch(dist, cfg, raw_model, rt)  # may change it
    weights_note = memory.hold_weights(raw_model, cfg.system.weights_dtype, cfg.system.parallel,
                                       dist.world_size)
    kernels = speedups.probe_attention(raw_model, rt, t.batch_size)  # before FSDP shards it
    model = dist.wrap(raw_model, cfg, rt)  # DDP or FSDP2 with several processes
    optimizer, fused_note = make_optimizer(raw_model, cfg, rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    train_batches, loaders, eval_sets = make_loaders(cfg, meta, rt, dist)
    hellaswag_eval = hellaswag.for_training(cfg, meta, rt)  # None unless hellaswag_interval
    counters, next_batch, resume_notes, state = resume.Counters(), None, [], None
    if t.init_from == "resume":
        state = checkpoint.load_train_state(source)
        counters, next_batch, resume_notes = resume.restore_train_state(
            state, dist.optimizer(raw_model, optimizer), scaler, train_batches, rt.device,
            str(source))
        resume_notes += resume.config_changes(checkpoint.read_config(source), cfg,
                                                (state.get("world_size", 1), dist.world_size))
    resume_notes += dist.restore_rank_rng(state, cfg.system.seed, counters.step)
    model, compile_note = techniques.compile_model(model, cfg.system, rt)
    if cfg.system.compile:  # every shape compiled now: no recompiles (or stalls) later
        memory.warm_up_training(model, raw_model, rt.device, rt.autocast, t.batch_size)

    print(f"config:\n{cfg.to_json()}")
    print(speedups.banner(speedups.settings(cfg, rt, fused_note, compile_note, batch_note,
                                            kernels), rt.notes))
    print(dist.describe(cfg) + (f"  [{accum_note}]" if accum_note else ""))
    print_model_and_memory(cfg, dist, raw_model, source, weights_note, train_batches)
    for note in resume_notes:
        print(f"note: {note}")
    tokens_per_step = t.batch_size * cfg.model.block_size * t.grad_accum_steps * dist.world_size
    peak = runtime.peak_flops(rt, cfg.system.peak_flops) * dist.world_size
    flops_per_step = raw_model.flops_per_token() * tokens_per_step
    run = runlog.RunLog(cfg, counters.step, resumed=t.init_from == "resume",
                        train_seconds=counters.train_seconds, wandb_id=counters.wandb_id,
                        files=dist.is_main)
    counters.wandb_id = run.wandb_id

    def save(step: int) -> None:
        if not t.save_checkpoints:
            return
        if not dist.weights_finite(raw_model):
            print(f"step {step:5d} | weights hold NaN/inf: not saved; the last good checkpoint "
                  f"is {checkpoint.latest_checkpoint(t.out_dir)}")
            stop.request("nonfinite")
            return
        counters.train_seconds = run.train_seconds
        # (x, y) is the batch already fetched for the next step
        state = dist.capture_train_state(raw_model, optimizer, scaler, train_batches, (x, y),
                                         counters, rt.device)  # every rank: FSDP gathers
        weights = dist.model_state(raw_model)  # None on ranks > 0
        if not dist.is_main:
            return
        info = {"losses": counters.losses, "eval_step": counters.eval_step,
                "tokens_seen": counters.tokens_seen, "tokenizer": meta["tokenizer"],
                "dataset": cfg.data.dataset}
        checkpoint.save(t.out_dir, step, raw_model, cfg, info, state, t.keep_checkpoints,
                        weights=weights)

    model.train()
    x, y = next_batch or train_batches.next()
    start_step = step = counters.step
    guard = resume.NonFiniteGuard(t.max_nonfinite_steps)
    # SIGINT/SIGTERM: save at the next step, exit (every rank at the same step)
    with distributed.stop_request(dist) as stop, run:
        while True:
            if (step % t.eval_interval == 0 or step == t.max_iters) and counters.eval_step != step:
                counters.record_eval(step, dist.mean_losses(evaluate(model, loaders, eval_sets,
                                                                     rt)))
                run.eval(step, counters.losses)  # prints it, redraws the loss curve
                if step > start_step:
                    save(step)
                memory.release_cached(rt.device, cfg.system.empty_cache)  # a phase boundary
            if hellaswag_eval and hellaswag_eval.due(step) and (step > start_step or step == 0):
                run.write(kind="hellaswag", step=step, **hellaswag_eval.run(raw_model, step))
                memory.release_cached(rt.device, cfg.system.empty_cache)
            if step >= t.max_iters or stop:
                break
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            result = train_step(model, raw_model, optimizer, scaler, train_batches, (x, y), rt,
                                lr, t.grad_accum_steps, t.grad_clip, guard, dist.grad_sync,
                                sync=lambda loss_sum: dist.sync_step(loss_sum, stop))
            loss_sum, norm, updated, (x, y) = (result.loss_sum, result.norm, result.updated,
                                               result.next_batch)
            step += 1
            counters.step, counters.tokens_seen = step, counters.tokens_seen + tokens_per_step
            if not updated:
                counters.skipped_steps += 1
                report_skip(run, step, loss_sum / t.grad_accum_steps, norm, guard)
                if guard.exhausted:
                    stop.request("nonfinite")
                    break
            if t.stop_after_iters and step - start_step >= t.stop_after_iters:
                stop.request("stop_after_iters")
            if step % t.log_interval == 0 or step == t.max_iters:
                loss_value = loss_sum.item() / t.grad_accum_steps  # .item() syncs the device
                dt = time.perf_counter() - t0
                mfu = flops_per_step / dt / peak if peak else None
                print(log_line(step, loss_value, lr, norm.item(), 1000 * dt, tokens_per_step / dt,
                               mfu) + run.progress(step))
                run.write(kind="train", step=step, loss=loss_value, lr=lr, norm=norm.item(),
                          ms=1000 * dt, tok_per_s=tokens_per_step / dt, mfu=mfu)
        if stop and stop.reason != "nonfinite" and counters.eval_step != step:
            save(step)  # stopped between evaluations: keep this step
        return run.finish(counters, stop.reason or "done", start_step,
                          checkpoint.latest_checkpoint(t.out_dir))


@dataclass
class TrainOptions:
    """train.py's own options (the rest of the command line is the config)."""

    estimate_memory: bool = opt(False, "print the memory estimate for this config and exit "
                                "without training")


def estimate_only(cfg: Config) -> str:
    """The start-up memory estimate, without building the model (vocab_size from the data)."""
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = dataset_meta(cfg)["vocab_size"]
    world = distributed.launch_env()[2]
    params = memory.parameter_count(cfg.model)
    return (f"model: {params / 1e6:.2f}M parameters, {world} process(es)\n"
            + memory.format_estimate(memory.estimate(cfg, world), cfg))


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (or stopped by stop_after_iters), 2 bad input, 3 stopped on NaN/inf,
    4 another process of a distributed run died or hung, 128 + N stopped by signal N after
    saving (130 for Ctrl-C, 143 for SIGTERM)."""
    where = distributed.error_prefix()  # 'rank 3: ' when there are several processes
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="train.py",
                                   script=TrainOptions)
        if options.estimate_memory:
            print(estimate_only(cfg))
            return 0
        summary = train(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError, runtime.SetupError) as e:
        print(f"{where}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing saved since the last checkpoint", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk outside a checkpoint save (those say more): metrics, data
        cause = checkpoint.disk_full_cause(e)
        if cause is None:
            raise
        print(f"{where}error: {cause} writing {e.filename or cfg.train.out_dir}; free some "
              "space there, or pass --out_dir=<a directory on a disk with room>", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not distributed.collective_failed(e):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"{where}error: waiting for the other processes failed ({first}): another rank "
              "died (its error is in the launcher's summary) or did not answer within "
              f"--dist_timeout={cfg.system.dist_timeout:g} seconds; a rank that is only slow (a "
              "long save or evaluation) needs a larger --dist_timeout", file=sys.stderr)
        return 4
    reason = summary["stop_reason"]
    if reason == "nonfinite":
        print(f"error: stopped at step {summary['step']}: the loss or gradient norm was NaN/inf "
              f"for {cfg.train.max_nonfinite_steps} steps in a row (or the weights were); "
              f"nothing non-finite was saved; the last good checkpoint is "
              f"{summary['checkpoint']}: resume it with --init_from=resume, perhaps with a "
              "lower --learning_rate", file=sys.stderr)
        return 3
    if reason.startswith("SIG"):
        return 128 + signal.Signals[reason].value
    return 0


if __name__ == "__main__":
    sys.exit(distributed.record(main)())
