"""serve.py's `logprobs` and `echo`: the engine in-process (a long prompt scored in bounded
pieces, the stop token and a stop string), then one server subprocess on a tiny random GPT-2-BPE
checkpoint, driven by the openai client and httpx: every log-probability against the model's
own forward pass, streamed against whole, the 400 for logprobs > 5, plain requests unchanged,
and HellaSwag endings scored through the API as engine.hellaswag scores them."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from config import Config
from data.bpe import GPT2Tokenizer
from data.tokenizer import CharTokenizer
from engine import hellaswag, saving, sources
from engine.evaluation.scoring import choice_logprobs
from engine.inference import packed as packing
from engine.inference.sampling import generate_tokens
from engine.serving import logprobs
from engine.serving.batching import BatchEngine, SamplingParams, Sequence
from model import GPT, ModelConfig
from test_serve import (CHARS, WAIT_S, post, reference, start_server, tiny_checkpoint,
                        tokenizer_ending_at)

TOK = GPT2Tokenizer()
TOL = 1e-4  # one log-probability, float32: the server's kernels and batch shapes against ours
PROMPT = "Caf\u00e9 \u2019quoted\u2019 \U0001f600 ok"  # some tokens are parts of characters


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # as test_serve.py (conftest restores the count)


def engine_events(model: GPT, requests: list[tuple[list[int], SamplingParams]],
                  prefill_chunk: int = 0, static: bool = False,
                  tokenizer: CharTokenizer | None = None) -> list[list[tuple]]:
    """Each request's events through one BatchEngine (char tokenizer), all submitted at once."""
    events: list[list[tuple]] = [[] for _ in requests]
    engine = BatchEngine(model, model, tokenizer or CharTokenizer(CHARS), torch.device("cpu"),
                         slots=3, max_queue=4, warmup=False, prefill_chunk=prefill_chunk,
                         static=static)
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


@pytest.mark.parametrize("static,packed", [(False, False), (True, False), (False, True)])
def test_a_long_prompt_is_scored_in_bounded_pieces(tmp_path, monkeypatch, static, packed):
    """At most 3 positions' logits a forward (PROMPT_LOGITS lowered): a 25-token prompt is
    scored in pieces, each token as the whole forward scores it, while another request runs
    alongside; both texts are what generate.py gives alone. static: the compiled path's
    shapes (every slot, the whole cache); packed: float32 packed weights, whose one forward a
    step also has the other request's row of logits."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    if packed:
        packing.convert(model, "float32", torch.device("cpu"))
        if not packing.fused(model):
            pytest.skip("the compiled kernels are not built here")
    monkeypatch.setattr(logprobs, "PROMPT_LOGITS", 3 * model.config.vocab_size)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(
        out.shape[:-1].numel()))
    prompt = CharTokenizer(CHARS).encode("what a long prompt it is!")
    scored = SamplingParams(max_tokens=6, temperature=0, logprobs=2, echo=True)
    plain = SamplingParams(max_tokens=20, temperature=0)
    events = engine_events(model, [(prompt, scored), (prompt[:2], plain)], prefill_chunk=8,
                           static=static)
    hook.remove()
    assert max(rows) == 3 + packed and rows.count(3 + packed) >= 24 // 3 - 1
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
    """The <|endoftext|> that ends a completion is in its logprobs, at the text's end (a
    harness reading a continuation's scores counts on one score per generated token)."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    first, second = reference(model, "what?", 2)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=0)
    (events,) = engine_events(model, [(CharTokenizer(CHARS).encode("what?"), params)],
                              tokenizer=tokenizer_ending_at(second))
    assert [e[0] for e in events] == ["text", "text", "done"]
    assert events[0][1] == first and [s.token for s in events[0][2]] == [CHARS.index(first)]
    assert events[1][1] == "" and [(s.token, s.offset) for s in events[1][2]] == [
        (CHARS.index(second), 1)]
    assert events[2] == ("done", "stop", 2)


def test_scored_tokens_travel_with_their_text_and_a_stop_string_cuts_both(tmp_path):
    """Text held back (it may begin a stop string) keeps its tokens' scores back too; the
    tokens that the stop string cuts away are not scored in the answer. One character a
    token: the tokens sent so far spell the text sent so far, after every event."""
    model = sources.load_source(str(tiny_checkpoint(tmp_path)), Config())[0].eval()
    expected = reference(model, "hello", 8)  # hyhhhy..: 'h' is held back, "hh" stops it
    params = SamplingParams(max_tokens=8, temperature=0, stop=[expected[3:5]], logprobs=1)
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


