"""The memory estimate (engine/memory_estimate.py) against memory measured on the CPU.

Activations: the bytes autograd keeps for backward during one training forward, seen through
torch.autograd.graph.saved_tensors_hooks (each storage once: views share it), plus the inputs a
checkpointed part holds and the gradients a chunked loss keeps in its autograd context. The
model's own parameters and buffers are left out: they exist whether or not backward runs.
Weights, gradients and optimizer state: the tensors a real step holds.

How close: the estimate counts whole tensors as wide as the model (C, 3C, 4C or heads x context
numbers per token), so those are compared to the byte: one tensor missed or added is at least
tokens x C x 2 bytes. Narrower ones (LayerNorm's and RMSNorm's per-row statistics, attention's
logsumexp and mask, the token ids) the estimate does not claim: they are left out of the
comparison and checked to stay a few percent. Beyond what is measured the estimate counts
exactly the tensors `overcount` names, which the CPU never makes (an upper estimate may). The
loss's part is a peak, so what the loss keeps is bounded by it, not equal. The cases these tests
first found wrong (scratch LayerNorm, the smear's and U-net's kept tensors, autocast's weight
copies, the bf16 masters' gradients, the parameter count) are counted now.
"""
from __future__ import annotations

import pytest
import torch

from config import Config, load_config
from conftest import tiny_model_config
from engine.training import master_weights, memory_estimate, optim, recompute
from engine.training.recompute import checkpoint_plan
from model import GPT

VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
         "SliceBackward0", "AliasBackward0", "ExpandBackward0"}


def is_weight_copy(t: torch.Tensor, params: set[int]) -> bool:
    """Autocast's 16-bit copy of a parameter (or a view of one): a cast straight from it."""
    fn = t.grad_fn
    while fn is not None and fn.name() in VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return id(getattr(source, "variable", None)) in params


