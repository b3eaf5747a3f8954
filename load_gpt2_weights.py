"""Hugging Face GPT-2 <-> our GPT: load OpenAI's published weights, check them against
transformers, and export our checkpoints in the Hugging Face format.

    python load_gpt2_weights.py gpt2 --out out/gpt2 --verify             # hub -> our checkpoint
    python load_gpt2_weights.py path/to/hf_dir --verify                  # check a local HF dir
    python load_gpt2_weights.py --export out/run --out hf/run --verify   # ours -> HF directory

Sources: gpt2, gpt2-medium, gpt2-large, gpt2-xl (or hf:ORG/NAME for another GPT-2 on the hub),
fetched with huggingface_hub, or a local directory holding config.json and model.safetensors (or
pytorch_model.bin, read with torch.load(weights_only=True)).

Our parameter names are GPT-2's, so the name map is one to one. The differences: HF stores the
four projection matrices as Conv1D, (in, out), where nn.Linear holds (out, in), so they are
transposed; older HF files carry the causal mask as buffers (attn.bias, attn.masked_bias), which
are dropped; the LM head is tied to wte on both sides. A padded vocabulary (vocab_pad_multiple)
gets zero rows after the real ones; the model slices its logits to the real vocabulary, so those
rows never reach the loss or the sampler.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine import checkpoint
from config import Config, ModelConfig
from model import GPT
from engine.tokenizer import GPT2_EOT, GPT2_RANKS, GPT2_RANKS_SHA256, GPT2Tokenizer

GPT2_MODEL_IDS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
HUB_PREFIX = "hf:"
HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json",
             "model-*.safetensors"]
GPT2_VOCAB = 50257
BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
VERIFY_TEXT = ("Hello, I'm a language model, and I can tell you that the weights were mapped "
               "correctly when the logits agree to the last few digits.")


class GPT2WeightsError(checkpoint.CheckpointError):
    """A GPT-2 source that cannot be found, read or mapped onto our model."""


class VerificationError(GPT2WeightsError):
    """Our logits and transformers' differ by more than the tolerance."""


def hub_repo(source: str) -> str | None:
    """The hub repository a source names, or None when it is not a hub id."""
    if source in GPT2_MODEL_IDS:
        return GPT2_MODEL_IDS[source]
    if source in GPT2_MODEL_IDS.values():
        return source
    if source.startswith(HUB_PREFIX):
        return source[len(HUB_PREFIX):]
    return None


def is_hf_dir(path: str | Path) -> bool:
    """A directory whose config.json is a Hugging Face one (ours has sections, not model_type)."""
    config = Path(path) / "config.json"
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError, TypeError):
        return False


def is_gpt2_source(source: str) -> bool:
    """True for a local HF directory, a hub id, or a near miss of a GPT-2 id (so that the
    error suggests the right name instead of 'no checkpoint')."""
    if is_hf_dir(source) or hub_repo(source) is not None:
        return True
    return not Path(source).exists() and bool(difflib.get_close_matches(
        source, list(GPT2_MODEL_IDS), n=1, cutoff=0.75))


