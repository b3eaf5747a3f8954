"""Several processes training one model: who this process is, and the collectives the loop needs.

    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_124m                # DDP
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_xl --parallel=fsdp  # FSDP2
    accelerate launch --multi_gpu --num_processes=8 train.py --config gpt2_124m         # the same

init() reads the launcher's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT (and accelerate's
flags); without them Dist is one process whose methods do nothing, so train.py has one loop.
Rank 0 alone prints and writes. A hung rank fails the others through system.dist_timeout.
DDP / FSDP2 wrapping is in engine/techniques.py.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist

from config import Config
from engine import runtime

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
        raise runtime.SetupError(
            f"RANK={env.get('RANK')!r}, LOCAL_RANK={env.get('LOCAL_RANK')!r}, "
            f"WORLD_SIZE={env.get('WORLD_SIZE')!r} must be integers; start the processes "
            "with torchrun or accelerate launch, which set them") from None
    if not 0 <= rank < world:
        raise runtime.SetupError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise runtime.SetupError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; "
                                     "start the processes with torchrun or accelerate launch")
    return rank, local, world


ACCELERATE_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "no": ""}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# accelerate's true/false flags: (variable, its flag, the system field and value it sets)
ACCELERATE_SWITCHES = (("ACCELERATE_USE_FSDP", "--use_fsdp", "parallel", "fsdp"),
                       ("ACCELERATE_USE_CPU", "--cpu", "device", "cpu"))


def apply_launcher_flags(cfg: Config) -> list[str]:
    """Honour what `accelerate launch` passes through the environment (--mixed_precision,
    --dynamo_backend/mode, --use_fsdp, --cpu); refuse what this code cannot do (fp8, DeepSpeed,
    other backends) or what contradicts the config. Returns notes for the banner."""
    env, system, notes = os.environ, cfg.system, []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    wanted = ACCELERATE_PRECISION.get(precision)
    if wanted is None:
        raise runtime.SetupError(f"accelerate launch --mixed_precision={precision} is not "
                                 "supported here; use bf16, fp16 or no (the config's --dtype)")
    if wanted and system.dtype not in ("float32", "auto", wanted):
        raise runtime.SetupError(f"accelerate launch --mixed_precision={precision} asks for "
                                 f"{wanted} but the config says dtype={system.dtype}; pass "
                                 "the same precision to both, or drop one")
    if wanted and system.dtype != wanted:
        system.dtype = wanted
        notes.append(f"accelerate --mixed_precision={precision}: dtype={wanted}")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend not in ("inductor", "no"):
        raise runtime.SetupError(f"accelerate launch --dynamo_backend={backend} is not supported "
                                 "here; use inductor (= --compile=true) or no")
    if backend == "inductor":
        mode = env.get("ACCELERATE_DYNAMO_MODE", "default")
        system.compile, system.compile_mode = True, mode if mode in COMPILE_MODES else "default"
        notes.append(f"accelerate --dynamo_backend=inductor: compile=on ({system.compile_mode})")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise runtime.SetupError("accelerate launch --use_deepspeed is not supported here; use "
                                 "--parallel=ddp or --parallel=fsdp (FSDP2)")
    for variable, flag, key, value in ACCELERATE_SWITCHES:
        if env.get(variable, "false").lower() == "true" and getattr(system, key) != value:
            setattr(system, key, value)
            notes.append(f"accelerate {flag}: {key}={value}")
    return notes


def rank_device(name: str, local_rank: int) -> tuple[str, str]:
    """(device, note): GPU LOCAL_RANK of this node with --device=auto or cuda, else the CPU."""
    cuda = torch.cuda.is_available()
    if name in ("auto", "cuda") and cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise runtime.SetupError(f"LOCAL_RANK={local_rank} but this node has {count} GPU(s); "
                                     f"start at most {count} processes per node "
                                     f"(--nproc_per_node={count})")
        return f"cuda:{local_rank}", ""
    if name.startswith("cuda"):
        if not cuda:
            raise runtime.SetupError(f"--device={name} but CUDA is not available here; use "
                                     "--device=cpu (processes then talk over gloo)")
        raise runtime.SetupError(f"--device={name} gives every process the same GPU; use "
                                 "--device=cuda (rank r of a node takes GPU LOCAL_RANK) and pick "
                                 "GPUs with CUDA_VISIBLE_DEVICES")
    if name == "mps":
        raise runtime.SetupError("several processes cannot share MPS; use --device=cpu or one "
                                 "process")
    return "cpu", "no GPU: every process trains on the CPU" if name == "auto" else ""


@dataclass
class Dist:
    """This process's place in the job, and the collectives the loop needs (every rank calls
    each at the same point). With one process each is a no-op or returns its input."""

    rank: int = 0
    world_size: int = 1
    parallel: str = "none"  # none | ddp | fsdp
    backend: str = ""
    device: str = ""  # the device this rank uses: system.device resolved per rank
    timeout_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    comm_device: torch.device = torch.device("cpu")  # where collective tensors must live
    _stdout: object = None
    _flags_in_flight: torch.Tensor | None = None  # the last step's summed stop flags

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self, batch: str) -> str:
        """The start-up lines: the layout (several processes), then `batch`, with the notes."""
        tail = f"  [{'; '.join(self.notes)}]" if self.notes else ""
        if not self.enabled:
            return batch + tail
        nodes = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        return (f"distributed: {self.parallel} over {self.world_size} processes on {nodes} "
                f"node(s) | backend {self.backend} | timeout {self.timeout_s:g}s{tail}\n{batch}")

    def close(self) -> None:
        """Leave the job after a barrier, so no rank tears its connections down under another."""
        if self._stdout is not None:
            sys.stdout.close()
            sys.stdout, self._stdout = self._stdout, None
        if torch_dist.is_initialized():
            torch_dist.barrier()
            torch_dist.destroy_process_group()

    def _all_reduce(self, values: torch.Tensor, op=torch_dist.ReduceOp.SUM) -> torch.Tensor:
        out = values.detach().to(self.comm_device, torch.float64 if values.is_floating_point()
                                 else torch.int64)
        torch_dist.all_reduce(out, op=op)
        return out

    def barrier(self) -> None:
        if self.enabled:
            torch_dist.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (download, data preparation), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def same_everywhere(self, value: int, what: str) -> None:
        """Raise when the ranks disagree on an integer they must share."""
        lo, hi = self.min_int(value), -self.min_int(-value)
        if lo != hi:
            raise runtime.SetupError(f"the processes disagree on {what} (from {lo} to {hi}; this "
                                     f"one has {value})")

    def min_int(self, value: int) -> int:
        if not self.enabled:
            return value
        return int(self._all_reduce(torch.tensor([value]), torch_dist.ReduceOp.MIN)[0])

    def all_true(self, flag: bool) -> bool:
        return self.min_int(int(flag)) == 1

    def mean_losses(self, losses: dict[str, float]) -> dict[str, float]:
        """Each rank's evaluation losses -> the mean over every rank's (same-sized) batches."""
        if not self.enabled:
            return losses
        total = self._all_reduce(torch.tensor([losses[k] for k in losses], dtype=torch.float64))
        return {k: float(v) / self.world_size for k, v in zip(losses, total.tolist())}

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (the same shape on each), on the CPU, in rank order."""
        mine = t.to(self.comm_device).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch_dist.all_gather(parts, mine)
        return [p.cpu() for p in parts]

    def sync_step(self, loss_sum: torch.Tensor, stop) -> torch.Tensor:
        """The global batch's loss (the mean over ranks), and a stop signal any rank received made
        every rank's: one small all-reduce per step, so all skip and stop together. The flags are
        read a step late: reading this step's would make the host wait for the device (NCCL
        queues the all-reduce behind the step's kernels); the last step's are long done, and
        every rank reads the same sums at the same step, so all still stop at one boundary."""
        if not self.enabled:
            return loss_sum
        pending = getattr(stop, "pending", None)
        flags = [float(pending == name) for name in SIGNALS]
        values = torch.stack([loss_sum.detach().double().to(self.comm_device),
                              *torch.tensor(flags, dtype=torch.float64, device=self.comm_device)])
        total = self._all_reduce(values)
        previous, self._flags_in_flight = self._flags_in_flight, total[1:]
        if previous is not None:
            for name, count in zip(SIGNALS, previous.tolist()):
                if count > 0:
                    stop.commit(name)
        return (total[0] / self.world_size).to(loss_sum.device, loss_sum.dtype)


