"""Hugging Face GPT-2 <-> our GPT: read HF directories (hub or local), write ours as one, and
check our logits against transformers'. Names map one to one; HF's Conv1D matrices are (in, out)
where nn.Linear is (out, in), so they are transposed; a padded vocabulary gets zero rows."""
from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from config import Config, ModelConfig
from data import GPT2_EOT
from data.bpe import GPT2_RANKS, BPETokenizer, GPT2Tokenizer, load_ranks
from data.tokenizer import from_meta
from engine import checkpoint, loading, saving
from engine.checkpoint import first_line
from engine.context import rows_past_block, source_context
from engine.fields import facts
from model import ACTIVATIONS, BLOCK_LINEARS, GPT

GPT2_MODEL_IDS = {name: f"openai-community/{name}"
                  for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json",
             "model-*.safetensors"]
GPT2_VOCAB = 50257
SHAPE = facts(ModelConfig, "hf")  # our shape keys -> their GPT2Config keys
BLOCK_PARTS = ("ln_1", *(n for n in BLOCK_LINEARS if n.startswith("attn.")), "ln_2",
               *(n for n in BLOCK_LINEARS if n.startswith("mlp.")))
CONV1D = tuple(f"{name}.weight" for name in BLOCK_LINEARS)  # HF's Conv1D: transposed
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
VERIFY_TEXT = ("Hello, I'm a language model, and I can tell you that the weights were mapped "
               "correctly when the logits agree to the last few digits.")


NOT_IN_GPT2 = facts(ModelConfig, "gpt2")  # options GPT2LMHeadModel has no place for -> its own


class GPT2WeightsError(checkpoint.CheckpointError):
    """A GPT-2 source that cannot be found, read or mapped onto our model."""


def check_gpt2_can_hold(cfg: ModelConfig, doing: str) -> None:
    """Refuse, in one line, a model whose options GPT-2's format cannot hold."""
    default = ModelConfig()
    found = [(f"model.{name}={getattr(cfg, name)}", has) for name, has in NOT_IN_GPT2.items()
             if getattr(cfg, name) != getattr(default, name)]
    if not ACTIVATIONS[cfg.activation].hf_names:
        found.append((f"model.activation={cfg.activation}", "no such activation_function"))
    if found:
        names, gpt2 = ", ".join(n for n, _ in found), "; ".join(h for _, h in found)
        raise GPT2WeightsError(f"cannot {doing}: {names} has no place in Hugging Face's GPT-2 "
                               f"(it has {gpt2}); our own checkpoints keep it (generate.py, "
                               "serve.py), or train without it")


class VerificationError(GPT2WeightsError):
    """Our logits and transformers' differ by more than the tolerance."""


def hub_repo(source: str) -> str | None:
    """The hub repository a source names (gpt2, openai-community/gpt2, hf:ORG/NAME), or None."""
    if source.startswith("hf:"):
        return source.removeprefix("hf:")
    return GPT2_MODEL_IDS.get(source, source if source in GPT2_MODEL_IDS.values() else None)