def context_tensors(loss: torch.Tensor, stop: torch.autograd.graph.Node) -> list[torch.Tensor]:
    """Tensors the loss's custom autograd Functions keep as attributes of their context (the
    chunked losses keep their gradients so), walking back from loss to the node `stop`."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn is stop or fn in seen:
            continue
        seen.add(fn)
        for value in getattr(fn, "__dict__", {}).values():
            found += [t for t in (value if isinstance(value, tuple) else (value,))
                      if torch.is_tensor(t)]
        todo += [next_fn for next_fn, _ in fn.next_functions]
    return found


class KeptBytes:
    """Bytes kept for backward by where they were saved: (block, 'attention' | 'mlp') for a
    block's two parts (each with its LayerNorm), 'trunk' for the rest up to the LM head's input
    (embeddings, skips, checkpointed parts' inputs, ln_f), 'loss' from the LM head's output on,
    'weight_copies' for autocast's 16-bit copies of the weights."""

    def __init__(self, gpt: GPT, tokens: int):
        self.gpt, self.where, self.tokens = gpt, "trunk", tokens
        self.model_state = {t.untyped_storage().data_ptr()
                            for t in (*gpt.parameters(), *gpt.buffers())}
        self.params = {id(p) for p in gpt.parameters()}
        self.storages: dict[int, tuple] = {}  # data_ptr -> (where, bytes, wide)

    def add(self, t: torch.Tensor, where: str | tuple | None = None) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.model_state or storage.data_ptr() in self.storages:
            return
        if is_weight_copy(t, self.params):
            where = "weight_copies"
        numbers = storage.nbytes() // t.element_size()
        wide = numbers >= self.tokens * self.gpt.config.n_embd
        self.storages[storage.data_ptr()] = (where or self.where, storage.nbytes(), wide)

    def bytes(self, where=lambda w: True, wide: bool | None = True) -> int:
        """Bytes saved where `where(place)` holds; wide: only (True) or none (False) of the
        tensors with at least C numbers per token; None: all."""
        return sum(n for w, n, is_wide in self.storages.values()
                   if where(w) and wide in (None, is_wide))

    def part(self, i: int, part: str) -> int:
        return self.bytes(lambda w: w == (i, part))

    @staticmethod
    def activation(where) -> bool:
        """What estimate.activations counts: all but the loss's and the weight copies."""
        return where not in ("loss", "weight_copies")


def set_where(kept: KeptBytes, where: str | tuple):
    return lambda *args: setattr(kept, "where", where)


def mark_parts(kept: KeptBytes) -> list:
    """Forward hooks that tell `kept` which part of the model is saving."""
    gpt, handles = kept.gpt, []
    for i, block in enumerate(gpt.transformer.h):
        handles.append(block.ln_1.register_forward_pre_hook(set_where(kept, (i, "attention"))))
        handles.append(block.ln_2.register_forward_pre_hook(set_where(kept, (i, "mlp"))))
        handles.append(block.register_forward_hook(set_where(kept, "trunk")))
    # the estimate counts the LM head's input as an activation; the loss starts after the head
    # (the chunked loss never calls it as a module: there, after ln_f)
    head = gpt.transformer.ln_f if gpt.config.loss == "chunked" else gpt.lm_head
    handles.append(head.register_forward_hook(set_where(kept, "loss")))
    return handles


def measure_kept(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> KeptBytes:
    """One training forward of cfg's model on a micro-batch of random tokens."""
    m = cfg.model
    torch.manual_seed(0)
    gpt = GPT(m).train()
    shape = (cfg.train.batch_size, m.block_size)
    idx, targets = torch.randint(0, m.vocab_size, shape), torch.randint(0, m.vocab_size, shape)
    kept = KeptBytes(gpt, idx.numel())
    checkpoint = recompute.checkpoint

    def holding_inputs(function, *args, **kwargs):  # a checkpointed part keeps its inputs
        for a in args:
            if torch.is_tensor(a):
                kept.add(a, "trunk")
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", holding_inputs)
    ln_f_out = []
    handles = mark_parts(kept) + [gpt.transformer.ln_f.register_forward_hook(
        lambda module, args, out: ln_f_out.append(out))]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16,
                              enabled=cfg.system.dtype == "bfloat16")
    def pack(t: torch.Tensor) -> torch.Tensor:  # autograd keeps t itself: nothing is copied
        kept.add(t)
        return t

    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = gpt(idx, targets)
    for handle in handles:
        handle.remove()
    for t in context_tensors(loss, ln_f_out[0].grad_fn):
        kept.add(t, "loss")
    return kept


def overcount(cfg: Config, attention_parts: int) -> int:
    """Bytes the estimate counts that the CPU never makes as tensors of their own, with
    `attention_parts` blocks' attention parts kept for backward."""
    m, act = cfg.model, 4 if cfg.system.dtype == "float32" else 2
    per_block, once = 0, 0
    if m.attention == "scratch" and act == 4:  # the softmax's cast copy: none in float32
        per_block += 4 * m.n_head * m.block_size
    # SDPA's output takes q's layout: with q a view of c_attn's output (no QK-norm, no rotary),
    # the output transposed is contiguous already, and is the projection's input (one storage)
    if m.attention == "sdpa" and not m.qk_norm and m.position != "rotary":
        per_block += act * m.n_embd
    return cfg.train.batch_size * m.block_size * (per_block * attention_parts + once)


def attention_kept(cfg: Config) -> int:
    """Blocks whose attention part is kept for backward, not recomputed."""
    plan = checkpoint_plan(cfg.model.activation_checkpointing, cfg.model.n_layer)
    return sum(part in ("", "mlp") for part in plan)


def assert_activations_match(cfg: Config, kept: KeptBytes) -> None:
    """The estimate is every wide tensor kept, plus what `overcount` names, to the byte; the
    narrow tensors left out stay a few percent."""
    estimated = memory_estimate.estimate(cfg).activations
    wide = kept.bytes(kept.activation)
    narrow = kept.bytes(kept.activation, wide=False)
    assert estimated - wide == overcount(cfg, attention_kept(cfg)), (estimated, wide)
    assert narrow <= 0.05 * estimated  # measured: 0.2-2.8% at the shapes here


def gpt2_config(dtype: str = "float32", **model) -> Config:
    """GPT-2's model (the config's defaults) in small shapes, a micro-batch of 4."""
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=65, block_size=32, n_layer=2, n_head=2,
                                  n_embd=64, **model)
    cfg.train.batch_size, cfg.system.dtype = 4, dtype
    return cfg


def shipped_config() -> Config:
    """configs/shakespeare_char.toml as `python train.py` runs it, on its 65 characters."""
    cfg, _ = load_config([])
    cfg.model.vocab_size = 65
    return cfg


NORMS = ["scratch", "native"]
# each checkpointing mode with both attentions; the loss and autocast where they change what
# is kept (the LM head's input or its gradient; 16-bit matmul inputs and the softmax's copy)
CASES = [dict(attention=a, activation_checkpointing=c) for a in ("scratch", "sdpa")
         for c in ("none", "all", "attention", "mlp")] + [
    dict(attention="sdpa", loss="chunked"),
    dict(attention="sdpa", loss="chunked", dtype="bfloat16"),
    dict(attention="scratch", dtype="bfloat16"), dict(attention="sdpa", dtype="bfloat16"),
    dict(attention="sdpa", activation_checkpointing="mlp", loss="chunked", dtype="bfloat16"),
    dict(attention="sdpa", value_embeds=1), dict(attention="scratch", value_embeds=1)]


