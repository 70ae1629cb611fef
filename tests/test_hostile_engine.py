"""The engine judges itself, not a request: what a hostile client sends cannot take it down.

- every numeric sampling field is bounded where the sampler computes it (float32, int64 tensors):
  a value out of range is a 400 naming the field, and the same server then serves a normal request;
  `top_k` and `stop_token_ids` are checked against the vocabulary by the engine, and named too;
- a request that fails inside the pass anyway fails alone (finish_reason "error"), found by
  bisecting its batch (about 2 log2(n) reruns), while the batch's other requests finish with the
  output they would have had; however often that happens, the engine stays alive.

The server tests share one in-process server (a tiny random model, no speculation); the engine tests
make a request fail for real, inside the sampler, by giving it a top_k no tensor holds after its
settings were validated.
"""
from __future__ import annotations

import json
import math

import httpx
import pytest

import engine.spec_decode.decoder as engine_module
from conftest import InProcessServer
from helpers import run_requests
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

MODEL = "tiny"
OVERFLOW = 18446744073709551616   # 2**64: fits no int64 tensor
PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(tiny_pair, **config) -> Engine:
    target, _ = tiny_pair
    return Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64, **config))


@pytest.fixture(scope="module")
def server(tiny_pair):
    import torch

    from server.api import create_app
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = make_engine(tiny_pair, max_num_seqs=8)
    with InProcessServer(create_app(engine, load_tokenizer(str(target)), MODEL)) as running:
        yield running.url, engine


def complete(url: str, **body) -> httpx.Response:
    """A completion; NaN and infinities go out as JSON's NaN / Infinity, as Python clients send them."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})


def assert_serving(url: str) -> None:
    """The same server still answers a normal request in full."""
    response = complete(url)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 4


def assert_400_naming(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert error["message"].startswith(field), error


# ---- bounds, through the server ------------------------------------------------------------------

def test_six_top_k_overflows_in_a_row_leave_the_server_serving(server):
    url, engine = server
    for _ in range(6):
        assert_400_naming(complete(url, top_k=OVERFLOW), "top_k")
    assert_serving(url)
    for _ in range(6):   # spread out between good requests
        assert_400_naming(complete(url, top_k=OVERFLOW, temperature=1.0), "top_k")
        assert_serving(url)
    assert engine.faults.num_failed_steps == 0


VOCAB = "the vocabulary size"   # stands for the served model's, in the cases below


def at_vocab(value, vocab_size: int):
    if isinstance(value, list):
        return [at_vocab(v, vocab_size) for v in value]
    return vocab_size if value == VOCAB else value


# (field, value): each out of its range, or (where the engine checks it) outside the tiny vocabulary.
OUT_OF_RANGE = [
    ("top_k", OVERFLOW), ("top_k", 10**40), ("top_k", -2),
    ("temperature", 1e308), ("temperature", 100.5), ("temperature", -0.1), ("temperature", math.nan),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.inf), ("top_p", -1e-46),
    ("min_p", 1.5), ("min_p", -1e-9), ("min_p", math.nan),
    ("repetition_penalty", 1e-46), ("repetition_penalty", 0.0), ("repetition_penalty", 1e39),
    ("repetition_penalty", 100.5),
    ("presence_penalty", 2.5), ("presence_penalty", -math.inf), ("frequency_penalty", -1e300),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [OVERFLOW]), ("stop_token_ids", [3, -1]),
    ("stop_token_ids", list(range(257))),
    ("logprobs", 21), ("seed", OVERFLOW),
]


@pytest.mark.parametrize("field,value", OUT_OF_RANGE, ids=lambda v: repr(v)[:24])
def test_a_value_out_of_range_is_a_400_naming_its_field(server, field, value):
    url, engine = server
    assert_400_naming(complete(url, **{field: at_vocab(value, engine.vocab_size)}), field)
    assert_serving(url)


def test_chat_names_the_field_the_engine_checks(server):
    url, engine = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("top_k", engine.vocab_size + 1), ("stop_token_ids", [engine.vocab_size])):
        response = httpx.post(url + "/v1/chat/completions", json={**body, field: value}, timeout=60)
        assert_400_naming(response, field)
    assert_serving(url)


@pytest.mark.parametrize("settings", [
    {"top_p": 1e-46}, {"top_p": 1e-9}, {"top_k": 1}, {"min_p": 1.0},
], ids=lambda s: repr(s))
def test_settings_that_keep_only_the_top_token_give_the_greedy_text(server, settings):
    """A tiny top_p used to underflow float32 to 0: nothing kept, empty text ending "length". Now it
    keeps the most likely token, as every top_p that small means."""
    url, engine = server
    greedy = complete(url, max_tokens=8).json()["choices"][0]["text"]
    response = complete(url, max_tokens=8, temperature=1.0, **settings)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == greedy


@pytest.mark.parametrize("settings", [
    {"temperature": 100.0}, {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0},
    {"top_k": VOCAB}, {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"stop_token_ids": list(range(1, 257))},
], ids=lambda s: repr(s))
def test_the_bounds_themselves_are_served(server, settings):
    url, engine = server
    settings = {k: at_vocab(v, engine.vocab_size) for k, v in settings.items()}
    response = complete(url, max_tokens=8, temperature=settings.pop("temperature", 1.0), seed=3, **settings)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert 1 <= usage["completion_tokens"] <= 8


# ---- a request that fails inside the pass ------------------------------------------------------

def overflowing(seed: int) -> SamplingParams:
    """Sampled settings that fail in the sampler's tensors: the check Engine.add_request makes is
    passed first, then top_k is raised past int64, as a bug in validation would let through."""
    return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)


def poison(engine: Engine, request_id: str) -> None:
    object.__setattr__(engine.requests[request_id].params, "top_k", OVERFLOW)


def count_passes(monkeypatch) -> list[tuple[int, bool]]:
    """(requests, failed) of every target pass, the canary's included."""
    verify, passes = engine_module.verify, []

    def counted(target, scheduled, proposal, *masks):
        try:
            result = verify(target, scheduled, proposal, *masks)
        except Exception:
            passes.append((len(scheduled), True))
            raise
        passes.append((len(scheduled), False))
        return result
    monkeypatch.setattr(engine_module, "verify", counted)
    return passes


