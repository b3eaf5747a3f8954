"""The decoding path against the reference: a KV cache read only up to what was written, a
prefill whose LM head runs at the last position only, compiled decoding (one static shape),
column-major weights and weights in 2 MiB pages (the same logits and tokens; checkpoints
unchanged), and the sliced one-row products (F.linear's values)."""
import copy
import math

import pytest
import torch
from torch import nn

from config import Config, SystemConfig
from conftest import HAS_CXX, on_each_device, tiny_default_model_config, tiny_model_config
from engine import compiling, saving
from engine import device as machine
from engine.inference import matvec, quantize, sampling
from engine.inference.kv_cache import new_kv_cache
from engine.inference.matvec import sliced_matvec
from model import GPT

LOGITS_TOL = {"cpu": dict(atol=1e-5, rtol=1e-5), "cuda": dict(atol=1e-4, rtol=1e-4)}


def poisoned_cache(model: GPT, batch: int):
    """A cache whose every slot holds NaN: any read of a slot not yet written shows in the
    logits, masked or not (a zero attention weight times NaN is NaN)."""
    cache = new_kv_cache(model, batch)
    for t in cache.kv:
        t.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("attention", ["scratch", "sdpa"])
@on_each_device
def test_decode_reads_only_the_written_prefix(attention, device):
    torch.manual_seed(0)
    model = GPT(tiny_model_config(attention=attention)).to(device).eval()  # block_size 16
    x = torch.randint(0, 37, (2, 16), device=device)
    with torch.no_grad():
        full, _ = model(x)  # (2, 16, vocab) without a cache
        cache = poisoned_cache(model, 2)
        first, pos = sampling.prefill(model, x[:, :5], cache)
        steps = [sampling.decode_step(model, x[:, t:t + 1], cache, t,
                                      torch.tensor([t], device=device)) for t in range(pos, 16)]
        # the reference read of the whole cache under a mask sees the poisoned slots
        cache = poisoned_cache(model, 2)
        whole, _ = model(x[:, :5], kv_cache=cache)
    assert first.shape == (2, 1, 37) and pos == 5
    torch.testing.assert_close(torch.cat([first] + steps, dim=1), full[:, 4:],
                               **LOGITS_TOL[device])
    assert torch.isnan(whole).all()


@on_each_device
def test_prefill_computes_the_last_logits_only(device):
    torch.manual_seed(0)
    model = GPT(tiny_model_config(vocab_pad_multiple=8)).to(device).eval()  # 37 -> 40 rows
    x = torch.randint(0, 37, (2, 6), device=device)
    with torch.no_grad():
        full, _ = model(x)
        for bucket in (0, 4, 32):  # exact, padded to 8, padded to block_size
            logits, pos = sampling.prefill(model, x, new_kv_cache(model, 2), bucket)
            assert logits.shape == (2, 1, 37) and pos == 6
            torch.testing.assert_close(logits, full[:, -1:], **LOGITS_TOL[device])


@pytest.mark.parametrize("impls", [dict(attention="scratch"), dict(
    attention="sdpa", norm="native", activation_impl="native"),
    dict(activation="gelu_erf", vocab_pad_multiple=8), dict(activation="relu2")])
def test_cached_decode_steps_give_the_whole_sequences_logits(impls):
    """Token by token through the cache, each step reading only the written prefix (no mask),
    NaN in every slot not written -> the logits of one forward over the whole sequence."""
    torch.manual_seed(0)
    model = GPT(tiny_model_config(**impls)).eval()  # block_size 16
    matvec.set_weight_layout(model, "column")
    x = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        whole = model(x)[0]
        cache = poisoned_cache(model, 2)
        first, pos = sampling.prefill(model, x[:, :5], cache)
        steps = [sampling.decode_step(model, x[:, t:t + 1], cache, t, torch.tensor([t]))
                 for t in range(pos, 16)]
    logits = torch.cat([first] + steps, dim=1)
    assert logits.shape == (2, 12, 37) and not logits.isnan().any()
    torch.testing.assert_close(logits, whole[:, 4:], atol=1e-5, rtol=1e-5)
    prompt = x[:1, :3]  # 30 tokens: past the context's overflow and re-read
    uncached = sampling.generate_tokens(model, prompt, 30, temperature=0, kv_cache=False)
    assert torch.equal(sampling.generate_tokens(model, prompt, 30, temperature=0), uncached)