def case_id(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpt2_activations_are_what_backward_keeps(case, norm, monkeypatch):
    cfg = gpt2_config(norm=norm, **case)
    assert_activations_match(cfg, measure_kept(cfg, monkeypatch))


@pytest.fixture(scope="module")
def shipped_kept() -> KeptBytes:
    """The shipped model's forward at its batch and context (2,048 tokens), measured once."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return measure_kept(shipped_config(), monkeypatch)


def test_shipped_activations_are_what_backward_keeps(shipped_kept):
    assert_activations_match(shipped_config(), shipped_kept)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["all", "attention", "mlp"])
def test_recompute_is_one_part_as_a_plain_forward_keeps_it(mode, dtype, norm, monkeypatch):
    """estimate.recompute: what backward rebuilds of one checkpointed part, which is what the
    same part keeps in a forward with nothing checkpointed (the largest of the blocks')."""
    plain = measure_kept(gpt2_config(dtype, norm=norm), monkeypatch)
    parts = {"all": ("attention", "mlp"), "attention": ("attention",), "mlp": ("mlp",)}[mode]
    blocks = range(plain.gpt.config.n_layer)
    rebuilt = max(sum(plain.part(i, part) for part in parts) for i in blocks)
    cfg = gpt2_config(dtype, norm=norm, activation_checkpointing=mode)
    assert memory_estimate.estimate(cfg).recompute - rebuilt == overcount(cfg, "attention" in parts)


# full and chunked (torch's F.linear_cross_entropy in float32, ours in bf16 and soft-capped)
LOSSES = {"full": dict(), "full-bfloat16": dict(dtype="bfloat16"),
          "chunked": dict(loss="chunked"),
          "chunked-bfloat16": dict(loss="chunked", dtype="bfloat16"),
          "full-softcap": dict(logit_softcap=30.0),
          "chunked-softcap": dict(logit_softcap=30.0, loss="chunked")}


@pytest.mark.parametrize("case", LOSSES.values(), ids=LOSSES.keys())
def test_the_loss_keeps_no_more_than_its_estimate(case, monkeypatch):
    """estimate.logits is the LM head + loss at its peak, which holds what the loss keeps for
    backward (its float32 log-softmax and soft-cap tanh; a chunked loss, the gradients it makes
    in forward) and more (the logits and their gradient, or one chunk's buffers)."""
    cfg = gpt2_config(norm="native", **case)
    kept = measure_kept(cfg, monkeypatch)
    assert 0 < kept.bytes(lambda w: w == "loss", wide=None) <= memory_estimate.estimate(cfg).logits


def test_the_shipped_loss_keeps_no_more_than_its_estimate(shipped_kept):
    loss = shipped_kept.bytes(lambda w: w == "loss", wide=None)
    assert 0 < loss <= memory_estimate.estimate(shipped_config()).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_everything_kept_for_backward_fits_the_estimate(dtype, monkeypatch):
    """All the forward leaves for backward, wide or narrow, with the loss's and any copies of
    the weights: within activations + logits."""
    cfg = gpt2_config(dtype, norm="native", attention="sdpa")
    kept = measure_kept(cfg, monkeypatch)
    e = memory_estimate.estimate(cfg)
    assert kept.bytes(wide=None) <= e.activations + e.logits + e.weight_copies
    assert kept.bytes(lambda w: w == "weight_copies", wide=None) == e.weight_copies


def storage_bytes(tensors) -> int:
    """Bytes of the tensors' storages, each once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def held_by_a_step(cfg: Config) -> dict[str, int]:
    """Bytes of the weights, the gradients and the optimizer's state (its tensors, not the step
    counts, one number each) held at the end of one optimizer step, as train.py builds them;
    with bf16 weights, the float32 masters are optimizer state and their .grad gradients."""
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    if cfg.system.weights_dtype == "bfloat16":
        master_weights.hold_weights(gpt, "ddp", 1)
    optimizer = optim.make_optimizer(gpt, cfg, torch.device("cpu"))
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.system.dtype == "bfloat16"):
        _, loss = gpt(idx, idx)
    loss.backward()
    optimizer.step()
    params = list(gpt.parameters())  # a tied LM head is the token embedding: once
    masters = getattr(optimizer, "masters", [])
    state = [t for s in optimizer.state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0] + masters
    return {"weights": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params + masters if p.grad is not None),
            "optimizer": storage_bytes(state)}


def bf16_weights(cfg: Config) -> Config:
    cfg.system.dtype = cfg.system.weights_dtype = "bfloat16"
    return cfg


def with_optimizer(cfg: Config, name: str) -> Config:
    cfg.train.optimizer = name
    return cfg


STEP_CASES = [
    pytest.param(lambda: gpt2_config(), id="gpt2-adamw"),
    pytest.param(lambda: with_optimizer(gpt2_config(), "muon"), id="gpt2-muon"),
    pytest.param(lambda: bf16_weights(gpt2_config()), id="gpt2-adamw-bf16-weights"),
    pytest.param(shipped_config, id="shipped-muon"),
    pytest.param(lambda: with_optimizer(shipped_config(), "adamw"), id="shipped-adamw"),
]


@pytest.mark.parametrize("make_config", STEP_CASES)
def test_weights_gradients_and_optimizer_state_are_what_a_step_holds(make_config):
    cfg = make_config()
    e = memory_estimate.estimate(cfg)
    assert held_by_a_step(cfg) == {"weights": e.weights, "gradients": e.gradients,
                                   "optimizer": e.optimizer}
