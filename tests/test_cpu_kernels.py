"""The CPU decode kernels (engine/inference/cpu_kernels.py): packing each weight format, every
kernel path this CPU runs (portable C++, AVX2, AVX-512, VNNI, BF16) against plain torch on the
unpacked weight, the fallback without a compiler, and PackedLinear (engine/inference/packed.py)
inside a model."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from engine.inference import cpu_kernels
from engine.inference import packed as packing
from engine.inference.kv_cache import new_kv_cache

PATHS = cpu_kernels.cpu_isas()
FLOAT_PATHS = [isa for isa in PATHS if isa not in cpu_kernels.LAYOUT_OF]  # the blocked layout's


def test_packing_keeps_each_format_to_its_rounding():
    torch.manual_seed(0)
    w = torch.randn(40, 64) * 0.02  # 40 outputs: padded to 48
    assert torch.equal(cpu_kernels.unpack(cpu_kernels.pack(w, "float32")), w)
    assert torch.equal(cpu_kernels.unpack(cpu_kernels.pack(w, "bfloat16")),
                       w.bfloat16().float())
    int8 = cpu_kernels.pack(w, "int8")
    step = w.abs().amax(dim=1, keepdim=True) / 127  # one int8 step per output
    assert int8.data.dtype == torch.int8 and int8.data.shape == (3, 64, 16)
    assert ((cpu_kernels.unpack(int8) - w).abs() <= step / 2 + 1e-9).all()
    int4 = cpu_kernels.pack(w, "int4")
    groups = w.view(40, 2, 32).abs().amax(dim=2) / 7  # one int4 step per output and group
    assert int4.data.dtype == torch.uint8 and int4.data.shape == (3, 32, 16)
    assert int4.scales.dtype == torch.float16 and int4.scales.shape == (3, 2, 16)
    error = (cpu_kernels.unpack(int4) - w).view(40, 2, 32).abs()
    assert (error <= groups[..., None] / 2 * (1 + 2e-3)).all()  # the float16 scale: 1 + 2^-11
    assert int4.nbytes() < int8.nbytes() < w.nbytes  # 4 bits (+ scales) < 8 bits < 32 bits


def test_int4_refuses_a_group_that_does_not_divide_the_inputs():
    with pytest.raises(ValueError, match="int4 needs an even group that divides the 48 inputs"):
        cpu_kernels.pack(torch.randn(16, 48), "int4", group=32)


@pytest.fixture(scope="module")
def built():
    """Skips where no compiler is found; where one is, a failed build fails the tests."""
    ok, why = cpu_kernels.status()
    if not ok and cpu_kernels.compiler() is None:
        pytest.skip(why)
    assert ok, why


@pytest.mark.parametrize("isa", FLOAT_PATHS)
@pytest.mark.parametrize("fmt", list(cpu_kernels.FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_every_path_gives_the_reference_product(built, isa, fmt, rows):
    """Every register-block size (1-8 rows on AVX-512, 1-4 on AVX2, and what is left over),
    outputs that are not a multiple of 16, with and without a bias."""
    torch.manual_seed(rows)
    w, bias = torch.randn(40, 96) * 0.05, torch.randn(40)
    packed = cpu_kernels.pack(w, fmt)
    x = torch.randn(rows, 96)
    for b in (bias, None):
        want = cpu_kernels.reference(x, packed, b)
        got = cpu_kernels.matmul(x, packed, b, isa=isa)
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


VNNI = pytest.mark.skipif("avx512_vnni" not in PATHS, reason="needs a CPU with AVX-512 VNNI")


@VNNI
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 8, 11])
def test_the_vnni_path_gives_the_reference_of_rounded_activations(built, fmt, rows):
    """Its int32 sums are exact: the product of the activations rounded to int8 per block of 32
    (cpu_kernels.rounded_activations) and the unpacked weight, to float32 rounding; and within
    the activations' rounding of the float32-activation product."""
    torch.manual_seed(rows)
    w, bias = torch.randn(40, 96) * 0.05, torch.randn(40)
    packed = cpu_kernels.pack(w, fmt, layout="vnni")
    assert torch.equal(cpu_kernels.unpack(packed), cpu_kernels.unpack(cpu_kernels.pack(w, fmt)))
    x = torch.randn(rows, 96)
    got = cpu_kernels.matmul(x, packed, bias, isa="avx512_vnni")
    torch.testing.assert_close(got, cpu_kernels.reference(x, packed, bias), rtol=1e-5, atol=1e-5)
    exact = F.linear(x, cpu_kernels.unpack(packed), bias)
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