def is_gpt2_source(source: str) -> bool:
    """A local HF directory (config.json with model_type), a hub id, or a near miss of a GPT-2
    id (so that the error suggests the right name)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        if "model_type" in json.loads((Path(source) / "config.json").read_text()):
            return True
    return hub_repo(source) is not None or not Path(source).exists() and bool(
        difflib.get_close_matches(source, list(GPT2_MODEL_IDS), n=1, cutoff=0.75))


def fetch(source: str) -> Path:
    """A local directory with the source's config.json and weights (a hub id is downloaded)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise GPT2WeightsError(f"{path} has no config.json; a Hugging Face model directory "
                                   "holds config.json and model.safetensors (or pytorch_model.bin)")
        return path
    repo = hub_repo(source)
    if repo is None:
        close = difflib.get_close_matches(source, list(GPT2_MODEL_IDS), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise GPT2WeightsError(f"{source!r} is neither a directory nor a GPT-2 model id{hint} "
                               f"(known: {', '.join(GPT2_MODEL_IDS)}, or hf:ORG/NAME)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GPT2WeightsError(f"fetching {repo} needs huggingface_hub: pip install "
                               "huggingface_hub (pyproject.toml's hf group)") from None
    print(f"fetching {repo} from the Hugging Face hub (once; cached after) ...", file=sys.stderr,
          flush=True)  # a download of up to 6 GB must not look like a hang
    try:
        local = Path(snapshot_download(repo, allow_patterns=HUB_FILES))
        if not any(local.glob("*.safetensors")):  # an older repository: PyTorch pickle only
            local = Path(snapshot_download(repo, allow_patterns=["config.json",
                                                                 "pytorch_model.bin"]))
    except Exception as e:  # no network, unknown or gated repository, ...
        raise GPT2WeightsError(f"could not fetch {repo} from the Hugging Face hub "
                               f"({first_line(e)}); without a network, copy a model directory "
                               "(config.json + model.safetensors) to this machine and pass its "
                               "path instead") from None
    return local


def our_activation(hf_name: str) -> str | None:
    """model.activation for a GPT2Config.activation_function (None: ours has no such one)."""
    return next((ours for ours, a in ACTIVATIONS.items() if hf_name in a.hf_names), None)


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a HF GPT-2, checked for anything our architecture cannot represent."""
    try:
        hf = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise GPT2WeightsError(f"{hf_dir}/config.json is unreadable ({e})") from None
    act = hf.get("activation_function", "gelu_new")
    missing = [k for k in SHAPE.values() if not isinstance(hf.get(k), int)]
    checks = [  # (cannot be represented, why)
        (hf.get("model_type") != "gpt2",
         f"model_type={hf.get('model_type')!r} (only 'gpt2' maps onto our model)"),
        (missing, f"no integer {', '.join(missing)}"),
        (our_activation(act) is None, f"activation_function={act!r} (ours: " + ", ".join(
            name for a in ACTIVATIONS.values() for name in a.hf_names) + ")"),
        (hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 0)),
         f"n_inner={hf.get('n_inner')} (ours is 4 * n_embd)"),
        (hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True),
         "attention scaling other than 1/sqrt(head size)"),
        (hf.get("add_cross_attention"), "cross-attention layers")]
    if problems := [why for bad, why in checks if bad]:
        raise GPT2WeightsError(f"{hf_dir}/config.json describes a model ours cannot represent: "
                               + "; ".join(problems))
    return hf


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of (sharded) model.safetensors, or pytorch_model.bin loaded weights-only."""
    index, pickled = hf_dir / "model.safetensors.index.json", hf_dir / "pytorch_model.bin"
    try:
        if (hf_dir / "model.safetensors").is_file():
            return load_file(str(hf_dir / "model.safetensors"))
        if index.is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(load_file(str(hf_dir / shard)))
            return state
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise GPT2WeightsError(f"weights in {hf_dir} are unreadable ({e}); the download is "
                               "truncated or corrupt: fetch them again") from None
    if pickled.is_file():
        try:
            return torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as e:  # the weights-only unpickler refuses code objects
            raise GPT2WeightsError(f"refusing to load {pickled}: {first_line(e)} (only tensors "
                                   "are accepted; use model.safetensors)") from None
    raise GPT2WeightsError(f"{hf_dir} holds no weights: expected model.safetensors (or "
                           "model.safetensors.index.json with its shards) or pytorch_model.bin")


def hf_names(n_layer: int) -> list[str]:
    """HF GPT-2 tensor names without 'transformer.'; ours are 'transformer.' + the same name."""
    block = [f"{part}.{kind}" for part in BLOCK_PARTS for kind in ("weight", "bias")]
    return ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
            *(f"h.{i}.{p}" for i in range(n_layer) for p in block)]


