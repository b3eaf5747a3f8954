"""serve.py in production: the API key, OpenAI-shaped errors for every bad request (the body
not UTF-8, nested too deeply, over the size cap; an unknown route, a wrong method), and the
Prometheus metrics, summed over --workers; the workers' one shared copy of the weights. Two
server subprocesses per module (test_serve.py's Server on a tiny checkpoint): one worker with the
key from the environment, two workers with the key from --api-key; and one test's own server of
two workers on a model large enough to see in their memory."""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_serve import CHARS, MAX_TOKENS_LIMIT, WAIT_S, Server, open_stream, tiny_checkpoint

import serve
from config import Config
from engine import saving
from engine.serving.options import API_KEY_ENV, ServeOptions
from model import GPT, ModelConfig

ENV_KEY, OPTION_KEY = "key-from-the-environment", "key-from-the-option"
MAX_BODY = 16384
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """One worker; the key from GPT2S_API_KEY; a 16 KiB body cap."""
    tmp = tmp_path_factory.mktemp("guarded")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, ENV_KEY)
        server = Server(tiny_checkpoint(tmp / "run"), tmp / "serve.log",
                        f"--max-body-bytes={MAX_BODY}")
    server.key = ENV_KEY
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """--workers 2; the key from --api-key, which wins over the environment's."""
    tmp = tmp_path_factory.mktemp("workers")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, ENV_KEY)
        server = Server(tiny_checkpoint(tmp / "run"), tmp / "serve.log", "--workers=2",
                        f"--api-key={OPTION_KEY}")
    server.key = OPTION_KEY
    yield server
    server.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response with this status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def samples_of(text: str) -> dict[tuple, float]:
    """Prometheus' text format -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple, float]:
    """/metrics, without the key."""
    r = httpx.get(f"{url}/metrics", timeout=WAIT_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples_of(r.text)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def greedy(client: httpx.Client, key: str, n: int) -> None:
    """n completions of 5 greedy tokens for the 5-token prompt 'hello', one after another."""
    for _ in range(n):
        r = client.post(COMPLETIONS, headers=auth(key), json={
            "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_without_the_key_v1_answers_401_and_health_and_metrics_stay_open(guarded):
    for r in (httpx.post(f"{guarded.url}{COMPLETIONS}", json={"prompt": "ab"}),
              httpx.post(f"{guarded.url}/v1/chat/completions", json={"messages": []}),
              httpx.get(f"{guarded.url}/v1/models")):
        error = error_of(r, 401)
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "no API key: send the header 'Authorization: Bearer KEY'" in error["message"]
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


@pytest.mark.parametrize("authorization", [f"Bearer {ENV_KEY}x", "Bearer", ENV_KEY,
                                           f"Basic {ENV_KEY}"])
def test_a_wrong_key_answers_401(guarded, authorization):
    r = httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": authorization})
    assert "the API key is not valid" in error_of(r, 401)["message"]


def test_the_openai_client_with_the_right_key_and_a_wrong_one(guarded):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=key, max_retries=0,
                             timeout=WAIT_S)

    out = client(ENV_KEY).completions.create(model="tiny", prompt="ab", max_tokens=4,
                                             temperature=0)
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
        client("wrong").models.list()


def test_the_option_wins_over_the_environment(two_workers, monkeypatch):
    for key, status in ((OPTION_KEY, 200), (ENV_KEY, 401)):
        assert httpx.get(f"{two_workers.url}/v1/models", headers=auth(key)).status_code == status
    monkeypatch.setenv(API_KEY_ENV, ENV_KEY)
    assert ServeOptions(api_key=OPTION_KEY).effective_api_key() == OPTION_KEY
    assert ServeOptions().effective_api_key() == ENV_KEY
    assert OPTION_KEY not in repr(ServeOptions(api_key=OPTION_KEY))  # logs never show it


def test_a_public_host_without_a_key_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    ckpt = tiny_checkpoint(tmp_path)
    assert serve.main([f"--checkpoint={ckpt}", "--host=0.0.0.0", "--device=cpu"]) == 2
    assert capsys.readouterr().err == (
        "error: --host 0.0.0.0 is reachable from other machines but no API key is set; pass "
        "--api-key KEY (or set GPT2S_API_KEY), or --allow-no-key true to serve without one\n")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        ServeOptions(host=host).check()  # loopback: no key needed
    ServeOptions(host="0.0.0.0", allow_no_key=True).check()
    ServeOptions(host="0.0.0.0", api_key="k").check()
    monkeypatch.setenv(API_KEY_ENV, "k")
    ServeOptions(host="10.1.2.3").check()


def test_the_help_says_the_body_cap(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    line = next(line for line in capsys.readouterr().out.splitlines() if "--max-body-bytes" in line)
    assert "--max-body-bytes=1048576" in line and "413" in line and "1 MiB" in line


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "ab\xff\xfe"}', "not valid UTF-8 JSON: send a JSON object encoded in UTF-8"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply to parse"),
])
def test_a_body_that_cannot_be_parsed_gets_an_openai_error(guarded, content, message):
    r = httpx.post(f"{guarded.url}{COMPLETIONS}", content=content, timeout=WAIT_S,
                   headers={"Content-Type": "application/json", **auth(guarded.key)})
    error = error_of(r, 400)
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_an_unknown_route_and_a_wrong_method_get_openai_errors(guarded):
    for path in ("/nowhere", "/v1/embeddings"):
        r = httpx.post(f"{guarded.url}{path}", json={}, headers=auth(guarded.key))
        message = error_of(r, 404)["message"]
        assert message.startswith(f"there is no route {path}; this server has ")
        assert "POST /v1/completions" in message and "GET /metrics" in message
        assert "POST /v1/chat/completions" in message
    r = httpx.get(f"{guarded.url}{COMPLETIONS}", headers=auth(guarded.key))
    assert error_of(r, 405)["message"] == "/v1/completions does not take GET; use POST"
    assert r.headers["Allow"] == "POST"


def test_a_body_over_the_cap_with_content_length_gets_413(guarded):
    body = json.dumps({"prompt": "a" * MAX_BODY})
    r = httpx.post(f"{guarded.url}{COMPLETIONS}", content=body, timeout=WAIT_S,
                   headers={"Content-Type": "application/json", **auth(guarded.key)})
    assert "over this server's limit of 16,384 bytes" in error_of(r, 413)["message"]
    assert "--max-body-bytes" in error_of(r, 413)["message"]


def test_a_chunked_body_over_the_cap_gets_413_before_it_ends(guarded):
    """Chunks past the cap, and no last chunk: the answer comes while the body is unfinished."""
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                     f"{guarded.key}\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b'{"prompt": "' + b"a" * 4096
        for _ in range(MAX_BODY // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        error = json.loads(response.read())["error"]
    assert "over this server's limit of 16,384 bytes" in error["message"]


def test_metrics_count_requests_tokens_and_latencies(guarded):
    before = scrape(guarded.url)
    with httpx.Client(base_url=guarded.url, timeout=WAIT_S) as client:
        greedy(client, guarded.key, 3)
        assert client.post(COMPLETIONS, json={"prompt": "ab"}).status_code == 401
        assert client.get("/nowhere").status_code == 404
    after = scrape(guarded.url)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("gpt2s_requests_total", route=COMPLETIONS, status="200") == 3
    assert moved("gpt2s_requests_total", route=COMPLETIONS, status="401") == 1
    assert moved("gpt2s_requests_total", route="unmatched", status="404") == 1
    assert moved("gpt2s_completion_tokens_total") == 15
    assert moved("gpt2s_prompt_tokens_total") == 15
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"gpt2s_{histogram}_seconds"
        assert moved(f"{name}_count") == 3 and moved(f"{name}_sum") > 0
        assert moved(f"{name}_bucket", le="60.0") == 3
    assert value(after, "gpt2s_slots") == 4


def test_gauges_show_busy_slots_and_the_queue_and_503s_are_counted(guarded):
    def until(condition) -> dict:
        deadline = time.monotonic() + WAIT_S
        while not condition(samples := scrape(guarded.url)):
            assert time.monotonic() < deadline, samples
            time.sleep(0.05)
        return samples

    def busy(slots: int, queued: int):
        return lambda s: (value(s, "gpt2s_busy_slots"), value(s, "gpt2s_queue_depth")) == (
            slots, queued)

    rejected = value(scrape(guarded.url), "gpt2s_requests_total", route=COMPLETIONS,
                     status="503")
    with httpx.Client(base_url=guarded.url, timeout=WAIT_S, headers=auth(guarded.key)) as client:
        with contextlib.ExitStack() as stack:
            for _ in range(8):  # 4 slots + 4 queued
                open_stream(client, stack, MAX_TOKENS_LIMIT)
            until(busy(4, 4))
            r = httpx.post(f"{guarded.url}{COMPLETIONS}", json={"prompt": "ab"},
                           headers=auth(guarded.key), timeout=WAIT_S)
            assert r.status_code == 503
    samples = until(busy(0, 0))
    assert value(samples, "gpt2s_requests_total", route=COMPLETIONS, status="503") == rejected + 1


def connection_to(url: str, pid: int, stack: contextlib.ExitStack) -> httpx.Client:
    """A keep-alive client whose connection a given worker accepted."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        client = httpx.Client(base_url=url, timeout=WAIT_S)
        if client.get("/health").json()["worker_pid"] == pid:
            stack.callback(client.close)
            return client
        client.close()
    raise AssertionError(f"no connection reached worker {pid}")