def test_rows_at_their_own_positions_decode_as_each_row_alone():
    """input_pos (rows, 1): three rows at positions 2, 7 and 4 in one call (a server's slots)
    -> each row's logits as that row decoded alone at its position; a view of one row
    (KVCache.rows) writes into the whole cache."""
    torch.manual_seed(0)
    model = GPT(tiny_model_config()).eval()
    x, at = torch.randint(0, 37, (3, 16)), [2, 7, 4]
    with torch.no_grad():
        cache = new_kv_cache(model, 3)
        for kv in cache.kv:  # stale keys and values (finite: masked ones weigh 0, as in a server)
            kv.normal_(0, 100)
        for row, n in enumerate(at):  # each row's context, positions 0..n-1
            scratch = new_kv_cache(model, 1)
            sampling.prefill(model, x[row:row + 1, :n], scratch)
            cache.copy_row(row, scratch, n)
        cache.filled = max(at) + 1
        tokens = torch.stack([x[row, n] for row, n in enumerate(at)])[:, None]
        together = model(tokens, kv_cache=cache, input_pos=torch.tensor(at)[:, None])[0]
        for row, n in enumerate(at):
            alone = new_kv_cache(model, 1)
            whole = model(x[row:row + 1, :n + 1], kv_cache=alone)[0][:, -1:]
            torch.testing.assert_close(together[row:row + 1], whole, atol=1e-5, rtol=1e-5)
        view = cache.rows(1)
        view.filled = at[1] + 2
        model(x[1:2, at[1] + 1:at[1] + 2], kv_cache=view, input_pos=torch.tensor([[at[1] + 1]]))
        view_kv = cache.kv[0][:, 1, :, at[1] + 1]  # written through the view
        assert view_kv.abs().max() < 50


def test_compiled_decoding_gives_the_eager_tokens():
    """Compiled code reads the whole static cache under the mask; the tokens are the same."""
    torch.manual_seed(0)
    model = GPT(tiny_model_config(attention="sdpa")).eval()  # block_size 16: overflows once
    prompt = torch.randint(0, 37, (1, 5))
    eager = sampling.generate_tokens(model, prompt, 20, temperature=0)
    torch._dynamo.reset()
    matvec.set_weight_layout(model, "column")  # traced with its strides, as generate.py does
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # traced: is_compiling()
    static = sampling.generate_tokens(compiled, prompt, 20, temperature=0, prompt_bucket=8)
    torch._dynamo.reset()
    assert torch.equal(static, eager)


@pytest.mark.skipif(not HAS_CXX, reason="torch.compile on CPU needs a C++ compiler")
def test_inductor_compiled_decoding_gives_the_eager_tokens():
    """generate.py with --compile: the default run's model compiled by inductor and warmed up
    (sampling.warm_up: the prompt's bucket, a decode step), then 20 greedy tokens after a
    5-token prompt in a 16-token context (the kept half re-read once, in the same bucket): the
    eager tokens, and nothing compiled after the warm-up. Weights scaled up 20x and this seed:
    varied tokens whose top two logits lie >= 0.06 apart at every step, where compiled and
    eager logits differ by a few 1e-6."""
    from torch._dynamo.utils import counters
    torch.manual_seed(1)
    model = GPT(tiny_default_model_config()).eval()
    with torch.no_grad():
        model.skip_weights.normal_()
        model.smear_weights.normal_()
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    prompt = torch.randint(0, 37, (1, 5))
    eager = sampling.generate_tokens(model, prompt, 20, temperature=0)
    assert len(set(eager[0, 5:].tolist())) >= 4
    torch._dynamo.reset()  # a fresh cache: no earlier test's graphs, no recompile limit reached
    matvec.set_weight_layout(model, "auto")  # as generate.py: compiled with these strides
    system = SystemConfig(device="cpu", compile=True)
    compiled, _ = compiling.compile_model(model, system, machine.setup(system))
    sampling.warm_up(compiled, prompt.size(1), 20, bucket=8)
    graphs = counters["stats"]["unique_graphs"]
    tokens = sampling.generate_tokens(compiled, prompt, 20, temperature=0, prompt_bucket=8)
    compiled_later = counters["stats"]["unique_graphs"] - graphs
    torch._dynamo.reset()
    assert graphs >= 2 and compiled_later == 0  # the prefill's graph and the decode step's
    assert torch.equal(tokens, eager)


