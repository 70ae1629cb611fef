"""/metrics agrees exactly with what the responses reported, on a fresh server with speculation on."""
import json

import httpx
import openai
import pytest
from conftest import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair   # the draft is a copy of the target: greedy drafts are always accepted
    spec = json.dumps({"method": "draft", "model": str(draft), "num_speculative_tokens": 3})
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


def test_counters_agree_with_responses(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["def add(a, b):", "import os\n", "for i in range(10):", "x = [", "hello world", "class A:"]
    responses = [client.completions.create(model=MODEL, prompt=p, max_tokens=9 + i, temperature=0)
                 for i, p in enumerate(prompts)]
    reported = [r.model_extra["speculative"] for r in responses]
    metrics = scrape(server.url)

    proposed = sum(r["proposed"] for r in reported)
    accepted = sum(r["accepted"] for r in reported)
    forwards = sum(r["target_forwards"] for r in reported)
    assert proposed > 0
    assert total(metrics, "specserve:spec_decode_num_draft_tokens") == proposed
    assert total(metrics, "specserve:spec_decode_num_accepted_tokens") == accepted
    assert total(metrics, "specserve:spec_decode_num_target_forwards") == forwards
    assert total(metrics, "specserve:generation_tokens") == sum(r.usage.completion_tokens for r in responses)
    assert total(metrics, "specserve:prompt_tokens") == sum(r.usage.prompt_tokens for r in responses)
    assert total(metrics, "specserve:request_success") == len(prompts)
    per_position = metrics["specserve:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_position.values()) == accepted
    # Copy-of-target draft: everything proposed is accepted, on the metrics as in the responses.
    assert accepted == proposed
    assert total(metrics, "specserve:spec_decode_num_accepted_tokens") / \
        total(metrics, "specserve:spec_decode_num_draft_tokens") == 1.0
    rate = metrics["specserve:spec_decode_acceptance_rate"]
    assert list(rate.values()) == [1.0]
    labels = dict(next(iter(rate))[1])
    assert labels == {"model_name": MODEL, "method": "draft"}
