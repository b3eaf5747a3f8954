"""FineWeb-Edu, the 10B-token sample, as GPT-2 token shards in data/fineweb_edu/ (~20 GB).

    python data/fineweb_edu/prepare.py                    # stream from the hub, all cores
    python data/fineweb_edu/prepare.py --max-tokens 50M   # try it small
    python data/fineweb_edu/prepare.py --dataset json --data-files 'local/*.jsonl'  # offline

Interrupt it at any time and run the same command again: it resumes. `--help` lists every option;
data/shards.py describes the output.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # imports here: the spawned tokenizer workers re-import this file
    from data.shards import Defaults, main
    defaults = Defaults(dataset="HuggingFaceFW/fineweb-edu", name="sample-10BT",
                        out_dir=Path(__file__).resolve().parent, expected_tokens=10_000_000_000)
    sys.exit(main(defaults, description=__doc__))