def test_int8_decoding_with_the_cache_gives_the_uncached_tokens():
    pytest.importorskip("torchao", reason="sample.quantize=int8 needs torchao (not installed)")
    torch.manual_seed(0)
    model = GPT(tiny_model_config(n_embd=32, attention="sdpa")).eval()
    quantize.quantize_linears(model, "attn,mlp")
    prompt = torch.randint(0, 37, (1, 5))
    plain = sampling.generate_tokens(model, prompt, 20, temperature=0, kv_cache=False)
    matvec.set_weight_layout(model, "column")  # the int8 Linears stay, the head changes
    assert not model.lm_head.weight.is_contiguous()
    cached = sampling.generate_tokens(model, prompt, 20, temperature=0)
    assert torch.equal(cached, plain)


def linear_weights(model: GPT) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def test_column_major_weights_give_the_row_major_logits_and_tokens():
    torch.manual_seed(0)
    row = GPT(tiny_model_config(attention="sdpa", vocab_pad_multiple=8)).eval()
    column = copy.deepcopy(row)
    assert matvec.set_weight_layout(column, "column") == "column"
    # every Linear, the tied head too, is now the transpose of a contiguous (in, out) matrix
    assert all(w.t().is_contiguous() and not w.is_contiguous() for w in linear_weights(column))
    assert column.lm_head.weight is column.transformer.wte.weight  # still one tied parameter
    x = torch.randint(0, 37, (2, 16))
    with torch.no_grad():
        for model in (row, column):
            cache = new_kv_cache(model, 2)
            first, pos = sampling.prefill(model, x[:, :5], cache)
            steps = [sampling.decode_step(model, x[:, t:t + 1], cache, t, torch.tensor([t]))
                     for t in range(pos, 16)]
            model.logits = torch.cat([first] + steps, dim=1)
    torch.testing.assert_close(column.logits, row.logits, atol=1e-5, rtol=1e-5)
    prompt = x[:1, :3]
    uncached = sampling.generate_tokens(row, prompt, 20, temperature=0, kv_cache=False)
    assert torch.equal(sampling.generate_tokens(column, prompt, 20, temperature=0), uncached)
    assert matvec.set_weight_layout(column, "row") == "row"
    assert all(w.is_contiguous() for w in linear_weights(column))
    assert all(torch.equal(a, b) for a, b in zip(linear_weights(column), linear_weights(row)))


def test_by_shape_layout_makes_only_the_wider_outputs_column_major():
    torch.manual_seed(0)
    model = GPT(tiny_model_config(vocab_pad_multiple=8)).eval()
    x = torch.randint(0, 37, (1, 3))
    rows = sampling.generate_tokens(model, x, 20, temperature=0, kv_cache=False)
    assert matvec.set_weight_layout(model, "auto") == "by_shape"  # on CPU
    for name, m in model.named_modules():  # c_attn, c_fc, the head: more outputs than inputs
        if isinstance(m, nn.Linear):
            wide = m.out_features > m.in_features
            assert m.weight.is_contiguous() != wide and m.weight.t().is_contiguous() == wide, name
    assert torch.equal(sampling.generate_tokens(model, x, 20, temperature=0), rows)


def test_column_major_weights_leave_saved_checkpoints_unchanged(tmp_path):
    torch.manual_seed(0)
    model, cfg = GPT(tiny_model_config()), Config()
    before = saving.save(tmp_path / "row", 1, model, cfg, {}) / "model.safetensors"
    matvec.set_weight_layout(model, "column")
    after = saving.save(tmp_path / "column", 1, model, cfg, {}) / "model.safetensors"
    assert before.read_bytes() == after.read_bytes()


def test_weight_layout_auto_and_bad_names():
    assert matvec.weight_layout_for("auto", torch.device("cpu")) == "by_shape"
    assert matvec.weight_layout_for("auto", torch.device("cuda")) == "row"
    with pytest.raises(ValueError, match="weight layout 'colum' is not one of auto, row, column"):
        matvec.weight_layout_for("colum", torch.device("cpu"))


