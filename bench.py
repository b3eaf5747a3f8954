"""Benchmarks, one sub-command each (engine/benchmarks/); `python bench.py COMMAND --help` lists
a command's options. Results go to bench_results/ (--results).

    python bench.py                          # ablation: the baseline, then each flag in turn
    python bench.py ablation --only all      # each flag alone against the baseline
    python bench.py ablation --order attention,compile=max-autotune --config gpt2_124m
    python bench.py memory --part train,decode          # what each memory strategy costs
    python bench.py decode --gguf f32.gguf --llama-python VENV/bin/python   # weight formats
    python bench.py decode-device --device cuda --streams 16  # bf16 eager, compiled, batched
    python bench.py serve --checkpoint out/shakespeare_char   # serve.py under load
    python bench.py to-loss 1.886 [--nanogpt ../nanoGPT]      # wall-clock time to a val loss
    python bench.py vs-nanogpt ../nanoGPT --rounds 3          # whole runs beside nanoGPT's
    python bench.py finetune-task                             # instruction finetuning: full, LoRA
    python bench.py finetune-step                             # its step at GPT-2 124M vs peft
    python bench.py tokenizer                                 # BPE: rustbpe vs HF; bytes/token
    python bench.py doc-aligned                               # rows at documents vs windows
    python bench.py checkpoint                                # FSDP2 saves: sharded vs rank 0
    python bench.py eval                                      # eval.py's suite on three models
    python bench.py rl                                        # RL's held-out gain: full, LoRA

ablation and memory take the config as train.py does (configs/bench_gpu.toml on CUDA, else
bench_cpu, unless --config is given); the others take only their own options.
"""
from __future__ import annotations

import difflib
import shlex
import sys
from typing import Callable, NamedTuple

from config import Config, ConfigError, load_config, load_options, parse_command_line
from data.loader import DataError
from engine import checkpoint
from engine.benchmarks import (ablation, checkpoint_save, decode, decode_device, doc_aligned,
                               evaluation, finetune, memory, rl, serving, to_loss, tokenizer)
from engine.device import SetupError, resolve_device


class Command(NamedTuple):
    options: type  # its options dataclass
    run: Callable[..., int]
    about: str
    config: bool = False  # run(cfg, options, config arguments, command) else run(options, command)


COMMANDS = {
    "ablation": Command(ablation.AblationOptions,
                        lambda cfg, o, args, command: ablation.run(cfg, o, command),
                        ablation.__doc__, config=True),
    "memory": Command(memory.MemoryOptions, memory.run, memory.__doc__, config=True),
    "decode": Command(decode.DecodeOptions, decode.run, decode.__doc__),
    "decode-device": Command(decode_device.DecodeDeviceOptions, decode_device.run,
                             decode_device.__doc__),
    "serve": Command(serving.ServeOptions, serving.run, serving.__doc__),
    "to-loss": Command(to_loss.ToLossOptions, to_loss.run, to_loss.__doc__),
    "vs-nanogpt": Command(to_loss.VsNanoGPTOptions, to_loss.vs_nanogpt, to_loss.__doc__),
    "finetune-task": Command(finetune.TaskOptions, finetune.run_task, finetune.__doc__),
    "finetune-step": Command(finetune.StepOptions, finetune.run_step, finetune.__doc__),
    "tokenizer": Command(tokenizer.TokenizerBenchOptions, tokenizer.run, tokenizer.__doc__),
    "doc-aligned": Command(doc_aligned.DocAlignedOptions, doc_aligned.run, doc_aligned.__doc__),
    "checkpoint": Command(checkpoint_save.CheckpointBenchOptions, checkpoint_save.run,
                          checkpoint_save.__doc__),
    "eval": Command(evaluation.EvalBenchOptions, evaluation.run, evaluation.__doc__),
    "rl": Command(rl.RLBenchOptions, rl.run, rl.__doc__),
}


def load_bench_config(name: str, argv: list[str]) -> tuple[Config, object, list[str]]:
    """(config, the command's options, the config's own arguments for a train.py subprocess);
    by default bench_gpu on CUDA, else bench_cpu."""
    script, prog = COMMANDS[name].options, f"bench.py {name}"
    line = parse_command_line(argv, script)
    given = any(a == "--config" or a.startswith("--config=") for a in argv)
    config = line.config_name if given else "bench_cpu"
    cfg, opts = load_config(["--config", config, *argv], prog=prog, script=script)
    device = resolve_device(cfg.system.device)
    if device.type == "cuda" and not given:
        config = "bench_gpu"
        cfg, opts = load_config(["--config", config, *argv], prog=prog, script=script)
    cfg.system.device = str(device)
    return cfg, opts, ["--config", config, *(f"--{k}={v}" for k, v in line.overrides)]


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """(sub-command, its arguments); none named: the ablation."""
    if not argv or argv[0].startswith("-"):
        return "ablation", argv
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown sub-command {argv[0]!r}{hint} (sub-commands: "
                          f"{', '.join(COMMANDS)})")
    return argv[0], argv[1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    command_line = "python bench.py " + shlex.join(argv)
    try:
        name, args = split_command(argv)
        command = COMMANDS[name]
        if command.config:
            cfg, opts, config_args = load_bench_config(name, args)
            return command.run(cfg, opts, config_args, command_line.strip())
        opts = load_options(args, command.options, f"bench.py {name}", command.about)
        return command.run(opts, command_line.strip())
    except (ConfigError, DataError, checkpoint.CheckpointError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
