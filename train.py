"""Train a GPT from one config.

    python train.py                          # tiny Shakespeare, char-level, CPU friendly
    python train.py --config gpt2_124m       # GPT-2 124M recipe
    python train.py --help                   # every key with the value it resolves to
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_124m   # several GPUs

build_run(cfg, dist) -> Run: data, the model with its techniques applied, optimizer, a resumed
run's state, the run log. train(cfg): build_run, then the loop (evaluate and checkpoint every
eval_interval steps, one train_step per step) until max_iters or a stop request.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, load_config, opt
from data.loader import Batches, DataError, open_batches
from data.workers import SharedMemoryBatches
from engine import checkpoint, distributed, hellaswag, memory, resume, runlog, runtime, techniques
from engine.optim import fused_note, lr_at, make_optimizer
from engine.sources import build_model, dataset_meta
from engine.step import NonFiniteGuard, StepResult, Trainer, evaluate, train_step
from model import GPT


@dataclass
class TrainOptions:
    """train.py's own options (the rest of the command line is the config)."""

    estimate_memory: bool = opt(False, "print the memory estimate for this config and exit "
                                "without training")


@dataclass
class Run:
    """Everything one training run holds, made by build_run."""

    cfg: Config
    dist: distributed.Dist
    rt: runtime.Runtime
    meta: dict
    raw_model: GPT  # the plain model: checkpoints, HellaSwag, sampling
    model: torch.nn.Module  # what the loop trains: raw_model with its techniques applied
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    batches: Batches  # this rank's training batches
    loaders: dict[str, Batches]  # both splits, for evaluation
    eval_sets: dict[str, list]  # the fixed evaluation batches
    hellaswag: hellaswag.TrainingEval | None
    counters: resume.Counters
    next_batch: tuple  # (x, y) of the first step
    source: Path | None  # the checkpoint or weights the run starts from
    notes: techniques.Notes  # for the start-up banner
    log: runlog.RunLog
    peak_flops: float  # of every process together; 0 when unknown

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.batch_size * self.cfg.model.block_size * t.grad_accum_steps * self.dist.world_size


def make_loaders(cfg: Config, meta: dict, rt: runtime.Runtime, dist: distributed.Dist
                 ) -> tuple[Batches, dict[str, Batches], dict[str, list]]:
    """This rank's training batches, both splits' loaders, and the fixed evaluation batches."""
    t, d = cfg.train, cfg.data
    split = {split: open_batches(meta, split, t.batch_size, cfg.model.block_size,
                                 cfg.system.seed, rt.device, d.pin_memory, dist.rank,
                                 dist.world_size, prefetch=d.prefetch and split == "train")
             for split in ("train", "val")}
    eval_sets = {name: b.fixed(t.eval_iters, seed=cfg.system.seed + 1 + i)
                 for i, (name, b) in enumerate(split.items())}
    batches = split["train"]
    if d.loader_workers:
        batches = SharedMemoryBatches(batches, meta, "train", d.loader_workers)
    return batches, {"train": batches, "val": split["val"]}, eval_sets


def build_run(cfg: Config, dist: distributed.Dist) -> Run:
    rt, t = runtime.setup(cfg.system, device=dist.device), cfg.train
    with dist.main_first():  # rank 0 prepares the data, tidies out_dir, downloads GPT-2 first
        t.init_from = resume.resolve_init(t.init_from, t.out_dir)
        meta = dataset_meta(cfg.data.dataset)
        raw_model, source = build_model(cfg, meta, rt.device)
    if dist.is_main:  # before the batch-size search and compile warm-up, which may take long
        print(estimate_line(cfg, raw_model, rt, dist.world_size), flush=True)
    resuming = t.init_from == "resume"
    dist.same_everywhere(checkpoint.read_meta(source)["step"] if resuming else -1,
                         "the checkpoint to resume (put out_dir where every node sees it)")
    model, notes = techniques.apply(raw_model, cfg, rt, dist)
    optimizer = make_optimizer(raw_model, cfg, rt.device)
    notes.fused_adamw = fused_note(optimizer, cfg)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    batches, loaders, eval_sets = make_loaders(cfg, meta, rt, dist)
    scored = hellaswag.TrainingEval(cfg, meta, rt) if cfg.train.hellaswag_interval else None
    counters, next_batch, notes.lines = resume.restore(source, cfg, dist, raw_model, optimizer,
                                                       scaler, batches, rt.device)
    log = runlog.RunLog(cfg, counters.step, resumed=resuming, files=dist.is_main,
                        train_seconds=counters.train_seconds, wandb_id=counters.wandb_id)
    counters.wandb_id = log.wandb_id
    return Run(cfg, dist, rt, meta, raw_model, model, optimizer, scaler, batches, loaders,
               eval_sets, scored, counters, next_batch or batches.next(), source, notes,
               log, runtime.peak_flops(rt, cfg.system.peak_flops) * dist.world_size)


