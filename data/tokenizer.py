"""The tokenizer a dataset's metadata names: character-level here, GPT-2's BPE and the
byte-level BPEs trained here (data/train_tokenizer.py) in data/bpe.py, imported only when a
dataset or checkpoint uses one."""
from __future__ import annotations

from typing import TYPE_CHECKING

from data import EOT_TEXT, TokenizerError  # noqa: F401 (TokenizerError: re-exported)

if TYPE_CHECKING:
    from data.bpe import BPETokenizer, GPT2Tokenizer


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



def from_meta(meta: dict) -> CharTokenizer | GPT2Tokenizer | BPETokenizer:
    """Build the tokenizer a dataset (or checkpoint) was made with from its metadata."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"], eot=bool(meta.get("eot")))
    if kind in ("gpt2", "bpe"):
        from data.bpe import BPETokenizer, GPT2Tokenizer
        return GPT2Tokenizer() if kind == "gpt2" else BPETokenizer.from_meta(meta)
    raise TokenizerError(f"unknown tokenizer kind {kind!r} in metadata; expected 'char', 'gpt2' "
                         "or 'bpe'")
