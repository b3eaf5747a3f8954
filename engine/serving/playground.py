"""serve.py's playground page at GET /: engine/serving/playground.html (package data) filled in for
this server, served with a strict Content-Security-Policy.

    page = Playground(model="tiny", key_required=True, max_tokens_limit=1024, chat=True)
    page.response()    # text/html; the CSP allows the page's own <style> and <script> by hash

The page holds no secret: the API key is typed into it and sent by the browser, so GET / stays
open like /health while every /v1 request it makes still needs the key.
"""
from __future__ import annotations

import base64
import hashlib
import html
import re
from importlib import resources

from fastapi.responses import HTMLResponse

PAGE = "playground.html"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)  # a tag named in a comment is no block
INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def source_hash(text: str) -> str:
    """A CSP source for exactly this inline <script> or <style> text."""
    digest = hashlib.sha256(text.encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def content_security_policy(page: str) -> str:
    """Nothing from elsewhere, no eval, no inline code but the page's own blocks; requests to
    this server only."""
    blocks = {"script": [], "style": []}
    for kind, text in INLINE.findall(COMMENT.sub("", page)):
        blocks[kind].append(source_hash(text))
    if not blocks["script"] or not blocks["style"]:
        raise ValueError(f"{PAGE} must have an inline <script> and <style> (the CSP hashes them)")
    return "; ".join([
        "default-src 'none'", f"script-src {' '.join(blocks['script'])}",
        f"style-src {' '.join(blocks['style'])}", "connect-src 'self'", "img-src data:",
        "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])


class Playground:
    """The page for one server, rendered once: its model name, whether /v1 asks for a key (the
    page then shows the key field), the largest max_tokens, and whether the model has a chat
    template (the page then opens on its conversation view)."""

    def __init__(self, model: str, key_required: bool, max_tokens_limit: int,
                 chat: bool = False):
        template = (resources.files("engine.serving") / PAGE).read_text(encoding="utf-8")
        values = {"model": model, "key_required": "true" if key_required else "false",
                  "max_tokens_limit": str(max_tokens_limit), "chat": "true" if chat else "false"}
        # the placeholders are in the body's attributes only, never in the hashed blocks
        self.page = PLACEHOLDER.sub(lambda m: html.escape(values[m[1]]), template)
        self.headers = {"Content-Security-Policy": content_security_policy(self.page),
                        "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                        "Cache-Control": "no-cache"}

    def response(self) -> HTMLResponse:
        return HTMLResponse(self.page, headers=self.headers)
