"""Faults and shutdown, in the engine and in real `specserve serve` processes.

- a failed step is bisected: only the request that fails alone is failed, and the others' output
  is what it would have been without it; such failures never count against the engine;
- a device error, or max_step_failures failed steps in a row whose canary pass (the engine's own)
  failed too, kills the engine: in-flight requests get errors, /health answers 503 and the server
  exits 1;
- SIGTERM drains: new requests get 503 at once, requests in flight run for up to
  shutdown_timeout, the rest end with an error event and [DONE], and the process exits 0.

Faults are injected into the engine's process by tests/faults/sitecustomize.py.
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import engine.spec_decode.decoder as engine_module
from conftest import ServerProcess, sse_events
from helpers import run_requests
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine, EngineDeadError

MODEL = "tiny"
POISON = 7
FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
         "--max-num-seqs", "8", "--engine-threads", "1"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[POISON, 40, 41, 42], [8, 40, 41], [9, 50, 51, 52, 53], [10, 60]]


# ---- the engine ------------------------------------------------------------------------------------

def make_engine(tiny_pair, adaptive: bool = True, **config) -> Engine:
    target, draft = tiny_pair
    return Engine(EngineConfig(model=str(target), dtype="float32", device="cpu",
                               speculative={"method": "draft", "draft": {"model": str(draft)}, "adaptive": adaptive}, **config))


def run(engine: Engine, prompts) -> dict[str, tuple[list[int], str | None, str | None]]:
    """request id -> (tokens, finish reason, error)."""
    tokens, finals = run_requests(engine, prompts, GREEDY)
    return {str(i): (t, final.finish_reason, final.error) for i, (t, final) in enumerate(zip(tokens, finals))}


def inject(monkeypatch, fails) -> list[int]:
    """Make the target pass raise when fails(scheduled) is true; returns the sizes of failed passes."""
    verify, failed = engine_module.verify, []

    def faulty(target, scheduled, proposal, *masks):
        if fails(scheduled):
            failed.append(len(scheduled))
            raise RuntimeError("injected fault")
        return verify(target, scheduled, proposal, *masks)
    monkeypatch.setattr(engine_module, "verify", faulty)
    return failed


def test_a_failed_step_fails_only_the_request_that_fails_alone(tiny_pair, monkeypatch):
    clean = run(make_engine(tiny_pair), PROMPTS[1:])
    engine = make_engine(tiny_pair)
    # The poisoned request fails mid-decode, after drafts were verified and rolled back for everyone.
    failed = inject(monkeypatch, lambda scheduled: any(
        s.request.token_ids[0] == POISON and s.request.num_output_tokens >= 3 for s in scheduled))
    results = run(engine, PROMPTS)
    tokens, reason, error = results["0"]
    assert reason == "error" and "injected fault" in error and len(tokens) >= 3
    assert max(failed) > 1 and failed[-1] == 1   # the batch failed, then the poisoned request alone
    for i, (want, _, _) in enumerate(clean.values(), 1):
        assert results[str(i)] == (want, "length", None)
    assert engine.faults.num_failed_steps == 0


def test_the_reruns_of_a_failed_step_teach_acceptance_but_not_step_costs(tiny_pair, monkeypatch):
    """A failed step's reruns, request by request, are no timing of the step the plan priced:
    they must leave the cost tables and the host overhead as they were (they fed the drafting
    scale before, comparing the whole batch's predicted time with one request's), while the
    drafts they verified still reach the policy."""
    engine = make_engine(tiny_pair, adaptive=False)   # static: every request drafts every step
    state = lambda: (engine.spec.costs.target.correction.factor, engine.spec.costs.overhead,
                     {m: t.correction.factor for m, t in engine.spec.costs.drafts.items()})
    verified, observe = [], engine.spec.policy.observe
    engine.spec.policy.observe = lambda plan, outcome: (verified.extend(outcome.verified), observe(plan, outcome))
    seen, isolate = [], engine.faults.isolate

    def watched(batch, exc, *callbacks):
        before, judged = state(), len(verified)
        outputs = isolate(batch, exc, *callbacks)
        seen.append((before, state(), len(verified) - judged))
        return outputs
    engine.faults.isolate = watched
    verify = engine_module.verify

    def faulty(target, scheduled, proposal, *masks):
        if len(scheduled) > 1 and all(s.is_decode for s in scheduled) and not seen:   # the first batch of decodes
            raise RuntimeError("injected fault")
        if len(scheduled) == 1 and not seen:
            time.sleep(0.05)   # a rerun far slower than any planned step: it would move every factor
        return verify(target, scheduled, proposal, *masks)
    monkeypatch.setattr(engine_module, "verify", faulty)
    results = run(engine, PROMPTS[1:])
    assert all(reason == "length" for _, reason, _ in results.values())
    (before, after, num_verified), = seen
    assert after == before
    assert num_verified == len(PROMPTS[1:])   # each rerun's drafts were judged



def test_requests_that_fail_alone_never_count_against_the_engine(tiny_pair, monkeypatch):
    engine = make_engine(tiny_pair, max_step_failures=2)
    failed = inject(monkeypatch, lambda scheduled: any(s.request.token_ids[0] == POISON for s in scheduled))
    for _ in range(3):   # more than max_step_failures in a row, which used to kill it
        assert run(engine, PROMPTS[:1])["0"][1] == "error" and engine.faults.num_failed_steps == 0
    results = run(engine, PROMPTS[:2])   # beside a good request
    assert results["0"][1] == "error" and results["1"][1] == "length" and engine.faults.num_failed_steps == 0
    assert failed == [1, 1, 1, 2, 1]   # alone: no rerun; in a batch of two: the batch, then it alone


def test_an_engine_whose_every_pass_fails_dies_after_max_step_failures(tiny_pair, monkeypatch):
    """When the canary pass fails too, the engine is at fault: the step counts, its requests wait for
    the next step unharmed (a step that passes resets the count), and max_step_failures such steps
    in a row kill the engine."""
    engine = make_engine(tiny_pair, max_step_failures=2)
    want = run(engine, PROMPTS[1:2])["0"]
    broken = [True]
    failed = inject(monkeypatch, lambda scheduled: broken[0])
    counts = []

    def heal(engine):
        counts.append(engine.faults.num_failed_steps)
        broken[0] = False
    tokens, finals = run_requests(engine, PROMPTS[1:2], GREEDY, after_step=heal)
    assert (tokens[0], finals[0].finish_reason, finals[0].error) == want
    assert counts[0] == 1 and counts[-1] == 0 and failed == [1, 1]   # the step's pass, then the canary's
    broken[0] = True
    engine.add_request("last", PROMPTS[1], GREEDY)
    assert engine.step() == [] and engine.faults.num_failed_steps == 1
    with pytest.raises(EngineDeadError, match="2 engine steps in a row failed"):
        engine.step()


def test_a_device_error_kills_the_engine_at_once(tiny_pair, monkeypatch):
    engine = make_engine(tiny_pair)

    def broken(target, scheduled, proposal, *masks):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine_module, "verify", broken)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    with pytest.raises(EngineDeadError, match="the device failed"):
        engine.step()


# ---- real servers ----------------------------------------------------------------------------------

def server_with_faults(tiny_pair, tmp_path, faults: dict, *args: str) -> ServerProcess:
    target, draft = tiny_pair
    env = {"PYTHONPATH": str(Path(__file__).parent / "faults"), "SPECSERVE_TEST_FAULTS": json.dumps(faults)}
    speculative = json.dumps({"method": "draft", "draft": {"model": str(draft)}})
    return ServerProcess(["--model", str(target), *FLAGS, "--speculative", speculative, *args], env=env,
                         log_path=tmp_path / "server.log").start().wait_ready()


def complete(url: str, prompt, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def concurrently(*calls):
    results = [None] * len(calls)

    def call(i):
        results[i] = calls[i]()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def streamed_text(url: str, prompt, started: threading.Event, **body) -> str:
    """A streamed completion's text; `started` is set at its first token."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True, **body}
    parts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                parts.append(event["choices"][0]["text"])
                started.set()
    return "".join(parts)


