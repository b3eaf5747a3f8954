"""bench.py checkpoint: saving an FSDP2 run's checkpoint, sharded (each process writes its own
shards, engine/sharded.py) against gathered on rank 0 (checkpoint_format=full), in time and in
each process's peak memory.

    python bench.py checkpoint                          # GPT-2 124M shape, 2 CPU processes
    python bench.py checkpoint --rounds 5 --n_layer 24  # a deeper model, more rounds

Each save runs in 2 fresh processes under torchrun (gloo) that build the model, shard it with
FSDP2 and give AdamW its state (one step), then time one save of step 1 between two barriers:
    full        every weight and AdamW moment gathered onto rank 0's CPU, written by rank 0
    sharded     each rank writes its shards with torch.distributed.checkpoint
    background  the same in the background: what the loop waits for (the copy to host memory),
                then the whole save
Peak memory: each process's resident-set high-water mark (VmHWM, reset just before the save
through /proc/self/clear_refs), less its resident memory then. The modes take turns, in a
different order each round; the table gives each mode's median over the rounds.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from config import opt
from engine.benchmarks import checks
from engine.benchmarks.report import markdown_table, utc_now, write_report
from engine.benchmarks.timing import REPO_ROOT
from engine.device import format_bytes, machine_line

MODES = ("full", "sharded", "background")


@dataclass
class CheckpointBenchOptions:
    rounds: int = opt(3, "saves of each mode, taking turns")
    n_layer: int = opt(12, "blocks (GPT-2 124M: 12)")
    n_embd: int = opt(768, "width, a multiple of 64 (a head each 64; GPT-2 124M: 768)")
    block_size: int = opt(1024, "context (GPT-2 124M: 1024)")
    work: str = opt("out/bench_checkpoint", "where the checkpoints go (each removed after its "
                    "round)")
    results: str = opt("bench_results", "folder for checkpoint_save_NAME.{json,md}")
    name: str = opt("cpu", "NAME in the result files")


def memory_kib(field: str) -> int:
    """VmRSS or VmHWM of this process, in KiB (0 where /proc is not there)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in text.splitlines()
                 if line.startswith(field + ":")), 0)


def reset_peak() -> bool:
    """Start VmHWM again from the current resident set (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(mode: str, out: Path, shape: dict, report: Path) -> None:
    """One rank of the 2-process job: build, shard, one AdamW step, then one timed save."""
    import config as config_mod
    from engine import saving
    from engine.sharded import ShardedWriter
    from engine.training import parallel
    from engine.training.optim import make_optimizer
    from model import GPT, ModelConfig

    torch.set_num_threads(1)
    cfg = config_mod.Config()
    cfg.system.device, cfg.system.parallel, cfg.train.optimizer = "cpu", "fsdp", "adamw"
    cfg.model = ModelConfig(vocab_size=50304, n_head=shape["n_embd"] // 64, **shape)
    dist = parallel.init(cfg, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                         int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = parallel.shard(GPT(cfg.model), cfg.system, SimpleNamespace(dtype=torch.float32))
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    for p in model.parameters():  # AdamW's state made as a step makes it (the values do not matter)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    writer = ShardedWriter(dist, str(out), 0, mode == "background") if mode != "full" else None
    dist.all_true(True)  # a barrier
    before, peak_known = memory_kib("VmRSS"), reset_peak()
    start = time.perf_counter()
    if writer is None:  # today's full checkpoint: everything through rank 0
        weights, state = dist.full_weights(model), dist.optimizer_state(model, optimizer)
        if dist.is_main:
            saving.save(out, 1, model, cfg, {}, {"optimizer": state}, weights=weights)
    else:
        writer.save(1, model, optimizer, cfg, {}, {"format": 2})
    returned = time.perf_counter() - start
    if writer is not None:
        writer.wait()
    dist.all_true(True)
    total = time.perf_counter() - start
    result = {"rank": dist.rank, "mode": mode, "returned_s": returned, "total_s": total,
              "rss_kib": before, "peak_kib": memory_kib("VmHWM") if peak_known else None}
    report.with_name(f"{report.stem}_{dist.rank}.json").write_text(json.dumps(result))
    dist.close()


def one_save(mode: str, opts: CheckpointBenchOptions, round_: int) -> dict:
    """A 2-process job saving once in `mode`: each rank's timing and memory, the bytes written."""
    work = Path(opts.work)
    out, report = work / f"{mode}_{round_}", work / f"result_{mode}_{round_}.json"
    shutil.rmtree(out, ignore_errors=True)
    shape = {"n_layer": opts.n_layer, "n_embd": opts.n_embd, "block_size": opts.block_size}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "engine.benchmarks.checkpoint_save", mode, str(out), json.dumps(shape),
           str(report)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} save failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    ranks = [json.loads(report.with_name(f"{report.stem}_{r}.json").read_text()) for r in (0, 1)]
    written = {}
    for f in out.rglob("*"):
        if f.is_file():
            key = f.name if f.suffix == ".distcp" else "rank 0"
            written[key] = written.get(key, 0) + f.stat().st_size
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "round": round_, "ranks": ranks, "bytes": written}


