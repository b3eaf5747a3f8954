"""How train.py starts, whatever started it: one plain process, or one rank of the job torchrun
or accelerate launch started (then parallel.py joins it, and only then is it loaded).

    dist = launch.init(cfg)    # processes.Dist(rank=0, world_size=1), or a parallel.ProcessGroup
    launch.leave(launch.record(main)())
"""
from __future__ import annotations

import os
import sys

from config import Config
from engine.training.processes import Dist, launch_env, launched


def init(cfg: Config) -> Dist:
    """Join the job the launcher started, or return the one-process Dist."""
    if launched():
        from engine.training import parallel  # a launcher: its flags, maybe several processes

        return parallel.init(cfg, *launch_env())
    fsdp = cfg.system.parallel == "fsdp"
    return Dist(notes=["parallel=fsdp needs several processes (torchrun): one plain process "
                       "here"] * fsdp)


def record(main):
    """torch's elastic error handler: the launcher's summary names the failed rank."""
    if not launched():
        return main
    try:
        from torch.distributed.elastic.multiprocessing.errors import record as elastic_record
    except ImportError:  # a torch built without distributed support
        return main
    return elastic_record(main)


def leave(status: int) -> None:
    """Exit with status. A launched rank skips the interpreter's teardown (os._exit, once its
    output is flushed): gloo's worker threads outlive destroy_process_group once DDP has used
    the group, and tearing them down at exit could abort a rank that had finished cleanly
    ('terminate called without an active exception')."""
    if not launched():
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        if not stream.closed:
            stream.flush()
    os._exit(status)


def collective_failure(e: BaseException, timeout_s: float) -> str | None:
    """The error to show when a collective timed out or lost a peer; None for any other."""
    if not launched():
        return None
    from engine.training import parallel

    return parallel.collective_failure(e, timeout_s)
