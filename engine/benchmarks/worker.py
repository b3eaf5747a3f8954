"""`python -m engine.benchmarks.worker SPEC.json` (started by runner.run_worker): runs
spec["kind"] and writes its result, or its error, to spec["result"]."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from engine.benchmarks import finetune, measure, memory

KINDS = {"train_row": measure.time_row, "decode": measure.decode_row,
         "ceiling": measure.ceiling, "memory_row": memory.train_row,
         "finetune_step": finetune.step_row}


def run_spec(spec: dict) -> dict:
    """The spec's kind run here -> its result; a failure is the row's result, not an error."""
    try:
        return {"status": "ok", **KINDS[spec["kind"]](spec)}
    except Exception as e:  # noqa: BLE001 - the row is reported failed, the others go on
        traceback.print_exc()
        first_line = (str(e).strip().splitlines() or [""])[0]
        return {"status": "failed", "error": f"{type(e).__name__}: {first_line}"[:300]}


def measure_in_worker(spec_path: str) -> int:
    """Run the spec's kind and write its result where the spec says."""
    spec = json.loads(Path(spec_path).read_text())
    result = run_spec(spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(measure_in_worker(sys.argv[1]))
