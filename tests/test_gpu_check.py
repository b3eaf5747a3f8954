"""scripts/gpu_check.sh's CPU pass, run as on the lent GPU machine it is written for: the packages
that machine's python3 lacks hidden from Python (DEVICE_LACKS), every part of the plan in order
at tiny size (what needs CUDA reported so), the summary headline first, at most 8 files in
$OUT (what the lent machine hands back), the whole within the budget. A run killed at a random
moment leaves a readable summary of the parts done. Also --plan, the time limits, and the time
budgets of the benchmarks the plan relies on."""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import bench
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402 - scripts/ is no package

# what the lent machine's Python does not have (the developers' guide lists them)
DEVICE_LACKS = {"torchao", "datasets", "wandb", "openai", "fastapi", "pydantic", "uvicorn",
                "starlette"}
PARTS = [p.name for p in gpu_check.PLAN]
# A sitecustomize.py that makes packages unfindable, as if they were not installed: `import X`
# raises ModuleNotFoundError and importlib.util.find_spec("X") is None (what transformers checks).
HIDE = '''import importlib.machinery

HIDDEN = {names!r}
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def _find_unless_hidden(cls, name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN:
        return None
    return _find_spec(cls, name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_find_unless_hidden)
'''


def script_env(tmp: Path, hidden: set[str], **extra: str) -> dict:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE.format(names=sorted(hidden)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_CHECK_") and k not in ("OUT", "PYTHONPATH")}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(site),
            "GPU_CHECK_CACHE": str(tmp / "cache"), **extra}


def run_script(tmp: Path, hidden: set[str], *args: str, **extra: str):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, text=True, capture_output=True,
                          env=script_env(tmp, hidden, **extra), timeout=900)


def out_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def cpu_pass(tmp_path_factory, char_dataset):
    tmp = tmp_path_factory.mktemp("gpu_check")
    proc = run_script(tmp, DEVICE_LACKS, "--cpu", "--results", str(tmp / "results"),
                      OUT=str(tmp / "out"), GPU_CHECK_DATASET=str(char_dataset))
    return proc, tmp


def test_cpu_pass_runs_the_plan_in_order_and_hands_back_at_most_8_files(cpu_pass):
    proc, tmp = cpu_pass
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = tmp / "out"
    assert out_files(out) == [f"bench_results/gpu_check{s}" for s in (
        ".json", ".jsonl", ".log", ".md", "_all.tar.gz")]  # at most 8 come back
    summary = json.loads((out / "bench_results" / "gpu_check.json").read_text())
    status = {p["part"]: p["status"] for p in summary["parts"]}
    assert list(status) == PARTS
    assert status == {"env": "ok", "headline": "ok", "without": "ok", "to_loss": "ok",
                      "decode": "ok", "memory": "ok", "tests": "skipped", "chain": "ok"}
    lines = (out / "bench_results" / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(line)["part"] for line in lines] == PARTS  # a line as each part ended
    names = ["gpu_check_cpu-check.md", "gpu_check_cpu-check.json", "gpu_check_cpu-check.log",
             "gpu_check_cpu-check_env.json", "gpu_check_cpu-check_tests.xml",
             "gpu_check_cpu-check_headline.json", "gpu_check_cpu-check_without.json",
             "gpu_check_cpu-check_chain.json", "to_loss_gpu_check_cpu-check.json",
             "decode_device_gpu_check_cpu-check.json", "memory_gpu_check_cpu-check.json"]
    with tarfile.open(out / "bench_results" / "gpu_check_all.tar.gz") as archive:
        assert set(names) <= set(archive.getnames())
    for name in names:
        assert (tmp / "results" / name).is_file(), name
    budget = int(re.search(r"budget (\d+) s,", proc.stdout).group(1))
    total = int(re.search(r"^gpu_check: done in (\d+) s;", proc.stdout, re.M).group(1))
    assert budget == gpu_check.BUDGET and total <= budget
    assert sum(p["seconds"] for p in summary["parts"]) <= total