def estimate_line(cfg: Config, raw_model: GPT, rt: runtime.Runtime, world_size: int) -> str:
    """About the time a step and the whole run take: their FLOPs at this device's matmul rate
    in the chosen dtype (measured now, in about 0.2 s; bench.py sets it against measured)."""
    t, block = cfg.train, cfg.model.block_size
    tokens = t.tokens_per_step or t.batch_size * t.grad_accum_steps * block * world_size
    per_token = raw_model.flops_per_token()  # training: forward + backward
    evaluations = t.max_iters // t.eval_interval + 1 + (t.max_iters % t.eval_interval > 0)
    eval_tokens = evaluations * 2 * t.eval_iters * t.batch_size * block  # both splits
    rate = runtime.matmul_rate(rt.device, rt.dtype)
    est = runtime.time_estimate(per_token * tokens / world_size, t.max_iters,
                                per_token / 3 * eval_tokens, rate)
    line = (f"estimate: ~{runtime.format_seconds(est['step_s'])} per step, ~"
            f"{runtime.format_seconds(est['run_s'])} for {t.max_iters} steps and {evaluations} "
            f"evaluations ({per_token * tokens / world_size / 1e9:,.1f} GFLOP per step at "
            f"{rate / 1e9:,.1f} GFLOP/s, the {str(rt.dtype).removeprefix('torch.')} matmul rate "
            "measured here; other work adds to it, a busy machine's probe reads low)")
    if est["step_s"] > 60:
        line += "\nnote: this recipe is far too big for this device; on a CPU try --config " \
                "shakespeare_char, or a smaller model, batch or --max_iters"
    return line


def print_banner(run: Run) -> None:
    cfg, notes, m = run.cfg, run.notes, run.raw_model
    print(f"config:\n{cfg.to_json()}")
    print(techniques.banner(techniques.settings(cfg, run.rt, notes), run.rt.notes))
    print(run.dist.describe(notes.global_batch))
    print(f"model: {m.num_params() / 1e6:.2f}M parameters without embeddings, "
          f"{m.num_params(False) / 1e6:.2f}M with"
          + (f" | from {run.source}" if run.source else ""))
    print(f"memory: weights={notes.weights} "
          f"activation_checkpointing={cfg.model.activation_checkpointing} "
          f"empty_cache={'on' if cfg.system.empty_cache else 'off'} "
          f"prefetch={run.batches.prefetch_note} loader_workers={cfg.data.loader_workers}")
    print(memory.format_estimate(memory.estimate(cfg, run.dist.world_size), cfg))
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
                           next_batch, counters, run.rt.device)  # None on ranks > 0
    weights = resume.full_weights(dist, run.raw_model)
    if dist.is_main:
        info = {"losses": counters.losses, "eval_step": counters.eval_step,
                "tokens_seen": counters.tokens_seen, "tokenizer": run.meta["tokenizer"],
                "dataset": run.cfg.data.dataset}
        checkpoint.save(t.out_dir, step, run.raw_model, run.cfg, info, state,
                        t.keep_checkpoints, weights=weights)


def evaluate_and_save(run: Run, step: int, next_batch: tuple, stop: resume.StopRequest,
                      keep: bool) -> None:
    losses = evaluate(run.model, run.loaders, run.eval_sets, run.rt)
    run.counters.record_eval(step, run.dist.mean_losses(losses))
    run.log.eval(step, run.counters.losses)  # prints it, redraws the loss curve
    if keep:
        save(run, step, next_batch, stop)
    memory.release_cached(run.rt.device, run.cfg.system.empty_cache)  # a phase boundary