def run(opts: CheckpointBenchOptions, command: str) -> int:
    checks.check(opts, {"rounds": 1, "n_layer": 1, "n_embd": 64, "block_size": 1})
    saves = []
    for r in range(opts.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]  # each mode first once every three rounds
        for mode in order:
            saves.append(one_save(mode, opts, r))
            print(f"round {r + 1}/{opts.rounds} {mode}: " + ", ".join(
                f"rank {x['rank']} {x['total_s']:.2f} s" for x in saves[-1]["ranks"]), flush=True)
    report = {"command": command, "date": utc_now(),
              "hardware": machine_line(torch.device("cpu")), "options": vars(opts),
              "saves": saves}
    text = page(report)
    print("\n" + text)
    write_report(report, text, opts.results, f"checkpoint_save_{opts.name}")
    return 0


def page(report: dict) -> str:
    rows = []
    for mode in MODES:
        mine = [s for s in report["saves"] if s["mode"] == mode]

        def median(key, rank=None):
            values = [max(x[key] for x in s["ranks"]) if rank is None else
                      next(x for x in s["ranks"] if x["rank"] == rank)[key] for s in mine]
            return statistics.median(values)

        def extra(rank):
            peaks = [next(x for x in s["ranks"] if x["rank"] == rank) for s in mine]
            if any(x["peak_kib"] is None for x in peaks):
                return "unknown"
            return format_bytes(1024 * statistics.median(x["peak_kib"] - x["rss_kib"]
                                                         for x in peaks))

        written = mine[0]["bytes"]
        rows.append([mode, f"{median('returned_s'):.2f}", f"{median('total_s'):.2f}",
                     extra(0), extra(1),
                     ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(written.items()))])
    o = report["options"]
    return "\n".join([
        f"# bench.py checkpoint ({report['date']})", "",
        f"- {report['hardware']}", f"- `{report['command']}`",
        f"- GPT-2 shape: {o['n_layer']} layers, n_embd {o['n_embd']}, context "
        f"{o['block_size']}, vocab 50,304; FSDP2 over 2 CPU processes (gloo), AdamW state "
        f"made by one step; {o['rounds']} rounds, the modes in turns; medians",
        "- seconds: the slowest rank's, from a barrier before the save to a barrier after it "
        "(the loop waits 'until save() returns'; 'until on disk' includes a background save's "
        "writing)",
        "- peak memory: each process's resident high-water mark during the save, less its "
        "resident memory before it", "",
        markdown_table(["mode", "s until save() returns", "s until on disk",
                        "rank 0 peak extra memory", "rank 1 peak extra memory",
                        "written"], rows)])


if __name__ == "__main__":  # one rank of one_save's job
    worker(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4]))