def test_the_summary_puts_the_headline_first_and_shows_every_row(cpu_pass):
    _, tmp = cpu_pass
    page = (tmp / "out" / "bench_results" / "gpu_check.md").read_text()
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Headline: GPT-2 124M, every GPU speedup on",
                            "## What each speedup buys: the full recipe, then each turned off "
                            "alone"]
    assert headings[-1] == "## Parts" and "## CUDA tests" in headings
    summary = json.loads((tmp / "out" / "bench_results" / "gpu_check.json").read_text())
    top = summary["headline"]
    assert top["tokens_per_s"] > 0 and top["steps"] == 3 and top["memory"]["rss"] > 0
    assert top["settings"]["optimizer"] == "muon" and top["settings"]["loss"] == "chunked"
    # every leave-one-out row planned; the CUDA-only ones say so without a process
    rows = {r["flag"]: r for r in summary["without"]}
    assert list(rows) == gpu_check.WITHOUT.split(",")
    for flag in ("tf32", "pin_memory"):
        assert rows[flag]["status"] == "skipped"
    assert f"| tf32 | - | - | skipped: needs CUDA: tf32 changes nothing on cpu |" in page
    assert "| compile | ~2.5x | - | skipped: changes nothing here: the same settings as row 0" \
        in page  # the CPU pass's recipe has compile off
    assert all(rows[f]["status"] == "ok" and rows[f]["buys"] > 0
               for f in ("attention", "vocab_pad", "chunked_loss", "muon"))
    to_loss = summary["to_loss"]["rows"]
    assert [r["recipe"] for r in to_loss] == ["gpt2_124m", "gpt2_124m_speedrun"]
    assert to_loss[0]["reached"] and to_loss[0]["target"] == to_loss[0]["reached"][1]
    decode = summary["decode"]["rows"]
    assert decode["eager"]["tok_per_s"] > 0 and decode["weights"]["tok_per_s"] > 0
    assert decode["engine"] == {"status": "skipped", "reason": "serve.py's engine needs pydantic"
                                ": pip install pydantic (gpu_check.sh: carry its wheels, "
                                "GPU_CHECK_WHEELS=DIR)"}  # hidden, as on the lent machine
    memory = {r["setting"]: r["status"] for r in summary["memory"]["train"]}
    assert memory["baseline"] == "ok" and memory["prefetch=on"] == "needs CUDA"
    chain = summary["chain"]
    assert chain[0]["label"] == "baseline" and len(chain) == len(gpu_check.CHAIN.split(",")) + 1
    tests = summary["tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # collected, all skipped
    assert DEVICE_LACKS <= set(summary["env"]["missing"])


def test_cpu_pass_says_what_it_skipped_and_why(cpu_pass):
    out = cpu_pass[0].stdout
    for line in ("missing torchao: the int8 tests skip",
                 "missing datasets: not used by this check",
                 "CPU pass: every part at tiny size on the CPU; rows that need CUDA say so",
                 "SKIP tests: no CUDA device: the -m cuda selection was collected and every test "
                 "in it skipped",
                 "train empty_cache=off: needs CUDA", "train prefetch=on: needs CUDA",
                 "skipped: needs CUDA: tf32 changes nothing on cpu"):
        assert line in out, line


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes in /proc")
def test_a_run_killed_at_a_random_moment_leaves_a_readable_summary(tmp_path, char_dataset):
    """SIGKILL to the whole check (what the lent machine's time limit does) somewhere in its
    first parts: $OUT holds a summary page that reads whole, every part of the plan in it,
    those done with their status and the others pending, and a JSON line per part done."""
    moment = random.Random().uniform(2.0, 30.0)
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--cpu", "--results", str(tmp_path / "r")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            env=script_env(tmp_path, DEVICE_LACKS, OUT=str(out),
                                           GPU_CHECK_DATASET=str(char_dataset)))
    time.sleep(moment)
    family = descendants(proc.pid)  # each part runs in a process group of its own
    for pid in [proc.pid, *family]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    where = f"killed after {moment:.1f} s"
    page = (out / "bench_results" / "gpu_check.md").read_text()
    assert page.startswith("# GPU check: ") and page.endswith("|\n"), where
    parts = re.findall(r"^\| (\w+) \| (\w+) \| \d+ \| \w+ \|", page, re.M)
    assert [name for name, _ in parts] == PARTS, where
    done = [name for name, status in parts if status != "pending"]
    assert done == PARTS[:len(done)], where  # in order; the rest not started
    record = json.loads((out / "bench_results" / "gpu_check.json").read_text())
    assert [p["part"] for p in record["parts"]] == PARTS
    lines = (out / "bench_results" / "gpu_check.jsonl").read_text().splitlines() \
        if (out / "bench_results" / "gpu_check.jsonl").exists() else []
    ended = [json.loads(line)["part"] for line in lines if line.endswith("}")]
    assert ended == done, where
    assert "gpu_check: results in" in (out / "bench_results" / "gpu_check.log").read_text()
    assert len(out_files(out)) <= 8


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), children first."""
    children = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        kids = children.get(queue.pop(), [])
        found += kids
        queue += kids
    return found


def test_plan_prints_every_part_with_its_cap_and_runs_nothing(tmp_path):
    proc = run_script(tmp_path, set(), "--plan", "--results", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    caps = re.findall(r"^(\w+) +(\d+ s|rest) ", proc.stdout, re.M)
    assert [name for name, _ in caps] == PARTS
    assert dict(caps)["headline"] == f"{gpu_check.PLAN[1].cap} s"
    assert sum(p.cap for p in gpu_check.PLAN) <= gpu_check.BUDGET - gpu_check.RESERVE
    assert "bench.py ablation --config gpt2_124m --optimizer=muon --dataset=shakespeare" in \
        proc.stdout and "--without none" in proc.stdout
    assert not (tmp_path / "r").exists()  # nothing made, nothing ran


def test_a_part_gets_its_cap_and_the_time_earlier_parts_left(tmp_path):
    """limit(i): at least the part's cap while the budget has it, plus what the parts before
    it left unused beyond the caps of the parts after it; never past the budget."""
    check = gpu_check.Check(False, tmp_path, 540, PARTS, sys.executable)
    later = sum(p.cap for p in gpu_check.PLAN[2:])
    check.start = time.monotonic()  # nothing spent: the headline may use what others leave
    assert check.limit(1) == pytest.approx(540 - gpu_check.RESERVE - later, abs=1)
    check.start = time.monotonic() - 300  # 300 s spent: its cap stands
    assert check.limit(1) == pytest.approx(gpu_check.PLAN[1].cap, abs=1)
    check.start = time.monotonic() - 525  # 5 s left: never more than the budget holds
    assert check.limit(1) == pytest.approx(5, abs=1)
    assert check.limit(len(PARTS) - 1) == pytest.approx(5, abs=1)  # the chain: what is left


def test_a_command_past_its_limit_is_stopped_and_results_are_published_as_they_land(tmp_path):
    """Check.run kills a command's whole process group at its limit (124), and while it runs,
    a result file landing in the results folder rewrites the summary in $OUT."""
    os.environ["OUT"] = str(tmp_path / "out")
    try:
        check = gpu_check.Check(True, tmp_path / "r", 60, PARTS, sys.executable)
    finally:
        del os.environ["OUT"]
    check.results.mkdir()
    check.out.mkdir(parents=True)
    check.slug_known = True
    writer = (f"import time, pathlib; time.sleep(1); "
              f"pathlib.Path({str(check.results)!r}, 'x.json').write_text('{{}}'); time.sleep(60)")
    gpu_check.REFRESH_S, saved = 0.5, gpu_check.REFRESH_S
    try:
        start = time.monotonic()
        assert check.run([sys.executable, "-c", writer], limit=3) == 124
    finally:
        gpu_check.REFRESH_S = saved
    assert time.monotonic() - start < 20
    assert (check.out / "gpu_check.md").is_file() and (check.out / "gpu_check_all.tar.gz").is_file()


def test_a_spent_budget_skips_every_part_with_its_reason(tmp_path):
    """GPU_CHECK_BUDGET=20 leaves under the env part's cap once the summary's seconds are kept:
    every part is skipped, saying why, the summary still written, the total within 20 s."""
    proc = run_script(tmp_path, set(), "--cpu", "--results", str(tmp_path / "results"),
                      GPU_CHECK_BUDGET="20", OUT=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "SKIP env: the 20 s budget is spent (GPU_CHECK_BUDGET)" in proc.stdout
    summary = json.loads((tmp_path / "out" / "bench_results" / "gpu_check.json").read_text())
    assert [p["part"] for p in summary["parts"]] == PARTS
    assert all(p["status"] == "skipped" and p["note"] for p in summary["parts"])
    assert int(re.search(r"^gpu_check: done in (\d+) s;", proc.stdout, re.M).group(1)) <= 20
    assert len(out_files(tmp_path / "out")) <= 8


def test_without_pytest_the_cuda_tests_are_skipped_with_the_fix(tmp_path):
    proc = run_script(tmp_path, {"pytest"}, "--cpu", "--results", str(tmp_path / "results"),
                      GPU_CHECK_PARTS="tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "missing pytest: the CUDA tests are skipped" in proc.stdout
    assert f"SKIP tests: pytest is not installed for {sys.executable}" in proc.stdout
    for part in ("headline", "decode", "memory"):
        assert f"SKIP {part}: not in GPU_CHECK_PARTS=env,tests" in proc.stdout
    page = (tmp_path / "results" / "gpu_check_cpu-check.md").read_text()
    assert "No report from pytest: pytest is not installed" in page
    assert run_script(tmp_path, set(), "--cpu", GPU_CHECK_PARTS="tests,speedrun").returncode == 2


def test_bench_time_budget_stops_and_still_writes_the_table(char_dataset, tmp_path, capsys):
    code = bench.main(["--config", "tiny", f"--dataset={char_dataset}", "--device=cpu",
                       "--order", "attention", "--time-budget", "0.001", "--results",
                       str(tmp_path), "--name", "t"])
    assert code == 1  # no row measured
    report = json.loads((tmp_path / "t.json").read_text())
    if report["ceiling"]["status"] != "ok":  # given 1 s at least: stopped unless it was done
        assert "stopped after 1 s: the --time-budget ran out" in report["ceiling"]["error"]
    assert [r["status"] for r in report["rows"]] == ["skipped", "skipped"]
    assert "the --time-budget of 0.001 s ran out before this row" in report["rows"][0]["reason"]
    assert "skipped: the --time-budget" in (tmp_path / "t.md").read_text()


def test_bench_memory_rows_and_time_budget(char_dataset, tmp_path, capsys):
    code = bench.main(["memory", "--part", "train", "--rows", "baseline,prefetch=on",
                       "--time-budget", "0.001", f"--dataset={char_dataset}",
                       "--device=cpu", "--results", str(tmp_path), "--name", "t"])
    assert code == 0
    baseline, prefetch = json.loads((tmp_path / "memory_t.json").read_text())["train"]
    # not started, or (if the budget had not quite run out) given 1 s and stopped
    assert (baseline["status"], prefetch["status"]) in [("skipped", "needs CUDA"),
                                                        ("failed", "needs CUDA")]
    assert "the --time-budget ran out" in (baseline.get("reason") or baseline["error"])
    assert "the --time-budget ran out" in (tmp_path / "memory_t.md").read_text()
    assert bench.main(["memory", "--part", "train", "--rows", "baseline,nope",
                       "--device=cpu"]) == 2
    assert "--rows='baseline,nope': use a comma list of baseline, checkpointing=all" in \
        capsys.readouterr().err
