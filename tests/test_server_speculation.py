"""Per-request speculation control over HTTP, and what responses and /metrics report of it.

An in-process server on the tiny (target, noisy-copy draft) pair with `speculative.method: auto`
(draft and n-gram proposers, gamma 4, adaptive off so every drafting pass verifies
min(gamma, what the request allows) drafts). Requests pick a strategy and a most-drafts-per-step
with `"speculative": {"method", "num_speculative_tokens"}`; responses report
`speculative.methods` (decode passes per proposer, "none" for k = 0) and `speculative.k` (decode
passes per number of drafts). Every response obeys the accounting identity. A second, n-gram-only
server answers a request for the draft model with a 400 naming what it offers, and on a fresh
server the /metrics chosen-k histogram equals the sum of the responses' k histograms.
"""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import InProcessServer, sse_events, wait_until_idle

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}
MESSAGES = [{"role": "user", "content": "count: one two three one two three one two"}]
REPETITIVE = "abcabcabcabcabcabcabcabcabc"   # the n-gram proposer finds its suffix earlier in the prompt


def auto_config(draft) -> dict:
    return {"method": "auto", "draft": {"model": str(draft)}, "num_speculative_tokens": 4, "adaptive": False}


def build_server(target, speculative: dict) -> InProcessServer:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from server.metrics import Metrics
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=128,
                                 max_num_seqs=8, speculative=speculative))
    metrics = Metrics(MODEL, engine.method, proposers=engine.configured_proposers)
    return InProcessServer(create_app(engine, load_tokenizer(str(target)), MODEL, None, metrics))


@pytest.fixture(scope="module")
def url(tiny_pair):
    target, draft = tiny_pair
    with build_server(target, auto_config(draft)) as server:
        yield server.url


@pytest.fixture(scope="module")
def ngram_url(tiny_pair):
    target, _ = tiny_pair
    with build_server(target, {"method": "ngram", "num_speculative_tokens": 3}) as server:
        yield server.url


# ---- helpers ------------------------------------------------------------------------------------

def complete(url: str, speculative=None, path: str = "/v1/completions", **body) -> dict:
    if path == "/v1/completions":
        body = {"prompt": REPETITIVE, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **body}
    else:
        body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **body}
    if speculative is not None:
        body["speculative"] = speculative
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def assert_accounting(body: dict, num_choices: int | None = None) -> dict:
    """usage + discarded = one first token per choice + accepted + target forwards; the k histogram
    and the methods count the same decode passes (each at most a target forward), and the drafts
    they verified are the proposed ones."""
    spec, usage = body["speculative"], body["usage"]
    num_choices = num_choices if num_choices is not None else len(body["choices"])
    assert usage["completion_tokens"] + spec["discarded"] == num_choices + spec["accepted"] + spec["target_forwards"], body
    assert spec["accepted"] <= spec["proposed"]
    passes = sum(spec["k"].values())
    assert passes == sum(spec["methods"].values()) <= spec["target_forwards"], spec
    assert sum(int(k) * n for k, n in spec["k"].items()) == spec["proposed"], spec
    assert spec["methods"].get("none", 0) == spec["k"].get("0", 0), spec
    assert all(isinstance(k, str) for k in spec["k"]) and list(spec["k"]) == sorted(spec["k"], key=int)
    return spec




