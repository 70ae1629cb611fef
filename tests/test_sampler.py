"""Unit tests for engine/sampler.py: warping, seeded sampling, penalties, logprobs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import (
    SamplingTensors,
    apply_penalties,
    compute_logprobs,
    sample,
    warp_probs,
)
from engine.sampling_params import (
    MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_REPETITION_PENALTY, MIN_TOP_P, SamplingParams,
)


# ---------------------------------------------------------------------------
# A deliberately naive per-row reference for warping (float64, Python loops).


def reference_warp(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    if temperature < 1e-5:
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / temperature
    if top_k > 0:
        kth = sorted(z, reverse=True)[min(top_k, len(z)) - 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        keep = np.zeros(len(p), dtype=bool)
        mass = 0.0
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
            if mass < top_p:
                keep[i] = True
            mass += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p < min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return warp_probs(logits, SamplingTensors.from_params(params, "cpu"))


def check_against_reference(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs = warp(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for row, p in enumerate(params):
        expected = reference_warp(logits[row].tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        got = probs[row].double().numpy()
        np.testing.assert_array_equal(got > 0, expected > 0, err_msg=f"support of row {row} ({p})")
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=1e-5, err_msg=f"row {row} ({p})")
        assert math.isclose(float(probs[row].sum()), 1.0, abs_tol=1e-5)
    return probs


# log of [0.5, 0.3, 0.15, 0.05], shuffled so the sort really matters
QUARTER = [0.15, 0.5, 0.05, 0.3]
QUARTER_LOGITS = [math.log(x) for x in QUARTER]


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(), [0, 1, 2, 3]),
        (SamplingParams(top_k=2), [1, 3]),
        (SamplingParams(top_k=10), [0, 1, 2, 3]),
        (SamplingParams(top_p=0.75), [1, 3]),             # 0.5 < 0.75, then 0.8 >= 0.75: stop
        (SamplingParams(top_p=0.85), [0, 1, 3]),
        (SamplingParams(top_p=0.1), [1]),                  # the top token always stays
        (SamplingParams(min_p=0.2), [0, 1, 3]),            # threshold 0.1
        (SamplingParams(min_p=0.7), [1]),                  # threshold 0.35
        (SamplingParams(top_k=3, top_p=0.6), [1, 3]),      # top-p on the renormalised top 3: 0.526 < 0.6
        (SamplingParams(top_k=3, min_p=0.35), [1, 3]),     # threshold 0.175
        (SamplingParams(temperature=0.5, top_p=0.75), [1, 3]),  # sharper: 0.685, then 0.932
        (SamplingParams(temperature=0.5, top_p=0.65), [1]),
        (SamplingParams(temperature=0.0), [1]),
    ],
)
def test_hand_built_supports(params, support):
    logits = torch.tensor([QUARTER_LOGITS])
    probs = check_against_reference(logits, [params])
    assert torch.nonzero(probs[0]).flatten().tolist() == sorted(support)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([QUARTER_LOGITS] * 3)
    probs = check_against_reference(
        logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0), SamplingParams(temperature=2.0)]
    )
    assert probs[0, 1] > probs[1, 1] > probs[2, 1]
    expected = torch.tensor(QUARTER) ** 2
    torch.testing.assert_close(probs[0], expected / expected.sum())


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    probs = check_against_reference(logits, [SamplingParams(top_k=2)])
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 2, 4]


def test_greedy_rows_are_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 2.0]])
    probs = warp(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6, top_k=2)])
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_random_batch_matches_reference_row_by_row():
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.7, min_p=0.02),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.9, top_p=0.3),
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    probs = check_against_reference(logits, params)
    # rows without filtering are exactly softmax(logits / T)
    torch.testing.assert_close(probs[0], logits[0].softmax(-1), rtol=0, atol=1e-7)


def test_flags_and_on_demand_flags_agree():
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=0.8)]
    t = SamplingTensors.from_params(params, "cpu")
    # a greedy row's top-k never needs the sort
    assert (t.needs_sort, t.needs_min_p, t.all_greedy) == (False, False, False)
    assert t.is_greedy.tolist() == [True, False]
    bare = SamplingTensors(t.temperature, t.top_k, t.top_p, t.min_p)
    logits = torch.randn(2, 9)
    torch.testing.assert_close(warp_probs(logits, bare), warp_probs(logits, t), rtol=0, atol=0)
    assert bare.needs_sort is False and bare.all_greedy is False
    assert SamplingTensors.from_params([SamplingParams(top_k=-1)], "cpu").top_k.tolist() == [0]
    assert SamplingTensors.from_params([SamplingParams(temperature=0)], "cpu").all_greedy


# ---------------------------------------------------------------------------
# sample()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_sample_is_argmax_and_draws_nothing():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    gen = seeded(3)
    state = gen.get_state()
    tokens = sample(probs, torch.tensor([True, True]), [gen, None])
    assert tokens.tolist() == [1, 0]
    assert torch.equal(gen.get_state(), state)


def test_same_seed_same_tokens_alone_and_in_any_batch():
    vocab = 50
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=gen).softmax(-1)
    others = torch.randn(6, vocab, generator=gen).softmax(-1)

    def run(position: int, batch: int, steps: int = 4) -> list[int]:
        mine = seeded(1234)
        gens = [seeded(99 + i) if i % 3 else None for i in range(batch)]
        gens[position] = mine
        greedy = torch.tensor([i % 2 == 1 and i != position for i in range(batch)])
        probs = others[:batch].clone()
        probs[position] = row
        return [int(sample(probs, greedy, gens)[position]) for _ in range(steps)]

    alone = run(0, 1)
    assert len(set(alone)) > 1  # the generator advances between calls
    assert run(3, 5) == alone
    assert run(1, 2) == alone
    assert run(5, 6) == alone


def test_sampled_row_draws_exactly_one_exponential_vector():
    vocab = 17
    gen = seeded(5)
    sample(torch.full((1, vocab), 1.0 / vocab), torch.tensor([False]), [gen])
    reference = seeded(5)
    torch.empty(vocab).exponential_(generator=reference)
    assert torch.equal(gen.get_state(), reference.get_state())


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a zero-probability token"
    return chisquare(counts[support], expected[support]).pvalue


@pytest.mark.parametrize("seeded_rows", [True, False])
def test_exponential_race_samples_from_probs(seeded_rows):
    probs = torch.tensor([0.05, 0.2, 0.0, 0.3, 0.25, 0.12, 0.08])
    draws = 20_000
    if seeded_rows:
        gen = seeded(2024)
        generators = [gen] * draws
    else:
        torch.manual_seed(2024)
        generators = [None] * draws
    tokens = sample(probs.expand(draws, -1).contiguous(), torch.zeros(draws, dtype=torch.bool), generators)
    counts = np.bincount(tokens.numpy(), minlength=len(probs))
    assert chi_square_pvalue(counts, probs.double().numpy()) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    # sanity check of the statistical check itself: uniform samples vs skewed probs
    probs = np.array([0.05, 0.2, 0.3, 0.25, 0.2])
    counts = np.bincount(np.random.default_rng(0).integers(0, 5, 20_000), minlength=5)
    assert chi_square_pvalue(counts, probs) < 1e-3


# ---------------------------------------------------------------------------
# Penalties


def test_penalties_exact_values():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    original = logits.clone()
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        SamplingParams(),  # no penalties: untouched although it has history
        SamplingParams(presence_penalty=-1.0),
        SamplingParams(repetition_penalty=0.5, frequency_penalty=1.0),
    ]
    prompts = [[0, 1], [0, 1, 2], [0, 5], [4]]
    outputs = [[3, 3, 2], [3, 3], [1, 1, 1], []]
    out = apply_penalties(logits, params, prompts, outputs)
    # row 0: repetition on {0,1,2,3} -> [1, -2, .25, 1.5, -2, 1]; frequency -.25 on 2, -.5 on 3;
    #        presence -.5 on 2 and 3
    # row 2: presence on output token 1 only (prompt tokens do not count)
    # row 3: repetition 0.5 on the prompt token 4 (negative logit: multiplied); no output, no frequency
    expected = torch.tensor(
        [
            [1.0, -2.0, -0.5, 0.5, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, 0.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -1.0, 1.0],
        ]
    )
    assert torch.equal(out, expected)
    assert torch.equal(logits, original), "apply_penalties must not modify its input"


def test_penalties_are_per_row_for_speculative_positions():
    # one request verified at three positions: each row counts only the output before it
    params = [SamplingParams(frequency_penalty=1.0)] * 3
    logits = torch.zeros(3, 4)
    history = [[2], [2, 3], [2, 3, 3]]
    out = apply_penalties(logits, params, [[0]] * 3, history)
    assert out.tolist() == [[0, 0, -1, 0], [0, 0, -1, -1], [0, 0, -1, -2]]


def test_no_penalties_skips_all_work():
    logits = torch.randn(2, 5)
    out = apply_penalties(logits, [SamplingParams(), SamplingParams(temperature=0)], [[1], [2]], [[3], [4]])
    assert out is logits


def test_penalties_keep_dtype():
    logits = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.bfloat16)
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[]])
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[0.5, -2.0, 2.0]]


# ---------------------------------------------------------------------------
# Logprobs


def test_compute_logprobs_matches_log_softmax_and_orders_top():
    gen = seeded(11)
    logits = torch.randn(4, 30, generator=gen) * 2
    token_ids = torch.tensor([0, 7, 29, 3])
    chosen, top_ids, top_logprobs = compute_logprobs(logits, token_ids, 5)
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(chosen.double(), reference[torch.arange(4), token_ids], rtol=0, atol=1e-5)
    assert top_ids.shape == (4, 5) and top_logprobs.shape == (4, 5)
    for row in range(4):
        order = sorted(range(30), key=lambda i: -float(reference[row, i]))[:5]
        assert top_ids[row].tolist() == order
        torch.testing.assert_close(top_logprobs[row].double(), reference[row, order], rtol=0, atol=1e-5)
    assert torch.all(top_logprobs[:, :-1] >= top_logprobs[:, 1:])


def test_compute_logprobs_without_top():
    logits = torch.randn(2, 6)
    chosen, top_ids, top_logprobs = compute_logprobs(logits, torch.tensor([1, 2]), 0)
    assert chosen.shape == (2,) and top_ids.shape == (2, 0) and top_logprobs.shape == (2, 0)
    assert top_ids.dtype == torch.int64


def test_top_k_top_p_among_candidates_equals_the_full_sort():
    """Vocabularies wider than TOP_CANDIDATES filter among the best candidates; rows whose kept set may
    reach past them (flat distributions, large top-k) fall back to the full sort. Same kept sets either way."""
    from engine.sampler import TOP_CANDIDATES, _filter_sorted, _top_k_top_p

    generator = torch.Generator().manual_seed(0)
    vocab = 4 * TOP_CANDIDATES
    peaky = torch.randn(6, vocab, generator=generator) * 6
    flat = torch.randn(6, vocab, generator=generator) * 0.1   # the nucleus needs most of the vocabulary
    logits = torch.cat([peaky, flat])
    top_k = torch.tensor([0, 7, 0, 2 * TOP_CANDIDATES, 0, 40] * 2)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0, 0.95] * 2)
    expected = _filter_sorted(logits, top_k, top_p)
    untouched = (top_k == 0) & (top_p == 1.0)
    expected[untouched] = logits[untouched]
    got = _top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    kept = ~torch.isinf(got)
    assert torch.equal(got[kept], expected[kept])


def test_a_request_may_cap_its_drafts_anywhere_the_server_may():
    from engine.config import MAX_SPEC_TOKENS
    from engine.sampling_params import SamplingParams

    assert SamplingParams(num_speculative_tokens=MAX_SPEC_TOKENS).num_speculative_tokens == MAX_SPEC_TOKENS
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=MAX_SPEC_TOKENS + 1)


# ---------------------------------------------------------------------------
# Bounds: no setting a request may give overflows or underflows the sampler's tensors.


@pytest.mark.parametrize("field,value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", 100.000001), ("temperature", -1e-9),
    ("top_k", -2), ("top_k", True), ("top_p", 0.0), ("top_p", math.nan), ("top_p", 1.0000001),
    ("min_p", math.nan), ("min_p", 1.5), ("presence_penalty", math.inf), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0099), ("repetition_penalty", 100.01), ("repetition_penalty", 1e-46),
    ("repetition_penalty", math.nan), ("logprobs", 21), ("prompt_logprobs", -1),
    ("stop_token_ids", range(257)), ("stop_token_ids", [-1]),
])
def test_each_field_out_of_range_is_an_error_naming_it(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_the_smallest_top_p_keeps_the_top_token_alone():
    """A top_p below MIN_TOP_P is raised to it: in float32 it would be 0 and keep nothing at all."""
    params = SamplingParams(top_p=1e-46)
    assert params.top_p == MIN_TOP_P
    logits = torch.tensor([[0.0, 3.0, 2.9999, -1.0], [-9.0, -20.0, -30.0, -9.5]])   # a near tie; all unlikely
    probs = warp_probs(logits, SamplingTensors.from_params([params, params], "cpu"))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_settings_at_their_bounds_give_finite_distributions():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    params = [SamplingParams(temperature=MAX_TEMPERATURE, top_k=50, min_p=1e-45),
              SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY, presence_penalty=-2.0, frequency_penalty=-2.0),
              SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY, presence_penalty=2.0, frequency_penalty=2.0)]
    history = [list(range(0, 50, 2)) * 40] * 3
    penalized = apply_penalties(logits, params, [list(range(10))] * 3, history)
    probs = warp_probs(penalized, SamplingTensors.from_params(params, "cpu"))
    assert torch.isfinite(penalized).all() and torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))


def test_stop_token_ids_are_a_set():
    params = SamplingParams(stop_token_ids=[5, 3, 5] + list(range(100, 354)))
    assert isinstance(params.stop_token_ids, frozenset) and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS
