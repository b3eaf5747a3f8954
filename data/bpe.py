"""GPT-2's byte-level BPE and the byte-level BPEs trained here (data/train_tokenizer.py),
both through tiktoken. GPT-2's ranks ship in data/gpt2.tiktoken (hash-checked), so no network is
needed; a trained BPE travels whole in the metadata."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from data import EOT_TEXT, TokenizerError

GPT2_RANKS = Path(__file__).resolve().parent / "gpt2.tiktoken"
# tiktoken's expected sha256 for r50k_base (the GPT-2 ranks)
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
DATA_FIX = "prepare the data again from the tokenizer's folder"  # an edited dataset's tokenizer
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


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
