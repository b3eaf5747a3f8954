"""Hugging Face GPT-2 <-> our checkpoints: import OpenAI's weights, check them against
transformers, export ours in the Hugging Face format (the library is engine/hf.py).

    python load_gpt2_weights.py gpt2 --out out/gpt2 --verify             # hub -> our checkpoint
    python load_gpt2_weights.py path/to/hf_dir --verify                  # check a local HF dir
    python load_gpt2_weights.py --export out/run --out hf/run --verify   # ours -> HF directory
The model section sets the implementation (--attention sdpa, ...); --device where --verify runs."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

from config import Config, ConfigError, load_config, opt
from engine import checkpoint, hf, saving, sources
from engine.device import SetupError, resolve_device


@dataclass
class WeightsOptions:
    positional: ClassVar[str] = "source"
    source: str = opt("", "gpt2 | gpt2-medium | gpt2-large | gpt2-xl | hf:ORG/NAME | a local "
                      "Hugging Face directory (also given as the first bare argument)")
    out: str = opt("", "import: run directory for our checkpoint (OUT/ckpt_0000000); with "
                   "--export: the Hugging Face directory to write")
    export: str = opt("", "export one of our checkpoints (or a run directory's latest) as a "
                      "Hugging Face GPT-2 directory")
    verify: bool = opt(False, "compare our logits with transformers' GPT2LMHeadModel on the "
                       "same tokens; fail above the tolerance")
    tolerance: float = opt(1e-4, "allowed max |logit difference| relative to max(1, max |logit|)")


def run(cfg: Config, o: WeightsOptions) -> None:
    if bool(o.source) == bool(o.export):
        raise ConfigError("give a SOURCE to import, or --export CKPT --out DIR (not both)")
    if o.export and not o.out:
        raise ConfigError("--export needs --out HF_DIR")
    if o.source and not (o.out or o.verify):
        raise ConfigError("nothing to do: add --out DIR to write our checkpoint and/or --verify")
    if o.out:  # a file there: say so before loading anything
        saving.check_out_dir(o.out, "--out")
    if o.export:  # a LoRA run's adapters come merged into their base
        model, _, meta, _ = sources.load_source(o.export, cfg)
        hf_dir, files = hf.export_hf(model, meta, o.out)
        print(f"exported {checkpoint.resolve(o.export)} ({hf.describe(model)}) to {hf_dir}: "
              + ", ".join(files))
    else:
        model, hf_dir = hf.load_hf(o.source, cfg.model)  # sets cfg.model's shape
        print(f"loaded {o.source} from {hf_dir}: {hf.describe(model)}")
    if o.verify:  # before writing a checkpoint, so a failed import leaves nothing behind
        hf.verify(model, hf_dir, o.tolerance, str(resolve_device(cfg.system.device)))
    if o.source and o.out:
        print(f"wrote {hf.import_checkpoint(model.cpu(), o.source, hf_dir, o.out)}")


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 verification failed, 2 bad input."""
    try:
        cfg, options = load_config(sys.argv[1:] if argv is None else argv,
                                   prog="load_gpt2_weights.py", script=WeightsOptions)
        run(cfg, options)
    except hf.VerificationError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except (ConfigError, checkpoint.CheckpointError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
