"""The structured-output benchmark's pure parts (bench/structured_bench.py): its schemas compile, its
prompts never repeat across rounds and concurrencies, and its ratios and tallies add up. No model runs."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import structured_bench as bench  # noqa: E402

from engine.structured import StructuredOutput  # noqa: E402

KINDS = bench.load_kinds()
WORDS = bench.load_words()


def plan(concurrencies=(1, 16), rounds=2, per_stream=4, fixed=None, seed=0):
    return bench.plan_requests(KINDS, WORDS, list(concurrencies), rounds,
                               lambda c: bench.requests_per_round(c, per_stream, fixed, len(KINDS)), seed)


def test_there_are_six_to_ten_schemas_each_with_texts():
    schema_files = sorted((bench.DATA / "schemas").glob("*.json"))
    assert 6 <= len(schema_files) <= 10
    assert [k.name for k in KINDS] == [f.stem for f in schema_files]
    assert all(k.instruction and k.templates for k in KINDS)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_schema_is_valid_and_compiles_to_a_grammar(kind):
    jsonschema.Draft202012Validator.check_schema(kind.schema)
    grammar = StructuredOutput.json_schema(kind.schema).grammar()
    assert json.loads(grammar)   # llguidance's grammar, as JSON text


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_template_renders_without_leftover_placeholders(kind):
    for seed in range(5):
        for template in kind.templates:
            text = bench.SourceText(random.Random(seed), WORDS, kind).render(template)
            assert "{" not in text and "}" not in text, text


def test_prompts_are_distinct_across_rounds_and_concurrencies():
    requests = [r for batch in plan().values() for r in batch]
    assert len(requests) == 2 * (8 + 64)
    assert len({r.index for r in requests}) == len(requests)
    assert len({r.text for r in requests}) == len(requests)
    assert len({json.dumps(r.messages) for r in requests}) == len(requests)


def test_every_round_has_the_same_mix_of_schemas():
    batches = plan(concurrencies=(1, 16), rounds=3)
    for (concurrency, _), batch in batches.items():
        mix = sorted(r.kind.name for r in batch)
        assert mix == sorted(r.kind.name for r in batches[(concurrency, 0)])
        assert len(set(mix)) == len(KINDS)


def test_plans_are_deterministic_by_seed():
    texts = lambda seed: [r.text for batch in plan((1,), 1, seed=seed).values() for r in batch]  # noqa: E731
    assert texts(0) == texts(0)
    assert texts(0) != texts(1)


def test_the_prompt_holds_instruction_schema_and_text():
    request = plan((1,), 1)[(1, 0)][0]
    content = request.messages[0]["content"]
    assert content.startswith(request.kind.instruction)
    assert json.dumps(request.kind.schema, separators=(",", ":")) in content
    assert content.endswith(request.text)


def test_requests_per_round():
    assert bench.requests_per_round(1, 4, None, 8) == 8      # rounded up: one of each schema
    assert bench.requests_per_round(16, 4, None, 8) == 64
    assert bench.requests_per_round(3, 2, None, 8) == 8
    assert bench.requests_per_round(16, 4, 2, 8) == 2        # --requests wins


def test_speed_ratio_pools_tokens_and_seconds_and_keeps_each_round():
    spec = [(100, 1.0), (100, 2.0)]
    plain = [(100, 2.0), (100, 2.0)]
    ratio = bench.speed_ratio(spec, plain)
    assert ratio.per_round == pytest.approx((2.0, 1.0))
    assert ratio.pooled == pytest.approx((200 / 3.0) / (200 / 4.0))
    assert (ratio.low, ratio.high) == (pytest.approx(1.0), pytest.approx(2.0))
    assert "1.33x pooled" in str(ratio) and "min-max 1.00-2.00, 2 rounds" in str(ratio)
    with pytest.raises(ValueError):
        bench.speed_ratio(spec, plain[:1])


def step_stats(mask=True, **values):
    stats = dict(draft_time_s=0.01, verify_time_s=0.09, drafts_by_proposer=(("grammar", 3, 3), ("ngram", 4, 1)))
    if mask:
        stats.update(mask_time_s=0.005, num_masked_rows=5)
    return SimpleNamespace(**{**stats, **values})


def test_tally_sums_steps_and_merges_rounds():
    first, second = bench.Tally(), bench.Tally()
    first.add_step(step_stats())
    second.add_step(step_stats())
    first.outputs, second.outputs = {0: [1, 2, 3]}, {1: [4, 5]}
    first.merge(second)
    assert first.steps == 2 and first.tokens == 5
    assert first.proposers == {"grammar": [6, 6], "ngram": [8, 2]}
    assert bench.mask_share(first) == pytest.approx(0.01 / 0.2)
    assert "grammar 6/6 (1.00), ngram 2/8 (0.25)" == bench.proposer_line(first)


def test_mask_share_is_none_where_the_engine_reports_no_mask_time():
    tally = bench.Tally()
    tally.add_step(step_stats(mask=False))
    assert not tally.mask_reported and bench.mask_share(tally) is None


class TextTokenizer:
    """Token ids are the text's characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_validity_parses_and_validates_against_each_schema():
    kind = next(k for k in KINDS if k.name == "product_review")
    good = {"product": "Lamp", "reviewer": "Ann", "rating": 4, "sentiment": "positive", "pros": ["bright"],
            "cons": [], "would_recommend": True}
    outputs = {0: json.dumps(good), 1: json.dumps({**good, "rating": 7}), 2: '{"product": "Lam'}
    requests = [bench.StructuredRequest(i, kind, f"text {i}") for i in outputs]
    tally = bench.Tally(outputs={i: list(map(ord, text)) for i, text in outputs.items()},
                        finish_reasons={0: "stop", 1: "stop", 2: "length"})
    valid, ended, invalid = bench.validity(tally, requests, TextTokenizer())
    assert (valid, ended) == (1, 2)
    assert [(bad["index"], bad["finish_reason"]) for bad in invalid] == [(1, "stop"), (2, "length")]
    assert invalid[0]["schema"] == "product_review" and invalid[1]["text"] == outputs[2]
    assert bench.mismatches(tally, bench.Tally(outputs={**tally.outputs, 1: []}), requests) == ["#1 (product_review)"]