def log_step(run: Run, step: int, result: StepResult, lr: float,
             since: tuple[int, float]) -> tuple[int, float]:
    """The log line, timed per step since `since` (step, time); returns the next `since`."""
    loss = result.loss_sum.item() / run.cfg.train.grad_accum_steps  # .item() syncs the device
    norm, now = result.norm.item(), time.perf_counter()
    dt = (now - since[1]) / max(1, step - since[0])
    flops_per_step = run.raw_model.flops_per_token() * run.tokens_per_step
    mfu = flops_per_step / dt / run.peak_flops if run.peak_flops else None
    tokens_per_s = run.tokens_per_step / dt
    print(runlog.log_line(step, loss, lr, norm, 1000 * dt, tokens_per_s, mfu)
          + run.log.progress(step))
    run.log.write(kind="train", step=step, loss=loss, lr=lr, norm=norm, ms=1000 * dt,
                  tok_per_s=tokens_per_s, mfu=mfu)
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
    checkpoint.check_out_dir(cfg.train.out_dir)  # a file there: say so before any work
    dist = distributed.init(cfg)
    run = build_run(cfg, dist)
    print_banner(run)
    t, counters = cfg.train, run.counters
    run.model.train()
    x, y = run.next_batch
    start_step = step = counters.step
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    last_log = (step, time.perf_counter())  # (step, time) of the last log line
    with resume.StopRequest(synced=dist.enabled) as stop, run.log:
        def sync(loss_sum: torch.Tensor) -> torch.Tensor:  # the mean over ranks; shares stops
            return dist.sync_step(loss_sum, stop)

        trainer = Trainer(run.model, run.raw_model, run.optimizer, run.scaler, run.batches,
                          run.rt, t.grad_accum_steps, t.grad_clip,
                          techniques.grad_sync(run.model), sync)
        while True:
            if (step % t.eval_interval == 0 or step == t.max_iters) and counters.eval_step != step:
                evaluate_and_save(run, step, (x, y), stop, keep=step > start_step)
                last_log = (step, time.perf_counter())  # the step times leave evaluations out
            if run.hellaswag and run.hellaswag.due(step) and (step > start_step or step == 0):
                run.log.write(kind="hellaswag", step=step,
                              **run.hellaswag.run(run.raw_model, step))
                memory.release_cached(run.rt.device, cfg.system.empty_cache)
                last_log = (step, time.perf_counter())
            if step >= t.max_iters or stop:
                break
            lr = lr_at(step, cfg)
            result = train_step(trainer, (x, y), lr)
            x, y = result.next_batch
            step += 1
            counters.step, counters.tokens_seen = step, counters.tokens_seen + run.tokens_per_step
            guard.record(step, result)  # nothing read yet: the device runs ahead
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
        summary = run.log.finish(counters, stop.reason or "done", start_step,
                                 checkpoint.latest_checkpoint(t.out_dir))
    dist.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (or stopped by stop_after_iters), 2 bad input, 3 stopped on NaN/inf,
    4 another process of a distributed run died or hung, 128 + N stopped by signal N after
    saving (130 for Ctrl-C, 143 for SIGTERM)."""
    where, cfg = distributed.error_prefix(), None
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="train.py",
                                   script=TrainOptions)
        if options.estimate_memory:  # without building the model: vocab_size from the data
            meta = {} if cfg.model.vocab_size else dataset_meta(cfg.data.dataset)
            cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
            print(memory.describe(cfg, distributed.launch_env()[2]))
            return 0
        summary = train(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError, runtime.SetupError) as e:
        return fail(f"{where}error: {e}", 2)
    except KeyboardInterrupt:
        return fail("interrupted: nothing saved since the last checkpoint", 130)
    except OSError as e:  # a full disk outside a checkpoint save (those say more): metrics, data
        if (cause := checkpoint.disk_full_cause(e)) is None:
            raise
        return fail(f"{where}error: {cause} writing {e.filename or 'out_dir'}; free some "
                    "space there, or pass --out_dir=<a directory on a disk with room>", 2)
    except RuntimeError as e:
        if cfg is None or (message := distributed.collective_failure(
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
    sys.exit(distributed.record(main)())
