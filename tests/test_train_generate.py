"""Tiny end-to-end runs: train -> checkpoint -> generate, and the sampler's behaviour; on CUDA,
where there is one, the same run with the CUDA speedups on, and KV-cache decoding there."""
from __future__ import annotations

import json
import math

import pytest
import torch

import generate
import load_gpt2_weights
import train
from config import load_config
from conftest import narrowed_below_amx, on_each_device, tiny_model_config
from engine import checkpoint, loading
from engine import device as machine
from engine.inference import sampling
from engine.training import memory_estimate, speedups
from model import GPT


def tiny_cfg(char_dataset, out_dir, *extra):
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", f"--out_dir={out_dir}",
                          "--device=cpu", *extra])
    return cfg


@pytest.fixture(scope="module")
def trained(char_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = tiny_cfg(char_dataset, out, "--max_iters=60", "--eval_interval=30")
    summary = train.train(cfg)
    return cfg, summary, out


def test_training_lowers_loss_and_checkpoints(trained):
    cfg, summary, out = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert evals[-1]["val"] < evals[0]["val"] - 0.5  # starts near ln(65) = 4.17
    assert summary["steps"] == 60
    ckpts = checkpoint.list_checkpoints(out)
    assert [p.name for p in ckpts] == ["ckpt_0000030", "ckpt_0000060"]
    assert not any(p.name.startswith(".tmp") for p in out.iterdir())


def test_checkpoint_reproduces_final_eval(trained, char_dataset):
    cfg, summary, out = trained
    model, stored, meta = loading.load_model(out)
    assert stored == cfg  # the resolved config is stored
    assert meta["step"] == 60 and meta["tokenizer"]["kind"] == "char"
    from data.loader import Batches, load_meta
    data_meta = load_meta(str(char_dataset))
    loaders = {s: Batches(data_meta, s, cfg.train.batch_size, cfg.model.block_size, 0)
               for s in ("train", "val")}
    eval_sets = {s: b.fixed(cfg.train.eval_iters, seed=cfg.system.seed + 1 + i)
                 for i, (s, b) in enumerate(loaders.items())}
    rt = machine.setup(cfg.system)
    losses = train.evaluate(model, loaders, eval_sets, rt)
    assert losses["val"] == pytest.approx(summary["final"]["val"], abs=1e-6)


def test_same_seed_same_training(char_dataset, tmp_path):
    a = train.train(tiny_cfg(char_dataset, tmp_path / "a", "--max_iters=10", "--eval_interval=10"))
    b = train.train(tiny_cfg(char_dataset, tmp_path / "b", "--max_iters=10", "--eval_interval=10"))
    c = train.train(tiny_cfg(char_dataset, tmp_path / "c", "--max_iters=10", "--eval_interval=10",
                             "--seed=2"))
    assert a["final"] == b["final"]
    assert a["final"] != c["final"]


def test_generate_cli_streams_text(trained, capsys):
    cfg, _, out = trained
    rc = generate.main(["--config", "tiny", f"--checkpoint={out}", "--prompt", "ROMEO:",
                        "--max_new_tokens=40", "--seed=3", "--device=cpu"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.rstrip("\n")) >= len("ROMEO:") + 30
    rc = generate.main(["--config", "tiny", f"--checkpoint={out}", "--prompt", "ROMEO:",
                        "--max_new_tokens=40", "--seed=3", "--device=cpu"])
    assert capsys.readouterr().out == text  # same seed, same text


def test_generate_without_checkpoint_says_how_to_train(tmp_path, capsys):
    rc = generate.main(["--config", "tiny", f"--out_dir={tmp_path / 'none'}", "--device=cpu"])
    assert rc == 2
    assert "does not exist; train one first with python train.py" in capsys.readouterr().err


def test_generate_rejects_prompt_outside_vocabulary(trained, capsys):
    _, _, out = trained
    rc = generate.main([f"--checkpoint={out}", "--prompt", "naïve ☃", "--device=cpu"])
    assert rc == 2
    assert "outside this 65-character vocabulary" in capsys.readouterr().err


def test_generate_and_serve_share_their_model_options_and_both_command_lines_take_them(capsys):
    """--init-from and --sparse are declared once (engine/inference/options.InferenceOptions): both
    scripts parse them into their options, list them in --help, and say where a model comes from
    alike."""
    from engine.serving.options import ServeOptions
    argv = ["--init-from=out/x", "--sparse", "dense"]
    for script, prog in ((generate.GenerateOptions, "generate.py"), (ServeOptions, "serve.py")):
        cfg, options = load_config(argv, prog=prog, script=script)
        assert (options.init_from, options.sparse) == ("out/x", "dense")
        assert options.model_source(cfg) == "out/x"
        cfg, options = load_config(["--checkpoint=out/y"], prog=prog, script=script)
        assert options.model_source(cfg) == "out/y"
        with pytest.raises(SystemExit):
            load_config(["--help"], prog=prog, script=script)
        shown = capsys.readouterr().out
        assert "--init-from=''" in shown and "--sparse='auto'" in shown


def test_long_prompt_is_cropped_and_empty_prompt_starts_at_newline(trained, capsys):
    _, _, out = trained
    model, _, meta = loading.load_model(out)
    from data.tokenizer import from_meta
    tok = from_meta(meta["tokenizer"])
    ids = generate.encode_prompt(tok, "To be or not to be " * 5, model.config.block_size)
    assert len(ids) == model.config.block_size
    assert "keeping the last 32" in capsys.readouterr().err
    assert generate.encode_prompt(tok, "", 32) == [tok.encode("\n")[0]]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0),
                                                     (0.8, 5, 1.0), (1.0, 0, 0.9)])
