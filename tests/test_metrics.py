"""server/metrics.py: exact counter sums, window gauges, names and labels of the exposition."""
from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import RequestOutput, RequestTiming, SpecStats, StepStats
from server.metrics import WINDOW_STEPS, Metrics

MODEL = "tiny-llama"

COUNTERS = [
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
    "spec_decode_num_target_forwards_total", "spec_decode_num_draft_tokens_by_proposer_total",
    "spec_decode_num_accepted_tokens_by_proposer_total", "spec_decode_measured_step_time_seconds_total",
    "num_preemptions_total", "prompt_tokens_total",
    "generation_tokens_total", "discarded_tokens_total", "request_success_total",
]
HISTOGRAMS = [
    "spec_decode_accepted_length", "spec_decode_draft_time_seconds", "spec_decode_verify_time_seconds",
    "spec_decode_chosen_k", "spec_decode_predicted_step_time_seconds", "spec_decode_step_time_ratio",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "batch_size", "num_batched_tokens",
]
GAUGES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "spec_decode_acceptance_rate", "spec_decode_estimated_speedup",
]


def step(**overrides) -> StepStats:
    """A decode step of 3 requests with gamma 4; override any field."""
    fields = dict(
        method="draft", num_running=3, num_waiting=2, kv_cache_usage=0.25, batch_size=3,
        num_batched_tokens=15, num_preemptions=0, num_prompt_tokens=0, num_generation_tokens=9,
        num_drafts=3, num_draft_tokens=12, num_accepted_tokens=6, num_target_forwards=3,
        accepted_per_position=(3, 2, 1, 0), accepted_lengths=(4, 2, 0),
        draft_time_s=0.004, verify_time_s=0.012, plain_step_time_s=0.010, pure_decode=True,
        chosen_k=(4, 4, 4), drafts_by_proposer=(("draft", 12, 6),), predicted_time_s=0.020,
    )
    fields.update(overrides)
    return StepStats(**fields)


