"""Sample text from a trained model.

    python generate.py --prompt "ROMEO:"                       # latest checkpoint of the default run
    python generate.py --checkpoint out/tiny --temperature 0   # greedy, from another run
    python generate.py --prompt FILE:prompt.txt --num_samples 3 --top_p 0.9 --seed 7
    python generate.py --init-from gpt2 --prompt "Hello, I'm a language model,"   # OpenAI's GPT-2

Tokens stream to stdout as they are produced. With the KV cache each new token costs the same
however long the text; when the context fills up, the oldest half is dropped and the rest
re-read once (the uncached path follows the same rule, so both give the same tokens).
"""
from __future__ import annotations

import codecs
import contextlib
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engine import checkpoint
import load_gpt2_weights
from engine import quantize, techniques
from engine import runtime
from config import Config, ConfigError, load_config, opt
from model import GPT
from engine.tokenizer import TokenizerError, from_meta


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from (B, V) logits: greedy at temperature 0, else top-k then top-p
    filtered sampling. Returns (B, 1)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def fresh(ids: torch.Tensor) -> torch.Tensor:
    """A copy with standard strides: a slice of the growing idx carries its row stride, a
    changing number that compiled code would otherwise guard on (and recompile for)."""
    return ids.clone(memory_format=torch.contiguous_format)


