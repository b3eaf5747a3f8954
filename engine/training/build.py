"""One way to build a training run, for train.py and for every benchmark that trains.

    run = build_run(cfg, dist)         # train.py: the model, optimizer, loaders, resume, run log
    run = build_training(cfg, Dist(), evaluates=False)  # a benchmark: no resume, no run log

build_training makes the model (fresh, or from train.init_from), applies the speedups, makes
the optimizer, the gradient scaler and the loaders (single-file or sharded data alike);
build_run adds HellaSwag scoring, the resumed state and the run log.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from config import Config
from data.dataset import check_vocab, is_instruction_file, load_or_prepare, token_bytes
from data.loader import Batches
from engine import checkpoint, device
from engine.training import metrics, resume, speedups
from engine.training.optim import fused_note, make_optimizer
from engine.training.processes import Dist
from engine.training.step import Trainer, grad_sync
from model import GPT


@dataclass
class Run:
    """Everything one training run holds, made by build_training and build_run."""

    cfg: Config
    dist: Dist
    rt: device.Runtime
    meta: dict
    raw_model: GPT  # the plain model: checkpoints, HellaSwag, sampling
    model: torch.nn.Module  # what the loop trains: raw_model with its speedups applied
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    batches: Batches  # this rank's training batches
    loaders: dict[str, Batches]  # both splits, for evaluation
    eval_sets: dict[str, list]  # the fixed evaluation batches
    source: Path | None  # the checkpoint or weights the run starts from
    notes: speedups.Notes  # for the start-up banner
    peak_flops: float  # of every process together; 0 when unknown
    counters: resume.Counters = field(default_factory=resume.Counters)
    next_batch: tuple | None = None  # (x, y) of the first step; build_run fetches it
    token_bytes: torch.Tensor | None = None  # each id's bytes: val bpb (not for instruction data)
    hellaswag: object | None = None  # engine/hellaswag.TrainingEval: train.hellaswag_interval
    log: metrics.RunLog | None = None  # build_run's; benchmarks write none
    shards: object | None = None  # engine/sharded.ShardedWriter: train.checkpoint_format

    def checkpoint_weights(self) -> tuple[dict | None, dict]:
        """(the weights a checkpoint stores (None on ranks > 0), what its meta.json adds): every
        weight, or a LoRA run's adapters and the base they adapt."""
        if getattr(self.raw_model, "lora", None) is None:
            return self.dist.full_weights(self.raw_model), {}
        from engine.lora import adapter_state

        weights = adapter_state(self.raw_model) if self.dist.is_main else None
        return weights, {"lora": self.raw_model.lora_record}

    def trainer(self) -> Trainer:
        """What a step works on (engine/training/step.py)."""
        t = self.cfg.train
        return Trainer(self.model, self.raw_model, self.optimizer, self.scaler, self.batches,
                       self.rt, t.grad_accum_steps, t.grad_clip, grad_sync(self.model))

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step reads; instruction data: its rows' mean length so far, padding in."""
        t, row = self.cfg.train, getattr(self.batches, "mean_row_tokens", None)
        return round(t.batch_size * (row or self.cfg.model.block_size) * t.grad_accum_steps
                     * self.dist.world_size)


def make_loaders(cfg: Config, meta: dict, rt: device.Runtime, dist: Dist
                 ) -> tuple[Batches, dict[str, Batches], dict[str, list]]:
    """This rank's training batches, both splits' loaders, and the fixed evaluation batches."""
    t, d = cfg.train, cfg.data
    loader = Batches
    if "shards" in meta:  # a sharded corpus: each token an input once per epoch
        from data.shard_batches import ShardBatches as loader
    if "instruction" in meta:  # whole examples a row, the loss on their responses
        from data.instruct import InstructBatches as loader
    if "mixture" in meta:  # rows from several datasets (data/mixture.py)
        from data.mixture import MixtureBatches as loader
    kinds = {"train": loader, "val": loader}
    if d.doc_aligned:  # training rows of whole documents; val keeps the usual windows
        from data.doc_batches import doc_loader

        kinds["train"] = doc_loader(meta, d.loader_workers)
    split = {split: kind(meta, split, t.batch_size, cfg.model.block_size, cfg.system.seed,
                         rt.device, d.pin_memory, dist.rank, dist.world_size,
                         prefetch=d.prefetch and split == "train")
             for split, kind in kinds.items()}
    eval_sets = {name: b.fixed(t.eval_iters, seed=cfg.system.seed + 1 + i)
                 for i, (name, b) in enumerate(split.items())}
    batches = split["train"]
    if d.loader_workers:  # batches read by worker processes into shared memory
        from data.loader_workers import SharedMemoryBatches

        batches = SharedMemoryBatches(batches, meta, "train", d.loader_workers)
    return batches, {"train": batches, "val": split["val"]}, eval_sets


