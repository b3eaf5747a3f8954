"""A chat template: how a conversation becomes token ids, and which of them a finetuning loss
counts. An instruction-finetuned checkpoint stores its template (meta.json "template"), so
generate.py --chat and serve.py's /v1/chat/completions format prompts as training did.

    template = ChatTemplate()                                   # the "chat" template
    ids, counted = template.render(tokenizer, messages)         # training: loss on `counted`
    ids = template.prompt(tokenizer, messages)                  # sampling: ends "Assistant: "
    template.end_id(tokenizer)                                  # the token that ends a reply

A conversation is a list of {"role": "system" | "user" | "assistant", "content": str}. Each
message is its role's header, then its content, then the end of its turn: an assistant's ends
with the tokenizer's end-of-text token (<|endoftext|>: GPT-2's own; a character vocabulary gets it
as one more id, data/tokenizer.py), every message with the separator after that:

    System: You answer briefly.\\n
    User: Reverse the word: night\\n
    Assistant: thgin<|endoftext|>\\n

The headers are plain text, so a template needs no new token but the end of text, and a
checkpoint exported to Hugging Face keeps working with the same prompts. The loss counts each
assistant's content and its end-of-text token, nothing else (every_token: all of it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


class TemplateError(ValueError):
    """A conversation or a stored template the chat template cannot use."""


@dataclass(frozen=True)
class ChatTemplate:
    """Headers before each role's messages, and the separator after every message."""

    name: str = "chat"
    system: str = "System: "
    user: str = "User: "
    assistant: str = "Assistant: "
    separator: str = "\n"

    def header(self, role: str) -> str:
        return getattr(self, role)

    def end_id(self, tokenizer) -> int:
        """The token that ends an assistant's turn: the tokenizer's end of text."""
        eot = getattr(tokenizer, "eot_id", None)
        if eot is None:
            raise TemplateError(f"the {tokenizer.kind} tokenizer has no end-of-text token to end "
                                "a turn with; make it with tokenizer.with_eot()")
        return eot

    def render(self, tokenizer, messages: list[dict], every_token: bool = False
               ) -> tuple[list[int], list[bool]]:
        """(ids, counted): the conversation's tokens, and for each whether a finetuning loss
        counts it as a target (the assistants' contents and end-of-text tokens)."""
        check_messages(messages)
        ids: list[int] = []
        counted: list[bool] = []

        def add(pieces: list[int], count: bool) -> None:
            ids.extend(pieces)
            counted.extend([count or every_token] * len(pieces))

        for message in messages:
            role, reply = message["role"], message["role"] == "assistant"
            add(tokenizer.encode_ordinary(self.header(role)), False)
            add(tokenizer.encode_ordinary(message["content"]), reply)
            if reply:
                add([self.end_id(tokenizer)], True)
            add(tokenizer.encode_ordinary(self.separator), False)
        return ids, counted

    def prompt(self, tokenizer, messages: list[dict]) -> list[int]:
        """The ids a model continues to answer the conversation: it, then the assistant's
        header."""
        if messages and messages[-1]["role"] == "assistant":
            raise TemplateError("the conversation ends with an assistant message; the last one "
                                "should be the user's, for the model to answer")
        ids = self.render(tokenizer, messages)[0] if messages else []
        return ids + tokenizer.encode_ordinary(self.assistant)

    def meta(self) -> dict:
        return dataclasses.asdict(self)


TEMPLATES = {"chat": ChatTemplate()}


def from_meta(meta: dict) -> ChatTemplate:
    """The template a checkpoint or prepared data stored."""
    names = {f.name for f in dataclasses.fields(ChatTemplate)}
    if not isinstance(meta, dict) or set(meta) - names or not all(
            isinstance(v, str) for v in meta.values()):
        raise TemplateError(f"the stored chat template {meta!r} is malformed; expected the "
                            f"string fields {', '.join(sorted(names))}")
    return ChatTemplate(**meta)


def check_messages(messages) -> None:
    """A conversation: a non-empty list of {"role", "content"} with a known role each."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list of {\"role\", \"content\"} "
                            "objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise TemplateError(f"messages[{i}] must be an object with \"role\" and "
                                f"\"content\", got {str(message)[:80]}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise TemplateError(f"messages[{i}] has the unknown role {role!r}; the roles are "
                                f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise TemplateError(f"messages[{i}] ({role}) needs \"content\" as a string, got "
                                f"{type(content).__name__}")