def worker_pids(server: Server) -> set[int]:
    deadline, pids = time.monotonic() + WAIT_S, set()
    while len(pids) < 2:
        assert time.monotonic() < deadline, pids
        pids.add(httpx.get(f"{server.url}/health", timeout=WAIT_S).json()["worker_pid"])
    return pids


def test_metrics_are_summed_over_two_workers(two_workers):
    """3 completions on one worker's connection, 2 on the other's, at once: either worker's
    /metrics reports all 5."""
    before = scrape(two_workers.url)
    with contextlib.ExitStack() as stack:
        clients = [connection_to(two_workers.url, pid, stack) for pid in worker_pids(two_workers)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(greedy, clients, [two_workers.key] * 2, [3, 2]))
        texts = [c.get("/metrics").text for c in clients]  # each worker answers once

    for after in map(samples_of, texts):
        assert (value(after, "gpt2s_requests_total", route=COMPLETIONS, status="200")
                - value(before, "gpt2s_requests_total", route=COMPLETIONS, status="200")) == 5
        assert (value(after, "gpt2s_completion_tokens_total")
                - value(before, "gpt2s_completion_tokens_total")) == 25
        assert (value(after, "gpt2s_time_to_first_token_seconds_count")
                - value(before, "gpt2s_time_to_first_token_seconds_count")) == 5
        assert value(after, "gpt2s_slots") == 8  # 4 per worker


