"""Data-parallel training over several processes: DDP, or FSDP2 for models whose training state
does not fit on one device.

    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_124m                # DDP
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_xl --parallel=fsdp  # FSDP2
    accelerate launch --multi_gpu --num_processes=8 train.py --config gpt2_124m         # the same

The launcher (torchrun, or `accelerate launch`, which runs torchrun's launcher) starts one process
per GPU and tells each who it is through RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. init() reads them; without them the run is one plain process and every method of
Dist does nothing (or returns its input), so train.py has one loop for both.

    ddp   each rank holds the whole model; gradients are averaged across ranks during the last
          micro-step's backward (no_sync on the others)
    fsdp  FSDP2 fully_shard: each transformer block, then the rest, is sharded over the ranks
          (parameters, gradients and AdamW moments); blocks are gathered just in time. With
          dtype=bfloat16 the gathered weights are bf16 and gradients are reduced in float32.

Every rank reads different data (data/loader.py: rank r keeps every world_size-th window of the
global batch), so the global batch is micro-batch x grad_accum_steps x world size sequences.
Rank 0 alone prints (ranks > 0 send stdout to /dev/null; warnings and errors still reach stderr),
writes metrics and writes checkpoints. Checkpoints have the single-process format: FSDP gathers
full weights and optimizer state onto rank 0 (on the CPU) to save them and shards them again on
load, so any world size, a single process included, resumes any checkpoint.

A dead rank takes the job down through the launcher; a hung one through the collective timeout
(system.dist_timeout): the ranks waiting for it raise, exit non-zero, and the launcher stops the
rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as torch_dist

from engine import checkpoint
from engine import resume
from engine import runtime
from engine import speedups
from config import Config, ConfigError, SystemConfig, TrainConfig

SIGNALS = tuple(s.name for s in resume.StopRequest.SIGNALS)  # ("SIGINT", "SIGTERM")


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


ACCELERATE_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}


def apply_launcher_flags(cfg: Config) -> list[str]:
    """Honour what `accelerate launch` passes its processes through the environment, so its
    flags are never silently ignored: --mixed_precision bf16/fp16 sets system.dtype, --dynamo_backend
    inductor turns on system.compile (with --dynamo_mode), --use_fsdp selects parallel=fsdp,
    --cpu the CPU. What this code cannot do (fp8, DeepSpeed, other dynamo backends) and flags
    that contradict the config are refused. Returns notes for the start-up banner."""
    env, system, notes = os.environ, cfg.system, []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision in ACCELERATE_PRECISION:
        wanted = ACCELERATE_PRECISION[precision]
        if system.dtype not in ("float32", wanted):
            raise runtime.SetupError(f"accelerate launch --mixed_precision={precision} asks for "
                                     f"{wanted} but the config says dtype={system.dtype}; pass "
                                     "the same precision to both, or drop one")
        if system.dtype != wanted:
            system.dtype = wanted
            notes.append(f"accelerate --mixed_precision={precision}: dtype={wanted}")
    elif precision != "no":
        raise runtime.SetupError(f"accelerate launch --mixed_precision={precision} is not "
                                 "supported here; use bf16, fp16 or no (the config's --dtype)")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend == "inductor":
        system.compile = True
        mode = env.get("ACCELERATE_DYNAMO_MODE", "default")
        system.compile_mode = mode if mode in ("default", "reduce-overhead", "max-autotune",
                                               "max-autotune-no-cudagraphs") else "default"
        notes.append(f"accelerate --dynamo_backend=inductor: compile=on ({system.compile_mode})")
    elif backend != "no":
        raise runtime.SetupError(f"accelerate launch --dynamo_backend={backend} is not supported "
                                 "here; use inductor (= --compile=true) or no")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise runtime.SetupError("accelerate launch --use_deepspeed is not supported here; use "
                                 "--parallel=ddp or --parallel=fsdp (FSDP2)")
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and system.parallel != "fsdp":
        system.parallel = "fsdp"
        notes.append("accelerate --use_fsdp: parallel=fsdp (FSDP2)")
    if env.get("ACCELERATE_USE_CPU", "false").lower() == "true" and system.device != "cpu":
        system.device = "cpu"
        notes.append("accelerate --cpu: device=cpu")
    return notes


def rank_device(system: SystemConfig, local_rank: int, world: int) -> tuple[str, str]:
    """The device this rank trains on and a note for the log: GPU LOCAL_RANK of this node with
    --device=auto or cuda, else the CPU."""
    name = system.device
    if world == 1:
        return name, ""
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
    note = "no GPU: every process trains on the CPU" if name == "auto" else ""
    return "cpu", note


@dataclass
class Dist:
    """This process's place in the job, and the collectives the training loop needs. With one
    process (world_size 1) every method is a no-op or returns its input."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    parallel: str = "none"  # none | ddp | fsdp
    backend: str = ""
    device: str = ""  # the device this rank uses: system.device resolved per rank
    timeout_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    wrapped: torch.nn.Module | None = None  # the DDP module, or the FSDP root
    comm_device: torch.device = torch.device("cpu")  # where collective tensors must live
    _stdout: object = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def system(self, system: SystemConfig) -> SystemConfig:
        """The system section with this rank's device, for runtime.setup (cfg itself keeps what
        the user wrote, so checkpoints do not record 'cuda:3')."""
        return dataclasses.replace(system, device=self.device) if self.enabled else system

    def describe(self, cfg: Config) -> str:
        """The start-up line: layout, and the global batch in sequences and tokens."""
        t = cfg.train
        seqs = t.batch_size * t.grad_accum_steps * self.world_size
        text = (f"global batch: {seqs} sequences = {seqs * cfg.model.block_size:,} tokens per step "
                f"({t.batch_size} micro-batch x {t.grad_accum_steps} accumulation x "
                f"{self.world_size} process{'es' if self.enabled else ''})")
        if not self.enabled:
            notes = self.notes + (["parallel=fsdp needs several processes (torchrun): one plain "
                                   "process here"] if cfg.system.parallel == "fsdp" else [])
            return text + (f"  [{'; '.join(notes)}]" if notes else "")
        nodes = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        layout = (f"distributed: {self.parallel} over {self.world_size} processes on {nodes} "
                  f"node(s) | backend {self.backend} | timeout {self.timeout_s:g}s")
        notes = f"  [{'; '.join(self.notes)}]" if self.notes else ""
        return f"{layout}{notes}\n{text}"

    def close(self) -> None:
        """Leave the job at the end of a run: every rank first waits for the others to finish
        their last collective, so none tears its connections down under another."""
        if self._stdout is not None:
            sys.stdout.close()
            sys.stdout, self._stdout = self._stdout, None
        if torch_dist.is_initialized():
            torch_dist.barrier()
            torch_dist.destroy_process_group()

    # collectives: each is called by every rank at the same point of the loop

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
        """Rank 0 runs the block first (a download, preparing data, tidying out_dir), then the
        others, which then find its result."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def same_everywhere(self, value: int, what: str) -> None:
        """Raise when the ranks disagree on an integer they must share."""
        if not self.enabled:
            return
        lo_hi = self._all_reduce(torch.tensor([value, -value]), torch_dist.ReduceOp.MIN)
        lo, hi = int(lo_hi[0]), -int(lo_hi[1])
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
        """Each rank's evaluation losses (over its own batches, all the same size) -> the mean
        over every rank's batches."""
        if not self.enabled:
            return losses
        total = self._all_reduce(torch.tensor([losses[k] for k in losses], dtype=torch.float64))
        return {k: float(v) / self.world_size for k, v in zip(losses, total.tolist())}

    def sync_step(self, loss_sum: torch.Tensor, stop: resume.StopRequest) -> torch.Tensor:
        """The global batch's loss (every rank's mean), and a stop signal received by any rank
        made every rank's: one small all-reduce per step, so all ranks skip a non-finite step
        together and stop at the same step boundary."""
        if not self.enabled:
            return loss_sum
        pending = getattr(stop, "pending", None)
        flags = [float(pending == name) for name in SIGNALS]
        values = torch.stack([loss_sum.detach().double().to(self.comm_device),
                              *torch.tensor(flags, dtype=torch.float64, device=self.comm_device)])
        total = self._all_reduce(values)
        for name, count in zip(SIGNALS, total[1:].tolist()):
            if count > 0:
                stop.commit(name)
        return (total[0] / self.world_size).to(loss_sum.device, loss_sum.dtype)

    def weights_finite(self, model: torch.nn.Module) -> bool:
        """No NaN/inf in any rank's weights (each checks its own shard under FSDP)."""
        local = [torch.isfinite(full_tensor(p, local=True)).all() for p in model.parameters()]
        return self.all_true(bool(torch.stack(local).all()))

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each rank's (B, T) batch -> the global (W*B, T) batch in the order one process would
        have read it (rank r's rows are global[r::W]); rank 0's copy is the one that matters."""
        if not self.enabled:
            return rows
        mine = rows.to(self.comm_device).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch_dist.all_gather(parts, mine)
        return torch.stack(parts, dim=1).flatten(0, 1).cpu()  # (B, W, T) -> (W*B, T)

    def gather_rng(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every rank's torch RNG state (CPU, and its own GPU's), stacked (W, n): what its
        dropout draws next."""
        states = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(device)
        out = {}
        for key, state in states.items():
            parts = [torch.empty_like(state, device=self.comm_device)
                     for _ in range(self.world_size)]
            torch_dist.all_gather(parts, state.to(self.comm_device))
            out[key] = torch.stack(parts).cpu()
        return out

    # training: wrap the model, micro-steps, checkpoints

    def wrap(self, model: torch.nn.Module, cfg: Config, rt: runtime.Runtime) -> torch.nn.Module:
        """DDP around the model, or FSDP2 sharding of it in place (make the optimizer after
        this: FSDP replaces the parameters with sharded ones). Returns the model to train."""
        if self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # the only buffer is the constant causal mask: nothing to broadcast each forward
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DDP).parameters
                              else {"broadcast_buffers": False})
            ids = [rt.device.index] if rt.device.type == "cuda" else None
            self.wrapped = DDP(model, device_ids=ids, **no_buffer_sync)
        elif self.parallel == "fsdp":
            self.wrapped = shard(model, cfg.system, rt)
        return self.wrapped if self.wrapped is not None else model

    def grad_sync(self, last_micro_step: bool):
        """Average gradients across ranks on the last micro-step only; on the others each rank
        accumulates its own (DDP no_sync, FSDP set_requires_gradient_sync)."""
        if self.parallel == "fsdp":
            self.wrapped.set_requires_gradient_sync(last_micro_step)
        if self.parallel == "ddp" and not last_micro_step:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """What runstate saves and loads as 'the optimizer': under FSDP a view whose state is
        the full, single-process one; otherwise the optimizer itself."""
        return FullStateOptimizer(model, optimizer) if self.parallel == "fsdp" else optimizer

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (gathered from the shards under FSDP); None elsewhere."""
        if self.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                        cpu_offload=True))
            return {k: v.contiguous() for k, v in full.items() if k != checkpoint.TIED} \
                if self.is_main else None
        return checkpoint.model_state(model) if self.is_main else None

    def capture_train_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            scaler: torch.amp.GradScaler, batches,
                            next_batch: tuple[torch.Tensor, torch.Tensor],
                            counters: resume.Counters, device: torch.device) -> dict | None:
        """runstate's train state, with what the other ranks hold added on rank 0: the next
        global batch and every rank's RNG. Every rank must call it; None on ranks > 0."""
        x, y = (self.gather_rows(t) for t in next_batch)
        rank_rng = self.gather_rng(device) if self.enabled else None
        state = resume.capture_train_state(self.optimizer(model, optimizer), scaler, batches,
                                             (x, y), counters, device)
        if not self.is_main:
            return None
        state["world_size"] = self.world_size
        if rank_rng is not None:
            state["rank_rng"] = rank_rng
        return state

    def restore_rank_rng(self, state: dict | None, seed: int, step: int) -> list[str]:
        """Ranks > 0 need their own dropout stream: the saved one when the world size is the
        same, else one derived from (seed, rank, step). Rank 0's is the single-process one."""
        if not self.enabled:
            return []
        saved = (state or {}).get("rank_rng")
        if saved is not None and saved["torch"].shape[0] == self.world_size:
            if not self.is_main:
                torch.set_rng_state(saved["torch"][self.rank])
                if "cuda" in saved and torch.device(self.device).type == "cuda":
                    torch.cuda.set_rng_state(saved["cuda"][self.rank], self.device)
            return []
        if not self.is_main:
            torch.manual_seed(int(np.random.SeedSequence([seed, self.rank, step])
                                  .generate_state(1)[0]))
        if state is None:
            return []
        was = state.get("world_size", 1)
        return [f"resuming on {self.world_size} processes, saved on {was}: ranks > 0 draw new "
                "dropout masks (the same run when dropout is 0)"]


