"""Lifecycle under hostile clients: a stream whose client leaves while nothing is being written is
aborted at once (also while its grammar waits to compile: the compile is cancelled); connections
that trickle their head or body (slowloris) are cut off while the server serves others; past
limit_concurrency connections a request gets 503. Each test ends with the same server serving a
normal request.

One in-process server (a tiny random model, the engine on a thread) with small connection limits,
started as `specserve serve` starts its own (server.http.uvicorn_config).
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from conftest import free_port, wait_until_idle
from helpers import one_worker_queue

MODEL = "tiny"
LIMITS = dict(limit_concurrency=6, timeout_keep_alive=5.0, header_timeout=2.0, body_timeout=2.0)
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


class AsgiSpecVersion:
    """Test wrapper: a request with `x-asgi-spec: 2.4` is served as by an ASGI 2.4 server, under
    which Starlette no longer listens for the client's disconnect while it streams."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        version = dict(scope.get("headers") or []).get(b"x-asgi-spec")
        if scope["type"] == "http" and version is not None:
            scope = {**scope, "asgi": {**scope["asgi"], "spec_version": version.decode()}}
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def served(tiny_pair):
    """(url, engine) of a running server."""
    import torch
    import uvicorn

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    from server.http import ConnectionLimits, uvicorn_config

    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4))
    app = AsgiSpecVersion(create_app(engine, load_tokenizer(str(target)), MODEL))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, ConnectionLimits(**LIMITS), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(15)


def serves_a_normal_request(url: str) -> None:
    reply = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def slowed(engine, monkeypatch, seconds: float) -> None:
    """Each engine step takes at least `seconds`: a generation runs long enough to leave mid-way."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


# ---- a stream whose client leaves ----------------------------------------------------------------

@pytest.mark.parametrize("asgi_spec", ["2.3", "2.4"])
def test_a_held_back_stream_is_aborted_when_its_client_leaves(served, monkeypatch, asgi_spec):
    """Every token of this stream stays held back (its text so far is always the start of its stop
    string), so the stream writes nothing after its headers. Its client leaves: the engine request
    is aborted and its KV freed within a second, under uvicorn's ASGI 2.3 and under an ASGI 2.4
    server, where Starlette does not watch for the disconnect."""
    url, engine = served
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert 0 < len(text) < 500
    slowed(engine, monkeypatch, 0.1)   # 40 tokens: four seconds
    stream = {**body, "stream": True, "stop": [text + "\u2603"]}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json=stream, headers={"x-asgi-spec": asgi_spec}) as reply:
            assert reply.status_code == 200
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health").json()["num_requests"] == 0:
                assert time.monotonic() < deadline, "the stream's request never reached the engine"
                time.sleep(0.02)
            time.sleep(0.3)   # generating, writing nothing
            assert engine.requests and not any(r.is_finished for r in engine.requests.values())
        left = time.monotonic()   # the response is closed: the client is gone
    wait_until_idle(url, timeout=1.0)   # no request left in the engine, every KV block free
    assert time.monotonic() - left < 1.0
    monkeypatch.undo()
    serves_a_normal_request(url)


def test_a_stream_that_leaves_while_its_grammar_waits_cancels_the_compile(served, monkeypatch):
    """A constrained stream whose compile waits behind another (one compile worker, held busy): its
    client leaves before anything is written. The request is aborted, its queued compile never
    runs, and once the first compile ends both the engine and the queue are empty."""
    url, engine = served
    queue, release, compiled = one_worker_queue(engine, monkeypatch)
    busy = {"model": MODEL, "prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{3}"}}
    first = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=busy, timeout=60))
    first.start()
    deadline = time.monotonic() + 30
    while compiled != ["regex"]:
        assert time.monotonic() < deadline, compiled
        time.sleep(0.02)
    waiting = {"model": MODEL, "prompt": "b", "max_tokens": 4, "stream": True,
               "structured_outputs": {"choice": ["yes", "no"]}}
    with httpx.Client(timeout=30) as client, client.stream("POST", url + "/v1/completions", json=waiting) as reply:
        assert reply.status_code == 200
        while len(queue) < 2:   # both wait for the one worker
            assert time.monotonic() < deadline
            time.sleep(0.02)
    left = time.monotonic()
    while len(queue) > 1:
        assert time.monotonic() - left < 1.0, "the stream's request is still queued after its client left"
        time.sleep(0.02)
    release.set()
    first.join(30)
    wait_until_idle(url, timeout=5.0)
    assert compiled == ["regex"] and len(queue) == 0, compiled
    monkeypatch.undo()
    serves_a_normal_request(url)


# ---- slowloris ---------------------------------------------------------------------------------

def trickle(port: int, head: bytes, drip: bytes, interval: float = 0.25, limit: float = 10.0) -> tuple[bytes, float]:
    """Send `head`, then `drip` a byte at a time every `interval` seconds until the server answers
    or closes; returns (what it answered, seconds from the connection's opening, where the server's head
    deadline starts)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.settimeout(interval)
        reply = b""
        for i in range(int(limit / interval)):
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
            except socket.timeout:
                pass
            try:
                sock.sendall(drip[i % len(drip):i % len(drip) + 1])
            except OSError:
                break
        return reply, time.monotonic() - started


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_client_trickling_its_request_is_cut_off_while_others_are_served(served, part):
    """A request whose head (or body) comes a byte at a time gets a 408 and its connection closed
    header_timeout (body_timeout) seconds in; normal requests are served meanwhile."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    if part == "body":
        head += b"content-length: 1000\r\n\r\n"
    drip = b"x-slow: " + b"a" * 64 if part == "head" else b'{"prompt": "' + b"a" * 64
    outcome = {}
    slow = threading.Thread(target=lambda: outcome.update(result=trickle(port, head, drip)))
    slow.start()
    time.sleep(0.5)
    served_meanwhile = 0
    while slow.is_alive() and served_meanwhile < 3:
        serves_a_normal_request(url)
        served_meanwhile += 1
    slow.join(15)
    reply, seconds = outcome["result"]
    assert served_meanwhile >= 1
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 2.0 <= seconds < 5.0, seconds
    if part == "body":
        assert b'"code":"request_timeout"' in reply.replace(b" ", b""), reply
    serves_a_normal_request(url)


def test_past_limit_concurrency_a_request_gets_503(served):
    """limit_concurrency counts open connections: with the limit's worth held open (idle), a new
    request is answered 503 at once; once they close, the server serves again."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS["limit_concurrency"] - 1)]
    try:
        time.sleep(0.2)   # accepted
        started = time.monotonic()
        reply = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30)
        assert reply.status_code == 503 and time.monotonic() - started < 1.0, reply.text
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    serves_a_normal_request(url)


