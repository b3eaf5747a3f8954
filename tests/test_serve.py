"""serve.py: the continuous-batching engine against generate.py's sampler (in-process), then one
server subprocess per module (a tiny checkpoint on a free port) driven by the openai client and
httpx: completions, streams, 8 concurrent greedy requests, bad requests, a disconnect, a full
queue, a killed worker, SIGTERM."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from config import Config
from data.tokenizer import CharTokenizer
from engine import pruning, saving, sources
from engine.inference import packed as packing
from engine.inference.matvec import set_weight_layout
from engine.inference.sampling import generate_tokens
from engine.serving import batching, supervisor
from engine.serving.batching import BatchEngine, SamplingParams, Sequence, TextStream
from engine.serving.options import ServeOptions
from model import GPT, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ,.!?\n:;'-ABCD"))
MAX_TOKENS_LIMIT = 20000
WAIT_S = 60  # bound on every wait for the server: a broken server fails, never hangs the suite


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from more threads, and lose a lot on a busy machine (conftest
    restores the count)."""
    torch.set_num_threads(1)


def tiny_checkpoint(out_dir: Path, attention: str = "sdpa", **techniques) -> Path:
    """A random 2-layer model whose weights are scaled up, so greedy picks have clear margins
    (float noise between batch sizes cannot flip them); techniques: model fields to set."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(block_size=32, vocab_size=len(CHARS), n_layer=2, n_head=2, n_embd=32,
                            attention=attention, **techniques)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
        if cfg.model.smear:  # its zeros would hide the previous tokens' path
            model.smear_weights.normal_()
    meta = {"tokenizer": {"kind": "char", "chars": CHARS}}
    return saving.save(out_dir, 1, model, cfg, meta)


def tokenizer_ending_at(char: str) -> CharTokenizer:
    """The char tokenizer with `char` as its end-of-text token (as GPT-2's <|endoftext|>)."""
    tok = CharTokenizer(CHARS)
    tok.eot_id = CHARS.index(char)
    return tok


def reference(model: GPT, prompt: str, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0, seed: int = 0) -> str:
    """What generate.py's sampler gives for this request alone."""
    tok = CharTokenizer(CHARS)
    idx = torch.tensor([tok.encode(prompt)])
    generator = torch.Generator().manual_seed(seed)
    out = generate_tokens(model, idx, max_tokens, temperature, top_k, top_p, True, generator)
    return tok.decode(out[0, idx.size(1):].tolist())


def run_engine(model: GPT, requests: list[tuple[str, SamplingParams]], slots: int,
               static: bool = False, prefill_chunk: int = 0, on_engine=None) -> list[str]:
    """The requests through one BatchEngine, all submitted at once (more than the slots wait)."""
    tok = CharTokenizer(CHARS)
    texts = [""] * len(requests)

    def collect(i: int, event: tuple) -> None:
        if event[0] == "text":
            texts[i] += event[1]

    engine = BatchEngine(model, model, tok, torch.device("cpu"), slots=slots, max_queue=16,
                         static=static, warmup=False, prefill_chunk=prefill_chunk)
    if on_engine is not None:
        on_engine(engine)
    seqs = [Sequence(tok.encode(p), params, lambda e, i=i: collect(i, e))
            for i, (p, params) in enumerate(requests)]
    engine.start()
    engine.submit(seqs)
    engine.stop()  # returns when all are done
    assert all(s.done for s in seqs)
    return texts


SPEEDRUN = dict(position="rotary", qk_norm=True, tie_embeddings=False, logit_softcap=15.0,
                smear=True, activation="relu2")


@pytest.mark.parametrize("attention,static,techniques", [
    ("sdpa", False, {}), ("scratch", False, {}), ("sdpa", True, {}), ("sdpa", False, SPEEDRUN),
    ("sdpa", True, SPEEDRUN)])
def test_engine_gives_each_request_what_generate_gives_alone(tmp_path, attention, static,
                                                             techniques):
    """Greedy and seeded sampling, prompts of different lengths, past the context (re-read):
    token for token generate.py's sampler alone. static: every slot, full cache, per-row mask
    (the compiled path's shapes). The speedrun's model: rotary positions per slot."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path, attention, **techniques)),
                               Config())[0].eval()
    requests = [("ab", SamplingParams(max_tokens=50, temperature=0)),
                ("hello world, this is long", SamplingParams(max_tokens=20, temperature=0)),
                ("c", SamplingParams(max_tokens=40, temperature=1.0, seed=7)),
                ("dd", SamplingParams(max_tokens=30, temperature=0.8, top_k=5, top_p=0.9, seed=3)),
                ("what?", SamplingParams(max_tokens=25, temperature=0))]
    got = run_engine(model, requests, slots=3, static=static)
    for (prompt, p), text in zip(requests, got):
        assert text == reference(model, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p,
                                 p.seed or 0), prompt


def test_long_prompts_are_read_in_chunks_between_decode_steps(tmp_path):
    """prefill_chunk=4: no step reads more than 4 prompt tokens in all, so a running stream
    waits for one chunk; the texts are still what generate.py gives each request alone (also
    after the context is full and re-read in chunks)."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    requests = [("ab", SamplingParams(max_tokens=45, temperature=0)),
                ("hello world, this is long", SamplingParams(max_tokens=12, temperature=0)),
                ("what a long prompt it is", SamplingParams(max_tokens=9, temperature=0.7,
                                                           seed=5)),
                ("c", SamplingParams(max_tokens=30, temperature=1.0, seed=7))]
    read: list[list[int]] = []  # per step, the length of every multi-token forward

    def watch(engine) -> None:
        step = engine.step
        engine.step = lambda: (read.append([]), step())

    hook = model.register_forward_pre_hook(lambda m, args: read[-1].append(
        args[0].size(1)) if args[0].size(1) > 1 else None)
    got = run_engine(model, requests, slots=3, prefill_chunk=4, on_engine=watch)
    hook.remove()
    assert max(sum(step) for step in read) <= 4
    assert sum(len(step) > 0 for step in read) >= 25 // 4 + 24 // 4  # the long ones in chunks
    for (prompt, p), text in zip(requests, got):
        assert text == reference(model, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p,
                                 p.seed or 0), prompt


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_weights_decode_and_read_prompts_in_one_forward_a_step(tmp_path, monkeypatch,
                                                                       fmt):
    """--weights FORMAT: each step is one forward_tokens call, the decoding rows' tokens and at
    most prefill_chunk prompt tokens (all of a prompt when nothing decodes); the texts are what
    generate.py gives each request alone on the same packed weights (past the context too)."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    packing.convert(model, fmt, torch.device("cpu"))
    if not packing.fused(model):
        pytest.skip("the compiled kernels are not built here")
    requests = [("ab", SamplingParams(max_tokens=45, temperature=0)),
                ("hello world, this is long", SamplingParams(max_tokens=12, temperature=0)),
                ("what a long prompt it is", SamplingParams(max_tokens=9, temperature=0.7,
                                                           seed=5)),
                ("c", SamplingParams(max_tokens=30, temperature=1.0, seed=7))]
    calls, forward_tokens = [], packing.forward_tokens

    def counted(model, tokens, kv, rows, positions, logits_at=None):
        calls.append((len(tokens), len(set(rows.tolist()))))
        return forward_tokens(model, tokens, kv, rows, positions, logits_at)

    monkeypatch.setattr(packing, "forward_tokens", counted)
    got = run_engine(model, requests, slots=3, prefill_chunk=4)
    assert calls[0] == (len("ab") + len("hello world, this is long") + len("what a long "
                                                                           "prompt it is"), 3)
    assert all(tokens <= 3 + 4 for tokens, _ in calls[1:])  # 3 decoding rows + one chunk
    monkeypatch.setattr(packing, "forward_tokens", forward_tokens)
    for (prompt, p), text in zip(requests, got):
        assert text == reference(model, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p,
                                 p.seed or 0), prompt


def test_new_prompts_are_read_together_in_one_forward(tmp_path):
    """Prompts that arrive together and fit the chunk are prefilled as one right-padded batch
    (each row's logits at its own last token): one forward, and each text still what
    generate.py gives it alone."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    requests = [("ab", SamplingParams(max_tokens=8, temperature=0)),
                ("hello world", SamplingParams(max_tokens=8, temperature=0)),
                ("c", SamplingParams(max_tokens=8, temperature=0.9, seed=2))]
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    got = run_engine(model, requests, slots=3, prefill_chunk=64)
    hook.remove()
    assert shapes[0] == (3, len("hello world"))  # the three prompts in one forward
    assert all(shape[1] == 1 for shape in shapes[1:])  # then decode steps only
    for (prompt, p), text in zip(requests, got):
        assert text == reference(model, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p,
                                 p.seed or 0), prompt