def full_tensor(t: torch.Tensor, local: bool = False) -> torch.Tensor:
    """A DTensor (FSDP) as a plain tensor: the whole of it, or with local=True this rank's
    shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local() if local else t.full_tensor()
    return t


def shard(model: torch.nn.Module, system: SystemConfig, rt: runtime.Runtime) -> torch.nn.Module:
    """FSDP2: each transformer block its own unit (gathered just before it runs), the rest
    (embeddings, final norm, tied head) the root unit."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise runtime.SetupError(f"--parallel=fsdp needs torch >= 2.6 (FSDP2 fully_shard); this "
                                 f"is torch {torch.__version__}: upgrade it or use "
                                 "--parallel=ddp") from None
    # bf16 weights gathered for compute (half the traffic), gradients reduced in float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rt.dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=system.fsdp_reshard, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # the logits are a slice (a view) of the padded head's output; nothing here modifies them
    # in place, which is what FSDP2's warning about views is about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    return model


class FullStateOptimizer:
    """An FSDP-sharded optimizer seen as a single process's: state_dict() gathers the full state
    onto rank 0 in torch.optim's own format (parameters numbered in param_groups order), and
    load_state_dict() takes such a state and shards it. Both are collectives."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        from torch.distributed.fsdp import FSDPModule

        self.model, self.optimizer = model, optimizer
        for module in model.modules():  # the root stays gathered after a forward (eval)
            if isinstance(module, FSDPModule):
                module.reshard()
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        full = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if not full:  # ranks > 0
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[n]: s for n, s in full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                 for g in full["param_groups"]]}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        groups = state["param_groups"]
        count = sum(len(g["params"]) for g in groups)
        if count != len(self.names) or len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved state has {count} parameters in {len(groups)} groups, "
                             f"this optimizer {len(self.names)} in "
                             f"{len(self.optimizer.param_groups)}")
        by_name = {"state": {self.names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                    for g in groups]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))


class SyncedStop(resume.StopRequest):
    """StopRequest for several processes. A signal reaches the ranks at different moments (or
    only one of them), so here it is only marked pending; Dist.sync_step shares it and every
    rank stops at the same step boundary, saves together and exits."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: str | None = None

    def request(self, reason: str) -> None:
        if reason in SIGNALS:
            self.pending = self.pending or reason
        else:  # stop_after_iters, nonfinite: every rank reaches these at the same step
            super().request(reason)

    def commit(self, reason: str) -> None:
        super().request(reason)