def test_a_request_that_fails_in_the_pass_fails_alone_in_log_reruns(tiny_pair, monkeypatch):
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    clean, _ = run_requests(make_engine(tiny_pair), prompts[:5] + prompts[6:], GREEDY)
    engine = make_engine(tiny_pair)
    params = [GREEDY] * 5 + [overflowing(seed=1)] + [GREEDY] * 2
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i])
    poison(engine, "5")
    passes = count_passes(monkeypatch)
    tokens, finals = collect(engine, len(prompts))
    bad = finals["5"]
    assert bad.finish_reason == "error" and "Overflow" in bad.error and tokens["5"] == []
    assert [tokens[str(i)] for i in range(8) if i != 5] == clean
    assert all(finals[str(i)].finish_reason == "length" for i in range(8) if i != 5)
    # The batch of 8, the canary, then the halves that hold the bad request and their other halves:
    # 2 log2(8) reruns.
    assert passes[:8] == [(8, True), (1, False), (4, False), (4, True), (2, True), (1, False), (1, True),
                          (2, False)]
    assert engine.faults.num_failed_steps == 0


def collect(engine: Engine, num_requests: int) -> tuple[dict[str, list[int]], dict]:
    """Step until every request has finished: tokens and final output by request id."""
    tokens, finals = {str(i): [] for i in range(num_requests)}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return tokens, finals


def test_requests_that_fail_again_and_again_never_kill_the_engine(tiny_pair):
    """max_step_failures is 1: under the old rule the first request failing alone killed the engine."""
    engine = make_engine(tiny_pair, max_step_failures=1)
    want, _ = run_requests(make_engine(tiny_pair), [PROMPT], GREEDY)
    for i in range(6):
        engine.add_request(f"bad{i}", PROMPT, overflowing(seed=i))
        poison(engine, f"bad{i}")
        if i % 2:   # alone, or beside a good request
            engine.add_request(f"good{i}", PROMPT, GREEDY)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert outputs[f"bad{i}"][-1].finish_reason == "error"
        if i % 2:
            good = outputs[f"good{i}"]
            assert [t for out in good for t in out.new_token_ids] == want[0] and good[-1].finish_reason == "length"
        assert engine.faults.num_failed_steps == 0
    tokens, finals = run_requests(engine, [PROMPT], GREEDY)
    assert tokens == want and finals[0].finish_reason == "length"