def test_idle_connections_are_closed_by_the_header_timeout(served):
    """A connection that sends nothing is closed header_timeout seconds in, freeing its place under
    limit_concurrency (uvicorn alone would keep it open forever)."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.settimeout(10)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and sock.recv(65536) == b""
        assert 2.0 <= time.monotonic() - started < 5.0
    serves_a_normal_request(url)


# ---- configuration -------------------------------------------------------------------------------

def test_connection_limits_and_the_tensor_parallel_timeout_are_configuration(tiny_pair):
    """Flags, SPECSERVE_* variables and YAML keys (one OPTIONS table) reach uvicorn's Config and the
    engine's; nonsense values are errors naming the key."""
    from server.config import ConfigError, load_config
    from server.http import ConnectionLimits, uvicorn_config

    model = str(tiny_pair[0])
    config = load_config(None, {"model": model, "limit_concurrency": "7", "header_timeout": "3.5",
                                "tensor_parallel_timeout": "20"},
                         environ={"SPECSERVE_BODY_TIMEOUT": "9", "SPECSERVE_TIMEOUT_KEEP_ALIVE": "2"})
    assert (config.limit_concurrency, config.header_timeout, config.body_timeout, config.timeout_keep_alive) == \
        (7, 3.5, 9.0, 2.0)
    assert config.engine.tensor_parallel_timeout == 20.0
    uv = uvicorn_config(lambda *_: None, "127.0.0.1", 0, ConnectionLimits(7, 2.0, 3.5, 9.0))
    assert (uv.limit_concurrency, uv.timeout_keep_alive, uv.app.timeout) == (7, 2.0, 9.0)
    for key, bad in [("limit_concurrency", "0"), ("header_timeout", "0"), ("body_timeout", "-1"),
                     ("timeout_keep_alive", "0"), ("tensor_parallel_timeout", "0")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, {"model": model, key: bad}, environ={})