@on_each_device
def test_kv_cache_gives_same_tokens(temperature, top_k, top_p, device):
    """Past the context length too, where the window shifts and the cache is rebuilt."""
    model = GPT(tiny_model_config(vocab_size=37, block_size=16)).to(device).eval()
    prompt = torch.randint(0, 37, (2, 5)).to(device)
    outs = []
    for use_cache in (True, False):
        g = torch.Generator(device=device).manual_seed(11)
        outs.append(sampling.generate_tokens(model, prompt, 40, temperature, top_k, top_p,
                                             use_cache, g))
    assert outs[0].shape == (2, 45)
    assert torch.equal(outs[0], outs[1])


def test_sampler_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert sampling.sample_next(logits, 0.0, 0, 1.0).item() == 0  # greedy
    g = torch.Generator().manual_seed(0)
    draws = {sampling.sample_next(logits, 1.0, 2, 1.0, g).item() for _ in range(200)}
    assert draws == {0, 1}  # top-k keeps two
    # softmax([4,3,2,1,0]) = [.636, .234, .086, .032, .012]: top_p=0.8 keeps the first two
    draws = {sampling.sample_next(logits, 1.0, 0, 0.8, g).item() for _ in range(200)}
    assert draws == {0, 1}
    draws = {sampling.sample_next(logits, 1.0, 0, 0.5, g).item() for _ in range(50)}
    assert draws == {0}  # the top token alone is already past top_p
    many = [sampling.sample_next(logits, 1.0, 0, 1.0, g).item() for _ in range(2000)]
    assert set(many) == {0, 1, 2, 3, 4}


SAMPLER_LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]


def kept_probabilities(logits: list[float], temperature: float, top_k: int,
                       top_p: float) -> list[float]:
    """What sample_next draws from, written out: softmax(logits / temperature); top_k keeps
    the k most probable; top_p then keeps, from the most probable down, each token while those
    above it hold less than top_p of what top_k kept; the kept renormalised to sum to 1."""
    weights = [math.exp(value / temperature) for value in logits]
    probs = [w / sum(weights) for w in weights]
    kept = sorted(range(len(probs)), key=lambda i: -probs[i])
    if 0 < top_k < len(kept):
        kept = kept[:top_k]
    if top_p < 1.0:
        total, above, nucleus = sum(probs[i] for i in kept), 0.0, []
        for i in kept:
            if above >= top_p:
                break
            nucleus.append(i)
            above += probs[i] / total
        kept = nucleus
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