def stop_request(d: Dist) -> resume.StopRequest:
    return SyncedStop() if d.enabled else resume.StopRequest()


def set_global_batch(t: TrainConfig, block_size: int, world_size: int) -> str:
    """train.tokens_per_step fixes the global batch in tokens: grad_accum_steps becomes
    tokens_per_step / (batch_size x block_size x world_size), so a config keeps its batch on any
    number of GPUs. Returns a note when grad_accum_steps changed."""
    if not t.tokens_per_step:
        return ""
    per_micro_step = t.batch_size * block_size * world_size
    accum, left = divmod(t.tokens_per_step, per_micro_step)
    if left or accum == 0:
        fits = [b for b in range(1, t.batch_size + 1)
                if t.tokens_per_step % (b * block_size * world_size) == 0]
        fix = (f"use --batch_size={max(fits)}" if fits else
               f"no batch_size fits {world_size} processes: change the number of processes")
        raise ConfigError(
            f"tokens_per_step={t.tokens_per_step:,} is not a multiple of batch_size x block_size "
            f"x processes = {t.batch_size} x {block_size} x {world_size} = {per_micro_step:,}; "
            f"{fix}, or another tokens_per_step (or 0, to use grad_accum_steps as it is)")
    note = "" if accum == t.grad_accum_steps else (
        f"grad_accum_steps {t.grad_accum_steps} -> {accum} for tokens_per_step="
        f"{t.tokens_per_step:,} on {world_size} process{'es' if world_size > 1 else ''}")
    t.grad_accum_steps = accum
    return note