def hf_to_ours(hf_state: dict[str, torch.Tensor], model: GPT,
               source: str) -> dict[str, torch.Tensor]:
    """Our state dict from HF GPT-2 tensors; every mismatch is listed in one error."""
    cfg, own, names = model.config, model.state_dict(), set(hf_names(model.config.n_layer))
    state: dict[str, torch.Tensor] = {}
    unexpected, shapes = [], []
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")
        if name not in names:  # the tied head is compared below; old mask buffers are dropped
            if name != "lm_head.weight" and not MASK_BUFFER.fullmatch(name):
                unexpected.append(key)
            continue
        expected = tuple(own[f"transformer.{name}"].shape)
        if name == "wte.weight":
            expected = (cfg.vocab_size, expected[1])  # HF has no padded rows
        conv1d = name.endswith(CONV1D)
        expected = expected[::-1] if conv1d else expected
        if tuple(tensor.shape) != expected:
            shapes.append(f"{key}: file {tuple(tensor.shape)} vs config {expected}")
        else:
            state[f"transformer.{name}"] = tensor.t() if conv1d else tensor
    found = {k.removeprefix("transformer.") for k in hf_state}
    parts = loading.mismatch_parts(sorted(names - found), sorted(unexpected), sorted(shapes))
    wte, head = state.get("transformer.wte.weight"), hf_state.get("lm_head.weight")
    if cfg.tie_embeddings and head is not None and wte is not None and not torch.equal(head, wte):
        parts.append("lm_head.weight differs from wte.weight, but config.json ties the LM head "
                     "to the token embedding")
    if not cfg.tie_embeddings:  # tie_word_embeddings=false: a head of its own
        if head is None or tuple(head.shape) != (cfg.vocab_size, cfg.n_embd):
            parts.append(f"lm_head.weight: {'missing' if head is None else tuple(head.shape)} "
                         f"vs config {(cfg.vocab_size, cfg.n_embd)} (tie_word_embeddings=false)")
        else:
            state["lm_head.weight"] = torch.cat([head, head.new_zeros(
                model.padded_vocab - cfg.vocab_size, head.size(1))])
    if parts:
        raise GPT2WeightsError(f"weights in {source} do not match its config.json ("
                               + "; ".join(parts) + "); the directory is not a complete GPT-2 "
                               "GPT2LMHeadModel: re-download or re-export it")
    if extra := model.padded_vocab - cfg.vocab_size:  # zero rows, sliced off the logits
        state["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(extra, wte.size(1))])
    return state


def load_hf(source: str, model_cfg: ModelConfig | None = None) -> tuple[GPT, Path]:
    """Our GPT holding a HF GPT-2's weights at its full context, and the directory read.
    model_cfg's shape and architecture (activation, tied head, learned positions, no QK-norm or
    soft-cap) are set from the HF config in place; its implementation switches stay."""
    model_cfg = model_cfg or ModelConfig()
    hf_dir = fetch(source)
    hf = read_hf_config(hf_dir)
    for ours, theirs in SHAPE.items():
        setattr(model_cfg, ours, hf[theirs])
    model_cfg.layer_norm_eps = float(hf.get("layer_norm_epsilon", 1e-5))
    model_cfg.bias = True  # GPT-2 has biases everywhere
    for name in facts(ModelConfig, "departure"):  # GPT-2's architecture, whatever was asked
        setattr(model_cfg, name, getattr(ModelConfig(), name))
    model_cfg.activation = our_activation(hf.get("activation_function", "gelu_new"))  # its own
    model_cfg.tie_embeddings = bool(hf.get("tie_word_embeddings", True))
    model = GPT(model_cfg)
    state = hf_to_ours(read_hf_weights(hf_dir), model, str(hf_dir))
    loading.load_state(model, state, str(hf_dir))  # copies, re-checking against our names
    return model, hf_dir


def tokenizer_meta(vocab_size: int, hf_dir: Path | None = None) -> dict:
    """GPT-2's BPE when the vocabulary is GPT-2's; a BPE trained here when hf_dir's
    tokenizer.json is one our export wrote; else unknown."""
    if vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}
    path = Path(hf_dir or "") / "tokenizer.json"
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
        return bpe_from_tokenizer_json(json.loads(path.read_text()), vocab_size)
    return {"kind": "unknown", "vocab_size": vocab_size}


