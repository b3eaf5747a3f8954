"""Sample text from a trained model or GPT-2, streaming tokens to stdout
(engine/inference/sampling.py).

    python generate.py --prompt "ROMEO:"                       # the default run's last checkpoint
    python generate.py --checkpoint out/tiny --temperature 0   # greedy, from another run
    python generate.py --prompt FILE:prompt.txt --num_samples 3 --top_p 0.9 --seed 7
    python generate.py --init-from gpt2 --prompt "Hello, I'm a language model,"   # OpenAI's GPT-2
    python generate.py --weight_layout=row    # weights as trained (auto: column-major on CPU)
"""
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from config import Config, ConfigError, help_first, load_config, opt
from engine.inference.options import InferenceOptions


@dataclass
class GenerateOptions(InferenceOptions):
    """generate.py's options: the model's source, shared with serve.py (--init-from, --sparse);
    the rest of the command line is the config (sample.*, system.*)."""

    chat: bool = opt(False, "talk to a checkpoint finetuned on instruction data, through its chat "
                     "template: one turn from --prompt, else a conversation at the terminal (a "
                     "turn per line of stdin when it is not one)")
    system: str = opt("", "--chat: a system message to start the conversation with")


# --help needs nothing more: it is answered here, before the imports of a run (torch, the model)
help_first("generate.py", GenerateOptions, lead=("sample",), main=__name__)

import torch  # noqa: E402 (this and what follows: after --help)

from data.tokenizer import TokenizerError, from_meta
from engine import checkpoint, device
from engine.inference.load import load_for_inference, prepare_weights
from engine.inference.sampling import (StreamPrinter, call_forward_directly, generate_tokens,
                                      warm_up)


def encode_prompt(tokenizer, prompt: str, block_size: int) -> list[int]:
    """The ids of the prompt (FILE:path: that file's text), its last block_size; empty: start."""
    if prompt.startswith("FILE:"):
        path = Path(prompt[5:])
        if not path.is_file():
            raise ConfigError(f"prompt file {path} not found")
        try:
            prompt = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"prompt file {path} is not UTF-8 text (byte "
                                 f"{e.object[e.start]:#04x} at offset {e.start}); save it as "
                                 "UTF-8") from None
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        return [tokenizer.start_id]
    if len(ids) > block_size:
        print(f"note: prompt has {len(ids)} tokens but block_size is {block_size}; keeping the "
              f"last {block_size}", file=sys.stderr)
    return ids[-block_size:]


def sample(cfg: Config, options: GenerateOptions) -> None:
    """Stream sample.num_samples texts from options.init_from (or the config's checkpoint) to
    stdout."""
    rt, s = device.setup(cfg.system), cfg.sample
    model, meta, label = load_for_inference(cfg, options, rt.device, "sample from")
    prepared = prepare_weights(model, cfg, options, rt.device)  # decoding: one row
    if prepared.sparse:
        print(prepared.sparse, file=sys.stderr)
    matvec = pages = "off (CPU only)"
    if rt.device.type == "cpu":  # one-row products laid out and sliced for a CPU
        from engine.inference.matvec import huge_pages_for, set_matvec

        matvec = f"{set_matvec(model, s.matvec)} ({s.matvec})"
        pages = huge_pages_for(s.huge_pages, rt.device)[1]
    call_forward_directly(model)  # the blocks' parts called without nn.Module's hook checks
    tokenizer = from_meta(meta["tokenizer"])
    prompt_ids = encode_prompt(tokenizer, s.prompt, model.config.block_size)
    bucket = 0
    if cfg.system.compile and s.kv_cache:  # bucketed prompts: a few shapes, no recompiles
        from engine.compiling import compile_model

        model, note = compile_model(model, cfg.system, rt)
        bucket, t0 = s.prompt_bucket, time.perf_counter()
        warm_up(model, len(prompt_ids), s.max_new_tokens, bucket, rt.autocast)
        print(f"compiled ({note}), prompt bucket {bucket}, warmed up in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    step = f" (step {meta['step']})" if "step" in meta else ""
    print(f"sampling from {label}{step} on {rt.device} | weights={prepared.weights} "
          f"weight_layout={prepared.weight_layout} "
          f"({s.weight_layout}) huge_pages={pages} matvec={matvec} "
          f"kv_cache={'on' if s.kv_cache else 'off'}", file=sys.stderr)
    generator = torch.Generator(device=rt.device).manual_seed(cfg.system.seed)
    if options.chat:  # a conversation through the checkpoint's chat template
        from engine.inference.chat import run_chat

        def reply(ids, n, stop_ids, on_token):
            return generate_tokens(model, ids.to(rt.device), n, s.temperature, s.top_k, s.top_p,
                                   s.kv_cache, generator, on_token, rt.autocast, bucket,
                                   stop_ids)

        return run_chat(model, meta, label, tokenizer, reply, s.max_new_tokens, s.prompt,
                        options.system)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=rt.device)
    for i in range(s.num_samples):
        if i:
            print("---------------")
        printer = StreamPrinter(tokenizer)
        print(tokenizer.decode(prompt_ids) if s.prompt else "", end="")
        t0 = time.perf_counter()
        generate_tokens(model, idx, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                        s.kv_cache, generator, printer, rt.autocast, bucket)
        printer.finish()
        print(flush=True)
        dt = time.perf_counter() - t0
        print(f"[sample {i + 1}/{s.num_samples}: {s.max_new_tokens} tokens in {dt:.2f}s, "
              f"{s.max_new_tokens / dt:,.0f} tok/s]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv, prog="generate.py",
                                   script=GenerateOptions, lead=("sample",))
        sample(cfg, options)
    except (ConfigError, checkpoint.CheckpointError, TokenizerError, device.SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
