"""/metrics agrees exactly with what the responses reported, on a fresh server whose draft is a noisy
copy of the target (so drafts are accepted and rejected): greedy and sampled requests, n > 1,
streaming, logprobs, prompt scoring (echo, max_tokens 0) and stop strings. Tokens generated but not
returned (past a stop string, the scoring request's one) are reported as discarded, in the response
and in /metrics."""
import json

import httpx
import openai
import pytest
from conftest import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow   # a real server process

MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    spec = json.dumps({"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 3, "adaptive": False})
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    process = ServerProcess(["--model", str(target), "--served-model-name", MODEL, "--dtype", "float32",
                             "--speculative-config", spec], log_path=log).start().wait_ready()
    yield process
    process.stop()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{family: {(sample name, labels): value}} from /metrics, parsed by prometheus-client."""
    text = httpx.get(url + "/metrics").text
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def total(families, name: str) -> float:
    return sum(value for (sample, _), value in families[name].items() if sample == name + "_total"
               or sample == name)


def run_requests(client: openai.OpenAI) -> list[tuple]:
    """(usage, speculative counters, number of choices) of each request of a varied mix."""
    out = []

    def keep(result):
        out.append((result.usage, result.model_extra["speculative"], len(result.choices)))
        return result

    for i, prompt in enumerate(["def add(a, b):", "import os\n", "for i in range(10):", "x = [", "hello world"]):
        keep(client.completions.create(model=MODEL, prompt=prompt, max_tokens=9 + i, temperature=0))
    keep(client.completions.create(model=MODEL, prompt="class A:", max_tokens=20, temperature=1.0, seed=3, n=3,
                                   logprobs=2))
    base = keep(client.completions.create(model=MODEL, prompt="Stop strings", max_tokens=40, temperature=0))
    text = base.choices[0].text
    stopped = keep(client.completions.create(model=MODEL, prompt="Stop strings", max_tokens=40, temperature=0,
                                             stop=[text[12:14]]))
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < base.usage.completion_tokens
    scored = keep(client.completions.create(model=MODEL, prompt="Score me", max_tokens=0, echo=True, logprobs=1))
    assert scored.usage.completion_tokens == 0 and scored.model_extra["speculative"]["discarded"] == 1
    chunks = list(client.completions.create(model=MODEL, prompt="Stream", max_tokens=25, temperature=0.7, seed=9,
                                            stream=True, stream_options={"include_usage": True}, stop=["e", "a"]))
    out.append((chunks[-1].usage, chunks[-1].model_extra["speculative"], 1))
    return out


def test_counters_agree_with_responses(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reported = run_requests(client)
    metrics = scrape(server.url)

    def summed(key: str) -> int:
        return sum(spec[key] for _, spec, _ in reported)
    proposed, accepted, forwards, discarded = (summed(k) for k in ("proposed", "accepted", "target_forwards",
                                                                    "discarded"))
    completion = sum(usage.completion_tokens for usage, _, _ in reported)
    choices = sum(n for _, _, n in reported)
    assert 0 < accepted < proposed   # a real draft: some accepted, some rejected
    assert discarded > 0   # the scoring request's token; and the stop strings' tails, when they cut a run
    for usage, spec, n in reported:  # per response: every choice's first token, then accepted + one per pass
        assert usage.completion_tokens + spec["discarded"] == n + spec["accepted"] + spec["target_forwards"]

    assert total(metrics, "specserve:spec_decode_num_draft_tokens") == proposed
    assert total(metrics, "specserve:spec_decode_num_accepted_tokens") == accepted
    assert total(metrics, "specserve:spec_decode_num_target_forwards") == forwards
    assert total(metrics, "specserve:discarded_tokens") == discarded
    assert total(metrics, "specserve:generation_tokens") == completion + discarded
    # usage counts a prompt once per request; the engine prefills it once per choice
    assert total(metrics, "specserve:prompt_tokens") == sum(usage.prompt_tokens * n for usage, _, n in reported)
    assert total(metrics, "specserve:request_success") == choices
    # how speculation ran: the chosen-k histogram is the responses' k histograms summed (decode
    # passes), the per-proposer counters split the totals (the served CLI passes its proposers)
    chosen = metrics["specserve:spec_decode_chosen_k"]
    passes = sum(sum(spec["k"].values()) for _, spec, _ in reported)
    assert sum(v for (name, _), v in chosen.items() if name.endswith("_count")) == passes > 0
    assert sum(v for (name, _), v in chosen.items() if name.endswith("_sum")) == proposed
    assert passes == sum(spec["methods"].get("draft", 0) + spec["methods"].get("none", 0) for _, spec, _ in reported)
    assert total(metrics, "specserve:spec_decode_num_draft_tokens_by_proposer") == proposed
    assert total(metrics, "specserve:spec_decode_num_accepted_tokens_by_proposer") == accepted
    per_position = metrics["specserve:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_position.values()) == accepted
    rate = metrics["specserve:spec_decode_acceptance_rate"]
    assert 0 < list(rate.values())[0] < 1
    labels = dict(next(iter(rate))[1])
    assert labels == {"model_name": MODEL, "method": "draft"}