# At temperature 2 the probabilities are [.36 .22 .17 .13 .08 .03]: top_p=0.7 keeps three (.58
# above the third, .76 above the fourth). Of the top 4's, renormalised, .85 lie above the
# fourth: top_k=4 then top_p=0.8 keeps three, where top_p over all six would keep four.
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.5, 0, 1.0), (0.8, 0, 1.0), (2.0, 0, 1.0), (0.8, 3, 1.0), (2.0, 0, 0.7), (2.0, 4, 0.8)])
def test_sampled_tokens_follow_the_tempered_and_filtered_softmax(temperature, top_k, top_p):
    """200,000 seeded draws of sample_next from the same logits: each token's frequency is
    within 6 standard errors, sqrt(p (1 - p) / n), of kept_probabilities (a dropped token, p = 0,
    is never drawn). A correct sampler misses that with probability 2e-9 per token (1.4e-6 for
    the rarest here, 7.5 draws expected), and the seed fixes the draws anyway; logits *
    temperature, or the temperature ignored, miss it by 60 standard errors or more."""
    draws = 200_000
    logits = torch.tensor(SAMPLER_LOGITS).expand(draws, -1)  # a row per draw: one call
    generator = torch.Generator().manual_seed(0)
    tokens = sampling.sample_next(logits, temperature, top_k, top_p, generator)
    assert tokens.shape == (draws, 1)
    frequency = torch.bincount(tokens.view(-1), minlength=len(SAMPLER_LOGITS)) / draws
    want = torch.tensor(kept_probabilities(SAMPLER_LOGITS, temperature, top_k, top_p))
    standard_error = (want * (1 - want) / draws).sqrt()
    assert ((frequency - want).abs() <= 6 * standard_error).all(), (frequency, want)


def test_checkpoint_from_other_architecture_is_refused(trained, tmp_path):
    _, _, out = trained
    other = GPT(tiny_model_config(vocab_size=65, block_size=32, n_embd=48, n_head=2))
    with pytest.raises(checkpoint.CheckpointError, match="do not fit the model .*mis-shaped"):
        loading.load_weights(other, checkpoint.resolve(out))


