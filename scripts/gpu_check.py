"""The GPU check, run by scripts/gpu_check.sh: every part of PLAN in order, each under its time
limit inside one budget (BUDGET: 9 minutes on one H100, cold compiles included), each part's
results kept as soon as it ends, so a run stopped at any second keeps what it measured.

    bash scripts/gpu_check.sh               # on the GPU machine, from anywhere
    bash scripts/gpu_check.sh --plan        # what would run, each part's limit; runs nothing
    bash scripts/gpu_check.sh --cpu         # the same plan at tiny sizes on the CPU (CUDA rows
                                            # planned and reported as needing CUDA)
    bash scripts/gpu_check.sh --results DIR # somewhere else than bench_results/

Results go to bench_results/ (a temporary folder for the CPU pass), named after the GPU. With $OUT
set (the lent machine hands back at most 8 files from it), $OUT/bench_results/ gets after every
part, and while a long part runs whenever a row lands: gpu_check_<gpu>.md (the summary page,
headline first), .json, .jsonl (a line per finished part), .log (the console, as it is written)
and one archive of every result file. Exit status 1 when a part failed or ran out of time.

Environment: PYTHON (the interpreter the parts run in; default this one), GPU_CHECK_BUDGET
(seconds, default BUDGET), GPU_CHECK_PARTS (a comma list; default every part), GPU_CHECK_WHEELS
(a folder of wheels installed offline into a temporary folder for the packages the machine
lacks: pytest for the tests part, pydantic for the decode part's engine row), GPU_CHECK_DATASET
(CPU pass: a prepared char-level dataset), GPU_CHECK_CACHE (the compile caches' folder, kept
between runs on one machine; default $TMPDIR/gpu_check_cache). Standard library only: it runs
where torch does not import, and says so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_report as report  # noqa: E402 - beside this file

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 540  # seconds: 9 minutes on one H100, cold compiles included
RESERVE = 10  # kept back for the last summary
REFRESH_S = 10  # while a part runs, the summary is rewritten this often when a result lands
# The headline's recipe: every speedup that should pay on a GPU, on configs/gpt2_124m.toml's
# GPT-2 124M (which has all but Muon on already), as bench.py ablation flags
RECIPE = ("dtype,tf32,compile,attention,causal_mask,norm_gelu,fused_adamw,vocab_pad,chunked_loss,"
          "pin_memory,muon")
# the leave-one-out rows: those whose graphs are compiled already first (no compile, then the
# optimizer and loader flags), then the rows that compile a graph of their own
WITHOUT = ("compile,fused_adamw,muon,pin_memory,dtype,attention,vocab_pad,chunked_loss,tf32,"
           "causal_mask,norm_gelu")
# the cumulative chain: GPT-2's reference path, then a flag at a time, compile last (one row
# compiles)
CHAIN = ("causal_mask,norm_gelu,attention,fused_adamw,pin_memory,vocab_pad,chunked_loss,tf32,dtype,"
         "compile")
GPU_SHAPE = ["--dataset=shakespeare", "--batch_size=16", "--grad_accum_steps=1",
             "--tokens_per_step=0"]  # 16 x 1,024 GPT-2 tokens a step, on data the machine has
CPU_SHAPE = ["--device=cpu", "--threads=1", "--vocab_size=0", "--n_layer=1", "--n_head=2",
             "--n_embd=32", "--block_size=32", "--batch_size=2", "--grad_accum_steps=1",
             "--tokens_per_step=0"]
CPU_COMPILE = ("CPU pass: compile off (TorchInductor's C++ build takes ~30 s a graph here even "
               "at tiny size; the compile tests cover it)")
TO_LOSS_STEPS = 60  # to-loss: steps of each config (about 3 passes over tiny Shakespeare)


@dataclasses.dataclass
class Part:
    name: str
    cap: int  # seconds it is given at least, when the budget has them (0: what is left)
    what: str
    needs: tuple[str, ...] = ()  # packages; installed from GPU_CHECK_WHEELS when missing


PLAN = [
    Part("env", 15, "nvidia-smi, python, torch and CUDA versions, the packages missing and what "
         "each one skips"),
    Part("headline", 110, "GPT-2 124M at context 1024 with every GPU speedup and Muon on "
         "(configs/gpt2_124m.toml + Muon): tok/s, MFU against its precision's peak, CUDA peak "
         "memory, the compile warm-up, the loss after 13 steps"),
    Part("without", 170, "the leave-one-out table: each speedup turned off alone from the "
         "headline's recipe, one process a row, what each buys beside the figures people quote"),
    Part("to_loss", 100, f"time to a target val loss: gpt2_124m, then gpt2_124m_speedrun, "
         f"{TO_LOSS_STEPS} steps each on tiny Shakespeare in GPT-2 tokens; the target is "
         "gpt2_124m's best val"),
    Part("decode", 55, "batch-1 bf16 decoding eager and compiled, and 16 streams at once through "
         "serve.py's engine; pruned Linears (2:4, CSR) against dense", needs=("pydantic",)),
    Part("memory", 45, "the memory strategies on the headline's config: peak memory and tok/s "
         "beside the estimate"),
    Part("tests", 35, "python -m pytest -m cuda tests/: the CUDA variants of the tests",
         needs=("pytest",)),
    Part("chain", 0, "the cumulative chain from GPT-2's reference path, a flag at a time, "
         "when time is left"),
]


class Check:
    """One run of the plan: where things go, the clock, what each part did."""

    def __init__(self, cpu: bool, results: Path, budget: int, parts: list[str], python: str):
        self.cpu, self.results, self.budget, self.python = cpu, results, budget, python
        self.chosen, self.start = parts, time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check."))
        self.slug, self.slug_known = "cpu-check", False  # known once the env part has run
        self.env: dict = {}
        self.parts: list[dict] = [{"part": p.name, "status": "pending", "seconds": 0,
                                   "cap": p.cap, "note": "", "what": p.what} for p in PLAN]
        out = os.environ.get("OUT")
        self.out = Path(out) / "bench_results" if out else None
        self.logs: list = []  # the console log's files, each flushed at every line
        self.saying = threading.Lock()  # a part's output and the check's own lines, whole
        self.running: subprocess.Popen | None = None  # the part's command now
        self.env_vars = dict(os.environ, PYTHONUNBUFFERED="1")
        cache = Path(os.environ.get("GPU_CHECK_CACHE") or
                     Path(tempfile.gettempdir()) / "gpu_check_cache")
        self.env_vars.update(  # one compile cache for every part: a graph compiles once
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
            TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
            TORCHINDUCTOR_AUTOGRAD_CACHE="1")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, text: str) -> None:
        with self.saying:
            print(text, flush=True)
            for f in self.logs:
                f.write(text + "\n")
                f.flush()

    def pass_on(self, stream) -> None:
        """A command's output, line by line, into the console and the log."""
        for line in stream:
            self.say(line.rstrip("\n"))

    def limit(self, i: int) -> float:
        """Part i's seconds: at least its cap (or what is left), and any time the parts before
        it left unused, less the caps of the parts after it."""
        left = self.budget - RESERVE - self.elapsed()
        later = sum(p.cap for p in PLAN[i + 1:] if p.name in self.chosen)
        return max(0.0, min(left, max(PLAN[i].cap, left - later)))

    def record(self, name: str, **fields) -> None:
        part = next(p for p in self.parts if p["part"] == name)
        part.update(fields)
        self.say(f"-- {name}: {part['status']} in {part['seconds']} s"
                 + (f" ({part['note']})" if part["note"] else ""))
        if self.out:  # a line per finished part, never rewritten
            with open(self.out / "gpu_check.jsonl", "a") as f:
                f.write(json.dumps({**part, "at_s": round(self.elapsed())}) + "\n")
        self.publish()

    def publish(self) -> None:
        """The summary page and record, rewritten whole (atomically): in the results folder
        once the GPU's name is known, and in $OUT with the archive of every result file."""
        targets = [self.results / f"gpu_check_{self.slug}"] * self.slug_known
        targets += [self.out / "gpu_check"] if self.out else []
        report.write_summary(self.results, self.slug, self.env, self.parts, self.budget,
                             round(self.elapsed()), self.cpu, targets)
        if self.out and self.slug_known:
            report.archive(self.results, self.slug, self.out / "gpu_check_all.tar.gz")

    def run(self, argv: list[str], limit: float) -> int:
        """argv in its own process group, its output passed on into the log, stopped at limit
        seconds (124); the summary rewritten every REFRESH_S while result files change."""
        self.say("$ " + shlex.join(argv))
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env_vars, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, errors="replace")
        self.running = proc  # stopped with the check on SIGTERM (run_plan)
        pump = threading.Thread(target=self.pass_on, args=(proc.stdout,), daemon=True)
        pump.start()
        deadline, seen = time.monotonic() + limit, report.result_times(self.results)
        while True:
            try:
                proc.wait(timeout=min(REFRESH_S, max(0.1, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    stop(proc)
                    pump.join(timeout=5)
                    return 124
                if (now := report.result_times(self.results)) != seen:
                    seen = now
                    self.publish()
        pump.join(timeout=5)
        self.running = None
        return proc.returncode


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def sizes(check: Check) -> list[str]:
    """The model and batch every training part runs at: GPU or the CPU pass's tiny ones."""
    if not check.cpu:
        return GPU_SHAPE
    data = os.environ.get("GPU_CHECK_DATASET") or "shakespeare_char"
    return CPU_SHAPE + [f"--dataset={data}"]


def bench(check: Check, *args: str) -> list[str]:
    return [check.python, "bench.py", *args]


def cpu_flags(check: Check, flags: str) -> str:
    """A list of flags as this pass runs them: the CPU pass's with compile off."""
    return flags.replace("compile", "compile=false") if check.cpu else flags


def ablation(check: Check, name: str, limit: float, *mode: str) -> list[str]:
    return bench(check, "ablation", "--config", "gpt2_124m", "--optimizer=muon", *sizes(check),
                 "--order", cpu_flags(check, RECIPE), *mode, "--kernels", "off",
                 "--time-budget", f"{max(1, limit - 10):.0f}", "--results", str(check.results),
                 "--name", f"gpu_check_{check.slug}_{name}")


def steps(check: Check, warmup: int, measure: int) -> list[str]:
    """A row's untimed and timed steps; the CPU pass's fewest, every row in one process (it
    checks the path, not the speed)."""
    if check.cpu:
        return ["--warmup-steps", "1", "--measure-steps", "2", "--in-process"]
    return ["--warmup-steps", str(warmup), "--measure-steps", str(measure)]


def part_headline(check: Check, limit: float) -> tuple[list[list[str]], str]:
    return [ablation(check, "headline", limit, "--without", "none", *steps(check, 3, 10))], (
        CPU_COMPILE if check.cpu else "")


def part_without(check: Check, limit: float) -> tuple[list[list[str]], str]:
    return [ablation(check, "without", limit, "--without", WITHOUT, "--ceiling=false",
                     *steps(check, 2, 6))], ""


def part_to_loss(check: Check, limit: float) -> tuple[list[list[str]], str]:
    steps, every = (6, 3) if check.cpu else (TO_LOSS_STEPS, 10)
    args = sizes(check) + ["--eval_iters=4", "--compile=false"] * check.cpu
    return [bench(check, "to-loss", "--configs", "gpt2_124m,gpt2_124m_speedrun", "--steps",
                  str(steps), "--eval-every", str(every), "--seconds", f"{max(1, limit - 15):.0f}",
                  f"--args={shlex.join(args)}", "--results", str(check.results),
                  "--name", f"gpu_check_{check.slug}")], CPU_COMPILE if check.cpu else ""


def part_decode(check: Check, limit: float) -> tuple[list[list[str]], str]:
    """decode-device; on a GPU then pruned Linears: 2:4 semi-structured and CSR against dense."""
    args = ["--device=cpu", "--model=tiny", "--new-tokens=16", "--rounds=2", "--streams=4",
            "--rows=eager,weights,engine"] if check.cpu else ["--device=cuda", "--streams=16"]
    commands = [bench(check, "decode-device", "--dtype=bfloat16", *args, "--results",
                      str(check.results), "--name", f"gpu_check_{check.slug}")]
    if check.cpu:
        return commands, (CPU_COMPILE.replace("compile off", "no compiled row")
                          + "; the sparse kernels' CPU rows: python -m engine.inference.sparse")
    return commands + [[check.python, "-m", "engine.inference.sparse", "--device=cuda",
                        "--rows=1,16,256,4096", "--repeats=5", "--threads=0",
                        f"--out={check.results / f'prune_sparse_{check.slug}'}"]], ""


def part_memory(check: Check, limit: float) -> tuple[list[list[str]], str]:
    rows = "baseline,empty_cache=off,prefetch=on,checkpointing=attention,checkpointing=all," \
           "dtype+weights_dtype=bfloat16"
    extra = ["--compile=false", "--dtype=float32"] if check.cpu else []
    return [bench(check, "memory", "--config", "gpt2_124m", "--optimizer=muon", *sizes(check),
                  *extra, "--part", "train", "--rows", rows, "--steps", "2", "--time-budget",
                  f"{max(1, limit - 10):.0f}", "--results", str(check.results),
                  "--name", f"gpu_check_{check.slug}")], (
        CPU_COMPILE + "; float32 (bf16 is emulated on this CPU)" if check.cpu else "")


def part_tests(check: Check, limit: float) -> tuple[list[list[str]], str]:
    settings = [] if report.importable(check.python, "pytest_timeout") else [
        "-o", "required_plugins=", "-o", "addopts=--strict-markers"]
    note = "" if not settings else "pytest-timeout is missing: no per-test timeout"
    return [[check.python, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider",
             *settings, "--continue-on-collection-errors",
             f"--junitxml={check.results / f'gpu_check_{check.slug}_tests.xml'}", "tests"]], note


def part_chain(check: Check, limit: float) -> tuple[list[list[str]], str]:
    return [bench(check, "ablation", "--config", "gpt2_124m", *sizes(check), "--order",
                  cpu_flags(check, CHAIN),
                  "--cumulative", "--ceiling=false", "--kernels", "off", *steps(check, 2, 4),
                  "--time-budget", f"{max(1, limit - 10):.0f}",
                  "--results", str(check.results), "--name", f"gpu_check_{check.slug}_chain")], ""


PARTS: dict[str, Callable[[Check, float], tuple[list[list[str]], str]]] = {
    "headline": part_headline, "without": part_without, "to_loss": part_to_loss,
    "decode": part_decode, "memory": part_memory, "tests": part_tests, "chain": part_chain}
LEAST = 20  # seconds: a part given fewer is skipped


def run_env(check: Check, limit: float) -> None:
    start = time.monotonic()
    rc = check.run([check.python, str(ROOT / "scripts" / "gpu_check_report.py"), "env", "--json",
                    str(check.work / "env.json"), "--nvidia-smi", report.nvidia_smi()]
                   + ["--cpu"] * check.cpu, limit)
    check.env = report.read_json(check.work / "env.json") or {}
    check.slug, check.slug_known = check.env.get("slug") or check.slug, True
    if not check.cpu and not check.env.get("has_cuda"):
        check.say("no CUDA device here: making the CPU pass instead (tiny sizes, as with --cpu)")
        check.cpu = True
    if (check.work / "env.json").is_file():
        shutil.copyfile(check.work / "env.json", check.results / f"gpu_check_{check.slug}_env.json")
    check.record("env", status=status_of(rc), seconds=round(time.monotonic() - start),
                 note="" if rc == 0 else "the environment could not be read")


def status_of(rc: int) -> str:
    return "ok" if rc == 0 else "timeout" if rc == 124 else "failed"


def skip_reason(check: Check, part: Part) -> str:
    """Why a part does not run here ('' when it does)."""
    if part.name not in check.chosen:
        return f"not in GPU_CHECK_PARTS={','.join(check.chosen)}"
    if cannot := check.env.get("cannot_run"):
        return cannot
    if part.name == "tests" and "pytest" in check.env.get("missing", {}):
        return f"pytest is not installed for {check.python} (pip install pytest, or carry its " \
               "wheels and set GPU_CHECK_WHEELS=DIR)"
    if part.name != "tests" and not check.cpu and "tiktoken" in check.env.get("missing", {}):
        return "tiktoken is not installed: the data is in GPT-2 tokens"
    return ""


def run_part(check: Check, i: int) -> None:
    part, limit = PLAN[i], check.limit(i)
    if why := skip_reason(check, part):
        check.say(f"SKIP {part.name}: {why}")
        return check.record(part.name, status="skipped", note=why)
    if limit < LEAST:
        why = f"the {check.budget} s budget is spent (GPU_CHECK_BUDGET)"
        check.say(f"SKIP {part.name}: {why}")
        return check.record(part.name, status="skipped", note=why)
    check.say(f"\n== {part.name} (at most {limit:.0f} s, {check.elapsed():.0f} s so far) ==")
    start, rc = time.monotonic(), 0
    commands, note = PARTS[part.name](check, limit)
    check.parts[i]["commands"] = [shlex.join(c) for c in commands]
    for argv in commands:
        left = limit - (time.monotonic() - start)
        rc = check.run(argv, left) if left >= 5 else 124
        if rc:
            break
    status = status_of(rc)
    if status == "timeout":
        note = f"stopped at its {limit:.0f} s limit" + (f"; {note}" if note else "")
    elif status == "failed":
        note = f"exit status {rc}" + (f"; {note}" if note else "")
    if part.name == "tests" and rc == 0 and not check.env.get("has_cuda"):
        status, note = "skipped", ("no CUDA device: the -m cuda selection was collected and "
                                   "every test in it skipped")
        check.say(f"SKIP tests: {note}")
    check.record(part.name, status=status, seconds=round(time.monotonic() - start), note=note)


def install_wheels(check: Check) -> None:
    """Packages a part needs that this Python lacks, from GPU_CHECK_WHEELS, offline."""
    folder = os.environ.get("GPU_CHECK_WHEELS")
    wanted = sorted({n for p in PLAN if p.name in check.chosen for n in p.needs
                     if not report.importable(check.python, n)})
    if not folder or not wanted:
        return
    target = check.work / "pylib"
    check.say(f"installing {', '.join(wanted)} offline from {folder}")
    subprocess.run([check.python, "-m", "pip", "install", "--quiet", "--no-index",
                    "--find-links", folder, "--target", str(target), *wanted,
                    *(["pytest-timeout"] if "pytest" in wanted else [])], check=False)
    paths = [str(target), check.env_vars.get("PYTHONPATH", "")]
    check.env_vars["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def print_plan(check: Check) -> None:
    """Each part's cap and commands at this pass's sizes (limits as if each part ran to its
    cap), without running anything."""
    print(f"gpu_check plan: budget {check.budget} s ({RESERVE} s kept for the summary), "
          f"{'CPU pass (tiny sizes)' if check.cpu else 'GPU sizes'}; a part gets at least its "
          "cap while the budget lasts, plus any time the parts before it left")
    total = 0
    for part in PLAN:
        cap = part.cap or "rest"
        on = part.name in check.chosen
        print(f"\n{part.name:9} {cap!s:>5}{' s' if part.cap else '  '}  {part.what}"
              + ("" if on else f"  [not in GPU_CHECK_PARTS]"))
        if part.name == "env":
            print("          $ python scripts/gpu_check_report.py env ...")
        elif on:
            commands, note = PARTS[part.name](check, part.cap or 60)
            for argv in commands:
                print("          $ " + shlex.join(argv))
            if note:
                print(f"          ({note})")
        total += part.cap
    print(f"\ncaps: {total} s of {check.budget - RESERVE} s")


def main(argv: list[str]) -> int:
    cpu = os.environ.get("GPU_CHECK_CPU") == "1"
    results, plan_only = "", False
    while argv:
        arg = argv.pop(0)
        if arg in ("--cpu", "--dry-run"):
            cpu = True
        elif arg == "--plan":
            plan_only = True
        elif arg == "--results" and argv:
            results = argv.pop(0)
        elif arg.startswith("--results="):
            results = arg.partition("=")[2]
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            print(f"gpu_check.sh: unknown argument {arg!r} (--plan, --cpu, --results DIR, "
                  "--help)", file=sys.stderr)
            return 2
    names = [p.name for p in PLAN]
    chosen = [n.strip() for n in os.environ.get("GPU_CHECK_PARTS", ",".join(names)).split(",")
              if n.strip()]
    if unknown := [n for n in chosen if n not in names]:
        print(f"gpu_check.sh: GPU_CHECK_PARTS: unknown {', '.join(unknown)} (parts: "
              f"{', '.join(names)})", file=sys.stderr)
        return 2
    budget = int(os.environ.get("GPU_CHECK_BUDGET") or BUDGET)
    python = os.environ.get("PYTHON") or sys.executable
    if plan_only:  # nothing made, nothing run
        check = Check(cpu, Path(results or "RESULTS"), budget, ["env", *chosen], python)
        check.slug = "<gpu>"  # the env part names it
        print_plan(check)
        shutil.rmtree(check.work, ignore_errors=True)
        return 0
    folder = Path(results) if results else (
        Path(tempfile.mkdtemp(prefix="gpu_check_results.")) if cpu else ROOT / "bench_results")
    folder.mkdir(parents=True, exist_ok=True)
    check = Check(cpu, folder.resolve(), budget, ["env", *chosen], python)
    return run_plan(check, default_results=not results)


def run_plan(check: Check, default_results: bool) -> int:
    def terminated(signum, frame):  # timeout(1) or a user: the part's processes go too
        if check.running is not None:
            stop(check.running)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    if check.out:
        check.out.mkdir(parents=True, exist_ok=True)
        check.logs.append(open(check.out / "gpu_check.log", "w"))
    check.logs.append(open(check.work / "console.log", "w"))  # moved once the slug is known
    try:
        check.say(f"gpu_check: results in {check.results}, budget {check.budget} s, python: "
                  f"{check.python}")
        check.publish()  # a page of pending parts from the first second
        if skip_env := (check.limit(0) < PLAN[0].cap):
            why = f"the {check.budget} s budget is spent (GPU_CHECK_BUDGET)"
            check.say(f"SKIP env: {why}")
            check.slug_known = True
            check.record("env", status="skipped", note=why)
        else:
            run_env(check, check.limit(0))
        if check.cpu and default_results and check.results == (ROOT / "bench_results").resolve():
            check.results = Path(tempfile.mkdtemp(prefix="gpu_check_results."))  # a dry run
            check.say(f"results of the CPU pass in {check.results}")
        keep_log(check)
        if check.cpu and not skip_env:
            check.say("CPU pass: every part at tiny size on the CPU; rows that need CUDA say so")
        install_wheels(check)
        for i in range(1, len(PLAN)):
            run_part(check, i)
    finally:
        check.publish()
        check.say(f"\ngpu_check: done in {check.elapsed():.0f} s; results in {check.results}")
        for f in check.logs:
            f.close()
        shutil.rmtree(check.work, ignore_errors=True)
    return int(any(p["status"] in ("failed", "timeout") for p in check.parts))


def keep_log(check: Check) -> None:
    """The console log from now on also in the results folder, named after the GPU."""
    first = check.logs.pop()  # the work folder's
    first.close()
    kept = open(check.results / f"gpu_check_{check.slug}.log", "w")
    kept.write((check.work / "console.log").read_text())
    check.logs.append(kept)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
