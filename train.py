"""Train a GPT from one config.

    python train.py                          # tiny Shakespeare, char-level, CPU friendly
    python train.py --config gpt2_124m       # GPT-2 124M recipe
    python train.py --help                   # every key with its default

main(cfg): runtime setup -> data -> model -> optimizer -> one training loop -> checkpoints.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

import checkpoint
import runtime
from config import Config, ConfigError, load_config
from data.loader import Batches, DataError, check_vocab, load_meta
from model import GPT

DEFAULT_DATASET = "shakespeare_char"
# model-section keys that fix the weights' shapes; the others (attention, norm, ...) are free to
# change when starting from a checkpoint
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "vocab_pad_multiple")


def dataset_meta(cfg: Config) -> dict:
    """The dataset's metadata; the default dataset is prepared on first use."""
    try:
        return load_meta(cfg.data.dataset)
    except DataError:
        if cfg.data.dataset != DEFAULT_DATASET:
            raise
    from data.shakespeare_char.prepare import prepare
    print(f"preparing the default dataset ({DEFAULT_DATASET}) ...")
    prepare()
    return load_meta(cfg.data.dataset)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to the peak, then cosine (or constant) decay to min_lr_ratio * peak."""
    t = cfg.train
    peak = t.learning_rate
    if step < t.warmup_iters:
        return peak * (step + 1) / t.warmup_iters
    if t.lr_schedule == "constant" or t.max_iters <= t.warmup_iters:
        return peak
    progress = min(1.0, (step - t.warmup_iters) / (t.max_iters - t.warmup_iters))
    min_lr = peak * t.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def build_model(cfg: Config, meta: dict, device: torch.device) -> tuple[GPT, Path | None]:
    """A fresh model, or one whose weights (and shape) come from a checkpoint."""
    source = None
    init = cfg.train.init_from
    if init == "resume":
        source = checkpoint.latest_checkpoint(cfg.train.out_dir)
        if source is None:
            raise checkpoint.CheckpointError(f"init_from=resume but {cfg.train.out_dir} has no "
                                             "checkpoint; use init_from=scratch to start")
    elif init != "scratch":
        source = checkpoint.resolve(init)
    if source is not None:
        stored = checkpoint.read_config(source).model
        for key in SHAPE_KEYS:
            setattr(cfg.model, key, getattr(stored, key))
        if cfg.model.block_size > stored.block_size:
            raise ConfigError(f"block_size {cfg.model.block_size} is larger than the "
                              f"checkpoint's context {stored.block_size}; use a block_size "
                              f"<= {stored.block_size}")
    elif cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    check_vocab(meta, cfg.model.vocab_size)
    if source is None:
        return GPT(cfg.model).to(device), None
    stored_block = checkpoint.read_config(source).model.block_size
    block = cfg.model.block_size
    cfg.model.block_size = stored_block
    model = GPT(cfg.model)
    checkpoint.load_weights(model, source)
    if block < stored_block:
        crop_block_size(model, block)
    return model.to(device), source


def crop_block_size(model: GPT, block_size: int) -> None:
    """Shorten the context (e.g. 1024 -> 256) by keeping the first position embeddings."""
    model.config.block_size = block_size
    wpe = model.transformer.wpe
    wpe.weight = torch.nn.Parameter(wpe.weight.data[:block_size].clone())
    wpe.num_embeddings = block_size
    for block in model.transformer.h:
        if hasattr(block.attn, "mask"):
            block.attn.mask = block.attn.mask[:block_size, :block_size]


def make_optimizer(model: GPT, cfg: Config, device: torch.device) -> tuple[torch.optim.AdamW, str]:
    t = cfg.train
    groups = model.optimizer_groups(t.weight_decay)
    kwargs = dict(lr=t.learning_rate, betas=(t.beta1, t.beta2))
    if t.fused_adamw:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs), "on"
        except (RuntimeError, ValueError) as e:
            note = f"off (fused AdamW unsupported on {device.type}: {e})"
            return torch.optim.AdamW(groups, **kwargs), note
    return torch.optim.AdamW(groups, foreach=False, **kwargs), "off"


@torch.no_grad()
def evaluate(model: torch.nn.Module, loaders: dict[str, Batches], eval_sets: dict[str, list],
             rt: runtime.Runtime) -> dict[str, float]:
    """Mean loss per split over fixed batches (the same ones at every evaluation)."""
    was_training = model.training
    model.eval()
    out = {}
    for split, starts_list in eval_sets.items():
        losses = []
        for starts in starts_list:
            x, y = loaders[split].windows(starts)
            with rt.autocast():
                _, loss = model(x, y)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train(was_training)
    return out


def banner(cfg: Config, rt: runtime.Runtime, fused_note: str, compiled: bool) -> str:
    m, s = cfg.model, cfg.system
    pin = "on" if cfg.data.pin_memory and rt.device.type == "cuda" else (
        "off (needs CUDA)" if cfg.data.pin_memory else "off")
    parts = [f"device={rt.device}", f"attention={m.attention}", f"mask={m.causal_mask}",
             f"norm={m.norm}", f"gelu={m.gelu}", f"vocab_pad={m.vocab_pad_multiple}",
             f"dtype={s.dtype}", f"tf32={'on' if rt.tf32 else 'off'}",
             f"compile={s.compile_mode if compiled else 'off'}", f"fused_adamw={fused_note}",
             f"pin_memory={pin}", f"batch={cfg.train.batch_size}x{cfg.train.grad_accum_steps}"]
    notes = f"  [{'; '.join(rt.notes)}]" if rt.notes else ""
    return "speedups: " + " ".join(parts) + notes


def log_line(step: int, loss: float, lr: float, norm: float, ms: float, tok_s: float,
             mfu: float | None) -> str:
    line = (f"step {step:5d} | loss {loss:.4f} | lr {lr:.1e} | norm {norm:.2f} | {ms:.0f} ms | "
            f"{tok_s:,.0f} tok/s")
    return line + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")


class MetricsLog:
    """Appends one JSON object per event to out_dir/metrics.jsonl."""

    def __init__(self, out_dir: str):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / "metrics.jsonl"

    def write(self, **record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def train(cfg: Config) -> dict:
    """Run training as configured; returns a summary (final losses, steps, time, checkpoint)."""
    rt = runtime.setup(cfg.system)
    meta = dataset_meta(cfg)
    raw_model, source = build_model(cfg, meta, rt.device)
    optimizer, fused_note = make_optimizer(raw_model, cfg, rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    t = cfg.train
    train_batches = Batches(meta, "train", t.batch_size, cfg.model.block_size, cfg.system.seed,
                            rt.device, cfg.data.pin_memory)
    loaders = {"train": train_batches,
               "val": Batches(meta, "val", t.batch_size, cfg.model.block_size, cfg.system.seed,
                              rt.device, cfg.data.pin_memory)}
    eval_sets = {split: b.fixed(t.eval_iters, seed=cfg.system.seed + 1 + i)
                 for i, (split, b) in enumerate(loaders.items())}
    start_step, best_val = 0, math.inf
    if t.init_from == "resume":
        state = checkpoint.load_train_state(source)
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        train_batches.load_state_dict(state["data"])
        torch.set_rng_state(state["torch_rng"])
        start_step, best_val = state["step"], state["best_val"]
    model = torch.compile(raw_model, mode=cfg.system.compile_mode) if cfg.system.compile else raw_model

    print(f"config:\n{cfg.to_json()}")
    print(banner(cfg, rt, fused_note, cfg.system.compile))
    tokens_per_step = t.batch_size * cfg.model.block_size * t.grad_accum_steps
    print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters without embeddings, "
          f"{raw_model.num_params(False) / 1e6:.2f}M with | {tokens_per_step:,} tokens per step"
          + (f" | from {source}" if source else ""))
    peak = runtime.peak_flops(rt, cfg.system.peak_flops)
    flops_per_step = raw_model.flops_per_token() * tokens_per_step
    metrics = MetricsLog(t.out_dir)

    def save(step: int, losses: dict) -> Path | None:
        if not t.save_checkpoints:
            return None
        state = {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                 "data": train_batches.state_dict(), "torch_rng": torch.get_rng_state(),
                 "step": step, "best_val": best_val}
        info = {"losses": losses, "tokens_seen": step * tokens_per_step,
                "tokenizer": meta["tokenizer"], "dataset": cfg.data.dataset}
        return checkpoint.save(t.out_dir, step, raw_model, cfg, info, state, t.keep_checkpoints)

    model.train()
    x, y = train_batches.next()
    losses, last_ckpt, run_start = {}, None, time.perf_counter()
    step = start_step
    while True:
        if step % t.eval_interval == 0 or step == t.max_iters:
            losses = evaluate(model, loaders, eval_sets, rt)
            best_val = min(best_val, losses["val"])
            print(f"eval {step:5d} | train {losses['train']:.4f} | val {losses['val']:.4f} | "
                  f"val ppl {math.exp(losses['val']):.2f}")
            metrics.write(kind="eval", step=step, **losses)
            if step > start_step:
                last_ckpt = save(step, losses)
        if step >= t.max_iters:
            break
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=rt.device)
        for micro in range(t.grad_accum_steps):
            with rt.autocast():
                _, loss = model(x, y)
            x, y = train_batches.next()  # fetch the next batch while the device works
            loss_sum += loss.detach()
            scaler.scale(loss / t.grad_accum_steps).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                              t.grad_clip if t.grad_clip > 0 else math.inf)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % t.log_interval == 0 or step == t.max_iters:
            loss_value = loss_sum.item() / t.grad_accum_steps  # .item() syncs the device
            dt = time.perf_counter() - t0
            mfu = flops_per_step / dt / peak if peak else None
            print(log_line(step, loss_value, lr, norm.item(), 1000 * dt, tokens_per_step / dt, mfu))
            metrics.write(kind="train", step=step, loss=loss_value, lr=lr, norm=norm.item(),
                          ms=1000 * dt, tok_per_s=tokens_per_step / dt)
    elapsed = time.perf_counter() - run_start
    summary = {"steps": step - start_step, "seconds": elapsed, "final": losses,
               "best_val": best_val, "tokens_seen": step * tokens_per_step,
               "checkpoint": str(last_ckpt) if last_ckpt else None}
    print(f"done: {summary['steps']} steps in {elapsed:.1f}s | val {losses.get('val', math.nan):.4f}"
          f" (best {best_val:.4f}) | checkpoint {summary['checkpoint']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, _ = load_config(sys.argv[1:] if argv is None else argv, prog="train.py")
        train(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
