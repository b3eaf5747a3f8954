"""serve.py's POST /v1/chat/completions: the template found at load (a bad one stops serve.py),
the engine ending a reply at the template's end token, the refusal of a model without a template
(an app in-process), then one server subprocess on a tiny chat model (150 steps on rendered
conversations, so it ends its replies with the end-of-turn token) driven by the openai client
and httpx: each reply against
generate.py's sampler on the template's prompt ids, streamed and whole, n with a seed, logprobs
against the model's own forward pass, a stop string, max_tokens, a second turn, bad
conversations' 400s."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from test_serve import WAIT_S, start_server

from config import Config
from data.chat_template import ChatTemplate, TemplateError
from data.tokenizer import CharTokenizer
from engine import saving, sources
from engine.inference.sampling import generate_tokens
from engine.serving import supervisor
from engine.serving.app import ServedModel, create_app
from engine.serving.batching import BatchEngine, SamplingParams, Sequence
from engine.serving.options import ServeOptions
from model import GPT, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CHARS = sorted(set((ROOT / "data" / "tinyshakespeare.txt").read_text()))  # 65
TOKENIZER = CharTokenizer(CHARS, eot=True)  # id 65: the end of a turn
TEMPLATE = ChatTemplate()
EXCHANGES = [("hi", "Hello there."), ("who are you?", "A small model."),
             ("say yes", "Yes."), ("count", "One, two, three.")]
TOL = 1e-4  # one log-probability, float32: the server's kernels against ours
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # as test_serve.py (conftest restores the count)


def conversation(user: str, reply: str | None = None) -> list[dict]:
    return [{"role": "user", "content": user}] + (
        [{"role": "assistant", "content": reply}] if reply is not None else [])


def chat_checkpoint(out_dir: Path, steps: int = 150, template: dict | None = None) -> Path:
    """A tiny char model trained on EXCHANGES rendered by the template (every token counted),
    with the template in its meta; template={}: none stored. steps=0: random weights scaled
    up, as test_serve.tiny_checkpoint's (clear greedy margins; replies that seldom end)."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(block_size=128, vocab_size=TOKENIZER.vocab_size, n_layer=2,
                            n_head=2, n_embd=48)
    model = GPT(cfg.model)
    rows = [TEMPLATE.render(TOKENIZER, conversation(u, r))[0] for u, r in EXCHANGES]
    rows += [a + b for a, b in zip(rows, rows[1:] + rows[:1])]  # second turns too
    longest = max(map(len, rows))
    ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
    targets = torch.tensor([r[1:] + [-1] * (longest - len(r) + 1) for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if steps == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(20 if p.dim() == 2 else 1)
    for _ in range(steps):
        _, loss = model(ids, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    stored = TEMPLATE.meta() if template is None else template
    meta = {"tokenizer": TOKENIZER.meta(), **({"template": stored} if stored else {})}
    return saving.save(out_dir, steps, model.eval(), cfg, meta)


def reference_ids(model: GPT, messages: list[dict], max_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, seed: int = 0) -> tuple[list[int], str]:
    """generate.py's sampler on the template's prompt ids -> (reply ids up to and with the end
    token, the finish_reason)."""
    idx = torch.tensor([TEMPLATE.prompt(TOKENIZER, messages)])
    generator = torch.Generator().manual_seed(seed)
    out = generate_tokens(model, idx, max_tokens, temperature, top_k, 1.0, True, generator)
    reply = out[0, idx.size(1):].tolist()
    end = TEMPLATE.end_id(TOKENIZER)
    return (reply[:reply.index(end) + 1], "stop") if end in reply else (reply, "length")


def reference(model: GPT, messages: list[dict], max_tokens: int = 100, **sampling
              ) -> tuple[str, str]:
    """The reply's text (without the end token) and its finish_reason."""
    ids, reason = reference_ids(model, messages, max_tokens, **sampling)
    return TOKENIZER.decode([t for t in ids if t != TOKENIZER.eot_id]), reason


def test_load_finds_the_template_in_the_checkpoint_meta(tmp_path):
    with_template = chat_checkpoint(tmp_path / "chat", steps=1)
    loaded = supervisor.load_for_serving(Config(), ServeOptions(init_from=str(with_template)))
    assert loaded.template == TEMPLATE and loaded.tokenizer.eot_id == 65
    without = chat_checkpoint(tmp_path / "plain", steps=1, template={})
    assert supervisor.load_for_serving(Config(), ServeOptions(
        init_from=str(without))).template is None
    malformed = chat_checkpoint(tmp_path / "bad", steps=1, template={"user": 3})
    with pytest.raises(TemplateError, match="stored chat template .* is malformed"):
        supervisor.load_for_serving(Config(), ServeOptions(init_from=str(malformed)))


def test_a_bad_template_stops_serve_py_at_load_with_one_line(tmp_path, capsys):
    import serve
    malformed = chat_checkpoint(tmp_path / "bad", steps=1, template={"user": 3})
    assert serve.main([f"--checkpoint={malformed}", "--port=0", "--device=cpu"]) == 2
    assert "error: the stored chat template {'user': 3} is malformed" in capsys.readouterr().err
    model = sources.load_source(str(chat_checkpoint(tmp_path / "chat", steps=1)), Config())[0]
    cfg = Config()
    cfg.model = model.config
    no_eot = saving.save(tmp_path / "no_eot", 1, model, cfg, {  # a char tokenizer, no eot
        "tokenizer": CharTokenizer(CHARS).meta(), "template": TEMPLATE.meta()})
    assert serve.main([f"--checkpoint={no_eot}", "--port=0", "--device=cpu"]) == 2
    assert "tokenizer has no end-of-text token" in capsys.readouterr().err


def test_a_sequence_ends_at_its_own_end_token_not_in_its_text(tmp_path):
    """The engine ends a chat reply at the template's end token (Sequence.end_token), whatever
    the tokenizer's end of text; the token is not in the text."""
    model = sources.load_source(str(chat_checkpoint(tmp_path, steps=0)), Config())[0].eval()
    prompt = TEMPLATE.prompt(TOKENIZER, HI)
    first, second = reference_ids(model, HI, 2)[0]
    events = []
    engine = BatchEngine(model, model, TOKENIZER, torch.device("cpu"), slots=1, max_queue=1,
                         warmup=False)
    engine.start()
    engine.submit([Sequence(prompt, SamplingParams(max_tokens=10, temperature=0),
                            events.append, end_token=second)])
    engine.stop()
    assert first != second and second != TOKENIZER.eot_id
    assert events == [("text", TOKENIZER.decode([first]), []), ("done", "stop", 2)]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_chat")
    server = start_server(tmp, chat_checkpoint(tmp / "run"))
    yield server
    server.stop()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S)


def post_chat(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=WAIT_S)


def test_the_reply_is_the_templates_greedy_continuation_ended_at_its_token(chat_server):
    client = client_of(chat_server)
    assert client.models.list().data[0].chat_template is True
    expected, reason = reference(chat_server.model, HI)
    assert (expected, reason) == ("Hello there.", "stop")  # the model learned its replies
    out = client.chat.completions.create(model="tiny", messages=HI, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert (choice.message.role, choice.message.content) == ("assistant", expected)
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt = len(TEMPLATE.prompt(TOKENIZER, HI))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt, len(expected) + 1)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert client.chat.completions.create(messages=parts, model="tiny", temperature=0) \
        .choices[0].message.content == expected


def test_a_streamed_reply_opens_with_the_role_and_ends_with_usage(chat_server):
    expected, _ = reference(chat_server.model, conversation("count"))
    chunks = list(client_of(chat_server).chat.completions.create(
        model="tiny", messages=conversation("count"), temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected) + 1
    with httpx.stream("POST", f"{chat_server.url}/v1/chat/completions", timeout=WAIT_S,
                      json={"messages": HI, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "<|endoftext|>" not in "".join(lines)


def test_max_tokens_and_a_stop_string_end_the_reply(chat_server):
    client = client_of(chat_server)
    expected, _ = reference(chat_server.model, conversation("who are you?"))
    for limit in ({"max_tokens": 4}, {"max_completion_tokens": 4}):
        out = client.chat.completions.create(model="tiny", messages=conversation("who are you?"),
                                             temperature=0, **limit)
        assert out.choices[0].message.content == expected[:4]
        assert out.choices[0].finish_reason == "length"
    stop = expected[3:5]
    out = client.chat.completions.create(model="tiny", messages=conversation("who are you?"),
                                         temperature=0, stop=[stop])
    assert out.choices[0].message.content == expected[:expected.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_n_choices_with_a_seed_are_reproducible_and_each_its_own(chat_server):
    body = {"messages": HI, "temperature": 2.0, "top_k": 8, "seed": 5, "n": 2,
            "max_tokens": 30}
    runs = [post_chat(chat_server, body).json()["choices"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2
    for j, choice in enumerate(runs[0]):  # choice j: seed + j, as generate.py samples alone
        ids, reason = reference_ids(chat_server.model, HI, 30, 2.0, top_k=8, seed=5 + j)
        assert choice["message"]["content"] == TOKENIZER.decode(
            [t for t in ids if t != TOKENIZER.eot_id])
        assert choice["finish_reason"] == reason
    assert runs[0][0]["message"] != runs[0][1]["message"]


def test_a_second_turn_reads_the_first(chat_server):
    history = conversation("hi", "Hello there.") + conversation("say yes")
    expected, reason = reference(chat_server.model, history)
    out = client_of(chat_server).chat.completions.create(model="tiny", messages=history,
                                                         temperature=0)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (expected, reason)
    assert out.usage.prompt_tokens == len(TEMPLATE.prompt(TOKENIZER, history))


def test_logprobs_are_the_models_own_in_the_chat_shape(chat_server):
    out = client_of(chat_server).chat.completions.create(
        model="tiny", messages=HI, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    text = out.choices[0].message.content
    assert "".join(t.token for t in content) == text  # one character a token; no end token
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    prompt = TEMPLATE.prompt(TOKENIZER, HI)
    ids = prompt + TOKENIZER.encode(text)
    with torch.no_grad():
        logits, _ = chat_server.model(torch.tensor([ids]))
    expected = torch.log_softmax(logits[0].float(), dim=-1)
    for i, t in enumerate(content):
        row = expected[len(prompt) - 1 + i]
        assert t.logprob == pytest.approx(row[ids[len(prompt) + i]].item(), abs=TOL)
        top = row.topk(2)
        assert [x.token for x in t.top_logprobs] == [TOKENIZER.decode([k]) for k in
                                                     top.indices.tolist()]
        assert [x.logprob for x in t.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
    none = post_chat(chat_server, {"messages": HI, "logprobs": True, "max_tokens": 3}).json()
    assert [t["top_logprobs"] for t in none["choices"][0]["logprobs"]["content"]] == [[]] * 3


@pytest.mark.parametrize("body,message", [
    ({"messages": []}, "messages: messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": conversation("hi", "Hello.")}, "ends with an assistant message"),
    ({"messages": [{"role": "user", "content": 5}]}, "needs \"content\" as a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text parts are supported"),
    ({"messages": [{"role": "user", "content": "caf\u00e9"}]}, "outside this"),
    ({"messages": [{"role": "user", "content": "a" * 200}]},
     "the conversation is 218 tokens with the chat template but this server takes at most 128"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"messages": HI, "top_logprobs": 6, "logprobs": True}, "top_logprobs: Input should be"),
    ({"messages": HI, "echo": True}, "unknown field 'echo'; the fields are: temperature, top_p, "
     "top_k, seed, stop, model, messages"),
    ({"messages": HI, "presence_penalty": 1.0}, "presence_penalty is not supported"),
    ({"messages": HI, "max_tokens": 30000}, "over this server's limit"),
    ({"messages": HI, "n": 9}, "server holds at most 8"),
    ({"max_tokens": 3}, "messages is required"),
])
def test_bad_conversations_get_a_clear_400(chat_server, body, message):
    r = post_chat(chat_server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_a_model_without_a_template_refuses_chat(tmp_path):
    """The app in-process on a checkpoint with no template (its engine never started: nothing
    reaches it): a 400 that says what to do; the model card and the page say it too."""
    options = ServeOptions(init_from=str(chat_checkpoint(tmp_path, steps=1, template={})))
    loaded = supervisor.load_for_serving(Config(), options)
    engine = BatchEngine(loaded.model, loaded.model, loaded.tokenizer, torch.device("cpu"),
                         slots=1, max_queue=1, warmup=False)
    engine.ready.set()
    served = ServedModel("plain", 128, TOKENIZER.vocab_size, options, loaded.template)
    client = TestClient(create_app(engine, served, loaded.tokenizer))
    r = client.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the model 'plain' has no chat template (its checkpoint's meta.json has no "
        "\"template\"): finetune it on instruction data to give it one, or send the text as "
        "a prompt to POST /v1/completions")
    assert client.get("/v1/models").json()["data"][0]["chat_template"] is False
    assert 'data-chat="false"' in client.get("/").text


@pytest.mark.parametrize("name, beyond", [("temperature", 2.5), ("top_p", 1.5), ("top_k", -1),
                                          ("seed", -1)])
def test_each_sampling_limit_is_one_definition_for_generate_and_both_requests(name, beyond):
    """The limits of a sampling field are its config field's check (config.py): generate.py's
    options, a completion request and a chat request refuse the same value."""
    from pydantic import ValidationError

    from config import validate
    from engine.serving.chat import ChatRequest

    cfg = Config()
    setattr(cfg.system if name == "seed" else cfg.sample, name, beyond)
    assert [p for p in validate(cfg) if p.split(".", 1)[1].startswith(f"{name} must be")]
    with pytest.raises(ValidationError):
        SamplingParams(**{name: beyond})
    with pytest.raises(ValidationError):
        ChatRequest(messages=[], **{name: beyond})
    within = {"temperature": 2.0, "top_p": 1.0, "top_k": 0, "seed": 0}[name]
    assert getattr(ChatRequest(messages=[], **{name: within}), name) == within


def test_a_chat_request_relays_every_sampling_field_to_its_completion():
    """A field added to batching.Sampling reaches the completion a chat request runs as, with
    the value the request gave (no list of the fields to keep in step)."""
    from engine.serving.batching import Sampling
    from engine.serving.chat import ChatRequest

    sent = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "stop": ["\n"]}
    assert set(sent) == set(Sampling.model_fields)  # a new field: give it a value here
    fields = ChatRequest(messages=[], **sent).completion_fields(4, 32, 16)
    assert {name: fields[name] for name in Sampling.model_fields} == sent
