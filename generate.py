"""Sample text from a trained model.

    python generate.py --prompt "ROMEO:"                       # latest checkpoint of the default run
    python generate.py --checkpoint out/tiny --temperature 0   # greedy, from another run
    python generate.py --prompt FILE:prompt.txt --num_samples 3 --top_p 0.9 --seed 7

Tokens stream to stdout as they are produced. With the KV cache each new token costs the same
however long the text; when the context fills up, the oldest half is dropped and the rest
re-read once (the uncached path follows the same rule, so both give the same tokens).
"""
from __future__ import annotations

import codecs
import contextlib
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import checkpoint
import runtime
from config import Config, ConfigError, load_config
from model import GPT
from tokenizer import TokenizerError, from_meta


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


@torch.no_grad()
def generate_tokens(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, kv_cache: bool = True,
                    generator: torch.Generator | None = None,
                    on_token: Callable[[torch.Tensor], None] | None = None,
                    autocast=None) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens tokens. The model sees tokens[start:], where start
    jumps forward by half a context whenever the context is full."""
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
                    cache = model.new_kv_cache(idx.size(0))
                    logits, _ = model(idx[:, start:], kv_cache=cache)
                else:
                    logits, _ = model(idx[:, -1:], kv_cache=cache)
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
        return path.read_text(encoding="utf-8")
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


def load_for_sampling(cfg: Config, device: torch.device) -> tuple[GPT, Config, dict, Path]:
    path = checkpoint.resolve(cfg.sample.checkpoint or cfg.train.out_dir)
    model, stored, meta = checkpoint.load_model(path, device)
    return model, stored, meta, path


def sample(cfg: Config) -> list[str]:
    """Generate cfg.sample.num_samples texts, streaming them to stdout; returns them."""
    rt = runtime.setup(cfg.system)
    model, stored, meta, path = load_for_sampling(cfg, rt.device)
    model.eval()
    tokenizer = from_meta(meta["tokenizer"])
    s = cfg.sample
    prompt_ids = encode_prompt(tokenizer, read_prompt(s.prompt), model.config.block_size)
    print(f"sampling from {path} (step {meta.get('step')}) on {rt.device}", file=sys.stderr)
    generator = torch.Generator(device=rt.device).manual_seed(cfg.system.seed)
    texts = []
    for i in range(s.num_samples):
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=rt.device)
        printer = StreamPrinter(tokenizer)
        sys.stdout.write(tokenizer.decode(prompt_ids) if s.prompt else "")
        t0 = time.perf_counter()
        out = generate_tokens(model, idx, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                              s.kv_cache, generator, printer, rt.autocast)
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
        cfg, _ = load_config(sys.argv[1:] if argv is None else argv, prog="generate.py")
        sample(cfg)
    except (ConfigError, checkpoint.CheckpointError, TokenizerError, runtime.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