def full_tensor(t: torch.Tensor, local: bool = False) -> torch.Tensor:
    """A DTensor (FSDP) as a plain tensor: the whole, or with local=True this rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local() if local else t.full_tensor()
    return t


def init(cfg: Config) -> Dist:
    """Join the job the launcher started (or return a one-process Dist)."""
    rank, local_rank, world = launch_env()
    launcher_notes, system = apply_launcher_flags(cfg), cfg.system
    if world == 1:
        return Dist(notes=launcher_notes + ["parallel=fsdp needs several processes (torchrun): "
                                            "one plain process here"] * (system.parallel == "fsdp"))
    device, note = rank_device(system.device, local_rank)
    cuda = device.startswith("cuda")
    if system.parallel == "fsdp" and system.dtype == "float16":
        raise runtime.SetupError("--parallel=fsdp with --dtype=float16 is not supported (its "
                                 "loss scaler would see only this rank's gradient shard); use "
                                 "--dtype=bfloat16 or --parallel=ddp")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    torch_dist.init_process_group(backend, timeout=datetime.timedelta(seconds=system.dist_timeout),
                                  **({"device_id": torch.device(device)} if cuda else {}))
    d = Dist(rank=rank, world_size=world, parallel=system.parallel,
             backend=backend, device=device, timeout_s=system.dist_timeout,
             notes=launcher_notes + ([note] if note else []),
             comm_device=torch.device(device) if cuda else torch.device("cpu"))
    if rank != 0:  # one log: rank 0's
        d._stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    return d


def error_prefix() -> str:
    """'rank 3: ' in a job of several processes, so an error says where it happened."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"rank {rank}: " if world not in ("", "0", "1") else ""


def record(main):
    """torch's elastic error handler: the launcher's summary names the failed rank."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record as elastic_record
    except ImportError:
        return main
    return elastic_record(main)


def collective_failure(e: BaseException, timeout_s: float) -> str | None:
    """The error to show when a collective timed out or lost a peer; None for any other error
    (gloo raises a plain RuntimeError, recognisable by its text)."""
    text = str(e).strip()
    if not isinstance(e, getattr(torch_dist, "DistError", ())) and not (
            isinstance(e, RuntimeError) and torch_dist.is_initialized()
            and any(w in text.lower() for w in ("gloo", "nccl", "timed out", "closed by peer"))):
        return None
    first = text.splitlines()[0][:300] if text else type(e).__name__
    return (f"waiting for the other processes failed ({first}): another rank died (its error is "
            f"in the launcher's summary) or did not answer within --dist_timeout={timeout_s:g} "
            "seconds; a rank that is only slow (a long save or evaluation) needs a larger "
            "--dist_timeout")