def test_generate_names_the_layout_and_gives_the_same_text(tmp_path, capsys):
    import generate
    torch.manual_seed(0)
    chars = [chr(ord("a") + i) for i in range(26)] + list(" .,;:!?'-\nX")  # 37 characters
    cfg = Config()
    cfg.model = tiny_model_config()
    saving.save(tmp_path, 1, GPT(cfg.model), cfg, {"tokenizer": {"kind": "char", "chars": chars}})
    texts = {}
    for layout in ("row", "column", "auto"):
        assert generate.main([f"--checkpoint={tmp_path}", "--prompt=ab", "--temperature=0",
                              "--max_new_tokens=12", "--device=cpu",
                              f"--weight_layout={layout}"]) == 0
        texts[layout], err = capsys.readouterr()
        shown = "by_shape" if layout == "auto" else layout
        assert f"weight_layout={shown} ({layout})" in err
    for mode in ("blas", "sliced"):
        assert generate.main([f"--checkpoint={tmp_path}", "--prompt=ab", "--temperature=0",
                              "--max_new_tokens=12", "--device=cpu", "--threads=2",
                              f"--matvec={mode}"]) == 0
        texts[mode], err = capsys.readouterr()
        assert f"matvec={mode} ({mode})" in err
    assert texts["row"] == texts["column"] == texts["auto"] == texts["blas"] == texts["sliced"]
    assert generate.main([f"--checkpoint={tmp_path}", "--weight_layout=colum"]) == 2
    assert "sample.weight_layout='colum' is not one of auto, row, column" in \
        capsys.readouterr().err