def prefill(model: GPT, ids: torch.Tensor, cache, bucket: int) -> torch.Tensor:
    """Run the prompt ids (B, L) into the cache; returns its logits (B, L, vocab). With a bucket
    the prompt is right-padded to a multiple of it (at most block_size): the padding's keys land
    beyond the real length, are masked out and are overwritten by the tokens that follow."""
    if bucket <= 0:
        return model(ids, kv_cache=cache)[0]
    length = ids.size(1)
    padded = min(model.config.block_size, -(-length // bucket) * bucket)
    ids = fresh(F.pad(ids, (0, padded - length)))
    logits, _ = model(ids, kv_cache=cache)  # (B, padded, vocab)
    cache.set_length(length)
    return logits[:, :length]


def warm_up(model: GPT, prompt_length: int, max_new_tokens: int, bucket: int,
            autocast=None) -> None:
    """Compile every shape this generation will use before the first real token: the prompt's
    bucket, one decode step, and the re-read of the kept half when the context overflows."""
    block = model.config.block_size
    lengths = {min(prompt_length, block)}
    if prompt_length + max_new_tokens > block:
        lengths.add(block - block // 2)
    for length in sorted(lengths):
        dummy = torch.zeros((1, length), dtype=torch.long,
                            device=model.transformer.wte.weight.device)
        generate_tokens(model, dummy, 2, temperature=0, autocast=autocast, prompt_bucket=bucket)


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, kv_cache: bool = True,
                    generator: torch.Generator | None = None,
                    on_token: Callable[[torch.Tensor], None] | None = None,
                    autocast=None, prompt_bucket: int = 0) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens. The model sees tokens[start:], where start
    jumps forward by half a context whenever the context is full. prompt_bucket > 0 (compiled
    models): a static KV cache, and prompts right-padded to a multiple of it, so the model only
    ever sees a few shapes."""
    block = model.config.block_size
    keep = block - block // 2  # context kept when it overflows: the newest half
    start = max(0, idx.size(1) - block)
    cache = None
    ctx = autocast or contextlib.nullcontext
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block:
            start = idx.size(1) - keep
            cache = None  # positions shifted: re-read the kept half once
        with ctx():
            if kv_cache:
                if cache is None:
                    cache = model.new_kv_cache(idx.size(0), static=prompt_bucket > 0)
                    logits = prefill(model, idx[:, start:], cache, prompt_bucket)
                else:
                    logits, _ = model(fresh(idx[:, -1:]), kv_cache=cache)
            else:
                logits, _ = model(idx[:, start:])
        next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        idx = torch.cat([idx, next_id], dim=1)
        if on_token is not None:
            on_token(next_id)
    return idx


class StreamPrinter:
    """Writes tokens as text as they arrive, holding back bytes of an unfinished UTF-8 char."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: torch.Tensor) -> None:
        ids = [int(token[0, 0])]
        if hasattr(self.tokenizer, "decode_bytes"):
            text = self.utf8.decode(self.tokenizer.decode_bytes(ids))
        else:
            text = self.tokenizer.decode(ids)
        self.out.write(text)
        self.out.flush()

    def finish(self) -> None:
        self.out.write(self.utf8.decode(b"", final=True) + "\n")
        self.out.flush()


def read_prompt(prompt: str) -> str:
    if prompt.startswith("FILE:"):
        path = Path(prompt[5:])
        if not path.is_file():
            raise ConfigError(f"prompt file {path} not found")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"prompt file {path} is not UTF-8 text (byte "
                                 f"{e.object[e.start]:#04x} at offset {e.start}); save it as "
                                 "UTF-8") from None
    return prompt


def encode_prompt(tokenizer, prompt: str, block_size: int) -> list[int]:
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        return [tokenizer.start_id]
    if len(ids) > block_size:
        print(f"note: prompt has {len(ids)} tokens but block_size is {block_size}; keeping the "
              f"last {block_size}", file=sys.stderr)
        ids = ids[-block_size:]
    return ids


@dataclass
class GenerateOptions:
    """generate.py's own options (the rest of the command line is the config)."""

    init_from: str = opt("", "sample from gpt2 | gpt2-medium | gpt2-large | gpt2-xl | "
                         "hf:ORG/NAME | a local HF directory | one of our checkpoints; not given: "
                         "sample.checkpoint, else the latest checkpoint in train.out_dir")


def load_hf_for_sampling(cfg: Config, source: str, device: torch.device) -> tuple[GPT, dict, str]:
    """A Hugging Face GPT-2 at its full context, with this config's implementation switches."""
    model, hf_dir = load_gpt2_weights.load_hf(source, copy.deepcopy(cfg.model))
    vocab = model.config.vocab_size
    tokenizer = load_gpt2_weights.tokenizer_meta(vocab)
    if tokenizer["kind"] != "gpt2":
        raise TokenizerError(f"{source} has a {vocab}-token vocabulary, not GPT-2's "
                             f"{load_gpt2_weights.GPT2_VOCAB}: there is no tokenizer for it here")
    label = source if Path(source) == hf_dir else f"{source} ({hf_dir})"
    return model.to(device), {"tokenizer": tokenizer}, label


def load_for_sampling(cfg: Config, device: torch.device,
                      init_from: str = "") -> tuple[GPT, Config, dict, Path | str]:
    if init_from and cfg.sample.checkpoint:
        raise ConfigError(f"--init-from {init_from} and --checkpoint {cfg.sample.checkpoint} both "
                          "name a model to sample from; pass one of them")
    if init_from == "scratch":
        raise ConfigError("--init-from scratch has nothing to sample from; pass a GPT-2 id, a "
                          "Hugging Face directory or one of our checkpoints")
    if init_from and load_gpt2_weights.is_gpt2_source(init_from):
        model, meta, label = load_hf_for_sampling(cfg, init_from, device)
        return model, cfg, meta, label
    if init_from in ("", "resume", "auto"):
        init_from = cfg.sample.checkpoint or cfg.train.out_dir
    path = checkpoint.resolve(init_from)
    model, stored, meta = checkpoint.load_model(path, device)
    return model, stored, meta, path


def sample(cfg: Config, init_from: str = "") -> list[str]:
    """Generate cfg.sample.num_samples texts, streaming them to stdout; returns them. init_from
    (a GPT-2 id, HF directory or checkpoint) overrides the checkpoint the config points at."""
    rt = runtime.setup(cfg.system)
    if cfg.sample.quantize != "none":
        quantize.quantize_targets(cfg.sample.quantize_layers)  # a bad list fails before loading
    model, stored, meta, path = load_for_sampling(cfg, rt.device, init_from)
    model.eval()
    if cfg.sample.quantize == "int8":
        chosen = quantize.quantize_linears(model, cfg.sample.quantize_layers)
        print(f"quantized {len(chosen)} Linear layers to int8 ({cfg.sample.quantize_layers}): "
              f"weights now {quantize.weight_bytes(model) / 2**20:.1f} MiB", file=sys.stderr)
    tokenizer = from_meta(meta["tokenizer"])
    s = cfg.sample
    prompt_ids = encode_prompt(tokenizer, read_prompt(s.prompt), model.config.block_size)
    bucket = 0
    if cfg.system.compile and s.kv_cache:  # static cache + bucketed prompts: no recompiles
        model, note = techniques.compile_model(model, cfg.system, rt)
        bucket, t0 = s.prompt_bucket, time.perf_counter()
        warm_up(model, len(prompt_ids), s.max_new_tokens, bucket, rt.autocast)
        print(f"compiled ({note}), prompt bucket {bucket}, warmed up in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    step = f" (step {meta['step']})" if "step" in meta else ""
    print(f"sampling from {path}{step} on {rt.device}", file=sys.stderr)
    generator = torch.Generator(device=rt.device).manual_seed(cfg.system.seed)
    texts = []
    for i in range(s.num_samples):
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=rt.device)
        printer = StreamPrinter(tokenizer)
        sys.stdout.write(tokenizer.decode(prompt_ids) if s.prompt else "")
        t0 = time.perf_counter()
        out = generate_tokens(model, idx, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                              s.kv_cache, generator, printer, rt.autocast, bucket)
        printer.finish()
        dt = time.perf_counter() - t0
        print(f"[sample {i + 1}/{s.num_samples}: {s.max_new_tokens} tokens in {dt:.2f}s, "
              f"{s.max_new_tokens / dt:,.0f} tok/s]", file=sys.stderr)
        texts.append(tokenizer.decode(out[0].tolist()))
        if i + 1 < s.num_samples:
            print("---------------")
    return texts


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="generate.py",
                                   script=GenerateOptions, lead=("sample",))
        sample(cfg, options.init_from)
    except (ConfigError, checkpoint.CheckpointError, TokenizerError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
