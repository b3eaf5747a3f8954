"""Who this process is in a training job. Without a launcher, one process: a Dist whose
collectives do nothing, so train.py has one loop for one process and for many. torchrun or
accelerate launch set RANK / WORLD_SIZE (or ACCELERATE_*); launch.py then joins the job through
parallel.py, whose ProcessGroup does what Dist leaves undone (docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from engine.checkpoint import model_state
from engine.device import SetupError

SIGNALS = ("SIGINT", "SIGTERM")  # what resume.StopRequest turns into a stop request


def launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment; (0, 0, 1) without one."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return 0, 0, 1
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", env.get("RANK", "0")))
    except ValueError:
        raise SetupError(f"RANK={env.get('RANK')!r}, LOCAL_RANK={env.get('LOCAL_RANK')!r}, "
                         f"WORLD_SIZE={env.get('WORLD_SIZE')!r} must be integers; start the "
                         "processes with torchrun or accelerate launch, which set them") from None
    if not 0 <= rank < world:
        raise SetupError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise SetupError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; start the "
                             "processes with torchrun or accelerate launch")
    return rank, local, world


@dataclass
class Dist:
    """This process's place in the job and the collectives the loop needs, which every rank
    calls at the same point. This class is the one-process job: each is a no-op or returns its
    input; parallel.ProcessGroup does them over several processes."""

    rank: int = 0
    world_size: int = 1
    parallel: str = "none"  # none | ddp | fsdp
    device: str = ""  # the device this rank uses: system.device resolved per rank ('': as set)
    notes: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self, batch: str) -> str:
        """The start-up line: the global batch, with the notes."""
        return batch + (f"  [{'; '.join(self.notes)}]" if self.notes else "")

    def close(self) -> None:
        """Leave the job (nothing to leave alone)."""

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (download, data preparation), then the others."""
        yield

    def same_everywhere(self, value: int, what: str) -> None:
        """Raise when the ranks disagree on an integer they must share."""

    def min_int(self, value: int) -> int:
        return value

    def all_true(self, flag: bool) -> bool:
        return flag

    def mean_losses(self, losses: dict[str, float]) -> dict[str, float]:
        return losses

    def sync_step(self, loss_sum: torch.Tensor, stop) -> torch.Tensor:
        """The global batch's loss; signals any rank received become every rank's stop."""
        return loss_sum

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Every weight on rank 0 (None elsewhere), as a checkpoint stores them."""
        return model_state(model)

    def optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


def launched(env: dict | None = None) -> bool:
    """Whether torchrun or accelerate launch started this process."""
    env = os.environ if env is None else env
    return "WORLD_SIZE" in env or any(k.startswith("ACCELERATE_") for k in env)


def error_prefix() -> str:
    """'rank 3: ' in a job of several processes, so an error says where it happened."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"rank {rank}: " if world not in ("", "0", "1") else ""
