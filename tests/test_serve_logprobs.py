"""serve.py's `logprobs` and `echo` in the engine, in-process: a long prompt scored in bounded
pieces, the stop token and a stop string; token strings of GPT-2's byte-level tokens."""
from __future__ import annotations

import pytest
import torch
from test_serve import CHARS, reference, tiny_checkpoint

from config import Config
from engine import logprobs, sources
from engine.serve_batch import BatchEngine, SamplingParams, Sequence
from engine.tokenizer import CharTokenizer, GPT2Tokenizer
from model import GPT

TOK = GPT2Tokenizer()
TOL = 1e-4  # one log-probability, float32: the server's kernels and batch shapes against ours
PROMPT = "Caf\u00e9 \u2019quoted\u2019 \U0001f600 ok"  # some tokens are parts of characters


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # as test_serve.py (conftest restores the count)


def engine_events(model: GPT, requests: list[tuple[list[int], SamplingParams]],
                  prefill_chunk: int = 0) -> list[list[tuple]]:
    """Each request's events through one BatchEngine (char tokenizer), all submitted at once."""
    events: list[list[tuple]] = [[] for _ in requests]
    engine = BatchEngine(model, model, CharTokenizer(CHARS), torch.device("cpu"), slots=3,
                         max_queue=4, warmup=False, prefill_chunk=prefill_chunk)
    seqs = [Sequence(ids, params, events[i].append) for i, (ids, params) in enumerate(requests)]
    engine.start()
    engine.submit(seqs)
    engine.stop()
    return events


def forward_logprobs(model: GPT, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of ids: (len(ids), vocab)."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0].float(), dim=-1)


def test_a_long_prompt_is_scored_in_bounded_pieces(tmp_path, monkeypatch):
    """At most 3 positions' logits a forward (PROMPT_LOGITS lowered): a 25-token prompt is
    scored in pieces, each token as the whole forward scores it, while another request runs
    alongside; both texts are what generate.py gives alone."""
    model = sources.load_model(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    monkeypatch.setattr(logprobs, "PROMPT_LOGITS", 3 * model.config.vocab_size)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(
        out.shape[:-1].numel()))
    prompt = CharTokenizer(CHARS).encode("what a long prompt it is!")
    scored = SamplingParams(max_tokens=6, temperature=0, logprobs=2, echo=True)
    plain = SamplingParams(max_tokens=20, temperature=0)
    events = engine_events(model, [(prompt, scored), (prompt[:2], plain)], prefill_chunk=8)
    hook.remove()
    assert max(rows) == 3 and rows.count(3) >= 24 // 3
    kind, scores = events[0][0]
    assert kind == "prompt" and [s.token for s in scores] == prompt
    assert scores[0].logprob is None
    expected = forward_logprobs(model, prompt)
    for i, s in enumerate(scores[1:], 1):
        assert s.logprob == pytest.approx(expected[i - 1, prompt[i]].item(), abs=TOL)
        assert [t for t, _ in s.top] == expected[i - 1].topk(2).indices.tolist()
    texts = ["".join(e[1] for e in seq_events if e[0] == "text") for seq_events in events]
    assert texts == [reference(model, "what a long prompt it is!", 6), reference(model, "wh", 20)]


def test_the_stop_token_is_scored_but_not_in_the_text(tmp_path):
    """As OpenAI: the <|endoftext|> that ends a completion is in its logprobs, at the text's
    end (a harness reading a continuation's scores counts on one score per token)."""
    model = sources.load_model(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    first, second = reference(model, "what?", 2)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token=CHARS.index(second),
                            logprobs=0)
    (events,) = engine_events(model, [(CharTokenizer(CHARS).encode("what?"), params)])
    assert [e[0] for e in events] == ["text", "text", "done"]
    assert events[0][1] == first and [s.token for s in events[0][2]] == [CHARS.index(first)]
    assert events[1][1] == "" and [(s.token, s.offset) for s in events[1][2]] == [
        (CHARS.index(second), 1)]
    assert events[2] == ("done", "stop", 2)


def test_scored_tokens_travel_with_their_text_and_a_stop_string_cuts_both(tmp_path):
    """Text held back (it may begin a stop string) keeps its tokens' scores back too; the
    tokens that the stop string cuts away are not scored in the answer. One character a
    token: the tokens sent so far spell the text sent so far, after every event."""
    model = sources.load_model(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    expected = reference(model, "hello", 8)  # hyhhhy..: 'h' is held back, "hh" stops it
    params = SamplingParams(max_tokens=8, temperature=0, stop=(expected[3:5],), logprobs=1)
    (events,) = engine_events(model, [(CharTokenizer(CHARS).encode("hello"), params)])
    text, tokens = "", []
    for kind, *rest in events[:-1]:
        text, tokens = text + rest[0], tokens + [s.token for s in rest[1]]
        assert kind == "text" and CharTokenizer(CHARS).decode(tokens) == text
    assert text == expected[:expected.index(expected[3:5])] and events[-1][:2] == ("done", "stop")


def test_tokens_that_are_parts_of_characters_are_written_as_bytes():
    ids = TOK.encode(PROMPT)
    shown = [logprobs.token_text(TOK.decode_bytes, t) for t in ids]
    assert "bytes:\\xe2\\x80" in shown and "bytes:\\x99" in shown and "\u00e9" in shown
    text, offsets = logprobs.decoded(TOK, ids)
    assert text == PROMPT and offsets == sorted(offsets) and offsets[-1] == PROMPT.index(" ok")
    # the two pieces of the closing quote both begin where it does
    quote = PROMPT.rindex("\u2019")
    assert offsets[shown.index("bytes:\\x99", 5) - 1:][:2] == [quote, quote]
