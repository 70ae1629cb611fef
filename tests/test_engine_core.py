"""The engine core in its own process: real `specserve serve` processes.

- the default server runs Engine.step() in a child process and says so on /health;
- `--engine-core thread` keeps the loop on a thread of the API process, with the same answers;
- when the engine process dies, the streams in flight end with an error event and [DONE], /health
  answers 503 (or nothing: the server is on its way out) and the server exits non-zero, so that
  an orchestrator restarts it.
"""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from conftest import ServerProcess, sse_events

pytestmark = pytest.mark.slow   # real server processes

MODEL = "tiny"
FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
         "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def servers(tiny_pair, tmp_path_factory):
    target, _ = tiny_pair
    logs = tmp_path_factory.mktemp("engine_core_logs")
    process = ServerProcess(["--model", str(target), *FLAGS, "--engine-threads", "1"], log_path=logs / "process.log")
    thread = ServerProcess(["--model", str(target), *FLAGS, "--engine-core", "thread"], log_path=logs / "thread.log")
    process.start()
    thread.start()
    try:
        yield process.wait_ready(), thread.wait_ready()
    finally:
        process.stop()
        thread.stop()


def completion(url: str, **body) -> dict:
    body = {"model": MODEL, "prompt": "the engine core", "max_tokens": 24, "temperature": 0, **body}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_engine_runs_in_its_own_process_and_answers_as_the_thread_does(servers):
    process, thread = servers
    health = httpx.get(process.url + "/health").json()
    assert health["engine"] == "process" and health["engine_threads"] == 1
    assert health["engine_pid"] != process.process.pid
    assert os.path.exists(f"/proc/{health['engine_pid']}")
    assert httpx.get(thread.url + "/health").json()["engine"] == "thread"
    for body in ({}, {"n": 2, "temperature": 0.8, "seed": 7}, {"logprobs": 2, "echo": True, "max_tokens": 4}):
        a, b = completion(process.url, **body), completion(thread.url, **body)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        assert a["usage"] == b["usage"]
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    assert "engine=process (1 threads)" in process.log()


def test_bad_input_is_a_400_from_across_the_process_boundary(servers):
    process, _ = servers
    response = httpx.post(process.url + "/v1/completions", json={"model": MODEL, "prompt": [[10 ** 6]]}, timeout=30)
    assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]
    assert completion(process.url)["choices"][0]["finish_reason"] == "length"   # and it serves on


def test_metrics_cross_the_process_boundary(servers):
    process, _ = servers
    completion(process.url, max_tokens=5)
    text = httpx.get(process.url + "/metrics").text
    generated = [line for line in text.splitlines() if line.startswith("specserve:generation_tokens_total")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 5


def test_a_dead_engine_process_fails_streams_and_exits_non_zero(tiny_pair, tmp_path):
    target, _ = tiny_pair
    server = ServerProcess(["--model", str(target), *FLAGS], log_path=tmp_path / "server.log").start().wait_ready()
    try:
        pid = httpx.get(server.url + "/health").json()["engine_pid"]
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))   # it is streaming
            os.kill(pid, signal.SIGKILL)
            rest = sse_events(lines)
        assert rest[-1] == "[DONE]"
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["error"]["code"] == "engine_dead", rest[-3:]
        assert "exited" in errors[0]["error"]["message"]
        try:
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass   # already gone
        deadline = time.monotonic() + 30
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.returncode not in (None, 0), server.log()[-2000:]
        assert "engine process exited" in server.log()
    finally:
        server.stop()
