"""serve.py's chat API, POST /v1/chat/completions: its request, the conversation made into prompt
ids by the served model's chat template (data/chat_template.py), and OpenAI's chat shapes. app.py
runs a chat request as a completion of those ids whose replies end at the template's end-of-turn
token, and answers it in these shapes.

    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=32)
    ids = prompt_ids(body.messages, template, tokenizer, max_prompt_tokens=1024)  # ChatError: 400
    body.completion_fields(len(ids), block_size=1024, max_tokens_limit=1024)  # what it runs as
    choice(0, "hello", None, "stop", streamed=False)   # {"index", "message", "logprobs", ...}

A message's content is a string, or OpenAI's list of parts of which only text parts are taken
({"type": "text", "text": ...}, joined by newlines, as vLLM joins them).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from data.chat_template import ChatTemplate, TemplateError, check_messages
from data.tokenizer import TokenizerError
from engine.serving.batching import Sampling
from engine.serving.logprobs import MAX_LOGPROBS


class ChatError(ValueError):
    """A chat request the server cannot run (a 400), and the field to change."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


def no_template(model: str) -> str:
    return (f"the model {model!r} has no chat template (its checkpoint's meta.json has no "
            "\"template\"): finetune it on instruction data to give it one, or send the text "
            "as a prompt to POST /v1/completions")


class ChatRequest(Sampling):
    """The body of POST /v1/chat/completions: the sampling fields every request shares
    (batching.Sampling), then the chat's own, with OpenAI's defaults but max_tokens' (below).
    Unknown fields are refused; the penalties and logit_bias are refused as in completions."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[Any]  # checked by check_messages, whose errors say what to fix
    max_completion_tokens: int | None = Field(None, ge=1)  # the reply's most tokens
    max_tokens: int | None = Field(None, ge=1)  # its older name; both None: the context's rest
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[Literal["include_usage"], bool] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def completion_fields(self, prompt_tokens: int, block_size: int,
                          max_tokens_limit: int) -> dict:
        """The fields of the completion this request runs as (app.py's CompletionRequest, its
        prompt the ids): a reply of max_completion_tokens, else max_tokens, else the rest of
        the context (at least 1, at most the server's limit); logprobs with top_logprobs
        alternatives."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ChatError("top_logprobs needs logprobs: true", "top_logprobs")
        rest = min(max_tokens_limit, max(1, block_size - prompt_tokens))
        shared = (*Sampling.model_fields, "model", "n", "stream", "user", "presence_penalty",
                  "frequency_penalty", "logit_bias")  # the sampling fields: all, whatever they are
        return {**{name: getattr(self, name) for name in shared},
                "max_tokens": self.max_completion_tokens or self.max_tokens or rest,
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None}


def text_of(i: int, message: Any) -> Any:
    """A message with its content as one string: the text parts of a list joined by newlines;
    anything else as it came (check_messages says what is wrong with it)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise ChatError(f"messages[{i}].content: only text parts are supported, "
                            f"{{\"type\": \"text\", \"text\": \"...\"}}; got {str(part)[:80]}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def prompt_ids(messages: list, template: ChatTemplate, tokenizer, max_prompt_tokens: int,
               block_size: int | None = None) -> list[int]:
    """The conversation through the template: the ids the model continues to answer it."""
    conversation = [text_of(i, message) for i, message in enumerate(messages)]
    try:
        check_messages(conversation)
        ids = template.prompt(tokenizer, conversation)
    except (TemplateError, TokenizerError) as e:
        raise ChatError(f"messages: {e}") from None
    if len(ids) > max_prompt_tokens:
        context = f" (the model's context is {block_size})" if block_size else ""
        raise ChatError(f"the conversation is {len(ids)} tokens with the chat template but this "
                        f"server takes at most {max_prompt_tokens}{context}; send fewer or "
                        "shorter messages")
    return ids


def opening(j: int) -> dict:
    """Choice j's first streamed chunk: who speaks."""
    return {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}


def choice(j: int, text: str, content: list[dict] | None, reason: str | None,
           streamed: bool) -> dict:
    """Choice j of a streamed chunk (its delta: text since the last) or of the whole answer (its
    message); content: its tokens' logprobs (logprobs.chat_logprobs), None if not asked."""
    shaped = None if content is None else {"content": content}
    if streamed:
        delta = {"content": text} if text or reason is None else {}
        return {"index": j, "delta": delta, "logprobs": shaped, "finish_reason": reason}
    return {"index": j, "message": {"role": "assistant", "content": text}, "logprobs": shaped,
            "finish_reason": reason}


def object_name(streamed: bool) -> str:
    return "chat.completion.chunk" if streamed else "chat.completion"