@pytest.mark.slow   # a real server process
def test_a_poisoned_request_fails_alone_in_a_real_server(tiny_pair, tmp_path):
    server = server_with_faults(tiny_pair, tmp_path, {"poison": POISON, "step_delay": 0.05})
    try:
        alone = [complete(server.url, prompt, max_tokens=64).json()["choices"][0]["text"] for prompt in PROMPTS[1:]]
        started = [threading.Event() for _ in PROMPTS[1:]]

        def poisoned():
            assert all(event.wait(30) for event in started)   # the others are decoding: it joins their batch
            return complete(server.url, PROMPTS[0])
        results = concurrently(poisoned, *[lambda p=p, e=e: streamed_text(server.url, p, e)
                                           for p, e in zip(PROMPTS[1:], started)])
        failed, texts = results[0], results[1:]
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
        assert "injected fault" not in failed.json()["error"]["message"]   # the log has it, under the error's id
        assert "injected fault" in server.log()
        assert texts == alone
        assert re.search(r"an engine step of [2-9] requests failed", server.log())   # they shared a batch
        assert "failed alone" in server.log()
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks_total"]
    finally:
        server.stop()


@pytest.mark.slow   # a real server process
def test_a_device_error_fails_requests_in_flight_and_exits_1(tiny_pair, tmp_path):
    server = server_with_faults(tiny_pair, tmp_path, {"fatal": POISON, "step_delay": 0.02})
    try:
        body = {"model": MODEL, "prompt": [8, 9], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))   # streaming
            fatal = complete(server.url, [POISON, 1, 2])
            rest = sse_events(lines)
        assert fatal.status_code == 503 and fatal.json()["error"]["code"] == "engine_dead"
        assert "the device failed" in fatal.json()["error"]["message"]
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_dead"
        assert server.process.wait(30) == 1
    finally:
        server.stop()


@pytest.mark.slow   # a real server process
def test_sigterm_drains_then_ends_what_is_left(tiny_pair, tmp_path):
    # The long stream needs at least 96 passes of 0.1 s (5 tokens a pass at most): it outlasts the drain.
    server = server_with_faults(tiny_pair, tmp_path, {"step_delay": 0.1}, "--shutdown-timeout", "3")
    try:
        body = {"model": MODEL, "prompt": [8, 9], "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))   # the long stream runs
            signalled = []

            def terminate_then_ask():
                time.sleep(0.2)
                server.process.send_signal(signal.SIGTERM)
                signalled.append(time.monotonic())
                time.sleep(0.3)
                return complete(server.url, [12]), httpx.get(server.url + "/health")
            finished, (refused, health) = concurrently(lambda: complete(server.url, [10, 11], max_tokens=12),
                                                       terminate_then_ask)
            rest = sse_events(lines)
            ended = time.monotonic() - signalled[0]
        assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 12
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "shutting_down", rest[-3:]
        assert 2.9 < ended < 8.0   # shutdown_timeout is 3 s
        assert server.process.wait(15) == 0
    finally:
        server.stop()