BF16 = pytest.mark.skipif("avx512_bf16" not in PATHS, reason="needs a CPU with AVX-512 BF16")


@BF16
@pytest.mark.parametrize("rows", [1, 2, 8, 11])
def test_the_bf16_path_gives_the_reference_of_bf16_activations(built, rows):
    """vdpbf16ps multiplies the activations rounded to bfloat16: the reference on those, to
    float32 rounding; and within bfloat16's rounding of the float32-activation product."""
    torch.manual_seed(rows)
    w, bias = torch.randn(40, 96) * 0.05, torch.randn(40)
    packed = cpu_kernels.pack(w, "bfloat16", layout="pairs")
    assert packed.data.shape == (3, 48, 16, 2)
    assert torch.equal(cpu_kernels.unpack(packed),
                       cpu_kernels.unpack(cpu_kernels.pack(w, "bfloat16")))
    x = torch.randn(rows, 96)
    for b in (bias, None):
        got = cpu_kernels.matmul(x, packed, b)  # the pairs layout's own path by default
        want = F.linear(x.bfloat16().float(), cpu_kernels.unpack(packed), b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, cpu_kernels.reference(x, packed, b), rtol=1e-5,
                                   atol=1e-5)
    exact = F.linear(x, cpu_kernels.unpack(packed))  # b is None last
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_the_pairs_layout_is_bfloat16_only():
    with pytest.raises(ValueError, match="pairs layout takes bfloat16"):
        cpu_kernels.pack(torch.randn(16, 32), "int8", layout="pairs")


def test_leading_dimensions_are_kept(built):
    packed = cpu_kernels.pack(torch.randn(32, 64), "int8")
    x = torch.randn(2, 1, 64)  # (B, T, C), as the model calls a Linear
    assert cpu_kernels.matmul(x, packed).shape == (2, 1, 32)


def test_without_a_compiler_the_product_is_plain_torch(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "compiler", lambda: None)
    cpu_kernels.status.cache_clear()
    try:
        assert cpu_kernels.status() == (False, "no C++ compiler (g++, c++, clang++ or $CXX): "
                                               "plain torch instead")
        packed = cpu_kernels.pack(torch.randn(16, 32), "int4")
        x = torch.randn(1, 32)
        assert torch.equal(cpu_kernels.matmul(x, packed), cpu_kernels.reference(x, packed))
    finally:
        cpu_kernels.status.cache_clear()


