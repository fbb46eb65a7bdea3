"""The OpenAI-compatible server (gyges/serve/) on localhost, driven by the official `openai`
client and by raw HTTP: real text from the packaged SmolLM2, streams that span a live
3xTP1 -> TP3 merge unchanged, the API's errors and security, and 50 concurrent streams with
random disconnects that leave every KV page as it was."""
import http.client
import json
import random
import threading
import time

import pytest

import gyges
from packaged import NAME, needs_packaged_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from gyges.serve import Server  # noqa: E402

KEY = "test-key-123"


pytestmark = needs_packaged_model


@pytest.fixture(scope="module")
def host():
    h = gyges.Host(gyges.Model.load(NAME), workers=3, memory_per_worker="768MiB",
                   layout="3xTP1", max_batch_tokens=256)
    yield h
    h.close()


@pytest.fixture(scope="module")
def secure(host):
    """Key and admin endpoints on."""
    s = Server(host, NAME, port=0, api_key=KEY, enable_admin=True, max_body_bytes=64 << 10).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(host):
    """The defaults: no key, no admin endpoints."""
    s = Server(host, NAME, port=0).start()
    yield s
    s.stop()


def client(server, key=KEY):
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)


def raw(server, method, path, body=None, key=KEY, headers=None):
    """(status, parsed JSON or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def wait_idle(host, timeout=60):
    deadline = time.monotonic() + timeout
    while host.has_unfinished():
        assert time.monotonic() < deadline, "requests still unfinished"
        time.sleep(0.05)


def test_models_chat_and_completions_with_the_openai_client(secure):
    c = client(secure)
    assert [m.id for m in c.models.list().data] == [NAME]
    chat = c.chat.completions.create(model=NAME, temperature=0, max_tokens=40, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens > 10 and chat.usage.total_tokens == \
        chat.usage.prompt_tokens + chat.usage.completion_tokens
    done = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12,
                                temperature=0)
    streamed = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert "".join(pieces) == done.choices[0].text and done.choices[0].text.startswith(" Paris")
    assert usage.completion_tokens == done.usage.completion_tokens == 12
    assert done.choices[0].finish_reason == "length"
    stop = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12,
                                temperature=0, stop=["."])
    assert stop.choices[0].text == " Paris" and stop.choices[0].finish_reason == "stop"
    chat_stream = c.chat.completions.create(model=NAME, temperature=0, max_tokens=40, stream=True,
                                            messages=[{"role": "user", "content": "What is the "
                                                       "capital of France?"}])
    text = "".join(ch.choices[0].delta.content or "" for ch in chat_stream if ch.choices)
    assert text == chat.choices[0].message.content


def test_a_stream_that_spans_a_live_merge_has_the_same_text(secure, host):
    c = client(secure)
    prompt, n = "Write a short story about a lighthouse keeper.", 48
    want = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert host.layout() == "3xTP1"
    stream = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    pieces, merged = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if len(pieces) == 10:  # mid-stream: merge the three workers into one TP3 instance
            merged = raw(secure, "POST", "/admin/transform", {"workers": [0, 1, 2], "tp": 3})
    assert merged[0] == 200 and merged[1]["layout"] == "TP3", merged
    assert "".join(pieces) == want
    # and back, while another stream runs
    stream = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if len(pieces) == 20:
            assert raw(secure, "POST", "/admin/transform",
                       {"workers": [0, 1, 2], "tp": 1})[1]["layout"] == "3xTP1"
    assert "".join(pieces) == want and host.layout() == "3xTP1"


@pytest.mark.parametrize("method, path, body, status, says", [
    ("POST", "/v1/completions", "{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n="),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs is not supported"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt must be"),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop must be"),
    ("POST", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "unknown field"),
    ("POST", "/v1/completions", {"prompt": "word " * 9000}, 400, "context"),
    ("POST", "/v1/completions", {"prompt": "x" * 70000}, 413, "over"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("GET", "/v1/nothing", None, 404, "no endpoint"),
])
def test_bad_requests_get_openai_style_errors(secure, method, path, body, status, says):
    code, reply = raw(secure, method, path, body)
    assert code == status, reply
    assert says in reply["error"]["message"] and reply["error"]["type"]


def test_keys_and_admin_endpoints(secure, open_server):
    assert raw(secure, "GET", "/v1/models", key=None)[0] == 401
    code, reply = raw(secure, "GET", "/v1/models", key="wrong")
    assert code == 401 and reply["error"]["type"] == "authentication_error"
    assert raw(secure, "POST", "/admin/transform", {"workers": [0], "tp": 1}, key=None)[0] == 401
    assert raw(secure, "GET", "/admin/layout")[1]["layout"] in ("3xTP1", "TP3")
    assert raw(secure, "GET", "/health", key=None)[0] == 200
    # the defaults: loopback only, no key asked, no admin endpoints at all
    assert open_server.bind == "127.0.0.1"
    assert raw(open_server, "GET", "/v1/models", key=None)[0] == 200
    assert raw(open_server, "POST", "/admin/transform", {"workers": [0, 1, 2], "tp": 3})[0] == 404
    code, reply = raw(secure, "POST", "/admin/transform", {"workers": [0, 1], "tp": 2})
    assert code == 400 and "aligned group" in reply["error"]["message"]
    with pytest.raises(gyges.InvalidArgumentError, match="needs an api_key"):
        Server(secure.host, NAME, port=0, enable_admin=True)


def _stream_and_maybe_drop(server, i, drop, results):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"model": NAME, "prompt": f"Request {i}: tell me about the number {i}.",
            "max_tokens": 24, "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    events, finish = 0, None
    for line in r:
        if line.startswith(b"data: [DONE]"):
            finish = finish or "no reason"
        elif line.startswith(b"data: "):
            events += 1
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            if drop and events == 3:
                break  # the client goes away mid-stream
    conn.close()
    results[i] = (drop, finish)


def test_fifty_concurrent_streams_with_disconnects_leak_nothing(secure, host):
    wait_idle(host)
    before = [m["in_use"] for m in host.memory()]
    rng = random.Random(7)
    results = {}
    threads = [threading.Thread(target=_stream_and_maybe_drop,
                                args=(secure, i, rng.random() < 0.4, results)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_idle(host)
    assert len(results) == 50
    kept = [finish for drop, finish in results.values() if not drop]
    assert kept and all(f == "length" for f in kept)  # every kept stream ran to its end
    stats = host.stats()
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
    assert [m["in_use"] for m in host.memory()] == before
    metrics = raw(secure, "GET", "/metrics", key=None)[1]
    assert 'gyges:request_success_total{model_name="smollm2-135m-instruct",finished_reason="abort"}' \
        in metrics
    assert "gyges:time_to_first_token_seconds_bucket" in metrics
    assert "gyges:kv_cache_usage_perc" in metrics
