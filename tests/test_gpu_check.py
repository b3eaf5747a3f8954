"""scripts/gpu_check.sh's CPU pass, run as on the H200 it is written for: the packages that
machine's python3 lacks hidden from Python (DEVICE_LACKS), every test module collected as the
script collects them there, every part at tiny size or skipped with a line saying why, the
summary written, at most 8 files in $OUT (what the lent machine hands back), the whole within
the script's budget by its own clock. Also the time budgets of bench.py and bench.py memory that
the script relies on, and the shell functions that bound a part and time its compile."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import bench
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# what the lent H200's Python does not have (the developers' guide lists them)
DEVICE_LACKS = {"torchao", "datasets", "wandb", "openai", "fastapi", "pydantic", "uvicorn",
                "starlette"}
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


def run_script(tmp: Path, hidden: set[str], *args: str, **env_extra: str):
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE.format(names=sorted(hidden)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_CHECK_") and k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(site), **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def cpu_pass(tmp_path_factory, char_dataset):
    tmp = tmp_path_factory.mktemp("gpu_check")
    proc = run_script(tmp, DEVICE_LACKS, "--cpu", "--results", str(tmp / "results"),
                      OUT=str(tmp / "out"), GPU_CHECK_DATASET=str(char_dataset))  # all of tests/
    return proc, tmp


def test_cpu_pass_exits_0_and_writes_its_results(cpu_pass):
    proc, tmp = cpu_pass
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    names = ["gpu_check_cpu-check.md", "gpu_check_cpu-check.json", "gpu_check_cpu-check.log",
             "gpu_check_cpu-check_env.json", "gpu_check_cpu-check_tests.xml",
             "gpu_check_cpu-check_bench.json", "gpu_check_cpu-check_bench.md",
             "memory_cpu-check_decode.json", "memory_cpu-check_train.json",
             "gpu_check_cpu-check_speedrun.md", "gpu_check_cpu-check_speedrun.json"]
    for name in names:
        assert (tmp / "results" / name).is_file(), name
    # $OUT: at most 8 files come back from the lent machine: the summary's three, and an archive
    # of every result file
    out = tmp / "out" / "bench_results"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check_cpu-check.json", "gpu_check_cpu-check.log", "gpu_check_cpu-check.md",
        "gpu_check_cpu-check_all.tar.gz"]
    with tarfile.open(out / "gpu_check_cpu-check_all.tar.gz") as archive:
        assert set(names) <= set(archive.getnames())
    summary = json.loads((tmp / "results" / "gpu_check_cpu-check.json").read_text())
    status = {p["part"]: p["status"] for p in summary["parts"]}
    assert status == {"env": "ok", "tests": "skipped", "compile": "ok", "decode": "ok",
                      "memory": "ok", "bench": "ok", "speedrun": "ok"}
    assert all(p["note"] for p in summary["parts"] if p["status"] == "skipped")  # with its reason
    note = next(p["note"] for p in summary["parts"] if p["part"] == "compile")
    assert note.startswith("CPU pass: --compile=false") and re.search(r"step 2 \d+ ms$", note)
    assert [r["config"] for r in summary["speedrun"]] == ["gpt2_124m", "gpt2_124m_speedrun"]
    assert all(r["steps"] == 3 and r["val"] for r in summary["speedrun"])
    tests = summary["tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # collected, all skipped
    assert DEVICE_LACKS <= set(summary["env"]["missing"])  # hidden
    assert summary["bench"]["baseline_tokens_per_s"] > 0
    assert summary["decode"]["ours_tokens_per_s"] > 0
    assert summary["decode"]["int8_tokens_per_s"] is None  # torchao is hidden
    assert summary["decode"]["hf_tokens_per_s"] > 0  # transformers is not
    assert [r["setting"] for r in summary["memory"]] == ["baseline"]
    page = (tmp / "results" / "gpu_check_cpu-check.md").read_text()
    for heading in ("## CUDA tests", "## bench.py chain", "## Decoding",
                    "## Memory estimate vs measured peak", "## The speedrun config beside"):
        assert heading in page, heading
    assert "SKIP tests: no CUDA device" in (tmp / "results" / "gpu_check_cpu-check.log").read_text()


def test_cpu_pass_hands_back_at_most_8_files_within_its_budget(cpu_pass):
    """What the lent machine returns: at most 8 files anywhere under $OUT; and the script's own
    total (its last line) within the budget it was given (GPU_CHECK_BUDGET, default 460 s)."""
    proc, tmp = cpu_pass
    assert len([p for p in (tmp / "out").rglob("*") if p.is_file()]) <= 8
    budget = int(re.search(r"^gpu_check: results in .*, budget (\d+) s,", proc.stdout,
                           re.M).group(1))
    total = int(re.search(r"^gpu_check: done in (\d+) s;", proc.stdout, re.M).group(1))
    assert budget == 460 and total <= budget
    summary = json.loads((tmp / "results" / "gpu_check_cpu-check.json").read_text())
    assert sum(p["seconds"] for p in summary["parts"]) <= total


def test_a_spent_budget_skips_every_part_with_its_reason(tmp_path):
    """GPU_CHECK_BUDGET=39 leaves under 25 s for the first part once the summary's 15 are kept:
    every part is skipped, saying why, the summary still written, the total within 39 s."""
    proc = run_script(tmp_path, set(), "--cpu", "--results", str(tmp_path / "results"),
                      GPU_CHECK_BUDGET="39", OUT=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "SKIP env: the 39 s budget is spent (GPU_CHECK_BUDGET)" in proc.stdout
    summary = json.loads((tmp_path / "results" / "gpu_check_cpu-check.json").read_text())
    assert [p["part"] for p in summary["parts"]] == ["env", "tests", "compile", "decode",
                                                      "memory", "bench", "speedrun"]
    assert all(p["status"] == "skipped" and p["note"] for p in summary["parts"])
    assert int(re.search(r"^gpu_check: done in (\d+) s;", proc.stdout, re.M).group(1)) <= 39
    assert len([p for p in (tmp_path / "out").rglob("*") if p.is_file()]) <= 8


def test_cpu_pass_says_what_it_skipped_and_why(cpu_pass):
    out = cpu_pass[0].stdout
    for line in ("missing torchao: the int8 tests skip and the int8 decode row is skipped",
                 "missing datasets: not used by this check",
                 "SKIP the GPU sizes (GPT-2 124M at context 1024)",
                 "SKIP tests: no CUDA device: the -m cuda selection was collected and every test "
                 "in it skipped",
                 "decode int8: skipped: sample.quantize=int8 needs torchao: pip install torchao",
                 "train empty_cache=off: needs CUDA",
                 "train prefetch=on: needs CUDA",
                 "skipped: changes nothing here: tf32 needs CUDA: off"):
        assert line in out, line


def test_without_pytest_the_cuda_tests_are_skipped_with_the_fix(tmp_path):
    proc = run_script(tmp_path, {"pytest"}, "--cpu", "--results", str(tmp_path / "results"),
                      GPU_CHECK_PARTS="tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "missing pytest: the CUDA tests are skipped" in proc.stdout
    assert f"SKIP tests: pytest is not installed for {sys.executable}" in proc.stdout
    for part in ("decode", "memory", "bench"):
        assert f"SKIP {part}: not in GPU_CHECK_PARTS=tests" in proc.stdout
    page = (tmp_path / "results" / "gpu_check_cpu-check.md").read_text()
    assert "No report from pytest: pytest is not installed" in page


def test_bench_time_budget_stops_and_still_writes_the_table(char_dataset, tmp_path, capsys):
    code = bench.main(["--config", "tiny", f"--dataset={char_dataset}", "--device=cpu",
                       "--order", "tf32", "--time-budget", "0.001", "--results", str(tmp_path),
                       "--name", "t"])
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


def shell_function(name: str) -> str:
    """One function of scripts/gpu_check.sh, to run alone."""
    text = SCRIPT.read_text()
    return f"{name}() {{" + text.split(f"\n{name}() {{", 1)[1].split("\n}\n", 1)[0] + "\n}\n"


def test_the_compile_part_notes_the_warm_up_and_each_step(tmp_path):
    """watch_compile passes train.py's lines on and notes the seconds from its "compiling:" line
    to the next (torch.compile's warm-up) and each step's time: a slow first step shows a
    compile the warm-up missed."""
    script = tmp_path / "watch.sh"
    script.write_text(f"WORK={tmp_path}\n" + shell_function("watch_compile") + (
        "{ echo 'compiling: torch.compile warms up ...'; sleep 2; echo 'config:'\n"
        "  echo 'step     1 | loss 10.9 | lr 6.0e-04 | norm 1.20 | 41234 ms | 198 tok/s'\n"
        "  echo 'step     2 | loss 10.8 | lr 6.0e-04 | norm 1.10 | 95 ms | 86,231 tok/s'\n"
        "} | watch_compile\n"))
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[0] == "compiling: torch.compile warms up ..."
    assert len(proc.stdout.splitlines()) == 4, proc.stdout + proc.stderr
    assert re.fullmatch(r"torch.compile warm-up [23] s, step 1 41234 ms, step 2 95 ms",
                        (tmp_path / "compile_note").read_text())


def test_a_part_gives_its_second_command_only_what_the_first_left(tmp_path):
    """limited() runs a command under what is left of the part's limit, so a part of two
    commands (decode, speedrun) ends within its own: with 6 s, `sleep 3` then `sleep 5` cuts
    the second (the whole limit would let it finish)."""
    script = tmp_path / "parts.sh"
    script.write_text("say() { printf '%s\\n' \"$*\"; }\n" + shell_function("limited") +
                      "LIMIT=6 PART_START=$SECONDS\nlimited sleep 3; echo first=$?\n"
                      "limited sleep 5; echo second=$?\n")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert "first=0" in proc.stdout and "second=124" in proc.stdout, proc.stdout + proc.stderr