def finished(request_id="r", reason="stop", arrival=100.0, scheduled=100.5, first=101.0, done=103.0,
             prompt=7, output=5) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, new_token_ids=[1], finished=True, finish_reason=reason,
        num_prompt_tokens=prompt, num_output_tokens=output, spec=SpecStats(8, 4, 2),
        timing=RequestTiming(arrival, scheduled, first, done))


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from the text exposition."""
    text = metrics.render().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels) -> float:
    found = samples(metrics)
    key = ("specserve:" + name, frozenset(labels.items()))
    assert key in found, f"no sample {key}; have {sorted(k[0] for k in found)}"
    return found[key]


def spec_labels(method="draft"):
    return {"model_name": MODEL, "method": method}


# A varied, hand-built run: prefill, decode with drafts, a preemption, an n-gram-style miss.
STEPS = [
    step(num_prompt_tokens=40, num_batched_tokens=40, num_generation_tokens=2, num_drafts=0, pure_decode=False,
         num_draft_tokens=0, num_accepted_tokens=0, num_target_forwards=0, accepted_per_position=(),
         accepted_lengths=(), draft_time_s=0.0, verify_time_s=0.02, batch_size=2, num_running=2,
         chosen_k=(), drafts_by_proposer=(), predicted_time_s=None),
    step(),
    step(num_preemptions=1, num_drafts=2, num_draft_tokens=8, num_accepted_tokens=7,
         num_target_forwards=2, accepted_per_position=(2, 2, 2, 1), accepted_lengths=(4, 3),
         num_generation_tokens=9, batch_size=2, num_batched_tokens=10,
         chosen_k=(4, 4), drafts_by_proposer=(("draft", 8, 7),), predicted_time_s=0.008),
    step(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=0, num_target_forwards=3,
         accepted_per_position=(0, 0), accepted_lengths=(0,), num_generation_tokens=3,
         chosen_k=(2, 0, 0), drafts_by_proposer=(("draft", 2, 0),), predicted_time_s=None),
    step(batch_size=0, num_running=0, num_waiting=0, num_batched_tokens=0, num_generation_tokens=0,
         num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, num_target_forwards=0,
         accepted_per_position=(), accepted_lengths=(), draft_time_s=0.0, verify_time_s=0.0,
         kv_cache_usage=0.0, chosen_k=(), drafts_by_proposer=(), predicted_time_s=None),
]


@pytest.fixture
def fed() -> Metrics:
    m = Metrics(MODEL, "draft")
    for s in STEPS:
        m.observe_step(s)
    m.observe_request(finished("a", "stop", 100.0, 100.5, 101.0, 103.0))
    m.observe_request(finished("b", "length", 200.0, 200.0, 200.25, 210.0))
    m.observe_request(finished("c", "abort", 300.0, None, None, 301.0))
    m.observe_token_gap(0.02)
    m.observe_token_gap(0.03)
    m.observe_discarded(3)
    return m


def test_counters_equal_sums_of_inputs(fed):
    sl = spec_labels()
    assert value(fed, "spec_decode_num_drafts_total", **sl) == sum(s.num_drafts for s in STEPS)
    assert value(fed, "spec_decode_num_draft_tokens_total", **sl) == sum(s.num_draft_tokens for s in STEPS)
    assert value(fed, "spec_decode_num_accepted_tokens_total", **sl) == sum(s.num_accepted_tokens for s in STEPS)
    assert value(fed, "spec_decode_num_target_forwards_total", **sl) == sum(s.num_target_forwards for s in STEPS)
    base = {"model_name": MODEL}
    assert value(fed, "num_preemptions_total", **base) == 1
    assert value(fed, "prompt_tokens_total", **base) == sum(s.num_prompt_tokens for s in STEPS)
    assert value(fed, "generation_tokens_total", **base) == sum(s.num_generation_tokens for s in STEPS)
    assert value(fed, "discarded_tokens_total", **base) == 3
    for position, expected in enumerate([3 + 2 + 0, 2 + 2 + 0, 1 + 2, 0 + 1]):
        assert value(fed, "spec_decode_num_accepted_tokens_per_pos_total", position=str(position), **sl) == expected
    for reason, expected in [("stop", 1), ("length", 1), ("abort", 1), ("error", 0)]:
        assert value(fed, "request_success_total", finished_reason=reason, **base) == expected


def test_step_histograms(fed):
    sl, base = spec_labels(), {"model_name": MODEL}
    lengths = [n for s in STEPS for n in s.accepted_lengths]
    assert value(fed, "spec_decode_accepted_length_count", **sl) == len(lengths)
    assert value(fed, "spec_decode_accepted_length_sum", **sl) == sum(lengths)
    for le in range(5):   # one bucket per integer: cumulative counts
        assert value(fed, "spec_decode_accepted_length_bucket", le=f"{float(le)}", **sl) == sum(n <= le for n in lengths)
    assert value(fed, "spec_decode_accepted_length_bucket", le="+Inf", **sl) == len(lengths)
    ran = [s for s in STEPS if s.batch_size > 0]
    assert value(fed, "batch_size_count", **base) == len(ran)
    assert value(fed, "batch_size_sum", **base) == sum(s.batch_size for s in ran)
    assert value(fed, "num_batched_tokens_sum", **base) == sum(s.num_batched_tokens for s in ran)
    assert value(fed, "spec_decode_verify_time_seconds_count", **sl) == len(ran)
    assert value(fed, "spec_decode_draft_time_seconds_count", **sl) == len(ran)
    assert value(fed, "spec_decode_draft_time_seconds_sum", **sl) == pytest.approx(sum(s.draft_time_s for s in ran))
    assert value(fed, "spec_decode_verify_time_seconds_sum", **sl) == pytest.approx(sum(s.verify_time_s for s in ran))


def test_chosen_k_histogram(fed):
    sl = spec_labels()
    ks = [k for s in STEPS for k in s.chosen_k]
    assert sorted(ks) == [0, 0, 2, 4, 4, 4, 4, 4]
    assert value(fed, "spec_decode_chosen_k_count", **sl) == 8
    assert value(fed, "spec_decode_chosen_k_sum", **sl) == 22 == value(fed, "spec_decode_num_draft_tokens_total", **sl)
    for le, expected in [(0, 2), (1, 2), (2, 3), (3, 3), (4, 8), (16, 8)]:   # cumulative, one bucket per k
        assert value(fed, "spec_decode_chosen_k_bucket", le=f"{float(le)}", **sl) == expected
    assert value(fed, "spec_decode_chosen_k_bucket", le="+Inf", **sl) == 8


def test_per_proposer_counters(fed):
    sl = spec_labels()
    assert value(fed, "spec_decode_num_draft_tokens_by_proposer_total", proposer="draft", **sl) == 12 + 8 + 2
    assert value(fed, "spec_decode_num_accepted_tokens_by_proposer_total", proposer="draft", **sl) == 6 + 7 + 0
    # an "auto" engine: both proposers' series exist from the start; split sums equal the unsplit counters
    m = Metrics(MODEL, "auto", proposers=["draft", "ngram"])
    al = spec_labels("auto")
    assert value(m, "spec_decode_num_draft_tokens_by_proposer_total", proposer="ngram", **al) == 0
    m.observe_step(step(method="auto", drafts_by_proposer=(("draft", 8, 5), ("ngram", 4, 1)), num_accepted_tokens=6))
    m.observe_step(step(method="auto", drafts_by_proposer=(("ngram", 12, 6),)))
    drafted = {p: value(m, "spec_decode_num_draft_tokens_by_proposer_total", proposer=p, **al) for p in ("draft", "ngram")}
    accepted = {p: value(m, "spec_decode_num_accepted_tokens_by_proposer_total", proposer=p, **al)
                for p in ("draft", "ngram")}
    assert drafted == {"draft": 8, "ngram": 16} and accepted == {"draft": 5, "ngram": 7}
    assert sum(drafted.values()) == value(m, "spec_decode_num_draft_tokens_total", **al) == 24
    assert sum(accepted.values()) == value(m, "spec_decode_num_accepted_tokens_total", **al) == 12
    # without the list, a proposer's series appears when it first drafts
    lazy = Metrics(MODEL, "auto")
    assert not [k for k in samples(lazy) if "by_proposer" in k[0]]
    lazy.observe_step(step(method="auto", drafts_by_proposer=(("ngram", 12, 6),)))
    assert value(lazy, "spec_decode_num_draft_tokens_by_proposer_total", proposer="ngram", **al) == 12
    assert not [k for k in samples(lazy) if ("proposer", "draft") in k[1]]


def test_predicted_against_measured_step_time(fed):
    sl = spec_labels()
    # pure decode steps with a prediction: STEPS[1] (0.020 predicted, 0.016 measured), STEPS[2] (0.008, 0.016)
    assert value(fed, "spec_decode_predicted_step_time_seconds_count", **sl) == 2
    assert value(fed, "spec_decode_predicted_step_time_seconds_sum", **sl) == pytest.approx(0.028)
    assert value(fed, "spec_decode_measured_step_time_seconds_total", **sl) == pytest.approx(0.032)
    assert value(fed, "spec_decode_step_time_ratio_count", **sl) == 2
    assert value(fed, "spec_decode_step_time_ratio_sum", **sl) == pytest.approx(0.8 + 2.0)
    assert value(fed, "spec_decode_step_time_ratio_bucket", le="0.8", **sl) == 1
    assert value(fed, "spec_decode_step_time_ratio_bucket", le="1.5", **sl) == 1
    assert value(fed, "spec_decode_step_time_ratio_bucket", le="2.0", **sl) == 2
    # a prediction on a step with prefill work, or none at all, is not observed
    m = Metrics(MODEL, "draft")
    m.observe_step(step(pure_decode=False))
    m.observe_step(step(predicted_time_s=None))
    assert value(m, "spec_decode_predicted_step_time_seconds_count", **sl) == 0
    assert value(m, "spec_decode_measured_step_time_seconds_total", **sl) == 0
    assert value(m, "spec_decode_step_time_ratio_count", **sl) == 0


def test_request_latencies(fed):
    base = {"model_name": MODEL}
    # TTFT: only requests that produced a token; queue: only requests that were scheduled.
    assert value(fed, "time_to_first_token_seconds_count", **base) == 2
    assert value(fed, "time_to_first_token_seconds_sum", **base) == pytest.approx(1.0 + 0.25)
    assert value(fed, "request_queue_time_seconds_count", **base) == 2
    assert value(fed, "request_queue_time_seconds_sum", **base) == pytest.approx(0.5 + 0.0)
    assert value(fed, "e2e_request_latency_seconds_count", **base) == 3
    assert value(fed, "e2e_request_latency_seconds_sum", **base) == pytest.approx(3.0 + 10.0 + 1.0)
    assert value(fed, "inter_token_latency_seconds_count", **base) == 2
    assert value(fed, "inter_token_latency_seconds_sum", **base) == pytest.approx(0.05)
    assert value(fed, "time_to_first_token_seconds_bucket", le="0.25", **base) == 1


def test_delta_times_give_inter_token_latency():
    m = Metrics(MODEL, "ngram")
    m.observe_request(finished(), num_deltas_times=[1.0, 1.5, 1.75, 1.75])
    assert value(m, "inter_token_latency_seconds_count", model_name=MODEL) == 3
    assert value(m, "inter_token_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.75)


def test_state_gauges_follow_last_step(fed):
    base = {"model_name": MODEL}
    assert value(fed, "num_requests_running", **base) == 0
    assert value(fed, "num_requests_waiting", **base) == 0
    assert value(fed, "kv_cache_usage_perc", **base) == 0.0
    m = Metrics(MODEL, "draft")
    m.observe_step(step(num_running=5, num_waiting=7, kv_cache_usage=0.875))
    assert value(m, "num_requests_running", **base) == 5
    assert value(m, "num_requests_waiting", **base) == 7
    assert value(m, "kv_cache_usage_perc", **base) == 0.875


def test_acceptance_rate_and_speedup_on_known_input(fed):
    sl = spec_labels()
    drafted = [s for s in STEPS if s.num_draft_tokens > 0]
    rate = sum(s.num_accepted_tokens for s in drafted) / sum(s.num_draft_tokens for s in drafted)
    assert rate == 13 / 22
    assert value(fed, "spec_decode_acceptance_rate", **sl) == pytest.approx(rate)
    # Pure decode steps with a known plain step time: STEPS[1:4].
    decode = STEPS[1:4]
    emitted = sum(s.num_accepted_tokens + s.num_target_forwards for s in decode)   # 6+3 + 7+2 + 0+3
    forwards = sum(s.num_target_forwards for s in decode)
    plain = sum(s.plain_step_time_s for s in decode)
    spent = sum(s.draft_time_s + s.verify_time_s for s in decode)
    expected = (emitted / forwards) * (plain / spent)
    assert expected == pytest.approx((21 / 8) * (0.03 / 0.048))
    assert value(fed, "spec_decode_estimated_speedup", **sl) == pytest.approx(expected)


def test_single_step_speedup_by_hand():
    m = Metrics(MODEL, "draft")
    # 4 requests, gamma 3: each accepts 2 -> emits 3 tokens per forward; spec step takes 1.5x a plain one.
    m.observe_step(step(batch_size=4, num_target_forwards=4, num_drafts=4, num_draft_tokens=12,
                        num_accepted_tokens=8, accepted_per_position=(4, 4, 0), accepted_lengths=(2, 2, 2, 2),
                        draft_time_s=0.005, verify_time_s=0.010, plain_step_time_s=0.010))
    assert value(m, "spec_decode_estimated_speedup", **spec_labels()) == pytest.approx(3 * 0.010 / 0.015)
    assert value(m, "spec_decode_acceptance_rate", **spec_labels()) == pytest.approx(8 / 12)


def test_window_forgets_old_steps():
    m = Metrics(MODEL, "draft", window_steps=4)
    for _ in range(10):   # all rejected
        m.observe_step(step(num_accepted_tokens=0, accepted_per_position=(0, 0, 0, 0), accepted_lengths=(0, 0, 0)))
    for _ in range(4):    # all accepted
        m.observe_step(step(num_accepted_tokens=12, accepted_per_position=(3, 3, 3, 3), accepted_lengths=(4, 4, 4)))
    assert value(m, "spec_decode_acceptance_rate", **spec_labels()) == 1.0
    assert value(m, "spec_decode_estimated_speedup", **spec_labels()) == pytest.approx(5 * 0.010 / 0.016)
    assert value(m, "spec_decode_num_accepted_tokens_total", **spec_labels()) == 48   # counters do not forget
    assert WINDOW_STEPS >= 16


def test_window_gauges_absent_until_computable():
    m = Metrics(MODEL, "draft")
    names = {k[0] for k in samples(m)}
    assert "specserve:spec_decode_acceptance_rate" not in names
    assert "specserve:spec_decode_estimated_speedup" not in names
    # A prefill-only step and a decode step without a plain-step estimate give nothing to compute.
    m.observe_step(STEPS[0])
    m.observe_step(step(plain_step_time_s=None, num_draft_tokens=0, num_drafts=0, num_accepted_tokens=0,
                        accepted_per_position=(), accepted_lengths=()))
    names = {k[0] for k in samples(m)}
    assert "specserve:spec_decode_acceptance_rate" not in names
    assert "specserve:spec_decode_estimated_speedup" not in names
    assert all(not math.isnan(v) for v in samples(m).values())


def test_method_none_reports_unit_speedup():
    m = Metrics(MODEL, "none")
    assert value(m, "spec_decode_estimated_speedup", **spec_labels("none")) == 1.0
    m.observe_step(step(method="none", num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                        accepted_per_position=(), accepted_lengths=(), draft_time_s=0.0))
    assert value(m, "spec_decode_estimated_speedup", **spec_labels("none")) == 1.0
    assert value(m, "spec_decode_num_target_forwards_total", **spec_labels("none")) == 3
    assert value(m, "spec_decode_verify_time_seconds_count", **spec_labels("none")) == 1
    assert value(m, "spec_decode_draft_time_seconds_count", **spec_labels("none")) == 0
    assert ("specserve:spec_decode_acceptance_rate", frozenset(spec_labels("none").items())) not in samples(m)


def test_every_listed_name_is_exported_with_labels(fed):
    families = {f.name: f for f in text_string_to_metric_families(fed.render().decode())}
    expected = {name.removesuffix("_total"): "counter" for name in COUNTERS}
    expected |= {name: "histogram" for name in HISTOGRAMS} | {name: "gauge" for name in GAUGES}
    for short, kind in expected.items():
        family = families.get("specserve:" + short)
        assert family is not None, f"specserve:{short} missing"
        assert family.type == kind, (short, family.type)
        assert family.samples, f"specserve:{short} has no samples"
        for s in family.samples:
            assert s.labels["model_name"] == MODEL
            if short.startswith("spec_decode_"):
                assert s.labels["method"] == "draft"
            else:
                assert "method" not in s.labels
    # The exact exported counter names (prometheus_client must not double the suffix).
    sample_names = {s.name for f in families.values() for s in f.samples}
    for name in COUNTERS:
        assert "specserve:" + name in sample_names
        assert "specserve:" + name + "_total" not in sample_names
    assert all(name.startswith("specserve:") for name in sample_names)


def test_registries_are_independent():
    a, b = Metrics("a", "draft"), Metrics("b", "ngram")
    a.observe_step(step())
    assert value(b, "generation_tokens_total", model_name="b") == 0
    assert value(a, "generation_tokens_total", model_name="a") == 9


def test_unexpected_finish_reason_still_counted():
    m = Metrics(MODEL, "draft")
    m.observe_request(finished(reason="timeout"))
    m.observe_request(RequestOutput("x", [], finished=True, finish_reason=None))   # no timing, no reason
    assert value(m, "request_success_total", model_name=MODEL, finished_reason="timeout") == 1
    assert value(m, "request_success_total", model_name=MODEL, finished_reason="stop") == 1
    assert value(m, "e2e_request_latency_seconds_count", model_name=MODEL) == 1


def _tiny_pair(request, tmp_path):
    """The session's shared (target, noisy-copy draft) checkpoints when conftest has them, else our own."""
    try:
        return request.getfixturevalue("tiny_pair")
    except pytest.FixtureLookupError:
        from helpers import make_noisy_copy, make_tiny_checkpoint
        target = make_tiny_checkpoint(tmp_path / "target", seed=0)
        return target, make_noisy_copy(target, tmp_path / "draft", noise=0.1)