def test_truncated_checkpoint_is_refused(trained, tmp_path):
    import shutil
    _, _, out = trained
    broken = tmp_path / "ckpt_0000001"
    shutil.copytree(checkpoint.resolve(out), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
        loading.load_model(broken)


def test_finetune_from_checkpoint_with_shorter_context(trained, char_dataset, tmp_path):
    _, _, out = trained
    cfg = tiny_cfg(char_dataset, tmp_path / "ft", f"--init_from={checkpoint.resolve(out)}",
                   "--block_size=16", "--max_iters=4", "--eval_interval=4",
                   "--attention=sdpa")
    summary = train.train(cfg)
    model, stored, _ = loading.load_model(tmp_path / "ft")
    assert stored.model.block_size == 16 and model.transformer.wpe.weight.shape[0] == 16
    assert summary["final"]["val"] < 3.5  # starts from the trained weights, not from scratch


def test_init_from_takes_what_the_weights_fix_and_the_runs_other_options(trained, char_dataset,
                                                                         tmp_path):
    """From a checkpoint: the fields that say fixed (shape, positions, ...) come from it; the
    rest (attention, a zero init, which only a fresh model reads) stay the run's."""
    from data.dataset import load_meta
    from engine.training.init_from import load_for_training

    _, _, out = trained
    cfg = tiny_cfg(char_dataset, tmp_path / "ft", f"--init_from={checkpoint.resolve(out)}",
                   "--position=rotary", "--n_layer=3", "--attention=sdpa", "--zero_init_proj=true")
    model, _ = load_for_training(cfg, load_meta(char_dataset), torch.device("cpu"))
    assert (model.config.position, model.config.n_layer) == ("learned", 2)
    assert (model.config.attention, model.config.zero_init_proj) == ("sdpa", True)
    assert model.config is cfg.model


# the CUDA speedups the end-to-end CUDA run turns on, and what its banner says of each there
CUDA_SPEEDUPS = ["--dtype=bfloat16", "--tf32=true", "--attention=sdpa", "--causal_mask=on_the_fly",
                 "--norm=native", "--activation_impl=native", "--fused_adamw=true",
                 "--pin_memory=true", "--prefetch=true"]
CUDA_BANNER = ("device=cuda", "tf32=on", "fused_adamw=on", "pin_memory=on", "dtype=bfloat16",
               "attention=sdpa [flash]")


def speedups_banner(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("speedups:"))


def test_cuda_speedups_run_on_the_cpu_saying_what_fell_back(char_dataset, tmp_path, capsys,
                                                           as_a_gpu, monkeypatch):
    """The CPU half of test_cuda_run_with_its_speedups_learns_like_the_cpu_reference: its
    command line parses, and with torch.cuda's answers a GPU gives, setup and the banner's
    settings take each CUDA speedup (what only a run shows, fused AdamW and the kernel, left
    to the GPU). On the CPU, the same flags train, the banner says which needed CUDA, and the
    bfloat16 run's checkpoint loads and samples."""
    if narrowed_below_amx():
        pytest.skip("torch's bf16 CPU Flash kernel raises under a narrowed ATEN_CPU_CAPABILITY "
                    "(test_speedups' flash test says why)")
    common = ["--max_iters=4", "--eval_interval=4", "--eval_iters=1", "--save_checkpoints=true",
              *CUDA_SPEEDUPS]
    on_cuda, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                              f"--out_dir={tmp_path / 'cuda'}", "--device=cuda", *common])
    rt = machine.setup(on_cuda.system)
    values = speedups.settings(on_cuda, rt, speedups.Notes(fused_adamw="on", kernels=["flash"]))
    banner = " ".join(f"{key}={value}" for key, value in values.items())
    assert all(part in banner for part in CUDA_BANNER), banner
    assert rt.notes == [] and torch.backends.cuda.matmul.allow_tf32
    # the CPU run: torch.cuda answers as this machine again (a CUDA build of torch without a
    # driver would otherwise start CUDA in the optimizer's capture check)
    monkeypatch.undo()
    cfg = tiny_cfg(char_dataset, tmp_path / "cpu", *common)
    capsys.readouterr()
    summary = train.train(cfg)
    out = capsys.readouterr().out
    banner = speedups_banner(out)
    for part in ("device=cpu", "tf32=off", "fused_adamw=on", "pin_memory=off (needs CUDA)",
                 "dtype=bfloat16", "attention=sdpa [flash (cpu)]", "norm=native",
                 "tf32 needs CUDA: off"):
        assert part in banner, (part, banner)
    assert "prefetch=off (needs CUDA: plain copy)" in out
    assert math.isfinite(summary["final"]["val"])
    model, stored, _ = loading.load_model(tmp_path / "cpu", torch.device("cpu"))
    assert stored.system.dtype == "bfloat16" and next(model.parameters()).dtype == torch.float32
    rc = generate.main([f"--checkpoint={tmp_path / 'cpu'}", "--prompt", "ROMEO:",
                        "--max_new_tokens=5", "--seed=3", "--device=cpu"])
    assert rc == 0 and capsys.readouterr().out.startswith("ROMEO:")


@pytest.mark.cuda
def test_cuda_run_with_its_speedups_learns_like_the_cpu_reference(char_dataset, tmp_path, capsys):
    """The tiny run on CUDA with bfloat16 autocast, TF32, SDPA (Flash), fused AdamW, pinned
    memory and the prefetch stream: the banner says each is on, the loss falls as on the CPU's
    float32 reference path, and the checkpoint samples on CUDA. (The GPU half: the flags and
    their fallbacks are checked on a CPU above.)"""
    common = ["--max_iters=40", "--eval_interval=40", "--save_checkpoints=true"]
    reference = train.train(tiny_cfg(char_dataset, tmp_path / "cpu", *common))
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}",
                          f"--out_dir={tmp_path / 'cuda'}", "--device=cuda", *common,
                          *CUDA_SPEEDUPS])
    capsys.readouterr()
    fast = train.train(cfg)
    out = capsys.readouterr().out
    banner = speedups_banner(out)
    for part in CUDA_BANNER:
        assert part in banner, (part, banner)
    assert "prefetch=on (side CUDA stream)" in out
    rows = [json.loads(line) for line in (tmp_path / "cuda" / "metrics.jsonl").read_text()
            .splitlines() if '"train"' in line]
    assert rows and all(0 < r["peak_mib"] <= r["reserved_mib"] for r in rows)
    assert fast["cuda_peak_mib"]["peak_mib"] == max(r["peak_mib"] for r in rows)
    assert fast["final"]["val"] < 3.6  # learned, from ln(65) = 4.17
    assert fast["final"]["val"] == pytest.approx(reference["final"]["val"], rel=0.05)
    model, _, _ = loading.load_model(tmp_path / "cuda", torch.device("cuda"))
    assert next(model.parameters()).is_cuda
    rc = generate.main([f"--checkpoint={tmp_path / 'cuda'}", "--prompt", "ROMEO:",
                        "--max_new_tokens=20", "--seed=3", "--device=cuda"])
    assert rc == 0 and capsys.readouterr().out.startswith("ROMEO:")