def bpe_checkpoint(out_dir: Path) -> Path:
    """A random 2-layer model over GPT-2's BPE vocabulary, weights scaled so greedy picks have
    clear margins over float noise."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(block_size=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=2,
                            n_embd=32)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return saving.save(out_dir, 1, model, cfg, {"tokenizer": {"kind": "gpt2"}})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_logprobs")
    server = start_server(tmp, bpe_checkpoint(tmp / "run"))
    server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                  max_retries=0, timeout=WAIT_S)
    yield server
    server.stop()


def greedy_ids(model: GPT, prompt: list[int], max_tokens: int) -> list[int]:
    out = generate_tokens(model, torch.tensor([prompt]), max_tokens, temperature=0)
    return out[0, len(prompt):].tolist()


def test_generated_logprobs_are_the_models_own(served):
    """Each generated token: its log-probability and top 3 as log_softmax of the forward over
    everything before it; greedy, so the chosen token is the likeliest."""
    prompt = TOK.encode("Hello there")
    out = served.client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                           temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    ids = greedy_ids(served.model, prompt, 8)
    choice = out.choices[0]
    assert choice.text == TOK.decode(ids)
    lp = choice.logprobs
    assert lp.tokens == [logprobs.token_text(TOK.decode_bytes, t) for t in ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset == logprobs.decoded(TOK, ids)[1]  # within the completion's text
    expected = forward_logprobs(served.model, prompt + ids)
    for i, (token, top) in enumerate(zip(ids, lp.top_logprobs)):
        row = expected[len(prompt) + i - 1]
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=TOL)
        assert 3 <= len(top) <= 4 and max(top, key=top.get) == lp.tokens[i]
        values, best = row.topk(3)
        for t, v in zip(best.tolist(), values.tolist()):
            assert top[logprobs.token_text(TOK.decode_bytes, t)] == pytest.approx(v, abs=TOL)


def test_sampled_tokens_are_scored_by_the_raw_distribution(served):
    """temperature, top-k and top-p shape the sampling, not the scores: each sampled token's
    log-probability (and its alternatives') is log_softmax of the raw logits."""
    vocab = {logprobs.token_text(TOK.decode_bytes, t): t for t in range(TOK.vocab_size)}
    prompt = TOK.encode("Hello there")
    out = served.client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                           temperature=0.5, top_p=0.9, seed=1, logprobs=2,
                                           extra_body={"top_k": 5, "ignore_eos": True})
    lp = out.choices[0].logprobs
    ids = [vocab[token] for token in lp.tokens]
    expected = forward_logprobs(served.model, prompt + ids)
    for i, (token, top) in enumerate(zip(ids, lp.top_logprobs)):
        row = expected[len(prompt) + i - 1]
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=TOL)
        values, best = row.topk(2)
        assert [top[logprobs.token_text(TOK.decode_bytes, t)] for t in best.tolist()] == \
            pytest.approx(values.tolist(), abs=TOL)


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_with_no_tokens_scores_the_prompt(served, as_ids):
    """echo + max_tokens=0 (a harness' loglikelihood): the prompt back, each token scored as
    the forward over the prompt scores it, the first None; a prompt of token ids too."""
    ids = TOK.encode(PROMPT)
    out = served.client.completions.create(model="tiny", prompt=ids if as_ids else PROMPT,
                                           max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert lp.tokens == [logprobs.token_text(TOK.decode_bytes, t) for t in ids]
    assert lp.text_offset == logprobs.decoded(TOK, ids)[1]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = forward_logprobs(served.model, ids)
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                          atol=TOL)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])


def test_echo_then_generated_tokens_continue_the_offsets(served):
    body = {"prompt": "The end", "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 0, "ignore_eos": True}
    choice = post(served, body).json()["choices"][0]
    ids = TOK.encode("The end") + greedy_ids(served.model, TOK.encode("The end"), 4)
    lp = choice["logprobs"]
    assert choice["text"] == TOK.decode(ids) and len(lp["tokens"]) == len(ids)
    assert lp["text_offset"] == logprobs.decoded(TOK, ids)[1]
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs=0: the chosen one


def stream_chunks(served, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True},
                      timeout=WAIT_S) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line)["choices"][0] for line in lines[:-1]]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 3}])