def bpe_from_tokenizer_json(hf: dict, vocab_size: int) -> dict:
    """bpe_tokenizer_json's inverse: ranks by id (the 256 bytes first), the Split's pattern and
    the added tokens after them; raises ValueError for a tokenizer.json of another shape."""
    from data.train_tokenizer import byte_alphabet

    byte_of = {char: b for b, char in byte_alphabet().items()}
    vocab = sorted(hf["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [bytes(byte_of[c] for c in text) for text, _ in vocab]
    special = [t["content"] for t in sorted(hf["added_tokens"], key=lambda t: t["id"])]
    if [i for _, i in vocab] != list(range(len(vocab))) or len(vocab) + len(special) != \
            vocab_size or hf["model"]["type"] != "BPE":
        raise ValueError("not a byte-level BPE numbered as ours")
    pattern = hf["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    return BPETokenizer(tokens, pattern, special, "imported").meta()


def ours_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel tensors: real vocabulary rows, Conv1D transposed, zero missing biases."""
    own, out = model.state_dict(), {}
    for name in hf_names(model.config.n_layer):
        ours = f"transformer.{name}"
        if ours in own:
            tensor = own[ours].detach().cpu()
        else:  # bias=False: GPT-2 always has biases, and zero ones change nothing
            owner = own[ours.removesuffix(".bias") + ".weight"]
            tensor = torch.zeros(owner.shape[0], dtype=owner.dtype)
        if name == "wte.weight":
            tensor = tensor[:model.config.vocab_size]
        if name == "wpe.weight" and (rows := rows_past_block(model)) is not None:
            tensor = torch.cat([tensor, rows.detach().cpu().to(tensor.dtype)])  # the source's
        out[ours] = (tensor.t() if name.endswith(CONV1D) else tensor).contiguous().clone()
    if not model.config.tie_embeddings:
        out["lm_head.weight"] = own["lm_head.weight"][:model.config.vocab_size].cpu().clone()
    return out


def hf_config(cfg: ModelConfig, context: int | None = None) -> dict:
    """config.json for GPT2LMHeadModel describing our model; `context` (n_positions) when it is
    not block_size: a finetune at a shorter context exports at its source's."""
    eot = GPT2_EOT if cfg.vocab_size == GPT2_VOCAB else None
    context = context or cfg.block_size
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            **{theirs: getattr(cfg, ours) for ours, theirs in SHAPE.items()}, "n_inner": None,
            "n_positions": context,
            "n_ctx": context,  # as OpenAI's files have it: llama.cpp's converter reads it
            "activation_function": ACTIVATIONS[cfg.activation].hf_names[0],
            "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "bos_token_id": eot,
            "eos_token_id": eot, "torch_dtype": "float32"}


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that made each token, in rank order: BPE over a token's own bytes, with only the
    merges ranked before it, ends in exactly the two parts it was made from."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, i = min((ranks.get(parts[i] + parts[i + 1], rank), i)
                          for i in range(len(parts) - 1))
            if best >= rank:
                raise GPT2WeightsError(f"cannot derive the merge for token rank {rank}")
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def hf_tokenizer_files(model_max_length: int, tokenizer: dict | None = None) -> dict[str, bytes]:
    """GPT-2's vocab.json, merges.txt and tokenizer_config.json from the bundled ranks (no
    download); a BPE trained here (`tokenizer`, its meta) as tokenizer.json, which alone can
    hold its split pattern."""
    from data.train_tokenizer import byte_alphabet

    alphabet = byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    eot = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": eot, "eos_token": eot,
              "unk_token": eot, "add_prefix_space": False, "model_max_length": model_max_length}
    if tokenizer is not None and tokenizer.get("kind") == "bpe":
        config = {**config, "tokenizer_class": "PreTrainedTokenizerFast"}
        return {"tokenizer.json": bpe_tokenizer_json(tokenizer, text).encode(),
                "tokenizer_config.json": json.dumps(config, indent=2).encode()}
    ranks = load_ranks(GPT2_RANKS)
    vocab = {text(token): rank for token, rank in ranks.items()} | {eot: GPT2_EOT}
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in merges_of(ranks))
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False).encode(),
            "merges.txt": ("#version: 0.2\n" + merges).encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def bpe_tokenizer_json(meta: dict, text) -> str:
    """A trained BPE in Hugging Face tokenizers' format: its split pattern, then GPT-2's
    byte-to-character step, its vocabulary and merges, its special tokens after them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = from_meta(meta)
    ranks = {token: i for i, token in enumerate(tok.tokens)}
    hf = Tokenizer(models.BPE(vocab={text(t): i for t, i in ranks.items()},
                              merges=[(text(a), text(b)) for a, b in merges_of(ranks)]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(tok.special)  # ids after the ranks, as ours
    return hf.to_str()


def write_hf_dir(model: GPT, out: Path, tokenizer: dict | None = None) -> list[str]:
    """A directory from_pretrained loads (config.json, model.safetensors, tokenizer files), staged
    and moved into place once complete, so a failure leaves `out` as it was."""
    out = Path(out)
    check_gpt2_can_hold(model.config, f"export to {out}")
    saving.check_out_dir(out, "--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = ours_to_hf(model)
    config = hf_config(model.config, source_context(model))
    if tokenizer is not None and tokenizer.get("kind") == "bpe":  # its end of text
        config["bos_token_id"] = config["eos_token_id"] = from_meta(tokenizer).eot_id
    files = {"config.json": json.dumps(config, indent=2).encode()}
    if tokenizer is not None and tokenizer.get("kind") in ("gpt2", "bpe"):
        files.update(hf_tokenizer_files(config["n_positions"], tokenizer))
    needed = saving.bytes_to_write(tensors, *files.values())
    staging = out if out.is_dir() else out.parent  # the same filesystem: renames work
    with saving.staging_dir(staging, ".tmp_export_", f"Hugging Face export {out}", needed,
                                "--out") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        saving.write_files(tmp, files)
        if out.is_dir():
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.rename(tmp, out)
    return ["config.json", "model.safetensors", *list(files)[1:]]


def export_hf(model: GPT, meta: dict, out: str | Path) -> tuple[Path, list[str]]:
    """One of our models, loaded with its meta (engine/sources.py: a LoRA run's merged) -> a HF
    GPT-2 directory and the files written there."""
    return Path(out), write_hf_dir(model, Path(out), meta.get("tokenizer"))


@torch.no_grad()
def verify(model: GPT, hf_dir: Path, tolerance: float = 1e-4, device: str = "cpu") -> float:
    """Max |logit difference| vs transformers' GPT2LMHeadModel on seeded ids (row 0 a sentence
    for GPT-2's vocabulary); VerificationError above tolerance * max(1, max |logit|)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise GPT2WeightsError("checking against Hugging Face's GPT-2 needs transformers: pip "
                               "install transformers (pyproject.toml's hf group)") from None

    reference = GPT2LMHeadModel.from_pretrained(str(hf_dir), attn_implementation="eager"
                                                ).float().to(device).eval()
    model.eval()
    vocab_size, T = model.config.vocab_size, min(model.config.block_size, 64)
    idx = torch.randint(0, vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    if vocab_size == GPT2_VOCAB:
        text = GPT2Tokenizer().encode_ordinary(VERIFY_TEXT)
        idx[0] = torch.tensor((text * (T // len(text) + 1))[:T])
    idx = idx.to(device)
    expected = reference(idx).logits.float()  # (B, T, vocab)
    ours, _ = model.to(device)(idx)
    diff, scale = (ours.float() - expected).abs().max().item(), expected.abs().max().item()
    limit = tolerance * max(1.0, scale)
    print(f"verify: max |logit difference| ours vs transformers GPT2LMHeadModel = {diff:.2e} "
          f"over {idx.numel()} tokens (max |logit| {scale:.1f}, limit {limit:.1e}, "
          f"attention={model.config.attention})")
    if not diff <= limit:
        raise VerificationError(f"logits differ by {diff:.3e} > {limit:.1e}: the weights are "
                                "mapped wrongly or the architectures disagree")
    return diff


def import_checkpoint(model: GPT, source: str, hf_dir: Path, out: str | Path) -> Path:
    """Save a loaded GPT-2 as one of our (weights-only) checkpoints: OUT/ckpt_0000000."""
    cfg = Config()
    cfg.model, cfg.data.dataset = model.config, ""
    cfg.train.out_dir, cfg.train.init_from = str(out), source
    meta = {"source": f"{source} ({hf_dir})", "losses": {}, "tokens_seen": 0,
            "tokenizer": tokenizer_meta(model.config.vocab_size, hf_dir)}
    return saving.save(out, 0, model, cfg, meta, out_flag="--out")


def describe(model: GPT) -> str:
    cfg, full = model.config, source_context(model)
    padded = f" padded to {model.padded_vocab}" if model.padded_vocab != cfg.vocab_size else ""
    context = f"{cfg.block_size}" if full == cfg.block_size else (
        f"{full} (trained at {cfg.block_size}; positions {cfg.block_size}-{full - 1} are its "
        "source's)")
    params = model.num_params(non_embedding=False) + (full - cfg.block_size) * cfg.n_embd
    return (f"{cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {context}, "
            f"vocab {cfg.vocab_size}{padded}; {params / 1e6:.2f}M parameters")