def test_a_dead_worker_leaves_the_gauges_and_its_counts_stay(two_workers):
    """The worker killed has served a request: its counts stay in the sums, its gauges go."""
    pid = min(worker_pids(two_workers))
    with contextlib.ExitStack() as stack:
        greedy(connection_to(two_workers.url, pid, stack), two_workers.key, 1)
    before = scrape(two_workers.url)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while len(re.findall(r"worker \d \(pid \d+\) ready", two_workers.log.read_text())) < 3:
        assert time.monotonic() < deadline, two_workers.log.read_text()
        time.sleep(0.05)
    after = scrape(two_workers.url)
    assert value(after, "gpt2s_slots") == 8  # the dead worker's 4 left, the new one's came
    for name in ("gpt2s_completion_tokens_total", "gpt2s_prompt_tokens_total"):
        assert value(after, name) == value(before, name) > 0


def ready_workers(server: Server, count: int) -> list[int]:
    """The pids of the first `count` workers to be warmed up, once they are (/health answers
    from any worker, warming up or not)."""
    deadline = time.monotonic() + WAIT_S
    while len(pids := re.findall(r"worker \d \(pid (\d+)\) ready", server.log.read_text())) < count:
        assert server.proc.poll() is None, server.log.read_text()
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.05)
    return [int(pid) for pid in pids]


def wide_checkpoint(out_dir: Path) -> tuple[Path, int]:
    """A random model 2048 wide: 384 MiB of float32 weights, several times the ~100 MiB a worker
    holds of its own (its imports, KV cache, buffers) -> (checkpoint, weight bytes)."""
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = ModelConfig(block_size=32, vocab_size=len(CHARS), n_layer=2, n_head=16,
                            n_embd=2048)
    model = GPT(cfg.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    meta = {"tokenizer": {"kind": "char", "chars": CHARS}}
    return saving.save(out_dir, 1, model, cfg, meta), weight_bytes


def memory_of(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's totals in bytes: Rss, Pss, Shared_Clean, Private_Dirty ..."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                if line.rstrip().endswith(" kB")}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                    reason="reads each worker's shared and private memory in "
                           "/proc/PID/smaps_rollup (Linux 4.14+), which this system lacks")
def test_two_workers_share_one_copy_of_the_weights(tmp_path):
    """Each worker has served a request, so the weights are in its memory, yet under half of
    their bytes are in pages of its own: it reads the supervisor's copy, shared copy-on-write.
    A worker that loaded or copied the weights would hold all of them privately."""
    ckpt, weight_bytes = wide_checkpoint(tmp_path / "run")
    # no warm-up: each worker's request runs the same forward, in seconds fewer on this model
    server = Server(ckpt, tmp_path / "serve.log", "--workers=2", "--warmup=false")
    try:
        with contextlib.ExitStack() as stack:
            pids = ready_workers(server, 2)
            for pid in pids:
                r = connection_to(server.url, pid, stack).post(COMPLETIONS, json={
                    "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        for pid in pids:
            memory = memory_of(pid)
            private = memory["Private_Clean"] + memory["Private_Dirty"]
            shared = memory["Shared_Clean"] + memory["Shared_Dirty"]
            assert private < weight_bytes / 2 and shared > weight_bytes, \
                f"worker {pid}: {private >> 20} MiB private, {shared >> 20} MiB shared, " \
                f"weights {weight_bytes >> 20} MiB"
    finally:
        server.stop()


def test_sigterm_removes_the_metrics_folder(two_workers):
    """Last: it stops the module's second server."""
    folder = re.search(r"metrics of every worker in (\S+)", two_workers.log.read_text())[1]
    assert os.path.isdir(folder) and os.listdir(folder)
    two_workers.proc.send_signal(signal.SIGTERM)
    assert two_workers.proc.wait(timeout=WAIT_S) == 0
    assert not os.path.exists(folder)
