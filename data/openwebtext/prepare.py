"""OpenWebText (~9B GPT-2 tokens, the GPT-2 paper's WebText recreated) as token shards in
data/openwebtext/ (~18 GB).

    python data/openwebtext/prepare.py                    # stream from the hub, all cores
    python data/openwebtext/prepare.py --max-tokens 50M   # try it small
    python data/openwebtext/prepare.py --dataset json --data-files 'owt/*.jsonl'  # offline

If the hub copy still ships a loading script (which datasets>=4 refuses to run), add
`--revision refs/convert/parquet` or point --dataset at a parquet mirror. Interrupt it at any time
and run the same command again: it resumes. data/shards.py describes the output.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":  # imports here: the spawned tokenizer workers re-import this file
    from data.shards import Defaults, main
    defaults = Defaults(dataset="Skylion007/openwebtext", out_dir=Path(__file__).resolve().parent,
                        expected_tokens=9_040_000_000)
    sys.exit(main(defaults, description=__doc__))