def test_a_pruned_checkpoint_is_served_with_sparse_kernels_and_the_same_text(tmp_path):
    """serve loads as generate.py does: a pruned model's Linears go sparse (--sparse), and the
    batched greedy text is what the dense model gives each request alone."""
    dense = sources.load_source(str(tiny_checkpoint(tmp_path / "dense")), Config())[0].eval()
    pruning.prune(dense, 0.75, "unstructured")
    cfg = Config()
    cfg.model = dense.config
    path = saving.save(tmp_path / "pruned", 1, dense, cfg,
                           {"tokenizer": {"kind": "char", "chars": CHARS}})
    options = ServeOptions(init_from=str(path), sparse="sparse", slots=3)
    loaded = supervisor.load_for_serving(cfg, options)
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert "CSRLinear" in kinds and loaded.name == "pruned"
    requests = [(p, SamplingParams(max_tokens=30, temperature=0)) for p in ("ab", "what?", "c")]
    got = run_engine(loaded.model, requests, slots=3)
    assert got == [reference(dense, p, 30) for p, _ in requests]


def test_text_stream_holds_back_a_possible_stop_and_cuts_before_it():
    tok = CharTokenizer(CHARS)
    stream = TextStream(tok, ("b\n",))
    sent = [stream.push(t) for t in tok.encode("aab")]
    assert sent == [("a", False), ("a", False), ("", False)]  # 'b' may start the stop
    assert stream.push(tok.encode("c")[0]) == ("bc", False)
    assert stream.push(tok.encode("b")[0]) == ("", False)
    assert stream.push(tok.encode("\n")[0]) == ("", True)
    assert stream.text[:stream.sent] == "aabc"