def build_training(cfg: Config, dist: Dist, evaluates: bool = True) -> Run:
    """The model (from train.init_from as given) with its speedups, optimizer, scaler and
    loaders; out_dir is neither read nor written. evaluates=False: no eval step is compiled."""
    rt, t = device.setup(cfg.system, device=dist.device), cfg.train
    with dist.main_first():  # rank 0 prepares the data and downloads GPT-2 first
        if cfg.data.mixture:  # several datasets, each row's drawn by weight
            from data.mixture import describe, mixture_meta

            meta = mixture_meta(cfg.data)
            meta["notes"] = describe(meta, cfg, dist.world_size)
        elif is_instruction_file(cfg.data.dataset):  # examples in the model's tokens
            from engine.training.finetune import instruction_data

            meta = instruction_data(cfg)
        else:
            meta = load_or_prepare(cfg.data.dataset)
        raw_model, source = build_model(cfg, meta, rt.device)
    if dist.is_main:  # before the batch-size search and compile warm-up, which may take long
        print(metrics.estimate_line(cfg, raw_model, rt, dist.world_size, meta), flush=True)
    dist.same_everywhere(checkpoint.read_meta(source)["step"] if t.init_from == "resume" else -1,
                         "the checkpoint to resume (put out_dir where every node sees it)")
    finetuning = meta.pop("notes", [])  # the banner's lines: the mixture, finetuning
    if cfg.lora.rank or getattr(raw_model, "lora", None):  # adapters train, the rest is frozen
        from engine.lora import attach

        finetuning.append(attach(raw_model, cfg, source))
    if "instruction" in meta:  # the loss counts the responses: the LM head only there
        from engine.training.finetune import head_at_counted_positions

        finetuning.append(head_at_counted_positions(raw_model))
    model, notes = speedups.apply(raw_model, cfg, rt, dist, evaluates)
    notes.lines += finetuning
    optimizer = make_optimizer(raw_model, cfg, rt.device)
    notes.fused_adamw = fused_note(optimizer, cfg)
    if getattr(raw_model, checkpoint.MASKS, None):  # a pruned model keeps its zeros
        from engine import pruning

        notes.lines += pruning.hold_zeros(raw_model, optimizer)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    batches, loaders, eval_sets = make_loaders(cfg, meta, rt, dist)
    notes.lines += [batches.note] if cfg.data.doc_aligned else []
    sizes = None if "instruction" in meta else torch.from_numpy(token_bytes(meta)).to(rt.device)
    return Run(cfg, dist, rt, meta, raw_model, model, optimizer, scaler, batches, loaders,
               eval_sets, source, notes,
               metrics.peak_flops(rt, cfg.system.peak_flops) * dist.world_size, token_bytes=sizes)


def build_run(cfg: Config, dist: Dist) -> Run:
    """out_dir's run to resume (or none), build_training, then HellaSwag scoring, the resumed
    state (or a fresh start) and the run log."""
    with dist.main_first():  # rank 0 tidies out_dir first
        cfg.train.init_from = resume.resolve_init(cfg.train.init_from, cfg.train.out_dir)
    t, shards = cfg.train, None
    sharded = t.checkpoint_format == "sharded" or (
        t.checkpoint_format == "auto" and dist.enabled and dist.parallel == "fsdp")
    if sharded or t.checkpoint_async:  # each process writes its own shards (checked first)
        from engine.sharded import ShardedWriter

        shards = ShardedWriter.for_run(cfg, dist, sharded)
    run = build_training(cfg, dist)
    if cfg.train.hellaswag_interval:
        from engine.hellaswag import TrainingEval

        run.hellaswag = TrainingEval(cfg, run.meta, run.rt)
    next_batch, resumed = None, []
    if cfg.train.init_from == "resume" or dist.enabled:  # as saved; each rank's dropout stream
        from engine.training.restore import restore

        run.counters, next_batch, resumed = restore(
            run.source, cfg, dist, run.raw_model, run.optimizer, run.scaler, run.batches,
            run.rt.device)
    run.notes.lines += resumed
    run.log = metrics.RunLog(cfg, run.counters.step, resumed=cfg.train.init_from == "resume",
                            files=dist.is_main, train_seconds=run.counters.train_seconds,
                            wandb_id=run.counters.wandb_id)
    run.counters.wandb_id = run.log.wandb_id
    run.next_batch = next_batch or run.batches.next()
    run.shards = shards
    return run


def build_model(cfg: Config, meta: dict, target: torch.device) -> tuple[GPT, Path | None]:
    """train.init_from's model and its checkpoint or HF directory (None: fresh)."""
    if cfg.train.init_from != "scratch":  # a checkpoint's or GPT-2's weights
        from engine.training.init_from import load_for_training

        return load_for_training(cfg, meta, target)
    cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
    check_vocab(meta, cfg.model.vocab_size)
    if meta["vocab_size"] < cfg.model.vocab_size:  # a config sized for another tokenizer
        print(f"note: the model has {cfg.model.vocab_size:,} token ids, the data "
              f"{meta['vocab_size']:,}: the rest never occur; --vocab_size=0 takes the data's")
    return GPT(cfg.model).to(target), None
