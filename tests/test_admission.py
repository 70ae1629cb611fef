"""Admission and untrusted input at the HTTP edge: the queue is bounded (429 with Retry-After), bodies
are bounded (413, unread), authentication comes before the body, unimplemented chat fields are 400s
naming the field, stop strings and prompts x n are bounded, and a 405 says what is allowed.

A flood of concurrent requests against a small queue: every request gets 200 or 429, none hangs,
and the KV cache is empty afterwards.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest import InProcessServer

MODEL = "tiny"
KEY = "sk-guard"
MESSAGES = [{"role": "user", "content": "hi"}]


def build(tiny_pair, **options):
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from server.metrics import Metrics
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=2))
    app = create_app(engine, load_tokenizer(str(target)), MODEL, metrics=Metrics(MODEL, engine.method), **options)
    return engine, InProcessServer(app)


@pytest.fixture(scope="module")
def guarded(tiny_pair):
    engine, server = build(tiny_pair, api_key=KEY, max_body_size=4096, max_num_waiting=4)
    with server:
        yield engine, server.url


def auth(**headers) -> dict:
    return {"authorization": f"Bearer {KEY}", **headers}


def test_a_flood_gets_200s_and_429s_and_leaves_the_cache_empty(guarded):
    engine, url = guarded

    async def one(http, i):
        body = {"model": MODEL, "prompt": f"flood {i}", "max_tokens": 24, "ignore_eos": True, "stream": i % 2 == 0}
        response = await http.post(url + "/v1/completions", json=body, headers=auth())
        return response

    async def flood():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(40))), 120)

    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    error = rejected.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded" and "waiting" in error["message"]
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.requests
    metrics = httpx.get(url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("specserve:num_requests_rejected_total"))
    assert float(line.rsplit(" ", 1)[1]) == codes.count(429)


def test_auth_comes_before_the_body_and_bodies_are_bounded(guarded):
    _, url = guarded
    # A wrong key is a 401 even with a body that could not be parsed: the body is never read.
    response = httpx.post(url + "/v1/completions", content=b"{not json", headers={"authorization": "Bearer nope"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}
    response = httpx.post(url + "/v1/completions", json=big, headers=auth())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():   # no Content-Length: the limit counts what arrives
        for _ in range(10):
            yield b" " * 1000
    response = httpx.post(url + "/v1/completions", content=chunks(), headers=auth(**{"content-type": "application/json"}))
    assert response.status_code == 413
    assert httpx.get(url + "/health").status_code == 200   # probes need no key
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
                      headers=auth()).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f g"}}]), ("tools", {"f": {}}),
    ("tool_choice", "auto"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("response_format", {"type": "xml"}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
    ("structured_outputs", {"regex": "[0-9"}), ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"choice": []}), ("structured_outputs", {"xml": "<a/>"}),
])
def test_bad_chat_fields_are_400s_naming_them(guarded, field, value):
    _, url = guarded
    response = httpx.post(url + "/v1/chat/completions", headers=auth(),
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_what_is_the_same_as_not_asking_passes(guarded):
    _, url = guarded
    for extra in ({"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"tools": []}):
        response = httpx.post(url + "/v1/chat/completions", headers=auth(),
                              json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra})
        assert response.status_code == 200, (extra, response.text)


def test_stop_strings_and_choices_are_bounded(tiny_pair):
    _, server = build(tiny_pair)   # no key, no body limit to speak of
    with server:
        def completion(**body):
            return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                   **body}, timeout=30)
        for stop in (["s"] * 17, ["x" * 513]):
            response = completion(stop=stop)
            assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
        assert completion(stop=["s"] * 16).status_code == 200
        response = completion(prompt=["a"] * 3, n=100)
        assert response.status_code == 400 and "at most 256 choices" in response.json()["error"]["message"]
        response = httpx.delete(server.url + "/v1/completions")
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_watchdog_marks_a_stuck_engine_unhealthy(tiny_pair, monkeypatch):
    import threading
    engine, server = build(tiny_pair, watchdog_timeout=0.5)
    release = threading.Event()
    step = engine.step

    def hanging_step():   # the second step hangs until released: a stuck kernel, a deadlock
        if engine.last_stats is not None:
            release.wait(30)
        return step()
    monkeypatch.setattr(engine, "step", hanging_step)
    with server, httpx.Client(timeout=30) as http:
        assert http.get(server.url + "/health").status_code == 200
        body = {"model": MODEL, "prompt": "stuck", "max_tokens": 4, "ignore_eos": True}
        with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
            deadline = time.monotonic() + 10
            while (health := http.get(server.url + "/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled", health.text
            release.set()
            assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        assert http.get(server.url + "/health").status_code == 200


def test_openapi_documents_the_errors_really_sent(guarded):
    _, url = guarded
    schema = httpx.get(url + "/openapi.json", headers=auth()).json()
    assert "ErrorResponse" in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            codes = set(operation["responses"])
            assert "422" not in codes, path
            assert {"400", "401", "404", "413", "429", "500", "503"} <= codes, (path, codes)


@pytest.mark.slow   # a real server fuzzed
def test_schemathesis_finds_no_server_errors(tiny_pair, tmp_path):
    """Requests generated from /openapi.json (schemathesis, a few examples per operation): every
    answer is below 500 and follows the documented schema of its status."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    _, server = build(tiny_pair)
    with server:
        result = subprocess.run([exe, "run", server.url + "/openapi.json", "--checks",
                                 "not_a_server_error,status_code_conformance,content_type_conformance",
                                 "--max-examples", "8", "--request-timeout", "30", "--phases", "examples,fuzzing", "--seed", "1"],
                                capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