def test_text_stream_assembles_utf8_across_byte_level_tokens():
    from data.bpe import GPT2Tokenizer
    tok = GPT2Tokenizer()
    text = "caf\u00e9 \U0001f600 ok"
    stream = TextStream(tok, ())
    pieces = [stream.push(t)[0] for t in tok.encode(text)]
    assert "".join(pieces) + stream.finish() == text and "\ufffd" not in "".join(pieces)


def test_stop_token_finishes_without_its_text(tmp_path):
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    first = reference(model, "ab", 1)
    events = []
    engine = BatchEngine(model, model, tokenizer_ending_at(first), torch.device("cpu"), slots=1,
                         max_queue=1, warmup=False)
    params = SamplingParams(max_tokens=10, temperature=0)
    engine.start()
    engine.submit([Sequence(CharTokenizer(CHARS).encode("ab"), params, events.append)])
    engine.stop()
    assert events == [("done", "stop", 1)]


def test_ignore_eos_goes_on_past_the_stop_token(tmp_path):
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    expected = reference(model, "ab", 10)
    events = []
    engine = BatchEngine(model, model, tokenizer_ending_at(expected[0]), torch.device("cpu"),
                         slots=1, max_queue=1, warmup=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.start()
    engine.submit([Sequence(CharTokenizer(CHARS).encode("ab"), params, events.append)])
    engine.stop()
    assert "".join(e[1] for e in events if e[0] == "text") == expected
    assert events[-1] == ("done", "length", 10)


def test_each_choice_is_sampled_as_the_request_says_with_its_own_seed():
    """The request is the choices' SamplingParams (no field relayed by hand): every sampling
    field reaches the engine as sent; choice j's seed is seed + j."""
    from engine.serving.app import CompletionRequest, make_sequences
    body = CompletionRequest(prompt="ab", n=2, max_tokens=3, temperature=0.5, top_p=0.9,
                             top_k=3, stop=["x", "y"], seed=7, logprobs=1, echo=True,
                             ignore_eos=True)
    seqs = make_sequences(body, [[1, 2], [3]], lambda j, event: None)
    assert [s.params.seed for s in seqs] == [7, 8, 9, 10]
    for name in set(SamplingParams.model_fields) - {"seed"}:
        assert {getattr(s.params, name) == getattr(body, name) for s in seqs} == {True}, name
    assert seqs[0].params.stop_strings() == ("x", "y")
    unseeded = body.model_copy(update={"seed": None})
    assert {s.params.seed for s in make_sequences(unseeded, [[1]], lambda j, e: None)} == {None}


def test_stop_token_sends_the_text_held_back_for_a_possible_stop_string(tmp_path):
    """The first character may begin the stop string, so it waits; the stop token that follows
    ends the completion, and the character is sent before the end."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    first, second = reference(model, "what?", 2)  # two different characters
    events = []
    engine = BatchEngine(model, model, tokenizer_ending_at(second), torch.device("cpu"),
                         slots=1, max_queue=1, warmup=False)
    params = SamplingParams(max_tokens=10, temperature=0, stop=[first + "!?"])
    engine.start()
    engine.submit([Sequence(CharTokenizer(CHARS).encode("what?"), params, events.append)])
    engine.stop()
    assert first != second and events == [("text", first, []), ("done", "stop", 2)]


def test_idle_window_hands_cached_memory_back_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(batching, "release_cached",
                        lambda device, enabled: calls.append(enabled) or True)
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    engine = BatchEngine(model, model, CharTokenizer(CHARS), torch.device("cpu"), slots=2,
                         max_queue=2, warmup=False, idle_release_s=0.05)
    engine.start()
    deadline = time.monotonic() + WAIT_S
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # idle on: no second release in the same window
    assert calls == [True]
    done = []
    engine.submit([Sequence([1, 2], SamplingParams(max_tokens=3, temperature=0),
                            lambda e: done.append(e[0]))])
    while "done" not in done and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a new idle window after the request: released again
    engine.stop()
    assert calls == [True, True] and engine.released_idle == 2


def test_an_error_in_the_decode_loop_fails_the_requests_and_the_engine_goes_on(tmp_path):
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    engine = BatchEngine(model, model, CharTokenizer(CHARS), torch.device("cpu"), slots=2,
                         max_queue=2, warmup=False, log=lambda text: None)
    decode = engine._decode
    engine._decode = lambda seqs: (_ for _ in ()).throw(RuntimeError("injected"))
    events = {0: [], 1: []}
    seqs = [Sequence([1, 2], SamplingParams(max_tokens=5, temperature=0), events[i].append)
            for i in range(2)]
    engine.start()
    engine.submit(seqs)
    deadline = time.monotonic() + WAIT_S
    while not all(s.done for s in seqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e[-1][0] for e in events.values()] == ["error", "error"]
    assert "RuntimeError: injected" in events[0][-1][1]
    engine._decode = decode
    after = []
    engine.submit([Sequence([1, 2], SamplingParams(max_tokens=5, temperature=0), after.append)])
    engine.stop()
    assert after[-1] == ("done", "length", 5) and engine.stats()["active"] == 0


def test_a_port_in_use_is_one_clear_error(tmp_path, capsys):
    import socket

    import serve
    ckpt = tiny_checkpoint(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve.main([f"--checkpoint={ckpt}", f"--port={port}", "--device=cpu"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


class Server:
    """serve.py in a subprocess on a free port; output in a log file."""

    def __init__(self, ckpt: Path, log: Path, *extra: str):
        self.log = log
        args = [sys.executable, str(ROOT / "serve.py"), f"--checkpoint={ckpt}", "--port=0",
                "--device=cpu", "--threads=1", "--slots=4", "--max_queue=4",
                f"--max-tokens-limit={MAX_TOKENS_LIMIT}", "--model-name=tiny", *extra]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self._port()}"
        self.health()  # waits until warmed up

    def _port(self) -> int:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log.read_text()):
                return int(m.group(1))
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"serve.py printed no address:\n{self.log.read_text()}")

    def health(self, until=lambda body: True) -> dict:
        """GET /health until it is 200 and `until(body)` holds."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200 and until(r.json()):
                    return r.json()
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"/health never satisfied the condition:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(tmp: Path, ckpt: Path) -> Server:
    """A server on ckpt, with the same weights in-process as .model (the reference)."""
    server = Server(ckpt, tmp / "serve.log")
    server.model = sources.load_source(str(ckpt), Config())[0].eval()
    set_weight_layout(server.model, "auto")  # as generate.py (and serve.py) store them
    return server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    server = start_server(tmp, tiny_checkpoint(tmp / "run"))
    yield server
    server.stop()


def post(server: Server, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S, **kwargs)


def test_openai_client_completion_and_stream(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                           timeout=WAIT_S)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    expected = reference(served.model, "hello", 12)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 12)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    stop = expected[3:5]
    stopped = client.completions.create(model="tiny", prompt="hello", max_tokens=12,
                                        temperature=0, stop=[stop, "never"])
    assert stopped.choices[0].text == expected[:expected.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_eight_concurrent_greedy_requests_equal_each_alone(served):
    """4 slots + 4 queued, prompts and lengths mixed, some past the 32-token context."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                           timeout=WAIT_S)
    jobs = [(p, n) for p, n in zip(["a", "hello there", "b c", "zzz", "the end.", "q", "xy, z",
                                    "long prompt text"], [40, 8, 60, 15, 33, 5, 70, 20])]

    def run(job):
        return client.completions.create(model="tiny", prompt=job[0], max_tokens=job[1],
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    assert texts == [reference(served.model, p, n) for p, n in jobs]
    # the same seed, the same text, alongside other traffic
    seeded = {"prompt": "ab", "max_tokens": 20, "temperature": 1.0, "seed": 11}
    first, second = (post(served, seeded).json()["choices"][0]["text"] for _ in range(2))
    assert first == second == reference(served.model, "ab", 20, 1.0, seed=11)


def test_n_choices_with_a_seed_are_reproducible(served):
    body = {"prompt": "ab", "max_tokens": 15, "temperature": 1.0, "seed": 5, "n": 2}
    texts = [[c["text"] for c in post(served, body).json()["choices"]] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]
    assert texts[0][1] == reference(served.model, "ab", 15, 1.0, seed=6)  # choice j: seed + j


@pytest.mark.parametrize("body,status,message", [
    ('{"prompt": "ab", "max_tokens": 3', 400, "not valid JSON"),
    ('["ab"]', 400, "must be a JSON object"),
    ({"prompt": "ab", "max_tokens": "ten"}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": "ab", "temperature": -1}, 400, "temperature: Input should be greater than"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": "ab", "colour": "red"}, 400, "unknown field 'colour'"),
    ({"prompt": "ab", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ({"prompt": "ab", "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "over this server's limit"),
    ({"prompt": "a" * 33}, 400, "has 33 tokens but this server takes at most 32"),
    ({"prompt": "ab\u00e9"}, 400, "outside this"),
    ({"prompt": [[1, 999]]}, 400, "token ids outside"),
    ({"prompt": "ab", "stop": ""}, 400, "stop must be"),
    ({"prompt": "ab", "best_of": 2}, 400, "best_of is not supported"),
    ({"prompt": "ab", "n": 9}, 400, "server holds at most 8"),
    ({"prompt": "ab", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
])
def test_bad_requests_get_a_clear_json_error(served, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{served.url}/v1/completions", content=content, timeout=WAIT_S,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def open_stream(client: httpx.Client, stack: contextlib.ExitStack, max_tokens: int):
    r = stack.enter_context(client.stream("POST", "/v1/completions", json={
        "prompt": "ab", "max_tokens": max_tokens, "stream": True}))
    assert r.status_code == 200
    return r


def test_disconnect_mid_stream_frees_the_slot(served):
    with httpx.Client(base_url=served.url, timeout=WAIT_S) as client:
        with contextlib.ExitStack() as stack:
            lines = open_stream(client, stack, MAX_TOKENS_LIMIT).iter_lines()
            assert [next(lines) for _ in range(4)][0].startswith("data: {")
            assert served.health()["active"] == 1
    assert served.health(lambda h: h["active"] == 0 and h["queued"] == 0)
    assert post(served, {"prompt": "ab", "max_tokens": 3}).status_code == 200


def test_full_queue_answers_503_with_retry_after(served):
    with httpx.Client(base_url=served.url, timeout=WAIT_S) as client:
        with contextlib.ExitStack() as stack:
            for _ in range(8):  # 4 slots + 4 queued
                open_stream(client, stack, MAX_TOKENS_LIMIT)
            assert served.health(lambda h: h["active"] == 4 and h["queued"] == 4)
            r = post(served, {"prompt": "ab", "max_tokens": 3})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "at capacity" in r.json()["error"]["message"]
    assert served.health(lambda h: h["active"] == 0 and h["queued"] == 0)
    assert post(served, {"prompt": "ab", "max_tokens": 3}).status_code == 200


def test_killed_worker_fails_its_request_and_is_restarted(served):
    pid = served.health()["worker_pid"]
    with httpx.Client(base_url=served.url, timeout=WAIT_S) as client:
        with contextlib.ExitStack() as stack:
            lines = open_stream(client, stack, MAX_TOKENS_LIMIT).iter_lines()
            next(lines)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # not a timeout
                for _ in lines:
                    pass
    assert served.health(lambda h: h["worker_pid"] != pid)
    assert post(served, {"prompt": "ab", "max_tokens": 3}).status_code == 200
    assert "worker 0" in served.log.read_text() and "restarting" in served.log.read_text()


def test_sigterm_finishes_running_requests_then_exits(served):
    """Last: it stops the module's server."""
    with httpx.Client(base_url=served.url, timeout=WAIT_S) as client:
        with contextlib.ExitStack() as stack:
            lines = open_stream(client, stack, 600).iter_lines()
            first = next(lines)
            served.proc.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    choices = [json.loads(line[6:])["choices"][0] for line in events[:-1]]
    assert choices[-1]["finish_reason"] == "length"
    assert len("".join(c["text"] for c in choices)) == 600  # one character per token
    assert served.proc.wait(timeout=WAIT_S) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health", timeout=5)
