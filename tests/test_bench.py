"""bench.py and engine/benchmarks/: the ablation's plan of rows, argument errors, tiny end-to-end
runs of each sub-command (one on a sharded dataset)."""
from __future__ import annotations

import json
import math

import pytest

import bench
from config import ConfigError, load_config
from engine.benchmarks import ablation, ablation_report, kernels, to_loss


def gpt2_cfg():
    cfg, _ = load_config(["--config", "gpt2_124m", "--device=cpu"])
    return cfg


def test_chain_adds_flags_one_by_one_from_the_reference_path():
    cfg = gpt2_cfg()  # the recipe has every speedup on: the baseline must switch them off
    rows = ablation.plan(cfg, ablation.parse_steps(ablation.DEFAULT_ORDER), "chain")
    base = rows[0]["config"]
    assert (base.model.attention, base.model.causal_mask, base.model.norm,
            base.model.activation_impl, base.model.vocab_pad_multiple, base.system.dtype,
            base.system.tf32, base.system.compile, base.train.fused_adamw, base.data.pin_memory,
            base.train.batch_size_auto) == ("scratch", "buffer", "scratch", "scratch", 1,
                                            "float32", False, False, False, False, False)
    assert (base.model.loss, base.train.optimizer) == ("full", "adamw")
    assert [r["flag"] for r in rows] == [None, *ablation.FLAGS]
    assert all(r["config"] is None for r in rows[1:])  # each made on the chain's head as it runs
    kept = [base]  # were every flag kept, the chain would end at the recipe again
    for r in rows[1:]:
        kept.append(ablation.with_flag(kept[-1], r["flag"], r["value"]))
    last = kept[-1]
    assert (last.model.loss, last.train.optimizer) == ("chunked", "muon")
    assert (last.model.attention, last.model.causal_mask, last.model.norm,
            last.model.activation_impl, last.model.vocab_pad_multiple, last.system.dtype,
            last.system.tf32, last.system.compile, last.train.fused_adamw, last.data.pin_memory,
            last.train.batch_size_auto) == ("sdpa", "on_the_fly", "native", "native", 64,
                                            "auto", True, True, True, True, True)
    padded = kept[[r["flag"] for r in rows].index("vocab_pad")]  # config.py's order of fields
    assert padded.model.norm == "native" and not padded.system.compile  # earlier flags only
    assert cfg.model.attention == "sdpa"  # planning leaves the given config alone