@pytest.mark.slow   # a real engine on a tiny checkpoint: seconds, mostly torch/transformers start-up
def test_real_engine_steps(request, tmp_path):
    """The engine's own StepStats and final outputs, through Metrics: sums match, gauges sane."""
    pytest.importorskip("torch")
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    target, draft = _tiny_pair(request, tmp_path)   # a noisy copy: some drafts accepted, some rejected
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                                 speculative={"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 3, "adaptive": False}))
    metrics = Metrics(MODEL, engine.method)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    steps, finals = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append(engine.last_stats)
        metrics.observe_step(engine.last_stats)
        for output in outputs:
            if output.finished:
                finals.append(output)
                metrics.observe_request(output)
    sl = spec_labels("draft")
    assert value(metrics, "spec_decode_num_draft_tokens_total", **sl) == sum(s.num_draft_tokens for s in steps) > 0
    assert value(metrics, "spec_decode_num_accepted_tokens_total", **sl) == sum(s.num_accepted_tokens for s in steps)
    assert value(metrics, "generation_tokens_total", model_name=MODEL) == 3 * 12
    assert value(metrics, "prompt_tokens_total", model_name=MODEL) == 3 * 5
    assert value(metrics, "request_success_total", model_name=MODEL, finished_reason="length") == 3
    accepted, proposed = sum(s.num_accepted_tokens for s in steps), sum(s.num_draft_tokens for s in steps)
    assert 0 < accepted < proposed
    assert value(metrics, "spec_decode_acceptance_rate", **sl) == pytest.approx(accepted / proposed)
    forwards = value(metrics, "spec_decode_num_target_forwards_total", **sl)
    assert 3 * 12 == 3 + accepted + forwards   # each request: its first token, then accepted + one per pass
    assert value(metrics, "time_to_first_token_seconds_count", model_name=MODEL) == 3
    speedup = value(metrics, "spec_decode_estimated_speedup", **sl)
    assert math.isfinite(speedup) and speedup > 0

