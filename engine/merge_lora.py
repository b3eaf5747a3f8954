"""A LoRA run's checkpoint as a standalone full one: its base with the adapters merged in
(engine/lora.py), for tools that take only full checkpoints or to drop the base.

    python -m engine.merge_lora out/instruct_lora out/instruct_merged
"""
from __future__ import annotations

import argparse
import sys

from config import Config, ConfigError, LoraConfig
from engine import saving
from engine.checkpoint import CheckpointError
from engine.sources import load_source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.merge_lora",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a LoRA run's checkpoint or run directory")
    parser.add_argument("out_dir", help="where the merged checkpoint goes")
    args = parser.parse_args(argv)
    try:
        model, cfg, meta, label = load_source(args.checkpoint, Config())
        if "lora" not in meta:
            raise CheckpointError(f"{label} holds no adapters: it is a full checkpoint already")
        cfg.lora = LoraConfig()  # the weights hold the adapters now
        info = {k: v for k, v in meta.items() if k not in ("lora", "step")}
        saved = saving.save(args.out_dir, meta["step"], model, cfg, info, out_flag="OUT_DIR")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged {label} into {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
