"""The data package: text to tokens (tokenizer.py, bpe.py), datasets prepared and read
(dataset.py), batches (loader.py). What follows is shared by every tokenizer."""

EOT_TEXT = "<|endoftext|>"
GPT2_EOT = 50256  # GPT-2's <|endoftext|> id, its last: 50,257 tokens


class TokenizerError(ValueError):
    """Text or metadata the tokenizer cannot handle."""