@pytest.mark.parametrize("layout", ["row", "column"])
@pytest.mark.parametrize("out, slices, bias", [(12, 2, True), (13, 3, True), (37, 4, False)])
def test_sliced_matvec_gives_f_linear(layout, out, slices, bias):
    """Equal blocks of the outputs through one bmm, the rest (13 = 3 x 4 + 1) apart."""
    weight = torch.randn(out, 24)
    weight = weight if layout == "row" else weight.t().contiguous().t()
    b = torch.randn(out) if bias else None
    for x in (torch.randn(1, 1, 24), torch.randn(1, 24)):
        got = sliced_matvec(x, weight, b, slices)
        assert got.shape == x.shape[:-1] + (out,)
        torch.testing.assert_close(got, nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def linear_slices(model: GPT) -> set[int]:
    return {getattr(m, "slices", 1) for m in model.modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("layout", ["row", "column", "auto"])
def test_sliced_decoding_gives_the_forward_logits_and_tokens(layout, monkeypatch):
    """Batch 1, every Linear sliced (the size floor lowered), 3 slices: the vocabulary (37)
    and the qkv (48) leave a remainder; the same logits as one F.linear and the same tokens."""
    monkeypatch.setattr(matvec, "SLICED_MIN_BYTES", 0)
    model = GPT(tiny_model_config(attention="sdpa", norm="native", activation_impl="native")).eval()
    matvec.set_weight_layout(model, layout)
    x = torch.randint(0, 37, (1, 16))
    reference = sampling.generate_tokens(model, x[:, :3], 30, temperature=0, kv_cache=False)
    logits = {}
    with torch.no_grad():
        for slices in (1, 3):
            for module in model.modules():
                if isinstance(module, matvec.SlicedLinear):
                    module.slices = slices
            cache = poisoned_cache(model, 1)
            sampling.prefill(model, x[:, :5], cache)
            logits[slices] = torch.cat([sampling.decode_step(
                model, x[:, t:t + 1], cache, t, torch.tensor([t])) for t in range(5, 16)], dim=1)
    torch.testing.assert_close(logits[3], logits[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(sampling.generate_tokens(model, x[:, :3], 30, temperature=0), reference)


def test_set_matvec_auto_blas_sliced_and_bad_names():
    model = GPT(tiny_model_config())
    torch.set_num_threads(2)
    assert matvec.set_matvec(model, "auto") == "sliced" and linear_slices(model) == {2}
    assert matvec.set_matvec(model, "blas") == "blas" and linear_slices(model) == {1}
    torch.set_num_threads(1)  # one thread: nothing to run side by side
    assert matvec.set_matvec(model, "auto") == "blas" and linear_slices(model) == {1}
    with pytest.raises(ValueError, match="matvec 'slice' is not one of auto, blas, sliced"):
        matvec.set_matvec(model, "slice")


def test_huge_pages_hold_the_same_weights_on_2_mib_boundaries(tmp_path):
    """A 2 MiB LM head (8192 x 64) moves into 2 MiB pages in the layout asked for; the values,
    the tokens and a saved checkpoint stay the same; a second call copies nothing."""
    if not matvec.huge_pages_for(True, torch.device("cpu"))[0]:
        pytest.skip(matvec.huge_pages_for(True, torch.device("cpu"))[1])
    model = GPT(tiny_model_config(vocab_size=8192, n_embd=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head = model.lm_head.weight
    x = torch.randint(0, 8192, (1, 4))
    tokens = sampling.generate_tokens(model, x, 8, temperature=0)
    saved = saving.save(tmp_path / "a", 1, model, Config(), {}) / "model.safetensors"
    small = model.transformer.h[0].attn.c_proj.weight  # 16 KiB, stays row-major: left in place
    small_pointer = small.data_ptr()
    assert matvec.set_weight_layout(model, "auto", huge_pages=True) == "by_shape"
    assert head.data_ptr() % matvec.HUGE_PAGE == 0 and head.t().is_contiguous()
    assert model.transformer.wte.weight is head  # still tied: one tensor
    assert small.data_ptr() == small_pointer
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(sampling.generate_tokens(model, x, 8, temperature=0), tokens)
    again = saving.save(tmp_path / "b", 1, model, Config(), {}) / "model.safetensors"
    assert saved.read_bytes() == again.read_bytes()
    pointer = head.data_ptr()
    matvec.set_weight_layout(model, "auto", huge_pages=True)
    assert head.data_ptr() == pointer
    matvec.set_weight_layout(model, "row", huge_pages=True)  # a row-major copy, also aligned
    assert head.is_contiguous() and head.data_ptr() % matvec.HUGE_PAGE == 0
    assert torch.equal(copy.deepcopy(model).lm_head.weight, before["lm_head.weight"])


def test_huge_page_empty_is_aligned_and_writable():
    t = matvec.huge_page_empty((3, matvec.HUGE_PAGE // 4), torch.float32)
    assert t.shape == (3, matvec.HUGE_PAGE // 4) and t.data_ptr() % matvec.HUGE_PAGE == 0
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * math.prod(t.shape)


def test_huge_pages_say_why_they_are_off(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    assert matvec.huge_pages_for(False, cpu) == (False, "off")
    assert matvec.huge_pages_for(True, torch.device("cuda")) == (
        False, "off (CPU only; cuda memory is the driver's)")
    mode = tmp_path / "enabled"
    monkeypatch.setattr(matvec, "THP_MODE", mode)
    assert matvec.huge_pages_for(True, cpu) == (
        False, "off (this system has no transparent huge pages)")
    mode.write_text("always madvise [never]\n")
    assert matvec.huge_pages_for(True, cpu)[1].startswith(
        "off (transparent huge pages are disabled")
    mode.write_text("always [madvise] never\n")
    assert matvec.huge_pages_for(True, cpu) == (True, "on")


def test_direct_calls_decode_the_same_tokens_with_the_same_weights():
    """call_forward_directly (generate.py and serve.py): the blocks' parts run their forward
    without nn.Module's hook checks; the tokens, logits and state dict stay, and the blocks
    themselves stay module calls."""
    model = GPT(tiny_default_model_config()).eval()
    idx = torch.randint(0, 37, (2, 5))
    want = sampling.generate_tokens(model, idx, 8, temperature=0)
    logits, keys = model(idx)[0], list(model.state_dict())
    sampling.call_forward_directly(model)
    sampling.call_forward_directly(model)  # a second time changes nothing more
    attn = model.transformer.h[0].attn
    assert type(attn).__call__ is type(attn).forward and isinstance(attn, type(attn).__mro__[1])
    assert type(model.transformer.h[0]).__call__ is torch.nn.Module.__call__
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.transformer.h.modules())
    assert torch.equal(sampling.generate_tokens(model, idx, 8, temperature=0), want)
    torch.testing.assert_close(model(idx)[0], logits, rtol=0, atol=0)
    assert list(model.state_dict()) == keys