def auto_micro_batch(d: Dist, cfg: Config, model: torch.nn.Module, rt: runtime.Runtime) -> str:
    """train.batch_size_auto on every rank, then all take the smallest micro-batch found (with
    the accumulation that keeps the global batch). Returns the banner value."""
    t = cfg.train
    if t.batch_size_auto and d.parallel == "fsdp":
        return (f"{t.batch_size}x{t.grad_accum_steps} (batch_size_auto measures the unsharded "
                "model: off with fsdp)")
    note = speedups.auto_micro_batch(cfg, model, rt)
    per_rank = t.batch_size * t.grad_accum_steps
    smallest = d.min_int(t.batch_size)
    if smallest == t.batch_size:
        return note
    t.batch_size, t.grad_accum_steps = smallest, per_rank // smallest
    return f"{t.batch_size}x{t.grad_accum_steps} (auto, the smallest fit over the processes)"


def init(cfg: Config) -> Dist:
    """Join the job the launcher started (or return a one-process Dist)."""
    rank, local_rank, world = launch_env()
    launcher_notes = apply_launcher_flags(cfg)
    system = cfg.system
    if world == 1:
        return Dist(notes=launcher_notes)
    device, note = rank_device(system, local_rank, world)
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
    d = Dist(rank=rank, local_rank=local_rank, world_size=world, parallel=system.parallel,
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
    """Under torchrun, an exception that ends a rank is written where the launcher reads it, so
    its summary names the rank and shows the traceback (torch's elastic error handler)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record as elastic_record
    except ImportError:
        return main
    return elastic_record(main)


def collective_failed(e: BaseException) -> bool:
    """A collective that timed out or lost a peer (another rank died or hung). gloo raises a
    plain RuntimeError, recognisable by its text."""
    if isinstance(e, getattr(torch_dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and torch_dist.is_initialized() and \
        any(w in text for w in ("gloo", "nccl", "timed out", "closed by peer"))