def test_targets_are_checked_where_measured():
    results = {"c1": {"ratio_pooled": 1.6, "ratio_min": 1.5, "ratio_max": 1.7},
               "c16": {bench.PLAIN: {"mask_share": 0.12}}}
    lines = "\n".join(bench.targets(results))
    assert "1 stream: met (1.60x" in lines and "16 streams: NOT met (12.0%)" in lines
    assert bench.targets({}) == []


class FakeEngine:
    """Runs nothing for its first step (grammars compiling), then emits two tokens per request per
    step until each has four."""

    def __init__(self):
        self.num_steps, self.last_stats, self.requests, self.calls = 0, None, {}, 0

    def add_request(self, request_id, prompt, params):
        assert params.structured is not None and params.greedy
        self.requests[request_id] = 0

    def step(self):
        self.calls += 1
        if self.calls == 1:
            return []
        self.num_steps += 1
        self.last_stats = step_stats()
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 2
            done = self.requests[request_id] >= 4
            outputs.append(SimpleNamespace(request_id=request_id, new_token_ids=[7, 8], finished=done,
                                           finish_reason="stop" if done else None, error=None,
                                           spec=SimpleNamespace(target_forwards=1)))
            if done:
                del self.requests[request_id]
        return outputs


def test_the_driver_times_every_step_and_counts_idle_ones():
    requests = plan((1,), 1, fixed=2)[(1, 0)]
    driver = bench.StructuredDriver(SimpleNamespace(engine=FakeEngine()), requests,
                                    {r.index: [1, 2, 3] for r in requests}, max_tokens=16)
    while not driver.done:
        driver.step()
    tally = driver.tally
    assert tally.outputs == {r.index: [7, 8, 7, 8] for r in requests}
    assert tally.steps == 2 and tally.target_passes == 2
    assert 0 < tally.idle_s <= tally.seconds
    assert tally.finish_reasons == {r.index: "stop" for r in requests}


def test_report_prints_a_table_per_concurrency_and_its_notes():
    kind = next(k for k in KINDS if k.name == "product_review")
    text = json.dumps({"product": "Lamp", "reviewer": "Ann", "rating": 4, "sentiment": "positive", "pros": [],
                       "cons": [], "would_recommend": True})
    requests = [bench.StructuredRequest(i, kind, f"text {i}") for i in range(2)]

    def tally(seconds, outputs):
        t = bench.Tally(seconds=seconds, outputs=outputs, finish_reasons={0: "stop", 1: "stop"}, target_passes=10)
        t.add_step(step_stats())
        return t
    same = {i: list(map(ord, text)) for i in range(2)}
    rounds = [{bench.SPEC: tally(1.0, same), bench.PLAIN: tally(2.0, same)}]
    lines, figures = bench.report(1, rounds, requests, TextTokenizer(), "spec")
    printed = "\n".join(lines)
    assert "2.00x pooled" in printed and "identical spec vs plain: 2/2" in printed
    assert "| 2/2 | 2/2 | 5.0% (1.000 ms/row) |" in printed
    assert figures["ratio_pooled"] == pytest.approx(2.0) and figures[bench.PLAIN]["valid"] == 2