def fetch(source: str) -> Path:
    """A local directory holding the source's config.json and weights (downloaded for a hub id,
    or found in the local hub cache)."""
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
    from huggingface_hub import snapshot_download
    try:
        local = Path(snapshot_download(repo, allow_patterns=HUB_FILES))
        if not any(local.glob("*.safetensors")):  # an older repository: PyTorch pickle only
            local = Path(snapshot_download(repo, allow_patterns=["config.json",
                                                                 "pytorch_model.bin"]))
    except Exception as e:  # no network, unknown or gated repository, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GPT2WeightsError(f"could not fetch {repo} from the Hugging Face hub "
                               f"({type(e).__name__}: {first}); without a network, copy a model "
                               "directory (config.json + model.safetensors) to this machine and "
                               "pass its path instead") from None
    return local


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a HF GPT-2, checked for anything our architecture cannot represent."""
    try:
        hf = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise GPT2WeightsError(f"{hf_dir}/config.json is unreadable ({e})") from None
    problems = []
    if hf.get("model_type") != "gpt2":
        problems.append(f"model_type={hf.get('model_type')!r} (only 'gpt2' maps onto our model)")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
               if not isinstance(hf.get(k), int)]
    if missing:
        problems.append(f"no integer {', '.join(missing)}")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        problems.append(f"activation_function={act!r} (ours is GPT-2's tanh GELU, gelu_new)")
    if hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 0)):
        problems.append(f"n_inner={hf['n_inner']} (ours is 4 * n_embd)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        problems.append("attention scaling other than 1/sqrt(head size)")
    if hf.get("add_cross_attention"):
        problems.append("cross-attention layers")
    if problems:
        raise GPT2WeightsError(f"{hf_dir}/config.json describes a model ours cannot represent: "
                               + "; ".join(problems))
    return hf


def apply_hf_config(model_cfg: ModelConfig, hf: dict) -> ModelConfig:
    """Set model_cfg's shape from a HF GPT-2 config, in place. Implementation switches, dropout
    and vocab padding stay as the caller set them."""
    model_cfg.n_layer, model_cfg.n_head = hf["n_layer"], hf["n_head"]
    model_cfg.n_embd = hf["n_embd"]
    model_cfg.block_size = hf["n_positions"]
    model_cfg.vocab_size = hf["vocab_size"]
    model_cfg.layer_norm_eps = float(hf.get("layer_norm_epsilon", 1e-5))
    model_cfg.bias = True  # GPT-2 has biases everywhere
    return model_cfg


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model directory: model.safetensors, sharded safetensors, or
    pytorch_model.bin (through the weights-only unpickler)."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    pickled = hf_dir / "pytorch_model.bin"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(str(hf_dir / shard)))
            return state
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise GPT2WeightsError(f"weights in {hf_dir} are unreadable ({e}); the download is "
                               "truncated or corrupt: fetch them again") from None
    if pickled.is_file():
        try:
            return torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as e:  # the weights-only unpickler refuses code objects
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise GPT2WeightsError(f"refusing to load {pickled}: {type(e).__name__}: {first} "
                                   "(only tensors are accepted; use model.safetensors)") from None
    raise GPT2WeightsError(f"{hf_dir} holds no weights: expected model.safetensors (or "
                           "model.safetensors.index.json with its shards) or pytorch_model.bin")


def name_map(n_layer: int) -> dict[str, str]:
    """HF GPT-2 tensor name (without the 'transformer.' prefix) -> our state-dict name."""
    names = {n: f"transformer.{n}" for n in ("wte.weight", "wpe.weight", "ln_f.weight",
                                             "ln_f.bias")}
    for i in range(n_layer):
        for p in BLOCK_PARAMS:
            names[f"h.{i}.{p}"] = f"transformer.h.{i}.{p}"
    return names


def is_conv1d(hf_name: str) -> bool:
    return hf_name.endswith(CONV1D)


def _hf_shape(ours: torch.Tensor, hf_name: str, vocab_size: int) -> tuple[int, ...]:
    """The shape a HF file stores for one of our tensors."""
    shape = tuple(ours.shape)
    if hf_name == "wte.weight":
        shape = (vocab_size, shape[1])  # HF has no padded rows
    return shape[::-1] if is_conv1d(hf_name) else shape


def _mapping_error(source: str, missing: list, unexpected: list, shapes: list,
                   head_note: str) -> GPT2WeightsError:
    parts = checkpoint.mismatch_parts(missing, unexpected, shapes)
    if head_note:
        parts.append(head_note)
    return GPT2WeightsError(f"weights in {source} do not match its config.json ("
                            + "; ".join(parts) + "); the directory is not a complete GPT-2 "
                            "GPT2LMHeadModel: re-download or re-export it")


def hf_to_ours(hf_state: dict[str, torch.Tensor], model: GPT,
               source: str) -> dict[str, torch.Tensor]:
    """Our state dict from HF GPT-2 tensors, checked name by name and shape by shape: every
    missing, unexpected and mis-shaped tensor is listed in one error."""
    cfg = model.config
    names, own = name_map(cfg.n_layer), model.state_dict()
    state: dict[str, torch.Tensor] = {}
    unexpected, shapes, seen, head = [], [], set(), None
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            head = tensor
            continue
        if MASK_BUFFER.fullmatch(name):
            continue  # causal-mask buffers of older transformers versions
        if name not in names:
            unexpected.append(key)
            continue
        seen.add(name)
        expected = _hf_shape(own[names[name]], name, cfg.vocab_size)
        if tuple(tensor.shape) != expected:
            shapes.append(f"{key}: file {tuple(tensor.shape)} vs config {expected}")
            continue
        state[names[name]] = tensor.t() if is_conv1d(name) else tensor
    missing = sorted(set(names) - seen)
    wte = state.get("transformer.wte.weight")
    head_note = ""
    if head is not None and wte is not None and not torch.equal(head, wte):
        head_note = ("lm_head.weight differs from wte.weight, but our LM head is tied to the "
                     "token embedding as in GPT-2")
    if missing or unexpected or shapes or head_note:
        raise _mapping_error(source, missing, sorted(unexpected), sorted(shapes), head_note)
    extra = model.padded_vocab - cfg.vocab_size
    if extra:  # padded rows: zero, and sliced off the logits by the model
        state["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(extra, wte.size(1))])
    return state


def load_hf(source: str, model_cfg: ModelConfig | None = None) -> tuple[GPT, Path]:
    """Our GPT holding a HF GPT-2's weights, at the source's full context; returns the model and
    the local directory read. The shape fields of model_cfg (default: a fresh ModelConfig) are
    set from the HF config in place; its implementation switches are kept."""
    hf_dir = fetch(source)
    model_cfg = apply_hf_config(model_cfg if model_cfg is not None else ModelConfig(),
                                read_hf_config(hf_dir))
    model = GPT(model_cfg)
    state = hf_to_ours(read_hf_weights(hf_dir), model, str(hf_dir))
    checkpoint.load_state(model, state, str(hf_dir))  # copies, re-checking against our names
    return model, hf_dir


def tokenizer_meta(vocab_size: int) -> dict:
    """The tokenizer metadata for a HF GPT-2: GPT-2's BPE when the vocabulary is GPT-2's."""
    return {"kind": "gpt2"} if vocab_size == GPT2_VOCAB else {"kind": "unknown",
                                                                "vocab_size": vocab_size}


def ours_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel tensors from our model: the real vocabulary rows only, Conv1D matrices
    transposed, zero biases where ours has none; the tied head is left for HF to tie."""
    own = model.state_dict()
    out = {}
    for hf_name, ours in name_map(model.config.n_layer).items():
        if ours in own:
            tensor = own[ours].detach().cpu()
        else:  # bias=False: GPT-2 always has biases, and zero ones change nothing
            owner = own[ours.removesuffix(".bias") + ".weight"]
            tensor = torch.zeros(owner.shape[0], dtype=owner.dtype)
        if hf_name == "wte.weight":
            tensor = tensor[:model.config.vocab_size]
        if is_conv1d(hf_name):
            tensor = tensor.t()
        out[f"transformer.{hf_name}"] = tensor.contiguous().clone()
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for GPT2LMHeadModel describing our model."""
    eot = GPT2_EOT if cfg.vocab_size == GPT2_VOCAB else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "bos_token_id": eot,
        "eos_token_id": eot, "torch_dtype": "float32",
    }


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character map, the alphabet of vocab.json and merges.txt:
    printable Latin-1 bytes stand for themselves, the others for chr(256), chr(257), ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that creates each multi-byte token, in rank order: BPE over the token's own
    bytes, using only merges ranked before it, ends in exactly the two parts it was made from."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                raise GPT2WeightsError(f"cannot derive the merge for token rank {rank}")
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def hf_tokenizer_files(model_max_length: int) -> dict[str, bytes]:
    """GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer_config.json), derived from the
    bundled ranks, so AutoTokenizer and pipelines work on the export with no download."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(GPT2_RANKS), expected_hash=GPT2_RANKS_SHA256)
    alphabet = bytes_to_unicode()
    text = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab["<|endoftext|>"] = GPT2_EOT
    merges = "".join(f"{text(a)} {text(b)}\n" for a, b in bpe_merges(ranks))
    eot = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": eot, "eos_token": eot,
              "unk_token": eot, "add_prefix_space": False, "model_max_length": model_max_length}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False).encode(),
            "merges.txt": ("#version: 0.2\n" + merges).encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def write_hf_dir(model: GPT, out: Path, gpt2_tokenizer: bool) -> list[str]:
    """A directory AutoModelForCausalLM.from_pretrained loads: config.json + model.safetensors,
    and GPT-2's tokenizer files when the model uses GPT-2's BPE. All are written into a hidden
    directory and moved into place once complete, so a failure (a full disk) leaves out as it
    was: a new out is renamed into place whole, an existing one gets each file replaced."""
    out = Path(out)
    checkpoint.check_out_dir(out, "--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = ours_to_hf(model)
    files = {"config.json": json.dumps(hf_config(model.config), indent=2).encode()}
    if gpt2_tokenizer:
        files.update(hf_tokenizer_files(model.config.block_size))
    needed = checkpoint.bytes_to_write(tensors, *files.values())
    staging = out if out.is_dir() else out.parent  # the same filesystem: renames work
    with checkpoint.staging_dir(staging, ".tmp_export_", f"Hugging Face export {out}", needed,
                                "--out") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        checkpoint.umask_mode(tmp / "model.safetensors")
        for name, payload in files.items():
            (tmp / name).write_bytes(payload)
        checkpoint.sync_files(tmp)
        if out.is_dir():
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.rename(tmp, out)
        checkpoint.sync_dir(staging)
    return ["config.json", "model.safetensors", *list(files)[1:]]


def export_hf(ckpt_path: str | Path, out: str | Path) -> tuple[GPT, Path, list[str]]:
    """One of our checkpoints (or a run directory's latest) -> a HF GPT-2 directory."""
    model, _, meta = checkpoint.load_model(ckpt_path)
    gpt2_bpe = meta.get("tokenizer", {}).get("kind") == "gpt2"
    return model, Path(out), write_hf_dir(model, Path(out), gpt2_bpe)


def verify_tokens(vocab_size: int, block_size: int) -> torch.Tensor:
    """(2, T) ids: a sentence in GPT-2 BPE when the vocabulary is GPT-2's, and seeded random
    ids, T = min(block_size, 64)."""
    T = min(block_size, 64)
    ids = torch.randint(0, vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    if vocab_size == GPT2_VOCAB:
        text = GPT2Tokenizer().encode_ordinary(VERIFY_TEXT)
        ids[0] = torch.tensor((text * (T // len(text) + 1))[:T])
    return ids


@torch.no_grad()
def verify(model: GPT, hf_dir: Path, tolerance: float = 1e-4, device: str = "cpu") -> float:
    """Max |logit difference| between our model and transformers' GPT2LMHeadModel (eager
    attention, float32) loaded from hf_dir, on the same tokens. Raises VerificationError when
    it exceeds tolerance * max(1, max |logit|)."""
    from transformers import GPT2LMHeadModel

    reference = GPT2LMHeadModel.from_pretrained(str(hf_dir), attn_implementation="eager")
    reference = reference.float().to(device).eval()
    was_training = model.training
    model.eval()
    idx = verify_tokens(model.config.vocab_size, model.config.block_size).to(device)
    expected = reference(idx).logits.float()  # (B, T, vocab)
    ours, _ = model.to(device)(idx)
    model.train(was_training)
    diff = (ours.float() - expected).abs().max().item()
    scale = expected.abs().max().item()
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
    cfg.model = model.config
    cfg.data.dataset = ""
    cfg.train.out_dir, cfg.train.init_from = str(out), source
    meta = {"source": f"{source} ({hf_dir})", "tokenizer": tokenizer_meta(model.config.vocab_size),
            "losses": {}, "tokens_seen": 0}
    return checkpoint.save(out, 0, model, cfg, meta, out_flag="--out")


def describe(model: GPT) -> str:
    cfg = model.config
    padded = f" padded to {model.padded_vocab}" if model.padded_vocab != cfg.vocab_size else ""
    return (f"{cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context "
            f"{cfg.block_size}, vocab {cfg.vocab_size}{padded}; "
            f"{model.num_params(non_embedding=False) / 1e6:.2f}M parameters")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="load_gpt2_weights.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    parser.add_argument("source", nargs="?", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | "
                        "hf:ORG/NAME | a local Hugging Face directory")
    parser.add_argument("--out", help="import: run directory for our checkpoint (written as "
                        "OUT/ckpt_0000000); with --export: the Hugging Face directory to write")
    parser.add_argument("--export", metavar="CKPT", help="export one of our checkpoints (or a "
                        "run directory's latest) as a Hugging Face GPT-2 directory")
    parser.add_argument("--verify", action="store_true", help="compare our logits with "
                        "transformers' GPT2LMHeadModel on the same tokens; fail above tolerance")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="allowed max |logit "
                        "difference| relative to max(1, max |logit|) (default 1e-4, float32)")
    parser.add_argument("--vocab-pad-multiple", type=int, default=1, help="pad the vocabulary "
                        "rows to a multiple of this (64: 50257 -> 50304)")
    parser.add_argument("--attention", default="scratch", choices=("scratch", "sdpa"),
                        help="our attention implementation for --verify and the stored config")
    parser.add_argument("--device", default="cpu", help="device for --verify (cpu, cuda, ...)")
    args = parser.parse_args(argv)
    if bool(args.source) == bool(args.export):
        parser.error("give a SOURCE to import, or --export CKPT --out DIR (not both)")
    if args.export and not args.out:
        parser.error("--export needs --out HF_DIR")
    if args.source and not (args.out or args.verify):
        parser.error("nothing to do: add --out DIR to write our checkpoint and/or --verify")
    if args.vocab_pad_multiple < 1:
        parser.error("--vocab-pad-multiple must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out:  # a file there: say so before loading anything
            checkpoint.check_out_dir(args.out, "--out")
        if args.export:
            model, out, files = export_hf(args.export, args.out)
            print(f"exported {checkpoint.resolve(args.export)} ({describe(model)}) to {out}: "
                  + ", ".join(files))
            hf_dir = out
        else:
            base = ModelConfig(vocab_pad_multiple=args.vocab_pad_multiple, attention=args.attention)
            model, hf_dir = load_hf(args.source, base)
            print(f"loaded {args.source} from {hf_dir}: {describe(model)}")
        if args.verify:  # before writing a checkpoint, so a failed import leaves nothing behind
            verify(model, hf_dir, args.tolerance, args.device)
        if args.source and args.out:
            print(f"wrote {import_checkpoint(model.cpu(), args.source, hf_dir, args.out)}")
    except VerificationError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
