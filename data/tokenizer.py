"""Character-level, GPT-2's BPE and byte-level BPEs trained here (data/train_tokenizer.py) behind
one interface, chosen by a dataset's metadata. GPT-2's ranks ship in data/gpt2.tiktoken
(hash-checked), so no network is needed; a trained BPE travels whole in the metadata.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

GPT2_RANKS = Path(__file__).resolve().parent / "gpt2.tiktoken"
# tiktoken's expected sha256 for r50k_base (the GPT-2 ranks)
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
GPT2_EOT = 50256
EOT_TEXT = "<|endoftext|>"
DATA_FIX = "prepare the data again from the tokenizer's folder"  # an edited dataset's tokenizer


class TokenizerError(ValueError):
    """Text or metadata the tokenizer cannot handle."""


class CharTokenizer:
    """One token per character of a fixed alphabet; with eot, one more id after them: the
    end-of-text token (<|endoftext|>) a chat template ends turns with (data/chat_template.py)."""

    kind = "char"

    def __init__(self, chars: list[str], eot: bool = False):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + eot
        if eot:
            self.eot_id = len(self.chars)
        # generation from an empty prompt starts at a newline, the char corpus' natural boundary
        self.start_id = self.stoi.get("\n", 0)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            shown = ", ".join(repr(c) for c in unknown[:10])
            raise TokenizerError(f"text has {len(unknown)} character(s) outside this "
                                 f"{self.vocab_size}-character vocabulary: {shown}; "
                                 "use only characters that appear in the training data")
        return [self.stoi[c] for c in text]

    encode_ordinary = encode  # no special tokens here

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else EOT_TEXT for i in ids)

    def with_eot(self) -> "CharTokenizer":
        """This alphabet with the end-of-text token after it."""
        return CharTokenizer(self.chars, eot=True)

    def meta(self) -> dict:
        return {"kind": self.kind, "chars": self.chars,
                **({"eot": True} if hasattr(self, "eot_id") else {})}


def load_ranks(path: Path) -> dict[bytes, int]:
    """A .tiktoken ranks file, sha256-checked (tiktoken's loader caches by path: a changed file
    would go unseen)."""
    if not path.is_file():
        raise TokenizerError(f"GPT-2 BPE ranks not found at {path}; they ship with the "
                             "repository as data/gpt2.tiktoken")
    contents = path.read_bytes()
    digest = hashlib.sha256(contents).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise TokenizerError(f"{path} failed its hash check (sha256 {digest}, expected "
                             f"{GPT2_RANKS_SHA256}); restore the file from the repository")
    return {base64.b64decode(token): int(rank)
            for token, rank in (line.split() for line in contents.splitlines() if line)}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE through tiktoken, loaded from the bundled ranks file."""

    kind = "gpt2"

    def __init__(self, ranks_path: Path = GPT2_RANKS):
        self.use(load_ranks(Path(ranks_path)), GPT2_PATTERN, [EOT_TEXT], "gpt2_offline")

    def use(self, ranks: dict[bytes, int], pattern: str, special: list[str], name: str) -> None:
        """tiktoken's Encoding of these ranks, its special tokens numbered after them."""
        import tiktoken

        self.special_ids = {s: len(ranks) + i for i, s in enumerate(special)}  # GPT-2's: 50256
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=self.special_ids)
        self.vocab_size, self.eot_id = self.enc.n_vocab, self.special_ids[EOT_TEXT]
        self.start_id = self.eot_id
        # tiktoken's own encode_ordinary(text), decode(ids) -> str, decode_bytes(ids) -> bytes
        self.encode_ordinary, self.decode = self.enc.encode_ordinary, self.enc.decode
        self.decode_bytes = self.enc.decode_bytes

    def encode(self, text: str) -> list[int]:
        """The ids of `text`; a special token's literal text (<|endoftext|>) becomes the token."""
        return self.enc.encode(text, allowed_special="all")

    def with_eot(self) -> "GPT2Tokenizer":
        return self  # <|endoftext|> is one of its special tokens

    def meta(self) -> dict:
        return {"kind": self.kind}


def ranks_text(tokens: list[bytes]) -> str:
    """tiktoken's .tiktoken format: one 'base64(token) rank' line per token."""
    return "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens))


class BPETokenizer(GPT2Tokenizer):
    """A byte-level BPE trained here: ranks (the 256 single bytes first, so any text
    round-trips), a split pattern, and special tokens after the ranks, <|endoftext|> first. Its
    sha256 covers all three; meta() carries it whole, so datasets and checkpoints need no file."""

    kind = "bpe"

    def __init__(self, tokens: list[bytes], pattern: str, special: list[str], name: str = ""):
        if tokens[:256] != [bytes([b]) for b in range(256)]:
            raise TokenizerError("a byte-level BPE's first 256 ranks must be the single bytes")
        self.special = [EOT_TEXT] + [s for s in special if s != EOT_TEXT]
        self.tokens, self.pattern, self.name = tokens, pattern, name
        self.use({t: i for i, t in enumerate(tokens)}, pattern, self.special, f"bpe_{name}")
        digest = hashlib.sha256(ranks_text(tokens).encode())
        digest.update(json.dumps({"pattern": pattern, "special": self.special}).encode())
        self.sha256 = digest.hexdigest()

    def meta(self) -> dict:
        return {"kind": self.kind, "name": self.name, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "pattern": self.pattern, "special": self.special,
                "ranks": [base64.b64encode(t).decode() for t in self.tokens]}

    @classmethod
    def from_meta(cls, meta: dict, fix: str = DATA_FIX) -> "BPETokenizer":
        """The tokenizer a meta.json carries, checked against its sha256 (`fix` ends the error)."""
        try:
            tok = cls([base64.b64decode(t) for t in meta["ranks"]], meta["pattern"],
                      list(meta["special"]), meta.get("name", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise TokenizerError(f"the BPE tokenizer in this metadata is malformed ({e!r}); "
                                 f"{fix}") from None
        if tok.sha256 != meta.get("sha256"):
            raise TokenizerError(f"the BPE tokenizer '{tok.name}' fails its hash check (sha256 "
                                 f"{tok.sha256[:12]}, recorded {str(meta.get('sha256'))[:12]}): "
                                 f"its metadata was edited; {fix}")
        return tok


Tokenizer = CharTokenizer | GPT2Tokenizer | BPETokenizer


def from_meta(meta: dict) -> Tokenizer:
    """Build the tokenizer a dataset (or checkpoint) was made with from its metadata."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"], eot=bool(meta.get("eot")))
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        return BPETokenizer.from_meta(meta)
    raise TokenizerError(f"unknown tokenizer kind {kind!r} in metadata; expected 'char', 'gpt2' "
                         "or 'bpe'")
