"""bench/policy_ablation.py's variants: each is the goodput policy less the one mechanism it names,
and plans through the same interface. Synthetic step costs: no model, no tensors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from policy_ablation import POLICY_VARIANTS, NoConfidenceStop, NoProbes, OneRate, PromptsCounted  # noqa: E402
from test_policy import Simulation, goodput_policy, synthetic_costs  # noqa: E402

from engine.spec_decode.policy import Candidate, GoodputPolicy, StepView  # noqa: E402

METHODS = ("draft", "ngram")


def variant(name: str) -> GoodputPolicy:
    return POLICY_VARIANTS[name](list(METHODS), synthetic_costs(draft=(0.002, 0.0001)))


@pytest.mark.parametrize("name", list(POLICY_VARIANTS))
def test_every_variant_plans_and_learns_through_the_policy_interface(name):
    """At a high acceptance every variant drafts: none of them breaks the policy, each removes one
    refinement of it."""
    sim = Simulation(variant(name), batch=4, seed=0, methods=METHODS)
    assert sim.mean_k(0.9, 30) > 1.0


def test_without_probes_acceptance_that_comes_back_is_never_found():
    """Acceptance falls from 0.9 to 0, then comes back: the whole policy's probes find it and it
    drafts again; without probes, requests planned at k = 0 stay there."""
    def recovers(policy) -> bool:
        sim = Simulation(policy, 4, seed=0)
        assert sim.mean_k(0.9, 30) > 2
        sim.mean_k(0.0, 60)
        return any(sim.mean_k(0.9, 1) > 1.5 for _ in range(300))
    costs = lambda: synthetic_costs(per_token=0.001)
    assert recovers(goodput_policy(costs()))
    assert not recovers(NoProbes(["ngram"], costs()))


def test_no_confidence_stop_drafts_without_a_bar():
    sim = Simulation(NoConfidenceStop(list(METHODS), synthetic_costs(draft=(0.002, 0.0001))), 2, 0, METHODS)
    sim.mean_k(0.9, 10)
    assert {d.p_min for d in sim.policy.plan(sim.view()).drafts.values()} == {0.0}


def test_one_rate_judges_every_position_alike():
    policy = OneRate(list(METHODS), synthetic_costs(draft=(0.002, 0.0001)))
    Simulation(policy, 1, 0, METHODS).mean_k(0.6, 20)
    first, rest = policy.acceptance("r0", "ngram")
    assert first == rest and 0.0 < first < 1.0


def test_prompts_counted_price_drafts_with_the_prompt_chunks():
    """With a long prompt chunk in the pass, the whole policy prices drafts against the decodes'
    share only; the variant against the whole pass, which makes drafts look cheaper."""
    costs = synthetic_costs(per_token=0.002)
    view = StepView((Candidate("r0", {"ngram": 8}, {"ngram": 0}),), num_prefill_tokens=512, num_prefill_seqs=1)
    whole, counted = GoodputPolicy(["ngram"], costs), PromptsCounted(["ngram"], costs)
    plain = whole._decode_time(view, 1.0)
    assert plain < 1.0 and counted._decode_time(view, 1.0) == 1.0
