"""wandb.enabled: the run's metrics in Weights & Biases too (the [wandb] section), the same run
continued when a run resumes. engine/training/metrics.py loads this when the option is on.
"""
from __future__ import annotations

from pathlib import Path

from config import Config
from engine.device import SetupError


def start_wandb(cfg: Config, out_dir: Path, run_id: str):
    """wandb.init from the [wandb] section; continues run `run_id` when resuming."""
    w = cfg.wandb
    try:
        import wandb
    except ImportError:
        raise SetupError("wandb.enabled=true but the wandb package is not installed; "
                         "pip install wandb, or set --wandb.enabled=false") from None
    kwargs = dict(project=w.project, entity=w.entity or None, name=w.name or out_dir.name,
                  group=w.group or None, config=cfg.to_dict(), dir=str(out_dir),
                  tags=[t.strip() for t in w.tags.split(",") if t.strip()] or None)
    kwargs.update({"mode": w.mode} if w.mode != "auto" else {},
                  **({"id": run_id, "resume": "allow"} if run_id else {}))
    try:
        return wandb.init(**kwargs)
    except Exception as e:  # wandb raises many types: no API key, no network, bad entity, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SetupError(f"could not start Weights & Biases logging ({first}); run `wandb login`, "
                         "or log offline with WANDB_MODE=offline (then `wandb sync`), or set "
                         "--wandb.enabled=false") from None