def timed_row(tokens_per_s: float, spread: float = 0.0, steps: int = 5) -> dict:
    """A measured row whose steps run at tokens_per_s, spread evenly +-spread/2 around it."""
    step = 100 / tokens_per_s
    times = [step * (1 + spread * (i / (steps - 1) - 0.5)) for i in range(steps)]
    return {"status": "ok", "tokens_per_step": 100, "step_s": times,
            "tokens_per_s": 100 / sorted(times)[steps // 2]}


def test_chain_keeps_a_flag_only_when_faster_beyond_the_noise():
    head = timed_row(1000)
    assert ablation.verdict(timed_row(1100), head, 0.03) == (True, "")
    keep, why = ablation.verdict(timed_row(500), head, 0.03)
    assert not keep and why.startswith("dropped: slower here (-50.0%, noise 3.0%")
    keep, why = ablation.verdict(timed_row(1020), head, 0.03)  # +2% < the 3% margin
    assert not keep and why.startswith("dropped: not faster beyond the noise (+2.0%")
    # +10% is no gain when the steps themselves spread by 40%: 5 steps with an interquartile
    # range of 20% give the median a standard error of 8.3%, the difference's 2 sigma 16.6%
    noisy = timed_row(1000, spread=0.4)
    assert ablation.spread(noisy["step_s"]) == pytest.approx(0.2)
    assert ablation.median_error(noisy["step_s"]) == pytest.approx(0.2 * 1.2533 / 1.349 / 5**0.5)
    keep, why = ablation.verdict(timed_row(1100), noisy, 0.03)
    assert not keep and "noise 16.6%" in why
    assert ablation.verdict(timed_row(1200), noisy, 0.03) == (True, "")
    assert ablation.verdict({"status": "skipped"}, head, 0.03) == (False, "")
    assert ablation.verdict({"status": "failed"}, head, 0.03) == (False, "dropped: failed")
    assert ablation.verdict(timed_row(10), {"status": "failed"}, 0.03) == (True, "")


def test_chain_goes_on_without_a_row_that_hurt(monkeypatch, tmp_path):
    """Synthetic timings: sdpa doubles the speed, native norm/GELU halves it, padding adds 20%.
    The norm row is shown but dropped, padding is tried on sdpa alone, the best is sdpa+pad."""
    specs = {}

    def fake_worker(spec, workdir, name, timeout=None, env=None):
        if spec["kind"] == "ceiling":
            return {"status": "ok", "measured": 1e9, "datasheet": 0, "hardware": "test CPU"}
        specs[name] = spec
        m = spec["config"]["model"]
        speed = 1000 * (2 if m["attention"] == "sdpa" else 1) * \
            (0.5 if m["norm"] == "native" else 1) * (1.2 if m["vocab_pad_multiple"] > 1 else 1)
        return {**timed_row(speed), "settings": dict(m), "notes": [], "memory": {"rss": 1},
                "flops_per_token": 1, "loss": 1.0, "kernels": [], "micro_batch": 8,
                "grad_accum_steps": 1, "build_s": 1.0}

    monkeypatch.setattr(ablation, "run_worker", fake_worker)
    cfg, opts, _ = bench.load_bench_config("ablation", ["--config", "tiny", "--device=cpu",
                                                        "--kernels", "off"])
    rows = ablation.plan(cfg, ablation.parse_steps("attention,norm_gelu,vocab_pad"), "chain")
    report = ablation.run_all(rows, cfg, opts, "chain", "test")
    base, sdpa, norm, pad = report["rows"]
    assert [r.get("chain") for r in report["rows"]] == [
        None, "kept", "dropped: slower here (-50.0%, noise 3.0%)", "kept"]
    assert [r["previous"] for r in report["rows"]] == [None, 0, 1, 1]  # pad built on sdpa
    assert specs["row3"]["config"]["model"]["norm"] == "scratch"  # the dropped flag left out
    assert specs["row3"]["config"]["model"]["attention"] == "sdpa"
    # each candidate is followed by a run of its head, side by side: pad's head is sdpa's row
    assert specs["row3head"]["config"] == specs["row1"]["config"] and "row0head" not in specs
    assert pad["alongside"]["tokens_per_s"] == pytest.approx(sdpa["tokens_per_s"])
    assert report["best"] == 3 and pad["vs_baseline"] == pytest.approx(2.4)
    assert ablation_report.best_line(report).startswith(
        "best here: row 3 = baseline + attention=sdpa, vocab_pad=64: 2,400 tok/s, 2.40x")
    assert "dropped: norm_gelu=native: slower here" in ablation_report.best_line(report)
    assert "| 2 | + norm_gelu=native |" in ablation_report.table(report["rows"])
    lines = ablation_report.table(report["rows"]).splitlines()
    assert "dropped: slower here" in lines[4] and "| on row 1 |" in lines[5]  # pad: on sdpa


def fake_rows(specs: dict, written: list | None = None):
    """A stand-in for the row's worker process: bf16 triples the speed, sdpa doubles it,
    compile adds 50%; each row's peak is its precision's (bf16 989e12, else 67e12); a stopped
    run's report file is read after every row (written)."""
    def fake_worker(spec, workdir, name, timeout=None, env=None):
        if spec["kind"] == "ceiling":
            return {"status": "ok", "measured": 1e9, "datasheet": 0, "hardware": "test GPU"}
        specs[name] = spec
        c = spec["config"]
        bf16 = c["system"]["dtype"] != "float32"
        speed = 1000 * (3 if bf16 else 1) * (2 if c["model"]["attention"] == "sdpa" else 1) * (
            1.5 if c["system"]["compile"] else 1)
        compiled = c["system"]["compile"]
        return {**timed_row(speed), "settings": {"device": "cuda", "compile": "on" if compiled
                                                 else "off"}, "notes": [],
                "dtype": c["system"]["dtype"], "memory": {"allocated": 2**30, "reserved": 2**31},
                "flops_per_token": 1e9, "loss": 1.0, "kernels": [], "micro_batch": 8,
                "grad_accum_steps": 1, "build_s": 20.0, "compile_s": 12.0 * compiled,
                "peak_flops": 989e12 if bf16 else 67e12,
                "peak_precision": "bfloat16" if bf16 else "float32"}
    return fake_worker


def test_without_mode_turns_each_flag_off_the_full_recipe(monkeypatch, tmp_path):
    """--without: row 0 is the full recipe, each other row one flag at its reference; 'it buys'
    is the full recipe's speed over the row's; MFU is against each row's own precision's peak;
    the json and md are rewritten after every row, so a stopped run keeps what it measured."""
    specs, seen = {}, []
    monkeypatch.setattr(ablation, "run_worker", fake_rows(specs))
    real_write = ablation_report.write

    def write(report, folder, stem, plot_too=True):
        paths = real_write(report, folder, stem, plot_too)
        seen.append(len(json.loads((tmp_path / "t.json").read_text())["rows"]))
        return paths

    monkeypatch.setattr(ablation_report, "write", write)
    assert bench.main(["ablation", "--config", "tiny", "--device=cpu", "--kernels", "off",
                       "--order", "dtype=bfloat16,attention,compile", "--without", "all",
                       "--results", str(tmp_path), "--name", "t"]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["mode"] == "without" and seen == [0, 1, 2, 3, 4, 4]  # ceiling, rows, the end
    full, *off = report["rows"]
    assert [r["label"] for r in report["rows"]] == [
        "full recipe", "without dtype (float32)", "without attention (scratch)",
        "without compile (false)"]
    assert [specs[f"row{i}"]["config"]["system"]["dtype"] for i in range(4)] == [
        "bfloat16", "float32", "bfloat16", "bfloat16"]
    assert all(specs[f"row{i}"]["config"]["system"]["compile"] for i in range(3))
    assert [r["buys"] for r in off] == pytest.approx([3.0, 2.0, 1.5])
    assert full["mfu"] == pytest.approx(9000 * 1e9 / 989e12)
    assert off[0]["mfu"] == pytest.approx(3000 * 1e9 / 67e12)  # float32: against float32's
    page = (tmp_path / "t.md").read_text()
    assert "| # | step | tok/s | it buys | vs full |" in page
    assert "| 1 | without dtype (float32) | 3,000 | 3.00x | 0.33x |" in page
    assert "each row's datasheet peak in its precision (bfloat16 989 TFLOP/s, float32 67" in page
    assert page.count("built and compiled in 20 s (compile warm-up 12 s)") == 3
    specs.clear()
    assert bench.main(["ablation", "--config", "tiny", "--device=cpu", "--kernels", "off",
                       "--order", "dtype=bfloat16,attention", "--without", "none",
                       "--ceiling=false", "--results", str(tmp_path), "--name", "h"]) == 0
    headline = json.loads((tmp_path / "h.json").read_text())
    assert [r["label"] for r in headline["rows"]] == ["full recipe"] and list(specs) == ["row0"]


def test_cumulative_chain_keeps_every_flag_and_modes_exclude_each_other(monkeypatch, tmp_path,
                                                                        capsys):
    specs = {}
    monkeypatch.setattr(ablation, "run_worker", fake_rows(specs))
    assert bench.main(["ablation", "--config", "tiny", "--device=cpu", "--kernels", "off",
                       "--order", "attention,dtype=bfloat16", "--cumulative", "--ceiling=false",
                       "--results", str(tmp_path), "--name", "c"]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert [r["vs_baseline"] for r in report["rows"]] == [None, 2.0, 6.0]
    assert [r["previous"] for r in report["rows"]] == [None, 0, 1] and report["best"] == 2
    assert sorted(specs) == ["row0", "row1", "row2"]  # no side-by-side reruns
    assert bench.main(["ablation", "--device=cpu", "--only", "all", "--without", "all"]) == 2
    assert "--only and --without are different modes: give one of them" in \
        capsys.readouterr().err
    assert bench.main(["ablation", "--device=cpu", "--order", "attention", "--without",
                       "compile"]) == 2
    assert "--without: compile is not in --order" in capsys.readouterr().err


def test_rows_that_change_nothing_here_are_known_without_a_process(monkeypatch):
    """A flag that needs CUDA, on a CPU, and a row whose settings are those of the row it is set
    against (here: compile already off in the recipe, and dtype=auto where it resolves to
    float32) are reported as skipped without starting their processes."""
    monkeypatch.setattr(ablation, "resolve_dtype", lambda name, device: (
        "float32" if name == "auto" else name, ""))
    rows = ablation.plan(gpt2_cfg(), ablation.parse_steps("dtype,compile=false,tf32,attention"),
                         "without")
    assert [ablation.unchanged(r, rows) for r in rows] == [
        "", "changes nothing here: the same settings as row 0",
        "changes nothing here: the same settings as row 0",
        "needs CUDA: tf32 changes nothing on cpu", ""]


def test_only_mode_and_flag_values():
    steps = ablation.parse_steps("compile=max-autotune,dtype=float16,vocab_pad=128")
    rows = ablation.plan(gpt2_cfg(), steps, "only")
    compile_cfg, fp16_cfg, pad_cfg = (r["config"] for r in rows[1:])
    assert compile_cfg.system.compile and compile_cfg.system.compile_mode == "max-autotune"
    assert compile_cfg.system.dtype == "float32"  # alone: nothing else switched on
    assert fp16_cfg.system.dtype == "float16" and not fp16_cfg.system.compile
    assert pad_cfg.model.vocab_pad_multiple == 128
    assert [r["previous"] for r in rows] == [None, 0, 0, 0]
    assert [ablation.label(r, "only") for r in rows] == [
        "baseline", "only compile=max-autotune", "only dtype=float16", "only vocab_pad=128"]


def test_unknown_or_repeated_flag_and_bad_value(capsys):
    assert bench.main(["--order", "atention,compile", "--device=cpu"]) == 2
    assert "unknown flag 'atention'; did you mean attention?" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="appears twice"):
        ablation.parse_steps("tf32,tf32")
    with pytest.raises(ConfigError, match="dtype=float8.*float32, bfloat16, float16"):
        ablation.plan(gpt2_cfg(), ablation.parse_steps("dtype=float8"), "chain")
    assert bench.main(["--measure-steps", "0", "--device=cpu"]) == 2
    assert "--measure-steps" in capsys.readouterr().err
    assert bench.main(["--clock=process", "--device=cpu", "--threads=2"]) == 2
    assert "needs --device=cpu and --threads=1" in capsys.readouterr().err
    assert bench.main(["--kernels", "maybe", "--device=cpu"]) == 2
    assert "--kernels='maybe': use auto or on or off" in capsys.readouterr().err
    assert bench.main(["--keep-margin=-1", "--device=cpu"]) == 2
    assert "--keep-margin must be >= 0 (got -1.0)" in capsys.readouterr().err
    assert bench.main(["ablaton"]) == 2
    assert "unknown sub-command 'ablaton'; did you mean ablation?" in capsys.readouterr().err
    assert bench.main(["--clock=sundial", "--device=cpu"]) == 2
    assert "--clock='sundial': use wall or process" in capsys.readouterr().err
    assert bench.main(["memory", "--part", "train,speed", "--device=cpu"]) == 2
    assert "--part='train,speed': use a comma list of train, quant, loader, decode" in \
        capsys.readouterr().err


@pytest.mark.parametrize("in_process", [False, True])
def test_bench_runs_end_to_end_and_writes_its_outputs(in_process, char_dataset, tmp_path, capsys):
    """Each row in a fresh process, and (--in-process, the GPU check's CPU pass) in this one:
    the same rows and, from the same seed, the same losses."""
    code = bench.main(["--config", "tiny", f"--dataset={char_dataset}", "--device=cpu",
                       "--order", "attention,tf32", "--warmup-steps", "1", "--kernels", "off",
                       "--measure-steps", "2", "--results", str(tmp_path), "--name", "t",
                       *["--in-process"] * in_process])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((tmp_path / "t.json").read_text())
    base, sdpa, tf32 = report["rows"]
    assert [r["status"] for r in report["rows"]] == ["ok", "ok", "skipped"]
    assert tf32["reason"] == "needs CUDA: tf32 changes nothing on cpu"  # reported, not run
    assert sdpa["kernels"] == ["flash (cpu)"] and base["kernels"] == []
    assert len(base["step_s"]) == 2 and base["tokens_per_step"] == 8 * 32
    assert base["tokens_per_s"] > 0 and sdpa["vs_baseline"] > 0
    assert sdpa["vs_baseline"] == pytest.approx(sdpa["tokens_per_s"] / base["tokens_per_s"])
    # same seed, same data, numerically neutral flag: the same loss after the timed steps
    assert math.isfinite(base["loss"]) and sdpa["loss"] == pytest.approx(base["loss"], abs=1e-4)
    assert base["memory"]["rss"] > 0 and report["ceiling"]["measured"] > 0
    assert 0 < sdpa["mfu_measured"] < 1
    md = (tmp_path / "t.md").read_text()
    assert "| 1 | + attention=sdpa |" in md and "skipped: needs CUDA: tf32" in md
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "+ attention=sdpa" in out and "wrote" in out


def test_to_loss_times_recipes_to_the_target_and_stops_them_there(tmp_path, capsys,
                                                                  monkeypatch):
    """Two recipes of the same math (the reference path, then every speedup) reach the target at
    the same evaluation with close losses; each run is stopped there; table, JSON and plot."""
    monkeypatch.setattr(to_loss, "EVAL_ITERS", 4)  # the same fixed batches for every recipe
    code = bench.main(["to-loss", "3.5", "--recipes",
                       "reference,every speedup,+ position=rotary", "--eval-every", "10",
                       "--results", str(tmp_path), "--name", "t"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "to_loss_t.json").read_text())
    reference, fast, rotary = report["rows"]
    assert rotary["args"][:len(to_loss.BASE)] == to_loss.BASE  # added to the best so far
    assert "--position=rotary" in rotary["args"] and rotary["chain"].startswith(("kept",
                                                                                 "dropped"))
    assert reference["status"] == fast["status"] == "ok"
    assert reference["reached"][0] == fast["reached"][0] <= 100  # the same step
    assert reference["reached"][1] <= 3.5 and fast["curve"][-1] == fast["reached"]  # stopped
    for (step_a, val_a, _), (step_b, val_b, _) in zip(reference["curve"], fast["curve"]):
        assert step_a == step_b and val_a == pytest.approx(val_b, abs=0.02)
    md = (tmp_path / "to_loss_t.md").read_text()
    assert "| reference |" in md and "| every speedup |" in md and "1.00x" in md
    assert (tmp_path / "to_loss_t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_loss_configs_shortens_each_config_in_proportion():
    """--configs --steps N: each config's warmup and Muon's momentum warm-up scaled by
    N / max_iters, HellaSwag off, --args last (they win)."""
    opts = to_loss.ToLossOptions(configs="gpt2_124m,gpt2_124m_speedrun", steps=100,
                                 args="--dataset=shakespeare --batch_size=8")
    assert to_loss.shortened("gpt2_124m", opts) == [
        "--config", "gpt2_124m", "--hellaswag_interval=0", "--max_iters=100",
        "--warmup_iters=4", "--muon_momentum_warmup=0", "--dataset=shakespeare",
        "--batch_size=8"]  # 715 of 19,073 steps
    assert to_loss.shortened("gpt2_124m_speedrun", opts)[3:6] == [
        "--max_iters=100", "--warmup_iters=2", "--muon_momentum_warmup=6"]  # 100, 300 of 5,000


def test_to_loss_configs_times_each_to_the_references_best(char_dataset, tmp_path, capsys):
    """Two configs at a tiny shape: the reference (first) runs to its end and its best val is
    the target; the other is stopped at the first evaluation at or below it (or runs out its
    steps); times from launch and from step 1, table, JSON and plot."""
    shape = (f"--dataset={char_dataset} --device=cpu --threads=1 --n_layer=1 --n_head=2 "
             "--n_embd=32 --block_size=32 --batch_size=4 --tokens_per_step=0 "
             "--grad_accum_steps=1 --compile=false --eval_iters=2")
    code = bench.main(["to-loss", "--configs", "tiny,shakespeare_char_speedrun", "--steps", "20",
                       "--eval-every", "5", f"--args={shape}", "--results", str(tmp_path),
                       "--name", "c"])
    report = json.loads((tmp_path / "to_loss_c.json").read_text())
    reference, other = report["rows"]
    best = min(reference["curve"], key=lambda point: point[1])
    assert [point[0] for point in reference["curve"]] == [5, 10, 15, 20]  # ran to its end
    assert reference["reached"] == best and reference["target"] == best[1]
    assert reference["first_step_s"] < best[2]
    if other["reached"]:  # stopped at the first evaluation at or below the target
        assert other["curve"][-1] == other["reached"] and other["reached"][1] <= best[1]
        assert all(val > best[1] for _, val, _ in other["curve"][:-1]) and code == 0
    else:
        assert other["curve"][-1][0] == 20 and code == 1
    md = (tmp_path / "to_loss_c.md").read_text()
    assert f"target: val loss <= {best[1]:.4f} (the reference config's best val)" in md
    assert "| tiny | step " in md and "| shakespeare_char_speedrun |" in md
    assert (tmp_path / "to_loss_c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench.main(["to-loss", "--configs", "tiny"]) == 2
    assert "give two configs or more, the reference first" in capsys.readouterr().err


def test_the_time_chain_keeps_a_technique_only_when_sooner_beyond_the_noise():
    head = {"reached": [100, 1.8, 50.0], "times": [50.0, 52.0]}

    def row(*times):
        return {"reached": [100, 1.8, times[0]], "times": list(times), "status": "ok"}

    assert to_loss.verdict(row(40.0, 41.0), head, 0.05) == (True, "kept")
    keep, why = to_loss.verdict(row(49.0, 50.0), head, 0.05)
    assert not keep and why.startswith("dropped: not sooner beyond the noise (+3%, noise 5%")
    keep, why = to_loss.verdict(row(30.0, 60.0), head, 0.05)  # a wide spread: noise
    assert not keep and "noise 67%" in why
    assert to_loss.verdict(row(70.0), head, 0.05)[1].startswith("dropped: slower here")
    assert to_loss.verdict({"reached": None, "status": "not reached"}, head, 0.05) == (
        False, "dropped: not reached")


def test_to_loss_bad_options(tmp_path, capsys):
    assert bench.main(["to-loss", "2", "--recipes", "referense"]) == 2
    assert "--recipes: unknown referense; the recipes are reference" in capsys.readouterr().err
    assert bench.main(["to-loss", "2", "--nanogpt", str(tmp_path)]) == 2
    assert "no train.py there; give a nanoGPT checkout" in capsys.readouterr().err
    assert bench.main(["to-loss", "--recipes", "reference"]) == 2
    assert "the target loss must be > 0 (got 0.0)" in capsys.readouterr().err
    assert bench.main(["to-loss", "2", "--device=cpu"]) == 2
    assert "unknown key 'device' in command line" in capsys.readouterr().err


def test_later_passes_add_their_steps_to_the_median():
    first = {"status": "ok", "tokens_per_step": 100, "step_s": [1.0, 1.0, 4.0],
             "tokens_per_s": 100.0, "memory": {"rss": 10}}
    ablation.merge_pass(first, {"status": "ok", "step_s": [0.5, 0.5], "memory": {"rss": 30}})
    assert first["step_s"] == [1.0, 1.0, 4.0, 0.5, 0.5]
    assert first["tokens_per_s"] == 100.0  # median step 1.0 s
    assert first["memory"] == {"rss": 30}
    ablation.merge_pass(first, {"status": "failed", "error": "OutOfMemoryError: ..."})
    assert first["later_pass_errors"] == ["OutOfMemoryError: ..."] and first["status"] == "ok"


def test_kernel_rows_say_what_the_isa_allowed():
    emulated = kernels.variants(threads=2, bf16_units=[])
    assert [r["label"] for r in emulated] == [
        "eager float32, 2 threads", "eager float32, 1 thread",
        "inductor C++ (compile), float32, 2 threads", "oneDNN bf16 (autocast), eager"]
    assert emulated[-1]["skip"] and "not native here" in emulated[-1]["isa"]
    assert [r["set"]["system.threads"] for r in emulated] == ["0", "1", "0", "0"]
    native = kernels.variants(threads=1, bf16_units=["AMX"])
    assert len(native) == 3 and native[-1]["isa"] == "oneDNN bf16 on AMX"
    assert not native[-1].get("skip") and native[-1]["set"]["system.dtype"] == "bfloat16"
    md = kernels.markdown(
        [{**emulated[0], "train": {"status": "ok", "tokens_per_s": 100.0},
          "decode": {"status": "ok", "tokens_per_s": 50.0, "new_tokens": 8}},
         {**emulated[2], "train": {"status": "ok", "tokens_per_s": 150.0},
          "decode": {"status": "failed", "error": "boom"}}, emulated[3]],
        {"compile_kernels": "inductor C++ kernels, vectorized for AVX2"})
    assert "| eager float32, 2 threads | 100 | 1.00x | 50 | 1.00x |" in md
    assert "| 150 | 1.50x | failed: boom | - | inductor C++ kernels, vectorized for AVX2 |" in md
    assert "| - | - | - | - | not native here" in md


def test_decode_row_generates_batch_1_tokens(char_dataset):
    from engine.benchmarks import measure
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", "--device=cpu",
                          "--threads=1"])
    result = measure.decode_row({"config": cfg.to_dict(), "new_tokens": 6, "rounds": 2})
    assert result["new_tokens"] == 6 and len(result["run_s"]) == 2
    assert result["tokens_per_s"] > 0 and result["compile"] == "off" and result["threads"] == 1


def test_serve_command_refuses_a_missing_checkpoint_and_an_unknown_part(tmp_path, capsys):
    missing = tmp_path / "no_run"
    assert bench.main(["serve", "--checkpoint", str(missing), "--parts=load"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err
    assert bench.main(["serve", "--parts=load,speed"]) == 2
    assert "--parts='load,speed': use a comma list of load, workers" in capsys.readouterr().err


def test_serve_prefill_part_reports_gaps_for_each_chunk_setting(tmp_path):
    from config import Config
    from engine import saving
    from model import GPT
    from tests.conftest import tiny_model_config
    cfg = Config()
    cfg.model = tiny_model_config(n_embd=32, block_size=32, vocab_size=26)
    meta = {"tokenizer": {"kind": "char", "chars": [chr(ord("a") + i) for i in range(26)]}}
    ckpt = saving.save(tmp_path / "run", 1, GPT(cfg.model), cfg, meta)
    assert bench.main(["serve", f"--checkpoint={ckpt}", "--parts=prefill", "--chunks=0,8",
                       "--rounds=1", "--streams=2", "--long-prompts=1", "--slots=4",
                       "--threads=1", f"--results={tmp_path}", "--name=t"]) == 0
    prefill = json.loads((tmp_path / "serve_t.json").read_text())["prefill"]
    assert prefill["chunks"] == [0, 8] and list(prefill["runs"]) == ["0", "8"]
    assert (prefill["streams"], prefill["long_prompts"], prefill["prompt_tokens"]) == (2, 1, 28)
    for m in prefill["runs"].values():
        assert m["long_requests"] == 1 and m["long_ttft_p50_ms"] > 0 and m["reading_s"] > 0
        assert m["quiet_gaps"] >= 2 * 15  # 16 chunks each after all were running
        assert m["reading_gaps"] >= 2  # each stream's gap that spans the end, at least
        for window in ("quiet", "reading"):
            p50, p99, top = (m[f"{window}_gap_{q}_ms"] for q in ("p50", "p99", "max"))
            assert 0 < p50 <= p99 <= top
    md = (tmp_path / "serve_t.md").read_text()
    assert "| prefill chunk | quiet gap p50 ms |" in md
    assert "| 0 (whole prompts) |" in md and "| 8 tokens a step |" in md
    assert "with prefill chunk 8, against" in md


FAKE_LLAMA = '''
import json, sys
print(json.dumps({"ready": "fake"}), flush=True)
for line in sys.stdin:
    print(json.dumps({"tokens": [3] * int(line)}), flush=True)
'''


def test_decode_benchmark_rows_ceilings_and_quality(char_dataset, tmp_path, monkeypatch):
    from config import Config
    from engine import saving
    from engine.benchmarks import decode
    from model import GPT
    from tests.conftest import tiny_model_config
    cfg = Config()
    cfg.data.dataset = str(char_dataset)
    cfg.model = tiny_model_config(n_embd=64, n_head=4, block_size=32, vocab_size=65)
    ckpt = saving.save(tmp_path / "run", 1, GPT(cfg.model), cfg, {})
    fake = tmp_path / "fake_llama.py"
    fake.write_text(FAKE_LLAMA)
    monkeypatch.setattr(decode, "LLAMA_WORKER", fake)  # the protocol, without llama.cpp
    monkeypatch.setattr(decode, "llama_imports", lambda python: True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 4096)
    assert bench.main(["decode", f"--checkpoint={ckpt}", "--formats=torch,float32,int8,int4",
                              "--new-tokens=6", "--rounds=2", "--hf=false", f"--gguf={gguf}",
                              f"--quality={ckpt}", "--eval-batches=2", "--agreement-tokens=8",
                              f"--results={tmp_path}", "--name=t", "--threads=1"]) == 0
    report = json.loads((tmp_path / "decode_t.json").read_text())
    rows = report["speed"]["rows"]
    assert list(rows) == ["ours torch", "ours float32", "ours int8", "ours int4",
                          "llama.cpp model"]
    assert rows["ours torch"]["bytes"] < rows["ours float32"]["bytes"]  # + the head's copy
    assert rows["ours float32"]["bytes"] > rows["ours int8"]["bytes"] > rows["ours int4"]["bytes"]
    assert rows["llama.cpp model"]["bytes"] == 4096
    for row in rows.values():
        assert len(row["seconds"]) == 2 and row["tok_per_s"] > 0
        assert row["ceiling"] == pytest.approx(row["bandwidth"] / row["bytes"])
    assert rows["ours torch"]["same_tokens"] == 6  # the first row is the reference
    quality = {q["format"]: q for q in report["quality"]}
    assert quality["torch"]["change"] == 0 and quality["torch"]["same_tokens"] == 8
    assert abs(quality["float32"]["change"]) < 1e-5  # the same weights, summed in other orders
    assert quality["int4"]["perplexity"] != quality["torch"]["perplexity"]
    assert "| llama.cpp | model |" in (tmp_path / "decode_t.md").read_text()


def test_decode_benchmark_refuses_an_unknown_format(capsys):
    assert bench.main(["decode", "--formats=float32,int3"]) == 2
    assert capsys.readouterr().err.startswith("error: --formats: 'int3' is not one of")


def test_ablation_row_trains_on_a_sharded_dataset(tmp_path):
    """The rows build through engine/training/build.py as train.py does, so sharded data (which
    plain Batches refuse) is read by its own loader."""
    from test_shards import write_synthetic
    write_synthetic(tmp_path / "shards", [700, 900, 500])
    assert bench.main(["ablation", "--config", "tiny", f"--dataset={tmp_path / 'shards'}",
                       "--device=cpu", "--threads=1", "--block_size=16", "--batch_size=4",
                       "--order", "tf32", "--warmup-steps", "1", "--measure-steps", "2",
                       "--kernels", "off", "--ceiling-size", "64", "--results", str(tmp_path),
                       "--name", "t"]) == 0
    base, tf32 = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert base["status"] == "ok" and len(base["step_s"]) == 2 and math.isfinite(base["loss"])
    assert base["tokens_per_step"] == 4 * 16 and str(base["settings"]["vocab_pad_multiple"]) == "1"
    assert tf32["status"] == "skipped"  # built on the shards too, then found to change nothing


def test_finetune_exact_match_scores_greedy_replies_to_the_end_of_text(monkeypatch):
    """bench.py finetune-task's score: a reply counts when it is the answer, then the end."""
    import torch

    from data.chat_template import ChatTemplate
    from data.tokenizer import CharTokenizer
    from engine.benchmarks.finetune import exact_match
    from engine.inference import sampling

    tok = CharTokenizer(sorted(set("ab :Reverse the word User Assistant\n")), eot=True)
    template, prompts = ChatTemplate(), []

    def greedy(model, idx, n, temperature):  # a model whose greedy reply is "ba", then the end
        prompts.append(idx[0].tolist())
        reply = tok.encode("ba") + [tok.eot_id] + tok.encode("aaaa")
        return torch.cat([idx, torch.tensor([reply[:n]])], 1)

    monkeypatch.setattr(sampling, "generate_tokens", greedy)
    record = {"instruction": "Reverse the word: ab", "output": "ba"}
    assert exact_match(None, tok, template, [("r", record)]) == 1.0
    assert tok.decode(prompts[0]) == "User: Reverse the word: ab\nAssistant: "
    wrong = [("r", {**record, "output": "b"}), ("s", {**record, "output": "bab"})]
    assert exact_match(None, tok, template, [("r", record)] + wrong) == 1 / 3


def test_finetune_step_batch_counts_about_a_third_of_its_targets():
    from engine.benchmarks.finetune import step_batch

    x, y = step_batch(4, 256, 50257)
    counted = (y != -1).float().mean().item()
    assert x.shape == y.shape == (4, 256) and 0.15 < counted < 0.6
    assert all((y[r] != -1).any() and y[r, 0] == -1 for r in range(4))



def test_finetune_task_draws_exact_match_against_steps(char_dataset, tmp_path, monkeypatch,
                                                       capfd):
    """bench.py finetune-task --steps 2,1: one whole run per step count and kind of finetuning
    (train.py's command line, run in this process here), cheapest first; a table and a PNG of
    the curve; a second call scores the finished runs again instead of retraining them."""
    import subprocess

    import train
    from data import instruct_tasks
    from engine.benchmarks import finetune

    base = tmp_path / "base"
    assert train.main(["--config", "tiny", f"--dataset={char_dataset}", f"--out_dir={base}",
                       "--device=cpu", "--threads=1", "--block_size=128", "--max_iters=1",
                       "--eval_interval=1", "--eval_iters=1", "--loss_curve=false"]) == 0
    runs = []

    def run_here(args, cwd, capture_output, text):  # python train.py ARGS, in this process
        runs.append(args[2:])
        status = train.main([*args[2:], "--device=cpu", "--threads=1", "--eval_iters=1"])
        return subprocess.CompletedProcess(args, status, "", "")

    monkeypatch.setattr(finetune.subprocess, "run", run_here)
    words = instruct_tasks.shakespeare_words()[:48]  # a small task: 40 words, 8 held out
    monkeypatch.setattr(instruct_tasks, "split_words", lambda *a: (words[8:], words[:8]))
    monkeypatch.setattr(finetune, "exact_match", lambda model, tok, template, records:
                        0.2 if model.config.block_size == 128 and records else 0.0)
    command = ["finetune-task", f"--base={base}", f"--work={tmp_path / 'work'}",
               "--tasks=sort", "--results", str(tmp_path), "--name=t"]
    assert bench.main([*command, "--steps=1"]) == 0
    assert "note: rows are padded to their batch's longest example: 64 of block_size 128 tokens " \
        "on average here, which the time estimate counts" in capfd.readouterr().out
    page = (tmp_path / "finetune_task_t.md").read_text()
    assert "| steps | full: exact match | full: training (s) | LoRA r=8: exact match |" in page
    first = json.loads((tmp_path / "finetune_task_t.json").read_text())["rows"][0]
    assert bench.main([*command, "--steps=2,1", "--finetuning=full"]) == 0
    assert [("--lora.rank=8" in a, next(x for x in a if x.startswith("--max_iters")))
            for a in runs] == [(False, "--max_iters=1"), (True, "--max_iters=1"),
                               (False, "--max_iters=2")]  # the first found finished: not rerun
    assert all("--config" in a and "instruct_cpu" in a for a in runs)
    page = (tmp_path / "finetune_task_t.md").read_text()
    assert [line.split(" | ")[:2] for line in page.splitlines()
            if line.startswith(("| 1 |", "| 2 |"))] == [["| 1", "20.0%"], ["| 2", "20.0%"]]
    assert (tmp_path / "finetune_task_t.png").stat().st_size > 0
    rows = json.loads((tmp_path / "finetune_task_t.json").read_text())["rows"]
    assert [(r["task"], r["finetuning"], r["steps"]) for r in rows] == [
        ("sort", "full", 1), ("sort", "full", 2)]
    assert rows[0] == first  # what was measured when it trained, not now
    capfd.readouterr()
    assert bench.main([*command, "--tasks=sort,shuffle"]) == 2
    assert capfd.readouterr().err == ("error: --tasks='sort,shuffle': shuffle is not one of "
                                       "reverse, sort (give them comma-separated)\n")


def test_instruct_tasks_hold_out_their_words_and_answer_exactly(tmp_path):
    from data.instruct import read_records
    from data.instruct_tasks import write_task

    train_file, val_file = write_task("sort", tmp_path)
    train, val = ([r for _, r in read_records(f)] for f in (train_file, val_file))
    assert len(val) == 200 and val[0]["instruction"].startswith("Sort the letters: ")
    words = [[r["instruction"].rsplit(" ", 1)[1] for r in part] for part in (train, val)]
    assert not set(words[0]) & set(words[1])
    assert all(r["output"] == "".join(sorted(w)) for r, w in zip(val, words[1]))