def test_streamed_logprobs_are_the_whole_answers(served, sampling):
    """The chunks' logprobs, joined, are the non-streamed answer's; each chunk carries the
    tokens whose text it completes (their text begins within what has been sent)."""
    body = {"prompt": PROMPT, "max_tokens": 12, "echo": True, "logprobs": 2,
            "ignore_eos": True, **sampling}
    whole = post(served, body).json()["choices"][0]
    chunks = stream_chunks(served, body)
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    joined = {k: [v for c in chunks for v in c["logprobs"][k]] for k in keys}
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:],
                                                         abs=TOL)
    sent = 0
    for c in chunks:
        sent += len(c["text"])
        assert all(offset < sent for offset in c["logprobs"]["text_offset"])
    assert chunks[0]["text"].startswith(PROMPT)  # the echo comes first


@pytest.mark.parametrize("value,message", [(6, "ask for 0 to 5"),
                                           (-1, "greater than or equal to 0")])
def test_logprobs_out_of_range_is_a_400_in_openais_shape(served, value, message):
    r = post(served, {"prompt": "ab", "logprobs": value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == "logprobs"
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="ask for 0 to 5"):
        served.client.completions.create(model="tiny", prompt="ab", logprobs=6)


def test_a_request_without_logprobs_is_unchanged(served):
    """Neither field: no logprobs, and the text generate.py gives; with logprobs the same text
    (greedy, and sampled with a seed)."""
    prompt = TOK.encode("Once upon")
    body = {"prompt": "Once upon", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = post(served, body).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == TOK.decode(
        greedy_ids(served.model, prompt, 10))
    for extra in ({}, {"temperature": 1.0, "seed": 9}):
        texts = [post(served, {**body, **extra, **lp}).json()["choices"][0]["text"]
                 for lp in ({}, {"logprobs": 5})]
        assert texts[0] == texts[1]


HELLASWAG = [
    {"ctx": "A man is sitting on a roof. He", "label": 0, "endings": [
        "starts pulling up roofing on a roof.", "is holding a cat.", "eats the roof.",
        "is ripping level tiles off."]},
    {"ctx": "A woman sits at a piano. She", "label": 1, "endings": [
        "sets her fingers on the keys.", "plays.", "walks away from the piano slowly.",
        "closes the lid and \u2019smiles\u2019."]},
    {"ctx": "Then, the man writes over the snow.", "label": 3, "endings": [
        "The man adds wax.", "A person boards a ski lift.", "The man", "The snow melts."]},
]


def test_hellaswag_through_the_api_scores_as_engine_hellaswag(served, tmp_path):
    """Each ending's summed log-likelihood through the API (echo, max_tokens=0, the context and
    ending as token ids, the ending's scores summed) is -engine.hellaswag's summed loss, and
    picks the same ending; so does lm-evaluation-harness' local-completions request
    (max_tokens=1, logprobs=1, scores [ctxlen:-1])."""
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(ex) + "\n" for ex in HELLASWAG))
    examples = hellaswag.load_examples(path)
    correct = 0
    for ex in examples:
        (context, endings), = hellaswag.requests([ex], TOK)
        rows = [(context + ending, len(ending)) for ending in endings]  # within the context
        assert all(len(row) <= served.model.config.block_size + 1 for row, _ in rows)
        scores = choice_logprobs(served.model, [(context, endings)])[0]
        losses = torch.tensor([-lp for lp, _ in scores])
        for generated in (0, 1):  # ours, then the harness' request
            body = {"prompt": [row for row, _ in rows], "echo": True, "temperature": 0,
                    "max_tokens": generated, "logprobs": generated}
            choices = sorted(post(served, body).json()["choices"], key=lambda c: c["index"])
            scores = [c["logprobs"]["token_logprobs"] for c in choices]
            assert [len(s) for s in scores] == [len(row) + generated for row, _ in rows]
            sums = [sum(s[len(row) - n_end:len(s) - generated])  # the harness' [ctxlen:-1]
                    for s, (row, n_end) in zip(scores, rows)]
            assert sums == pytest.approx((-losses).tolist(), abs=1e-3)
            pick = max(range(4), key=sums.__getitem__)
            assert pick == int(losses.argmin())
        correct += pick == ex["label"]
    assert hellaswag.evaluate(served.model, TOK, examples)["correct"] == correct