@pytest.mark.parametrize("rows", [1, packing.KERNEL_ROWS, packing.KERNEL_ROWS + 5])
def test_packed_linear_is_the_linear_of_its_unpacked_weight(rows):
    """Kernels up to KERNEL_ROWS rows, plain torch above (a prompt's prefill), on the path
    best_path picks for the format here (vnni for int8 where the CPU has it)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40)
    packed = packing.PackedLinear(linear, "int8")
    assert (packed.isa, packed.layout) == (cpu_kernels.best_path("int8") if
                                           cpu_kernels.status()[0] else ("torch", "blocked"))
    x = torch.randn(rows, 64)
    want = cpu_kernels.reference(x, packed.packed, linear.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    assert packed.nbytes() < linear.weight.nbytes


def block_tolerance(model: torch.nn.Module) -> dict:
    """assert_close's tolerance for a packed model against forward() over the same Linears.
    Paths that round the activations (bf16, int8 per block) round them from inputs that the
    two sides compute a float apart (torch's norms and attention against the block call's):
    now and then a value rounds to the neighbouring step, so such paths get one step's worth
    (bf16's is 2^-8 of the value). Seen under ATEN_CPU_CAPABILITY=default: 4.5e-4 apart."""
    rounded = model.transformer.h[0].attn.c_attn.layout in cpu_kernels.LAYOUT_OF.values()
    return {"rtol": 2e-2, "atol": 2e-3} if rounded else {"rtol": 1e-4, "atol": 1e-5}


def packed_model(fmt: str, **overrides) -> torch.nn.Module:
    from conftest import tiny_model_config
    from model import GPT
    model = GPT(tiny_model_config(n_embd=64, n_head=4, block_size=32, vocab_size=50,
                                  **overrides)).eval()
    for parent, attr, linear in packing.linears(model):  # float32 too: the packed kind
        setattr(parent, attr, packing.PackedLinear(linear, fmt))
    return model


@pytest.mark.parametrize("fmt", list(cpu_kernels.FORMATS))
@pytest.mark.parametrize("overrides", [{}, {"activation": "gelu_erf", "bias": False},
                                       {"activation": "relu2"},
                                       {"tie_embeddings": False, "logit_softcap": 3.0}])
def test_a_fused_block_step_gives_forward_logits(built, fmt, overrides):
    """decode_rows (each block one compiled call) against forward() over the same packed
    Linears: rows at different positions in one call, as the server's slots are."""
    from engine.inference.sampling import prefill
    torch.manual_seed(1)
    model = packed_model(fmt, **overrides)
    assert packing.fused(model)
    lengths = [5, 11, 2]
    caches, ids = [], []
    for length in lengths:  # each row's context, prefilled alone (batch 1)
        tokens = torch.randint(0, 50, (1, length + 1))
        cache = new_kv_cache(model, 1)
        prefill(model, tokens[:, :length], cache)
        caches.append(cache)
        ids.append(tokens)
    kv = [torch.cat([c.kv[i] for c in caches], dim=1) for i in range(len(model.transformer.h))]
    last = torch.cat([t[:, -1:] for t in ids])  # (3, 1): each row's next token
    got = packing.decode_rows(model, last, kv, torch.tensor(lengths))
    for row, (tokens, length) in enumerate(zip(ids, lengths)):
        want, _ = model(tokens)  # the whole context through forward()
        torch.testing.assert_close(got[row, 0], want[0, length], **block_tolerance(model))
        for i in range(len(kv)):  # the step's key and value went into the row's cache
            assert torch.count_nonzero(kv[i][:, row, :, length]) > 0


def test_generate_with_each_weight_format(tmp_path, capsys):
    """generate.py --weights: every format samples and says what it holds, packed float32 the
    same greedy text as torch's products (weights scaled up for clear margins); auto names what
    it timed; torchao's int8 and ours together are refused."""
    import generate
    from config import Config
    from conftest import tiny_model_config
    from engine import saving
    from model import GPT
    torch.manual_seed(0)
    chars = [chr(ord("a") + i) for i in range(26)] + list(" .,;:!?'-\nX")  # 37 characters
    cfg = Config()
    cfg.model = tiny_model_config(n_embd=64, n_head=4)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    saving.save(tmp_path, 1, model, cfg, {"tokenizer": {"kind": "char", "chars": chars}})
    args = [f"--checkpoint={tmp_path}", "--prompt=ab", "--temperature=0",
            "--max_new_tokens=12", "--device=cpu"]
    texts = {}
    for fmt in ("torch", "float32", "bfloat16", "int8", "int4", "auto"):
        assert generate.main([*args, f"--weights={fmt}"]) == 0
        texts[fmt], err = capsys.readouterr()
        assert len(texts[fmt]) > len("ab")
        if fmt == "auto":
            assert "(auto: the fastest decode step here of torch " in err, err
        else:
            assert f"weights={fmt}" in err
    assert texts["float32"] == texts["torch"]
    assert generate.main([*args, "--weights=int8", "--quantize=int8"]) == 2
    assert "both choose the weights' format; pass one of them" in capsys.readouterr().err


def test_auto_decodes_with_the_format_it_picked(built, monkeypatch):
    """auto times each format by decoding with it: the blocks' arguments made for the first
    one timed must not outlive it (they did: every format was timed, and then decoded, with
    float32's weights)."""
    from engine.inference.sampling import prefill
    times = iter([3.0, 2.0, 5.0, 1.0])  # torch, float32, bfloat16, int8: int8 wins
    real = packing.step_seconds

    def timed(model):
        real(model, steps=2)  # decodes: makes the blocks' arguments for what is packed now
        return next(times)

    monkeypatch.setattr(packing, "step_seconds", timed)
    torch.manual_seed(2)
    model = packed_model("float32")
    for parent, attr, packed in packing.linears(model):  # back to plain Linears
        linear = torch.nn.Linear(packed.in_features, packed.out_features)
        setattr(parent, attr, linear)
    note = packing.convert(model, "auto", torch.device("cpu"))
    assert note.startswith("int8"), note
    assert packing.block_arguments(model)[0][6] == cpu_kernels.FORMATS["int8"]
    tokens = torch.randint(0, 50, (1, 6))
    cache = new_kv_cache(model, 1)
    prefill(model, tokens[:, :5], cache)
    got = packing.decode_rows(model, tokens[:, 5:], cache.kv, torch.tensor([5]))
    torch.testing.assert_close(got[0, 0], model(tokens)[0][0, 5],
                               **block_tolerance(model))


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_output_block_is_computed_once_whatever_the_threads(built, threads):
    """The threads take the output blocks in chunks and steal from each other's shares: with
    more threads than cores (5 on 2: some are delayed, so others steal), each block once."""
    torch.manual_seed(threads)
    w = torch.randn(16 * 37 - 5, 64) * 0.05  # 37 blocks: shares and chunks of unequal sizes
    packed, x = cpu_kernels.pack(w, "float32"), torch.randn(3, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            got = cpu_kernels.matmul(x, packed)
            torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_one_call_decodes_some_rows_and_reads_a_prompt_into_another(built, fmt):
    """forward_tokens: a decoding row's next token and a new prompt's 7 tokens (its own cache
    row, read causally in the same call) -> forward()'s logits at each token asked for."""
    from engine.inference.sampling import prefill
    torch.manual_seed(3)
    model = packed_model(fmt)
    running, fresh = torch.randint(0, 50, (1, 6)), torch.randint(0, 50, (1, 7))
    cache = new_kv_cache(model, 1)
    prefill(model, running[:, :5], cache)
    kv = [torch.cat([c, torch.zeros_like(c), torch.zeros_like(c)], dim=1) for c in cache.kv]
    tokens = torch.cat([running[0, 5:], fresh[0]])  # row 0 at 5; row 2 at 0..6
    rows = torch.tensor([0] + [2] * 7)
    positions = torch.tensor([5, 0, 1, 2, 3, 4, 5, 6])
    got = packing.forward_tokens(model, tokens, kv, rows, positions, torch.tensor([0, 3, 7]))
    want_running, want_fresh = model(running)[0][0], model(fresh)[0][0]
    torch.testing.assert_close(got[0], want_running[5], **block_tolerance(model))
    torch.testing.assert_close(got[1], want_fresh[2], **block_tolerance(model))
    torch.testing.assert_close(got[2], want_fresh[6], **block_tolerance(model))
    assert all(torch.count_nonzero(k[:, 1]) == 0 for k in kv)  # row 1 untouched


def test_the_kernel_decodes_only_the_math_it_has(monkeypatch):
    """A ModelConfig field the kernel does not know (its field says kernel=False), away from its
    default, or an activation without a kernel id, sends decoding through forward()."""
    import dataclasses

    from model import ACTIVATIONS, ModelConfig
    assert packing.kernel_has_the_math(ModelConfig(activation="relu2", bias=False))
    monkeypatch.setitem(ACTIVATIONS, "gelu_erf",
                        dataclasses.replace(ACTIVATIONS["gelu_erf"], kernel_id=-1))
    assert not packing.kernel_has_the_math(ModelConfig(activation="gelu_erf"))
    bias = next(f for f in dataclasses.fields(ModelConfig) if f.name == "bias")
    monkeypatch.setattr(bias, "metadata", {**bias.metadata, "kernel": False})
    assert not packing.kernel_has_the_math(ModelConfig(bias=False))
    assert ACTIVATIONS["gelu_tanh"].kernel_id == 0
    assert packing.kernel_has_the_math(ModelConfig(tie_embeddings=False, zero_init_proj=True,
                                                   logit_softcap=30.0))
    assert not packing.kernel_has_the_math(ModelConfig(position="rotary"))
    assert not packing.kernel_has_the_math(ModelConfig(value_embeds=1))
    assert not packing.kernel_has_the_math(ModelConfig(attn_scale=0.3))
    assert not packing.kernel_has_the_math(ModelConfig(unet_skips=True))
    assert not packing.kernel_has_the_math(ModelConfig(qk_norm=True))


# The largest rounding of one stored value, as a fraction of the largest value sharing its
# scale: bfloat16 keeps 8 significant bits (round to nearest: 2^-9 of the value itself); int8
# half a step of max/127 per output; int4 half a step of max/7 per group of 32 inputs
WORST_ROUNDING = {"float32": 0.0, "bfloat16": 2.0 ** -9, "int8": 1 / 254, "int4": 1 / 14}


def logit_error_bound(fmt: str, n_layer: int, rounds_activations: bool) -> float:
    """The most ||packed logits - float32 logits|| / ||float32 logits|| a format may cost. A
    product whose weights (or activations) are rounded by at most d of their scale is off by
    about d of its size; independent roundings add in quadrature, so n of them on a logit's way
    cost sqrt(n) d. n counts the token embedding (bfloat16 below float32) and each block
    Linear's and the head's weights, 1 + 4 n_layer + 1, and as many again for their activations
    on the vnni and bf16 paths (int8 or bfloat16: never coarser than the weights). float32
    rounds nothing: its bound is float32 arithmetic's. Measured over 40 seeds, at every ATen
    CPU capability: up to 0.35 of it (bfloat16), 0.6 (int8), 0.5 (int4)."""
    products = 4 * n_layer + 1
    roundings = 1 + products * (2 if rounds_activations else 1)
    return max(math.sqrt(roundings) * WORST_ROUNDING[fmt], 1e-5)


class RoundedInputs(torch.nn.Module):
    """A Linear whose inputs are rounded first, as a packed path rounds its activations: int8
    per block of 32 on vnni, bfloat16 on pairs (cpu_kernels.reference's rounding)."""

    def __init__(self, linear: torch.nn.Linear, layout: str):
        super().__init__()
        self.linear, self.layout = linear, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rounded = cpu_kernels.rounded_activations(x) if self.layout == "vnni" else \
            x.bfloat16().float()
        return self.linear(rounded)


def dequantized_twin(model: torch.nn.Module, packed: torch.nn.Module) -> torch.nn.Module:
    """model (float32) with each Linear's weight what its packed twin stores (cpu_kernels.unpack)
    and the token embedding as convert left it: plain torch products of the stored values, the
    inputs rounded first where the packed path rounds its activations."""
    twin = copy.deepcopy(model)
    for (parent, attr, linear), (_, _, stored) in zip(packing.linears(twin),
                                                      packing.linears(packed)):
        linear.weight = torch.nn.Parameter(cpu_kernels.unpack(stored.packed))  # unties the head
        if stored.layout != "blocked":
            setattr(parent, attr, RoundedInputs(linear, stored.layout))
    twin.transformer.wte.weight.data = packed.transformer.wte.weight.data.float()
    return twin


def whole_and_decoded_logits(model: torch.nn.Module, x: torch.Tensor, prompt: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward's logits over x, the logits of a cached decode of x: its first `prompt` tokens
    prefilled, then one decode_step a token), for positions prompt-1 onwards."""
    from engine.inference.sampling import decode_step, prefill
    with torch.no_grad():
        whole = model(x)[0]
        cache = new_kv_cache(model, x.size(0))
        first, pos = prefill(model, x[:, :prompt], cache)
        steps = [decode_step(model, x[:, t:t + 1], cache, t, torch.tensor([t]))
                 for t in range(pos, x.size(1))]
    return whole, torch.cat([first] + steps, dim=1)


def assert_the_logits_of(got: torch.Tensor, want: torch.Tensor, layout: str) -> None:
    """got: the packed model's logits; want: its dequantized twin's. To float32 rounding, but
    on a path that rounds activations one that the two sides compute a float apart may round
    to the next step: 1% of the largest logit (up to 0.43% seen, over 60 seeds at each ATen
    CPU capability: avx512, avx2, default)."""
    if layout == "blocked":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * float(want.abs().max()))


# each format on the kernels' float-activation (blocked) path, which every x86 CPU has; on the
# CPU's own vnni or bf16 path where it has one for the format; and plain torch (no kernels)
ROUNDING_PATHS = [fmt for fmt in cpu_kernels.FORMATS
                  if cpu_kernels.best_path(fmt)[1] in cpu_kernels.LAYOUT_OF.values()]
FORMAT_PATHS = [(fmt, path) for fmt in cpu_kernels.FORMATS for path in ("blocked", "torch")] + \
    [(fmt, "own") for fmt in ROUNDING_PATHS]


@pytest.mark.parametrize("fmt, path", FORMAT_PATHS)
def test_each_format_gives_the_logits_of_what_it_stores(fmt, path, request, monkeypatch):
    """convert(model, fmt): forward's logits and a prefill + decode_step run (each block one
    fused kernel call where the kernels are built) are those of the float32 model with the
    stored weights put back (dequantized_twin), to float32 rounding; and within the format's
    rounding of the float32 model's own (logit_error_bound)."""
    from conftest import tiny_model_config
    from model import GPT
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "status", lambda: (False, "no C++ compiler: torch"))
    else:
        request.getfixturevalue("built")
    if path == "blocked":  # best_path picks among these: the blocked layout's widest
        monkeypatch.setattr(cpu_kernels, "cpu_isas", lambda: FLOAT_PATHS)
    torch.set_num_threads(1)  # a tiny model gains nothing from more (conftest restores them)
    torch.manual_seed(0)
    original = GPT(tiny_model_config(n_embd=64, n_head=4, block_size=32, vocab_size=50)).eval()
    with torch.no_grad():  # biases and norms away from their 0 and 1: a path must apply them
        for p in original.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.1)
    model = copy.deepcopy(original)
    assert packing.convert(model, fmt, torch.device("cpu")).startswith(fmt)
    head = model.lm_head
    assert {linear.format for _, _, linear in packing.linears(model)} == {fmt}
    assert head.isa == ("torch" if path == "torch" else cpu_kernels.best_path(fmt)[0])
    assert packing.fused(model) == (path != "torch")
    twin = dequantized_twin(original, model)
    x = torch.randint(0, 50, (5, 32))
    with torch.no_grad():  # 160 rows: past KERNEL_ROWS, the unpacked weight's dense product
        assert_the_logits_of(model(x)[0], twin(x)[0], head.layout)
        want, exact = twin(x[:2])[0], original(x[:2])[0]
    got, decoded = whole_and_decoded_logits(model, x[:2], prompt=5)  # 64 rows: the kernels
    assert_the_logits_of(got, want, head.layout)
    assert_the_logits_of(decoded, want[:, 4:], head.layout)
    error = torch.cat([got - exact, decoded - exact[:, 4:]], dim=1).norm()
    size = torch.cat([exact, exact[:, 4:]], dim=1).norm()
    assert error / size < logit_error_bound(fmt, original.config.n_layer,
                                             head.layout != "blocked")