def test_a_gpu_runs_log_records_cuda_peak_memory(char_dataset, tmp_path, capsys, monkeypatch):
    """The CPU half of the CUDA run's memory record: each log line's peak since the line before
    (what train.cuda_peak_memory reads and resets on a GPU, here answered by a stand-in) goes to
    the line, metrics.jsonl and .csv; summary.json keeps the highest. A CPU run records none."""
    peaks = iter([(3 * 2**30, 4 * 2**30), (5 * 2**30, 6 * 2**30), (2**30, 6 * 2**30)])
    monkeypatch.setattr(train, "cuda_peak_memory", lambda device: next(peaks))
    out_dir = tmp_path / "run"
    summary = train.train(tiny_cfg(char_dataset, out_dir, "--max_iters=6", "--log_interval=2",
                                   "--eval_interval=6", "--eval_iters=1"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[-3] for line in lines] == [
        "peak 3.00 GiB (reserved 4.00)", "peak 5.00 GiB (reserved 6.00)",
        "peak 1.00 GiB (reserved 6.00)"]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["peak_mib"], r["reserved_mib"]) for r in rows if r["kind"] == "train"] == [
        (3072, 4096), (5120, 6144), (1024, 6144)]
    assert "peak_mib,reserved_mib" in (out_dir / "metrics.csv").read_text().splitlines()[0]
    assert summary["cuda_peak_mib"] == {"peak_mib": 5120, "reserved_mib": 6144}
    assert json.loads((out_dir / "summary.json").read_text())["cuda_peak_mib"]["peak_mib"] == 5120
    monkeypatch.undo()
    assert train.cuda_peak_memory(torch.device("cpu")) is None
    assert "cuda_peak_mib" not in train.train(tiny_cfg(char_dataset, tmp_path / "cpu",
                                                       "--max_iters=2", "--eval_interval=2",
                                                       "--eval_iters=1"))


def test_cuda_peak_memory_reads_then_resets(monkeypatch):
    """train.cuda_peak_memory on a GPU (torch.cuda's answers stood in): the peaks allocated
    and reserved, then a reset, so the next log line has its own peak."""
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append("a") or 7)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append("r") or 9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    assert train.cuda_peak_memory(torch.device("cuda")) == (7, 9)
    assert calls == ["a", "r", "reset"]


def test_relu_squared_end_to_end(char_dataset, tmp_path, capsys):
    """--activation=relu2 through everything that reads it: the memory estimate (one kept
    tensor per hidden unit, against four for the written-out tanh GELU), training, the
    checkpoint's config, sampling, and the export as transformers' relu2."""
    out = tmp_path / "relu2"
    cfg = tiny_cfg(char_dataset, out, "--activation=relu2", "--max_iters=30",
                   "--eval_interval=30")
    gelu = tiny_cfg(char_dataset, out)
    hidden = 4 * cfg.model.n_embd * cfg.model.n_layer * cfg.train.batch_size * cfg.model.block_size
    assert (memory_estimate.estimate(gelu).activations - memory_estimate.estimate(cfg).activations
            == 3 * 4 * hidden)  # float32: three fewer hidden-size tensors per block
    summary = train.train(cfg)
    assert summary["final"]["val"] < 3.9  # learned, from ln(65) = 4.17
    model, _, _ = loading.load_model(out, torch.device("cpu"))
    assert model.config.activation == "relu2"
    capsys.readouterr()
    assert generate.main([f"--checkpoint={out}", "--prompt", "ROMEO:", "--max_new_tokens=10",
                          "--seed=3"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert load_gpt2_weights.main(["--export", str(out), "--out", str(tmp_path / "hf")]) == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["activation_function"] == "relu2"
