"""generate.py --chat: a conversation with a checkpoint finetuned on instruction data, through the
chat template it was trained with (data/chat_template.py), each reply streamed and ended at the
template's end-of-text token.

    python generate.py --chat                                 # on a terminal: you type, it answers
    python generate.py --chat --prompt "Reverse the word: night"      # one turn, then exit
    printf 'Hi\\nAnd then?\\n' | python generate.py --chat              # a turn per line of stdin

On a terminal, /reset starts a new conversation and /exit (or Ctrl-D) leaves. A conversation
that no longer fits the context loses its oldest turns, whole (a system message stays).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from config import ConfigError
from data.chat_template import ChatTemplate, TemplateError, from_meta
from engine.inference.sampling import StreamPrinter


def template_of(meta: dict, label: str) -> ChatTemplate:
    """The checkpoint's chat template; TemplateError (one line) when it has none."""
    if "template" not in meta:
        raise TemplateError(f"{label} has no chat template (its meta.json has no \"template\"): "
                            "finetune it on instruction data (train.py with a .json/.jsonl "
                            "--dataset, docs/finetuning.md) or sample without --chat")
    return from_meta(meta["template"])


@dataclass
class Chat:
    """A conversation: its messages and how replies are sampled."""

    model: torch.nn.Module
    tokenizer: object
    template: ChatTemplate
    sample: Callable  # sample(idx, max_new_tokens, stop_ids, on_token) -> ids (1, T + new)
    max_new_tokens: int
    system: str = ""
    messages: list[dict] = field(default_factory=list)
    notes: Callable[[str], None] = lambda text: print(text, file=sys.stderr)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The conversation's prompt, its oldest turns dropped until it leaves room to answer."""
        block = self.model.config.block_size
        budget = block - min(self.max_new_tokens, block // 2)
        ids = self.template.prompt(self.tokenizer, self.messages)
        dropped = 0
        while len(ids) > budget:
            first = 1 if self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:  # only the new message is left
                raise TemplateError(f"the message takes {len(ids)} tokens with the template, "
                                    f"more than the {budget} this model's context of {block} "
                                    "leaves for it; send a shorter one")
            del self.messages[first]  # a user's message, and the reply to it
            dropped += 1
            if len(self.messages) - first > 1 and self.messages[first]["role"] == "assistant":
                del self.messages[first]
                dropped += 1
            ids = self.template.prompt(self.tokenizer, self.messages)
        if dropped:
            self.notes(f"note: the conversation outgrew the context ({block} tokens): its "
                       f"{dropped} oldest message(s) were dropped")
        return ids

    def reply(self, text: str, write: Callable[[str], None]) -> str:
        """Answer the user's text, streaming the reply through write; the reply."""
        if not self.messages and self.system:
            self.reset()
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
        except TemplateError:
            self.messages.pop()
            raise
        end = self.template.end_id(self.tokenizer)
        printer = StreamPrinter(self.tokenizer, write, end)
        self.sample(torch.tensor([ids]), self.max_new_tokens, {end}, printer)
        answer = printer.finish()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def converse(chat: Chat, lines: Iterable[str], write: Callable[[str], None],
             prompt: Callable[[], None] = lambda: None) -> None:
    """A turn per line: /reset, /exit, or a message answered; prompt() before each line."""
    chat.reset()
    prompt()
    for line in lines:
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            return
        if text.strip() == "/reset":
            chat.reset()
            chat.notes("(a new conversation)")
        elif text.strip():
            try:
                chat.reply(text, write)
                write("\n")
            except TemplateError as e:
                chat.notes(f"error: {e}")
        prompt()


def terminal_lines() -> Iterable[str]:
    """Lines typed at the terminal (input() with line editing), until Ctrl-D or Ctrl-C."""
    while True:
        try:
            yield input()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def run_chat(model: torch.nn.Module, meta: dict, label: str, tokenizer, sample: Callable,
             max_new_tokens: int, prompt: str, system: str) -> None:
    """generate.py --chat: one turn from prompt, else a conversation (terminal or stdin lines).
    ConfigError for a checkpoint without a template, or a message that cannot fit."""
    try:
        chat = Chat(model, tokenizer, template_of(meta, label), sample, max_new_tokens, system)
    except TemplateError as e:
        raise ConfigError(str(e)) from None

    def write(text: str) -> None:
        print(text, end="", flush=True)

    if prompt not in ("", "\n"):  # one turn
        chat.reset()
        try:
            chat.reply(prompt, write)
        except TemplateError as e:
            raise ConfigError(str(e)) from None
        print()
    elif sys.stdin.isatty():
        print(f"chatting with {label}: /reset starts over, /exit or Ctrl-D leaves",
              file=sys.stderr)
        converse(chat, terminal_lines(), write,
                 prompt=lambda: print("you> ", end="", file=sys.stderr, flush=True))
    else:  # a turn per line of stdin, one conversation
        converse(chat, sys.stdin, write)
