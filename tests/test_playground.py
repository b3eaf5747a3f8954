"""serve.py's playground page at GET /: served open with a strict Content-Security-Policy (httpx),
then driven in headless Chromium like a person would: type a prompt, click Generate, read the
streamed text off the page and compare it with the same greedy request through the API; Stop; a
bad value's error line; with an API key, the key field, the 401 line, then a completion.

For a model with a chat template the page opens on a conversation: a message sent, the reply
streamed into its bubble as the chat API gives it, a second turn after the first, Stop, a new
conversation.

Chromium is driven over its DevTools protocol on a pipe (--remote-debugging-pipe: it reads
commands on its file descriptor 3 and writes replies on 4, each a JSON text ended by a NUL), so
no browser-automation package is needed. Without a chromium binary the browser tests are skipped
(CI installs Debian's chromium: .ci/run). Three server subprocesses per module (test_serve.py's
Server on a tiny checkpoint): one open, one with --api-key, one on a chat model.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from test_serve import WAIT_S, Server, tiny_checkpoint
from test_serve_chat import chat_checkpoint

KEY = "playground-key"
PROMPT = "hello"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--remote-debugging-pipe")


def find_browser() -> str | None:
    found = (shutil.which(name) for name in BROWSERS)
    return next((path for path in found if path), None)


def at_fds_3_and_4(commands: int, replies: int):
    """For preexec_fn: the browser's pipe ends as its fds 3 and 4 (copied above 10 first, so
    neither dup2 can overwrite the other; the copies close at exec)."""
    def in_child() -> None:
        commands_copy = fcntl.fcntl(commands, fcntl.F_DUPFD_CLOEXEC, 10)
        replies_copy = fcntl.fcntl(replies, fcntl.F_DUPFD_CLOEXEC, 10)
        os.dup2(commands_copy, 3)
        os.dup2(replies_copy, 4)
    return in_child


class Browser:
    """Headless Chromium and its DevTools protocol over the pipe: call() sends a command and
    returns its result; events that arrive meanwhile are dropped (nothing here waits on one)."""

    def __init__(self, binary: str, profile: Path, log: Path):
        commands_read, self.commands = os.pipe()
        self.replies, replies_write = os.pipe()
        self.output = log.open("w")
        self.proc = subprocess.Popen(
            [binary, *BROWSER_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.output, stderr=subprocess.STDOUT,
            close_fds=False, preexec_fn=at_fds_3_and_4(commands_read, replies_write))
        os.close(commands_read)
        os.close(replies_write)
        self.log, self.received, self.last_id = log, b"", 0

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self.commands, data):]
        while (reply := self.receive()).get("id") != self.last_id:
            pass
        assert "error" not in reply, f"{method}: {reply['error']}"
        return reply["result"]

    def receive(self) -> dict:
        """The next message, waiting at most WAIT_S for it."""
        deadline = time.monotonic() + WAIT_S
        while b"\0" not in self.received:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.replies], [], [], max(left, 0))
            chunk = os.read(self.replies, 1 << 16) if ready else b""
            assert chunk, f"the browser did not answer:\n{self.log.read_text()[-3000:]}"
            self.received += chunk
        message, self.received = self.received.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=WAIT_S)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self.commands)
            os.close(self.replies)
            self.output.close()


class Tab:
    """One page in the browser, typed into and clicked through the protocol's input events."""

    def __init__(self, browser: Browser, url: str):
        self.browser = browser
        self.target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = browser.call("Target.attachToTarget", targetId=self.target,
                                    flatten=True)["sessionId"]
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.href === {json.dumps(url)} && "
                      "document.readyState === 'complete'")

    def call(self, method: str, **params) -> dict:
        return self.browser.call(method, self.session, **params)

    def evaluate(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in out, f"{expression}: {out['exceptionDetails']}"
        return out["result"].get("value")

    def wait_for(self, expression: str):
        """Polls the expression until it is truthy; its value."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if value := self.evaluate(expression):
                return value
            time.sleep(0.05)
        raise AssertionError(f"never true on the page: {expression}\n{self.text_of('#error')}")

    def text_of(self, selector: str) -> str:
        return self.evaluate(f"document.querySelector({json.dumps(selector)}).textContent")

    def type_into(self, selector: str, text: str) -> None:
        """Empties the field, then types the text into it (input events, as a keyboard)."""
        self.evaluate(f"(e => {{ e.focus(); e.value = ''; }})"
                      f"(document.querySelector({json.dumps(selector)}))")
        self.call("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        """A left click in the middle of the element, scrolled into view first."""
        x, y = self.evaluate(f"(e => {{ e.scrollIntoView(); const r = e.getBoundingClientRect();"
                             f" return [r.x + r.width / 2, r.y + r.height / 2]; }})"
                             f"(document.querySelector({json.dumps(selector)}))")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def close(self) -> None:
        self.browser.call("Target.closeTarget", targetId=self.target)


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("playground_open")
    server = Server(tiny_checkpoint(tmp / "run"), tmp / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("playground_key")
    server = Server(tiny_checkpoint(tmp / "run"), tmp / "serve.log", f"--api-key={KEY}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A model with a chat template: random weights (steps=0), whose replies seldom end."""
    tmp = tmp_path_factory.mktemp("playground_chat")
    server = Server(chat_checkpoint(tmp / "run", steps=0), tmp / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = find_browser()
    if binary is None:
        pytest.skip(f"no Chromium binary on PATH (looked for {', '.join(BROWSERS)}); "
                    "install one, e.g. apt-get install chromium, to run the playground in it")
    tmp = tmp_path_factory.mktemp("chromium")
    chromium = Browser(binary, tmp / "profile", tmp / "chromium.log")
    yield chromium
    chromium.close()


@pytest.fixture
def tab_on(browser):
    """tab_on(server): the playground of that server in a new tab, closed after the test."""
    tabs = []

    def open_tab(server: Server) -> Tab:
        tabs.append(Tab(browser, f"{server.url}/"))
        return tabs[-1]

    yield open_tab
    for tab in tabs:
        tab.close()


def api_completion(server: Server, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers,
                      timeout=WAIT_S)


def generate_on_page(tab: Tab, prompt: str, max_tokens: int, temperature: str = "0") -> str:
    """Types the prompt and controls, clicks Generate, waits until the run ends; its status."""
    tab.type_into("#prompt", prompt)
    tab.type_into("#max-tokens", str(max_tokens))
    tab.type_into("#temperature", temperature)
    tab.evaluate("document.getElementById('status').textContent = ''")  # this run's, not the last
    tab.click("#generate")
    return tab.wait_for("(s => s !== 'generating...' && s)"
                        "(document.getElementById('status').textContent)")


def test_the_page_is_served_without_a_key_with_a_strict_csp(keyed_server):
    r = httpx.get(f"{keyed_server.url}/", timeout=WAIT_S)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["x-content-type-options"] == "nosniff"
    page, csp = r.text, r.headers["content-security-policy"]
    assert 'data-key-required="true"' in page and 'data-model="tiny"' in page
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    for block in ("script", "style"):  # the page's own block by its hash: no other inline code
        text = re.fullmatch(rf"(?s).*<{block}>(.*)</{block}>.*", page)[1]
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert directives[f"{block}-src"] == f"'sha256-{digest}'"
    assert "unsafe" not in csp
    assert not re.search(r"https?:|//[\w-]+\.[a-z]|@import|url\(", page), "an outside URL"
    assert set(re.findall(r"(?:src|href)=\"([^\"]*)\"", page)) == {"data:,"}
    assert httpx.post(f"{keyed_server.url}/v1/completions", json={"prompt": "ab"},
                      timeout=WAIT_S).status_code == 401  # the page is open, /v1 is not


def test_the_page_streams_what_the_api_gives_greedily(open_server, tab_on):
    tab = tab_on(open_server)
    assert tab.evaluate("document.getElementById('key-row').hidden") is True
    assert tab.evaluate("['views', 'chat-view'].map(id => document.getElementById(id).hidden)"
                        ) == [True, True]  # no chat template: the completion view alone
    styled = "getComputedStyle(document.getElementById('error')).color"
    assert tab.evaluate(styled) == "rgb(176, 0, 32)"  # the CSP let the page's <style> in
    status = generate_on_page(tab, PROMPT, 24)
    r = api_completion(open_server, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    expected = r.json()["choices"][0]["text"]
    assert len(expected) == 24  # the char model: one character per token
    assert tab.text_of("#completion") == expected
    assert tab.text_of("#shown-prompt") == PROMPT and tab.text_of("#error") == ""
    assert status == "done: 24 tokens, finish_reason length"


def test_stop_cancels_the_stream_on_the_server(open_server, tab_on):
    tab = tab_on(open_server)
    tab.type_into("#prompt", PROMPT)
    tab.type_into("#max-tokens", "20000")
    tab.click("#generate")
    tab.wait_for("document.getElementById('completion').textContent.length > 0")
    assert tab.text_of("#status") == "generating..."  # text arrives while it still runs
    tab.click("#stop")
    assert tab.wait_for("document.getElementById('status').textContent") == "stopped"
    assert tab.text_of("#error") == ""
    assert tab.evaluate("document.getElementById('generate').disabled") is False
    assert open_server.health(lambda h: h["active"] == 0 and h["queued"] == 0)
    shown = len(tab.text_of("#completion"))
    assert 0 < shown < 20000


def test_a_bad_value_shows_the_servers_error_in_one_line(open_server, tab_on):
    tab = tab_on(open_server)
    assert generate_on_page(tab, PROMPT, 8, temperature="3") == "failed"
    r = api_completion(open_server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 3})
    assert r.status_code == 400
    assert tab.text_of("#error") == f"error 400: {r.json()['error']['message']}"
    assert "\n" not in tab.text_of("#error") and tab.text_of("#completion") == ""


def test_with_a_key_the_field_shows_a_401_line_then_the_key_works(keyed_server, tab_on):
    tab = tab_on(keyed_server)
    visible = "(e => !e.closest('[hidden]') && e.getClientRects().length > 0)" \
              "(document.getElementById('api-key'))"
    assert tab.evaluate(visible) is True
    assert generate_on_page(tab, PROMPT, 12) == "failed"
    error = tab.text_of("#error")
    assert error.startswith("error 401: no API key: send the header 'Authorization: Bearer KEY'")
    tab.type_into("#api-key", KEY)
    assert generate_on_page(tab, PROMPT, 12) == "done: 12 tokens, finish_reason length"
    r = api_completion(keyed_server, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
                       key=KEY)
    assert tab.text_of("#completion") == r.json()["choices"][0]["text"]
    assert tab.text_of("#error") == ""


TURNS = "[...document.querySelectorAll('#conversation .turn')].map(t => [t.className, " \
        "t.textContent])"


def send_on_page(tab: Tab, message: str) -> str:
    """Types the message, clicks Send, waits until the reply ends; the status line."""
    tab.type_into("#message", message)
    tab.evaluate("document.getElementById('status').textContent = ''")
    tab.click("#send")
    return tab.wait_for("(s => s !== 'generating...' && s)"
                        "(document.getElementById('status').textContent)")


def api_chat(server: Server, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=WAIT_S, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["message"]["content"]


def test_a_conversation_streams_each_reply_and_keeps_the_turns(chat_server, tab_on):
    tab = tab_on(chat_server)
    hidden = "['chat-view', 'completion-view', 'output', 'ignore-eos'].map(id => " \
             "document.getElementById(id).getClientRects().length === 0)"
    assert tab.evaluate(hidden) == [False, True, True, True]  # a chat template: the chat view
    tab.type_into("#max-tokens", "12")
    tab.type_into("#temperature", "0")
    assert send_on_page(tab, "hello") == "done: 12 tokens, finish_reason length"
    first = api_chat(chat_server, [{"role": "user", "content": "hello"}], 12)
    assert tab.evaluate(TURNS) == [["turn user", "hello"], ["turn assistant", first]]
    assert tab.text_of("#message") == "" and tab.text_of("#error") == ""
    assert send_on_page(tab, "again") == "done: 12 tokens, finish_reason length"
    second = api_chat(chat_server, [{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": first},
                                    {"role": "user", "content": "again"}], 12)
    assert second != api_chat(chat_server, [{"role": "user", "content": "again"}], 12)
    assert tab.evaluate(TURNS) == [["turn user", "hello"], ["turn assistant", first],
                                   ["turn user", "again"], ["turn assistant", second]]
    tab.click("#show-completion")  # the toggle: the completion view, the turns kept
    assert tab.evaluate(hidden) == [True, False, False, False]
    tab.click("#show-chat")
    assert len(tab.evaluate(TURNS)) == 4


def test_stop_ends_a_reply_and_a_new_conversation_starts_empty(chat_server, tab_on):
    tab = tab_on(chat_server)
    tab.type_into("#max-tokens", "20000")
    tab.type_into("#temperature", "0")
    tab.type_into("#message", "hello")
    tab.click("#send")
    tab.wait_for("document.querySelector('.turn.assistant').textContent.length > 0")
    assert tab.text_of("#status") == "generating..."  # the reply arrives while it runs
    tab.click("#chat-stop")
    assert tab.wait_for("document.getElementById('status').textContent") == "stopped"
    assert chat_server.health(lambda h: h["active"] == 0 and h["queued"] == 0)
    turns = tab.evaluate(TURNS)
    assert [t[0] for t in turns] == ["turn user", "turn assistant"]
    assert 0 < len(turns[1][1]) < 20000 and tab.text_of("#error") == ""
    assert tab.evaluate("document.getElementById('send').disabled") is False
    tab.click("#new-conversation")
    assert tab.evaluate(TURNS) == []
    tab.type_into("#max-tokens", "5")
    assert send_on_page(tab, "hello") == "done: 5 tokens, finish_reason length"
    assert tab.evaluate(TURNS) == [["turn user", "hello"], ["turn assistant", api_chat(
        chat_server, [{"role": "user", "content": "hello"}], 5)]]
