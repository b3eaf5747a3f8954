"""Several processes training one model (torchrun, accelerate launch): joining the job, the
collectives train.py's loop needs, accelerate's flags, DDP or FSDP2 around the model, and
checkpoints of a sharded model saved as one process's. Loaded only under a launcher
(launch.init); one process never imports it.

    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_124m                # DDP
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2_xl --parallel=fsdp  # FSDP2
    accelerate launch --multi_gpu --num_processes=8 train.py --config gpt2_124m         # the same

Rank 0 alone prints and writes. A hung rank fails the others through system.dist_timeout.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from config import Config, SystemConfig
from engine.device import Runtime, SetupError
from engine.training.processes import SIGNALS, Dist

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
        raise SetupError(f"accelerate launch --mixed_precision={precision} is not "
                         "supported here; use bf16, fp16 or no (the config's --dtype)")
    if wanted and system.dtype not in ("float32", "auto", wanted):
        raise SetupError(f"accelerate launch --mixed_precision={precision} asks for "
                         f"{wanted} but the config says dtype={system.dtype}; pass "
                         "the same precision to both, or drop one")
    if wanted and system.dtype != wanted:
        system.dtype = wanted
        notes.append(f"accelerate --mixed_precision={precision}: dtype={wanted}")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend not in ("inductor", "no"):
        raise SetupError(f"accelerate launch --dynamo_backend={backend} is not supported "
                         "here; use inductor (= --compile=true) or no")
    if backend == "inductor":
        mode = env.get("ACCELERATE_DYNAMO_MODE", "default")
        system.compile, system.compile_mode = True, mode if mode in COMPILE_MODES else "default"
        notes.append(f"accelerate --dynamo_backend=inductor: compile=on ({system.compile_mode})")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise SetupError("accelerate launch --use_deepspeed is not supported here; use "
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
            raise SetupError(f"LOCAL_RANK={local_rank} but this node has {count} GPU(s); "
                             f"start at most {count} processes per node "
                             f"(--nproc_per_node={count})")
        return f"cuda:{local_rank}", ""
    if name.startswith("cuda"):
        if not cuda:
            raise SetupError(f"--device={name} but CUDA is not available here; use "
                             "--device=cpu (processes then talk over gloo)")
        raise SetupError(f"--device={name} gives every process the same GPU; use "
                         "--device=cuda (rank r of a node takes GPU LOCAL_RANK) and pick "
                         "GPUs with CUDA_VISIBLE_DEVICES")
    if name == "mps":
        raise SetupError("several processes cannot share MPS; use --device=cpu or one "
                         "process")
    return "cpu", "no GPU: every process trains on the CPU" if name == "auto" else ""

@dataclass
class ProcessGroup(Dist):
    """A rank of a job of several processes: Dist's collectives over torch.distributed."""

    backend: str = ""
    timeout_s: float = 0.0
    comm_device: torch.device = torch.device("cpu")  # where collective tensors must live
    _stdout: object = None
    _flags_in_flight: torch.Tensor | None = None  # the last step's summed stop flags

    def describe(self, batch: str) -> str:
        """The layout of the job, then the global batch with the notes."""
        nodes = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        return (f"distributed: {self.parallel} over {self.world_size} processes on {nodes} "
                f"node(s) | backend {self.backend} | timeout {self.timeout_s:g}s\n"
                + super().describe(batch))

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

    @contextlib.contextmanager
    def main_first(self):
        if not self.is_main:
            torch_dist.barrier()
        yield
        if self.is_main:
            torch_dist.barrier()

    def same_everywhere(self, value: int, what: str) -> None:
        lo, hi = self.min_int(value), -self.min_int(-value)
        if lo != hi:
            raise SetupError(f"the processes disagree on {what} (from {lo} to {hi}; this one "
                             f"has {value})")

    def min_int(self, value: int) -> int:
        return int(self._all_reduce(torch.tensor([value]), torch_dist.ReduceOp.MIN)[0])

    def all_true(self, flag: bool) -> bool:
        return self.min_int(int(flag)) == 1

    def mean_losses(self, losses: dict[str, float]) -> dict[str, float]:
        """Each rank's evaluation losses -> the mean over every rank's (same-sized) batches."""
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

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (gathered from the shards under FSDP); None elsewhere."""
        if self.parallel != "fsdp":
            return super().full_weights(model) if self.is_main else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if not self.is_main:
            return None
        return {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"
                or not model.config.tie_embeddings}

    def optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        """optimizer.state_dict(); under FSDP gathered onto rank 0 in the same single-process
        format ({} elsewhere; a collective)."""
        if self.parallel != "fsdp":
            return optimizer.state_dict()
        return fsdp_optimizer_state(model, optimizer)

    def load_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """optimizer.load_state_dict(state); under FSDP each rank takes its shards."""
        if self.parallel != "fsdp":
            return optimizer.load_state_dict(state)
        load_fsdp_optimizer_state(model, optimizer, state)


def init(cfg: Config, rank: int, local_rank: int, world: int) -> Dist:
    """Join the job the launcher started (a one-process launch: its flags only)."""
    launcher_notes, system = apply_launcher_flags(cfg), cfg.system
    if world == 1:
        return Dist(notes=launcher_notes + ["parallel=fsdp needs several processes (torchrun): "
                                            "one plain process here"] * (system.parallel == "fsdp"))
    device, note = rank_device(system.device, local_rank)
    cuda = device.startswith("cuda")
    if system.parallel == "fsdp" and system.dtype == "float16":
        raise SetupError("--parallel=fsdp with --dtype=float16 is not supported (its loss "
                         "scaler would see only this rank's gradient shard); use "
                         "--dtype=bfloat16 or --parallel=ddp")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    torch_dist.init_process_group(backend, timeout=datetime.timedelta(seconds=system.dist_timeout),
                                  **({"device_id": torch.device(device)} if cuda else {}))
    d = ProcessGroup(rank=rank, world_size=world, parallel=system.parallel, device=device,
                     notes=launcher_notes + ([note] if note else []), backend=backend,
                     timeout_s=system.dist_timeout,
                     comm_device=torch.device(device) if cuda else torch.device("cpu"))
    if rank != 0:  # one log: rank 0's
        d._stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    return d


def wrap(model: torch.nn.Module, cfg: Config, rt: Runtime, dist: Dist) -> torch.nn.Module:
    """system.parallel: DDP around the model, or FSDP2 sharding it in place; else the model."""
    if dist.parallel == "none":
        return model
    if dist.parallel == "fsdp":
        return shard(model, cfg.system, rt)
    from torch.nn.parallel import DistributedDataParallel as DDP

    # the buffers are constants (the causal mask, a cropped source's position rows): nothing to
    # broadcast each forward
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(model, device_ids=ids, **no_buffer_sync)


def shard(model: torch.nn.Module, system: SystemConfig, rt: Runtime) -> torch.nn.Module:
    """FSDP2: each block its own unit, the rest (embeddings, final norm, head) the root."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise SetupError(f"--parallel=fsdp needs torch >= 2.6 (FSDP2 fully_shard); this is "
                         f"torch {torch.__version__}: upgrade it or use --parallel=ddp") from None
    # bf16 weights gathered for compute (half the traffic), gradients reduced in float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if rt.dtype == torch.bfloat16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=system.fsdp_reshard, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # the logits are a view of the padded head's output, never modified in place: harmless
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    return model


def _fsdp_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in param_groups order: how torch.optim's format numbers them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # the root stays gathered after a forward (eval)
        if isinstance(module, FSDPModule):
            module.reshard()
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def fsdp_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A sharded optimizer's state gathered onto rank 0 in the single-process format ({}
    elsewhere; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    index = {name: i for i, name in enumerate(_fsdp_names(model, optimizer))}
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not full:  # ranks > 0
        return {}
    return {"state": {index[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in full["param_groups"]]}


def load_fsdp_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict) -> None:
    """The single-process format's state into a sharded optimizer: each rank takes its shards
    (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names, groups = _fsdp_names(model, optimizer), state["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if count != len(names) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved state has {count} parameters in {len(groups)} groups, "
                         f"this optimizer {len(names)} in {len(optimizer.param_groups)}")
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))


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