def assert_400(response: httpx.Response, field: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert error["param"] == "speculative" and error["type"] == "invalid_request_error", error
    assert field in error["message"], error
    return error["message"]


# ---- per-request control ------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_method_none_is_plain_decoding(url, path):
    spec = assert_accounting(complete(url, {"method": "none"}, path))
    n = spec["target_forwards"]
    assert n == 15   # 16 tokens: the prefill's, then one per plain decode pass
    assert spec["proposed"] == spec["accepted"] == 0
    assert spec["methods"] == {"none": n} and spec["k"] == {"0": n}
    assert assert_accounting(complete(url, {"num_speculative_tokens": 0}, path))["k"] == {"0": n}


def test_default_request_drafts_with_the_model(url):
    """auto without adaptivity: the draft model (the first proposer) verifies gamma drafts every pass."""
    for speculative in (None, {}, {"method": "auto"}, {"method": None, "num_speculative_tokens": None}):
        spec = assert_accounting(complete(url, speculative))
        assert spec["proposed"] > 0 and set(spec["methods"]) <= {"draft", "none"} and "draft" in spec["methods"]
        assert set(spec["k"]) <= {str(k) for k in range(5)} and "4" in spec["k"]
    spec = assert_accounting(complete(url, {"method": "draft"}))
    assert set(spec["methods"]) <= {"draft", "none"} and spec["proposed"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_method_ngram_uses_only_ngram(url, path):
    spec = assert_accounting(complete(url, {"method": "ngram"}, path, max_tokens=24))
    assert set(spec["methods"]) <= {"ngram", "none"}, spec
    if path == "/v1/completions":   # a prompt that repeats itself: n-gram matches from the first pass
        assert spec["methods"].get("ngram", 0) > 0 and spec["proposed"] > 0, spec
    spec = assert_accounting(complete(url, {"method": "ngram", "num_speculative_tokens": 1}, path, max_tokens=24))
    assert set(spec["methods"]) <= {"ngram", "none"} and set(spec["k"]) <= {"0", "1"}, spec


@pytest.mark.parametrize("k", [1, 2, 3])
def test_num_speculative_tokens_caps_k(url, k):
    spec = assert_accounting(complete(url, {"num_speculative_tokens": k}, max_tokens=20))
    assert max(int(key) for key in spec["k"]) == k, spec   # the draft model always has k to give
    assert spec["proposed"] <= k * spec["target_forwards"]
    spec = assert_accounting(complete(url, {"num_speculative_tokens": 16}, max_tokens=20))
    assert max(int(key) for key in spec["k"]) <= 4   # the server's gamma still caps a request


def test_n_choices_sum_and_stream_usage_carries_the_same_object(url):
    spec = assert_accounting(complete(url, {"method": "none"}, n=3, seed=7, temperature=1.0))
    assert spec["methods"] == {"none": 3 * 15} and spec["k"] == {"0": 3 * 15}   # summed over the choices
    spec = assert_accounting(complete(url, {"num_speculative_tokens": 2}, n=3, seed=7, temperature=1.0))
    assert set(spec["k"]) <= {"0", "1", "2"} and spec["accepted"] > 0
    stream = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}, "speculative": {"method": "none"}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    spec = assert_accounting(events[-2], num_choices=1)
    assert spec == {"proposed": 0, "accepted": 0, "target_forwards": 11, "discarded": 0,
                    "methods": {"none": 11}, "k": {"0": 11}}


# ---- invalid values --------------------------------------------------------------------------------

BAD = [
    ({"method": "medusa"}, "speculative.method"),
    ({"method": "NGRAM"}, "speculative.method"),
    ({"method": 1}, "speculative.method"),
    ({"num_speculative_tokens": True}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": 40}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": -1}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": 2.0}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": "2"}, "speculative.num_speculative_tokens"),
    ({"foo": 1}, "speculative.foo"),
    ({"method": "ngram", "k": 2}, "speculative.k"),
    (5, "speculative"),
    ("ngram", "speculative"),
    ([{"method": "ngram"}], "speculative"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("speculative, field", BAD, ids=[repr(b[0]) for b in BAD])
def test_invalid_speculative_is_a_400(url, path, speculative, field):
    body = {"model": MODEL, "max_tokens": 2, "speculative": speculative}
    body |= {"prompt": "a"} if path == "/v1/completions" else {"messages": MESSAGES}
    message = assert_400(httpx.post(url + path, json=body, timeout=30), field)
    assert message.startswith(field)


def test_a_proposer_the_server_lacks_is_a_clear_400(ngram_url):
    for path, body in [("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        response = httpx.post(ngram_url + path, json={**body, "max_tokens": 2, "speculative": {"method": "draft"}})
        message = assert_400(response, "speculative.method")
        assert "'draft'" in message and "'ngram'" in message and "auto, ngram, none" in message, message
    for method in ("ngram", "auto", "none"):   # what it has works
        spec = assert_accounting(complete(ngram_url, {"method": method}))
        assert set(spec["methods"]) <= {"ngram", "none"}


def test_server_without_speculation_names_what_it_offers():
    from types import SimpleNamespace

    from server.errors import APIError
    from server.serving import Server

    server = Server.__new__(Server)   # only the engine's info matters to the check
    server.async_engine = SimpleNamespace(info=SimpleNamespace(method="none", proposers=()))
    for method in (None, "auto", "none"):
        server.check_speculative_method(method)
    with pytest.raises(APIError) as error:
        server.check_speculative_method("ngram")
    assert error.value.status == 400 and error.value.param == "speculative"
    assert "'none'" in error.value.message and "use one of auto, none" in error.value.message


# ---- /metrics agrees with the responses ----------------------------------------------------------

def metric_samples(url: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_chosen_k_equal_the_responses(tiny_pair):
    """On a fresh server: the chosen-k histogram (count, sum and every bucket) is the sum of the
    responses' k histograms, and the per-proposer counters sum to the responses' proposed / accepted."""
    target, draft = tiny_pair
    with build_server(target, auto_config(draft)) as server:
        url = server.url
        bodies = [
            complete(url, {"method": "none"}),
            complete(url, {"method": "ngram"}, max_tokens=20),
            complete(url, {"num_speculative_tokens": 2}, n=2, seed=3, temperature=1.0),
            complete(url),
            complete(url, {"method": "draft", "num_speculative_tokens": 3}, "/v1/chat/completions"),
            complete(url, None, max_tokens=30, stop=["c"], ignore_eos=False),   # drained after a stop string
        ]
        stream = {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 14, "temperature": 0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}, "speculative": {"num_speculative_tokens": 1}}
        with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=60) as r:
            bodies.append(sse_events(r)[-2])
        wait_until_idle(url)
        samples = metric_samples(url)
    specs = [assert_accounting(b, num_choices=len(b["choices"]) or 1) for b in bodies]
    ks: dict[int, int] = {}
    for spec in specs:
        for k, n in spec["k"].items():
            ks[int(k)] = ks.get(int(k), 0) + n
    labels = (("method", "auto"), ("model_name", MODEL))
    assert samples[("specserve:spec_decode_chosen_k_count", labels)] == sum(ks.values()) > 0
    assert samples[("specserve:spec_decode_chosen_k_sum", labels)] == sum(k * n for k, n in ks.items())
    for le in range(17):
        bucket = ("specserve:spec_decode_chosen_k_bucket", tuple(sorted(labels + (("le", f"{float(le)}"),))))
        assert samples[bucket] == sum(n for k, n in ks.items() if k <= le), le
    assert {k for k in ks} >= {0, 1, 2, 3, 4}
    for counter, key in [("num_draft_tokens", "proposed"), ("num_accepted_tokens", "accepted")]:
        by_proposer = {dict(lab)["proposer"]: v for (name, lab), v in samples.items()
                       if name == f"specserve:spec_decode_{counter}_by_proposer_total"}
        assert set(by_proposer) == {"draft", "ngram", "suffix"}   # every configured proposer, from the start
        if key == "proposed":
            assert by_proposer["draft"] > 0 and by_proposer["ngram"] > 0, by_proposer
        assert sum(by_proposer.values()) == sum(s[key] for s in specs) == \
            samples[(f"specserve:spec_decode_{counter}_total", labels)]
    assert samples[("specserve:generation_tokens_total", (("model_name", MODEL),))] == \
        sum(b["usage"]["completion_tokens"] + b["speculative"]["discarded"] for b in bodies)
