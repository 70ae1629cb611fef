"""The speculation policy (engine/spec_decode/policy.py), its estimates and its cost tables, as
properties over several seeds on synthetic step costs: no model, no tensors."""
from __future__ import annotations

import random

import pytest

from engine.spec_decode.estimates import FORGET, POOL_FORGET, AcceptanceRate, DraftRates, judged_tokens
from engine.spec_decode.policy import (EXPLORE, Candidate, Draft, GoodputPolicy, StaticPolicy, StepOutcome, StepPlan,
                                       StepView, Verified, expected_tokens, paying_depth)
from engine.step_costs import DraftForward, PassTiming, StepCosts, TargetTable

MAX_K = 8
SEEDS = range(5)


def synthetic_costs(step: float = 0.020, per_seq: float = 0.0005, per_token: float = 0.0004,
                    draft: tuple[float, float] | None = None, catch_up_price: float = 0.0) -> StepCosts:
    """A target pass of b sequences and q tokens each costs step + per_seq b + per_token b q; a draft
    forward of r rows draft[0] + draft[1] r."""
    costs = StepCosts()
    for b in (1, 2, 4, 8, 16, 32):
        for q in (1, 2, 5, 9):
            costs.target.add(b, q, step + per_seq * b + per_token * b * q)
        if draft is not None:
            costs.draft("draft").add(b, draft[0] + draft[1] * b)
    costs.draft("draft").catch_up_price = catch_up_price
    return costs


def accepted_count(rng: random.Random, alpha: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


class Simulation:
    """A policy driven step by step over `batch` requests that accept each draft token at alpha(step)."""

    def __init__(self, policy, batch: int, seed: int, methods=("ngram",), caps: int = MAX_K):
        self.policy, self.batch, self.rng = policy, batch, random.Random(seed)
        self.methods, self.caps, self.step_index = methods, caps, 0

    def view(self) -> StepView:
        return StepView(tuple(Candidate(f"r{i}", {m: self.caps for m in self.methods}, {m: 0 for m in self.methods})
                              for i in range(self.batch)))

    def step(self, alpha: float) -> dict[str, tuple[str, int]]:
        plan = self.policy.plan(self.view())
        verified = tuple(Verified(rid, d.proposer, d.k, accepted_count(self.rng, alpha, d.k))
                         for rid, d in plan.drafts.items() if d.k)
        self.policy.observe(plan, StepOutcome(verified, None))
        self.step_index += 1
        return {rid: (d.proposer, d.k) for rid, d in plan.drafts.items()}

    def mean_k(self, alpha: float, steps: int) -> float:
        total = sum(k for _ in range(steps) for _, k in self.step(alpha).values())
        return total / (steps * self.batch)


def goodput_policy(costs: StepCosts, methods=("ngram",)) -> GoodputPolicy:
    return GoodputPolicy(list(methods), costs)


# ---- the plan ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_k_falls_as_the_batch_grows(seed):
    """Verification rows cost more of a step the bigger the batch: fewer drafts each."""
    ks = []
    for batch in (1, 4, 16, 32):
        sim = Simulation(goodput_policy(synthetic_costs(per_token=0.002)), batch, seed)
        sim.mean_k(0.8, 20)   # learn the rate
        ks.append(sim.mean_k(0.8, 30))
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] + 1, ks


@pytest.mark.parametrize("seed", SEEDS)
def test_no_drafts_at_low_acceptance(seed):
    """At alpha 0.05 no draft pays for its row: after a few steps the plan drafts (almost) nothing
    but one-token probes, and those spend, net of what they win, no more than the exploration
    budget (plus what each request may bank: one plain step)."""
    costs = synthetic_costs(per_token=0.002)
    policy = goodput_policy(costs)
    sim = Simulation(policy, 4, seed)
    sim.mean_k(0.05, 20)
    steps, planned, net = 1000, 0, 0.0
    for _ in range(steps):
        plan = policy.plan(sim.view())
        verified = tuple(Verified(rid, d.proposer, d.k, accepted_count(sim.rng, 0.05, d.k))
                         for rid, d in plan.drafts.items())
        policy.observe(plan, StepOutcome(verified, None))
        planned += sum(d.k for d in plan.drafts.values() if not d.probe)
        # a probe adds one verification row, and an accepted one saves a plain token
        net += sum(0.002 - v.num_accepted * costs.plain_step(4) / 4 for v in verified if plan.drafts[v.request_id].probe)
    assert planned < 0.01 * steps * 4, planned   # false rises of the change detector draft a little
    assert 0 < net <= EXPLORE * steps * costs.plain_step(4) + 4 * costs.plain_step(4), net


@pytest.mark.parametrize("seed", SEEDS)
def test_deep_drafts_at_high_acceptance_and_cheap_rows(seed):
    sim = Simulation(goodput_policy(synthetic_costs(per_token=0.0002)), 1, seed)
    sim.mean_k(0.95, 20)
    assert sim.mean_k(0.95, 30) >= 6


@pytest.mark.parametrize("seed", SEEDS)
def test_recovery_after_a_shift(seed):
    """Acceptance falls from 0.9 to 0: drafting stops within a few steps; it comes back to 0.9: the
    probes find it and the plan drafts again."""
    sim = Simulation(goodput_policy(synthetic_costs(per_token=0.001)), 4, seed)
    assert sim.mean_k(0.9, 30) > 2
    down = next(t for t in range(100) if sim.mean_k(0.0, 1) < 0.3)
    assert down <= 10, down
    sim.mean_k(0.0, 50)
    up = next((t for t in range(300) if sim.mean_k(0.9, 1) > 1.5), None)
    assert up is not None and up <= 150, up


@pytest.mark.parametrize("seed", SEEDS)
def test_a_new_request_starts_from_the_engine_wide_rate(seed):
    """Requests that finish leave the rate behind: a newcomer drafts at once when traffic accepts."""
    policy = goodput_policy(synthetic_costs(per_token=0.0005))
    sim = Simulation(policy, 2, seed)
    sim.mean_k(0.9, 40)
    for rid in ("r0", "r1"):
        policy.on_finish(rid)
    plan = policy.plan(StepView((Candidate("new", {"ngram": MAX_K}, {"ngram": 0}),)))
    assert plan.drafts["new"].k >= 3 and not plan.drafts["new"].probe


def test_the_dear_forward_of_a_draft_model_limits_depth_where_rows_are_cheap():
    """One forward per depth: at batch 1 a draft model costing 30% of a target step drafts fewer
    tokens than a free proposer at the same acceptance, and one costing 3% drafts deep."""
    for forward, low, high in ((0.006, 1, 4), (0.0006, 4, MAX_K)):
        policy = goodput_policy(synthetic_costs(per_token=0.0002, draft=(forward, 0.0)), ("draft",))
        sim = Simulation(policy, 1, 0, methods=("draft",))
        sim.mean_k(0.8, 20)
        assert low <= sim.mean_k(0.8, 20) <= high, forward


def test_the_free_proposer_wins_at_equal_acceptance():
    policy = goodput_policy(synthetic_costs(draft=(0.004, 0.0005)), ("draft", "ngram"))
    sim = Simulation(policy, 2, 0, methods=("draft", "ngram"))
    for _ in range(20):
        sim.step(0.8)
    assert {method for method, k in sim.step(0.8).values() if k} == {"ngram"}


def test_a_long_catch_up_is_paid_only_where_drafts_repay_it():
    """Catching a draft model up on 2,000 tokens buys drafting for the rest of the request: worth it at
    alpha 0.5 for a long answer, not for its last few tokens (and no catch-up is always worth it)."""
    costs = synthetic_costs(draft=(0.002, 0.0002), catch_up_price=0.0001)
    policy = goodput_policy(costs, ("draft",))
    for lag, remaining, drafts in ((0, 4, True), (2000, 4, False), (2000, 20_000, True)):
        view = StepView((Candidate("r", {"draft": MAX_K}, {"draft": lag}, remaining),))
        policy.observe(policy.plan(view), StepOutcome((Verified("r", "draft", 4, 2),), None))
        plan = policy.plan(view)
        assert bool(plan.drafts.get("r") and not plan.drafts["r"].probe) == drafts, (lag, remaining)


def test_the_plan_respects_what_a_proposer_can_offer():
    policy = goodput_policy(synthetic_costs(per_token=0.0001))
    view = StepView((Candidate("r", {"ngram": 2}, {"ngram": 0}), Candidate("s", {"ngram": 0}, {"ngram": 0})))
    policy.pool["ngram"].observe(8, 8)
    plan = policy.plan(view)
    assert plan.drafts["r"].k <= 2 and "s" not in plan.drafts


def test_the_confidence_stop_is_the_break_even_chance():
    """p_min rises with the price of a row: a dear row needs a likelier draft token."""
    bars = []
    for per_token in (0.0002, 0.002):
        policy = goodput_policy(synthetic_costs(per_token=per_token))
        policy.pool["ngram"].observe(20, 20)
        draft = policy.plan(StepView((Candidate("r", {"ngram": MAX_K}, {"ngram": 0}),))).drafts["r"]
        bars.append(draft.p_min)
    assert 0 < bars[0] < bars[1] < 1


def test_static_policy_drafts_gamma_from_the_first_usable_proposer():
    costs = synthetic_costs()
    policy = StaticPolicy(["draft", "ngram"], 4, costs, p_min=0.2)
    view = StepView((Candidate("a", {"draft": 3, "ngram": 4}, {"draft": 0}),
                     Candidate("b", {"draft": 0, "ngram": 2}, {}), Candidate("c", {"draft": 0, "ngram": 0}, {})))
    plan = policy.plan(view)
    drafts = plan.drafts
    assert (drafts["a"].proposer, drafts["a"].k, drafts["a"].p_min) == ("draft", 3, 0.2)
    assert (drafts["b"].proposer, drafts["b"].k) == ("ngram", 2) and "c" not in drafts
    # priced like any plan, so the metrics compare its predicted and measured time
    assert plan.predicted_time == pytest.approx(
        costs.step_time(3, 3 + 5, {"draft": [1, 1, 1]}, {"draft": 0}) - costs.overhead)


def test_a_static_policy_without_cost_tables_predicts_nothing():
    plan = StaticPolicy(["ngram"], 4, StepCosts()).plan(StepView((Candidate("a", {"ngram": 4}, {}),)))
    assert plan.drafts["a"].k == 4 and plan.predicted_time is None


def test_expected_tokens():
    assert expected_tokens(0.5, 0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 1.0, 4) == 4.0 and expected_tokens(0.0, 0.9, 4) == 0.0
    assert expected_tokens(0.6, 0.9, 3) == pytest.approx(0.6 * (1 + 0.9 + 0.81)) and expected_tokens(0.6, 0.9, 0) == 0


def test_the_paying_depth_follows_both_rates():
    assert paying_depth(0.3, 0.99, 0.4, 8) == 0   # the first token does not pay
    assert paying_depth(0.6, 0.9, 0.4, 8) == 4    # 0.6 * 0.9^3 = 0.44 > 0.4 > 0.6 * 0.9^4
    assert paying_depth(0.6, 1.0, 0.4, 8) == 8 and paying_depth(0.6, 0.0, 0.4, 8) == 1


def accepted_by_position(rng: random.Random, first: float, rest: float, k: int) -> int:
    """A copy in progress: the first draft token accepted at `first`, each later one at `rest`."""
    n = 0
    while n < k and rng.random() < (first if n == 0 else rest):
        n += 1
    return n


@pytest.mark.parametrize("seed", SEEDS)
def test_a_copy_in_progress_is_drafted_deep(seed):
    """First draft token 0.6, later ones 0.95 (what n-gram and suffix drafting measure on code edits):
    both rates are learned, and the plan drafts past the depth the first token's rate alone would
    pay for (0.6^k above the bar of about 0.3 here: 2)."""
    policy = goodput_policy(synthetic_costs(per_token=0.002))
    sim = Simulation(policy, 4, seed)
    ks = []
    for _ in range(60):
        plan = policy.plan(sim.view())
        verified = tuple(Verified(rid, d.proposer, d.k, accepted_by_position(sim.rng, 0.6, 0.95, d.k))
                         for rid, d in plan.drafts.items() if d.k)
        policy.observe(plan, StepOutcome(verified, None))
        ks.append(sum(d.k for d in plan.drafts.values()) / 4)
    first, rest = policy.acceptance("r0", "ngram")   # a request remembers about 32 judged tokens
    assert abs(first - 0.6) < 0.2 and rest > 0.8, (first, rest)
    assert sum(ks[-20:]) / 20 >= 3, ks


def test_draft_rates_split_by_position_on_one_clock():
    rates = DraftRates()
    rates.observe(4, 2)   # first accepted; of the rest, one accepted and one rejected
    assert (rates.first.accepted, rates.first.rejected) == (1, 0)
    assert (rates.rest.accepted, rates.rest.rejected) == (1, 1)
    rates.observe(3, 0)   # first rejected; the rest not judged, but their evidence ages with the draft's token
    keep = 1 - FORGET
    assert (rates.first.accepted, rates.first.rejected) == (pytest.approx(keep), 1)
    assert (rates.rest.accepted, rates.rest.rejected) == (pytest.approx(keep), pytest.approx(keep))


# ---- estimates ----------------------------------------------------------------------

def test_judged_tokens():
    assert judged_tokens(4, 4) == 4 and judged_tokens(4, 1) == 2 and judged_tokens(4, 0) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_the_estimate_follows_the_rate_and_restarts_on_a_shift(seed):
    rng, rate = random.Random(seed), AcceptanceRate()
    means = []
    for _ in range(60):
        rate.observe(4, accepted_count(rng, 0.9, 4))
        means.append(rate.mean())
    assert sum(means[-30:]) / 30 > 0.8
    steps = 0
    while rate.mean() > 0.5:
        rate.observe(4, accepted_count(rng, 0.1, 4))
        steps += 1
    assert steps <= 10, steps   # the change detector: forgetting alone takes ~20 steps


def test_idle_evidence_ages_toward_the_prior():
    rate = AcceptanceRate()
    for _ in range(20):
        rate.observe(4, 0)
    before = rate.mean(prior=0.9, weight=4)
    for _ in range(100):
        rate.age()
    assert before < 0.3 < 0.6 < rate.mean(prior=0.9, weight=4)
    assert rate.upper(0.9, 4) > rate.mean(0.9, 4)


# ---- cost tables ----------------------------------------------------------------------

def test_the_target_table_interpolates_and_extrapolates():
    table = TargetTable()
    for b, q, seconds in ((1, 1, 0.010), (1, 5, 0.014), (4, 1, 0.012), (4, 5, 0.020)):
        table.add(b, q, seconds)
    assert table(1, 1) == pytest.approx(0.010) and table(1, 3) == pytest.approx(0.012)
    assert table(2, 2) == pytest.approx(0.010 + (0.012 - 0.010) / 3)   # between batches, at q = 1
    assert table(4, 36) == pytest.approx(0.020 + 0.002 * 4)            # past the last q, linearly
    assert table(8, 8) == pytest.approx(2 * 0.012)                     # past the largest batch: as many passes


def test_one_factor_per_table_follows_the_machine_and_a_stall_moves_it_little():
    costs = synthetic_costs(draft=(0.002, 0.0005))
    forward = DraftForward("draft", 4, 0, 1.5 * costs.draft("draft").tabled(4))
    for _ in range(60):   # a machine 1.5x slower than at start-up
        costs.observe(PassTiming(4, 8, 1.5 * costs.target.tabled(4, 8), (forward,), 1.0))
    assert costs.target.correction.factor == pytest.approx(1.5, rel=0.02)
    assert costs.draft("draft").correction.factor == pytest.approx(1.5, rel=0.02)
    factor = costs.target.correction.factor
    costs.observe(PassTiming(4, 8, 100.0, (), 101.0))   # one stall
    assert costs.target.correction.factor < 1.1 * factor


def test_host_overhead_is_the_step_less_its_passes():
    costs = synthetic_costs()
    for _ in range(50):
        costs.observe(PassTiming(1, 1, costs.target(1, 1), (), costs.target(1, 1) + 0.003))
    assert costs.overhead == pytest.approx(0.003, rel=0.05)


def test_a_certain_optimistic_rate_drafts_what_the_proposer_offers():
    """An upper bound of 1 (little evidence, a high prior) prices every draft as sure to pass."""
    policy = goodput_policy(synthetic_costs(per_token=0.0002))
    policy.optimistic = lambda rid, method: (1.0, 1.0)
    choice = policy._choose(Candidate("r", {"ngram": 5}, {"ngram": 0}), 10.0, {"ngram": 0.001}, optimistic=True)
    assert choice.k == 5


def test_later_draft_tokens_start_as_likely_as_the_first():
    """Only drafts past their first token judge the later positions: engine-wide, a later token is taken
    to be as likely as the first until some are judged, or a draft model accepted 0.98 of the time at one
    token would be priced at 0.5 past it and never drafted deep enough to learn better."""
    pool = DraftRates(POOL_FORGET)
    for _ in range(40):
        pool.observe(1, 1)
    first, rest = pool.mean()
    assert first > 0.95 and rest > 0.85
    pool.observe(4, 1)   # now a later token is judged: rejected
    assert pool.mean()[1] < rest


def test_a_prompt_sharing_the_pass_does_not_cheapen_drafts():
    """The prompt chunk's time is spent whatever the plan: drafting must pay against the decodes' own
    share of the pass. Here a draft row costs 4 ms and a plain token 7 ms at batch 8, so drafts
    accepted half of the time do not pay, with or without 300 prompt tokens in the pass (counted in,
    those made 8 tokens in 1.26 s the rate to beat); drafts accepted 0.95 of the time pay in both."""
    for alpha, pays in ((0.5, False), (0.95, True)):
        policy = goodput_policy(synthetic_costs(per_token=0.004))
        rng = random.Random(0)
        ids = [f"r{i}" for i in range(8)]
        for _ in range(40):   # learn the rate at 4 drafts a step
            verified = tuple(Verified(rid, "ngram", 4, accepted_count(rng, alpha, 4)) for rid in ids)
            policy.observe(StepPlan({rid: Draft("ngram", 4) for rid in ids}), StepOutcome(verified, None))
        candidates = tuple(Candidate(rid, {"ngram": 4}, {"ngram": 0}) for rid in ids)
        for view in (StepView(candidates), StepView(candidates, num_prefill_tokens=300, num_prefill_seqs=1)):
            drafts = {rid: d for rid, d in policy.plan(view).drafts.items() if not d.probe}
            assert bool(drafts) == pays, (alpha, view.num_prefill_tokens, drafts)


def test_a_draft_models_tree_is_priced_by_its_depth():
    """A tree of k nodes at most `depth` deep costs a model proposer depth sequential forwards (the root,
    then a level each), not k; a chain costs k."""
    from engine.spec_decode.policy import forward_rows

    assert forward_rows(4, None) == [1, 1, 1, 1] and forward_rows(3, 8) == [1, 1, 1]
    assert forward_rows(16, 8) == [1, 3, 2, 2, 2, 2, 2, 2] and sum(forward_rows(16, 8)) == 16
    assert forward_rows(5, 1) == [1]


def test_a_tree_offer_widens_the_draft_and_prices_its_alternatives():
    """with_trees: a proposer's tree offer gives the draft its slots; the alternatives' bar is their
    added seconds per row at the plan's goodput (here a row costs 0.4 ms: at 100 tokens/s, 0.04), never
    below the chain's p_min; without a shadow price (the static policy) the bar is p_min."""
    from engine.spec_decode.policy import with_trees

    costs = synthetic_costs()
    view = StepView((Candidate("r", {"ngram": 3}, {"ngram": 0}, trees={"ngram": 9}),
                     Candidate("s", {"ngram": 2}, {"ngram": 0})))
    drafts = {"r": Draft("ngram", 3, 0.01), "s": Draft("ngram", 2, 0.01)}
    widened = with_trees(costs, view, drafts, shadow=100.0)
    assert widened["s"] == drafts["s"] and widened["r"].slots == 9 and widened["r"].k == 3
    assert widened["r"].tree_p_min == pytest.approx(100.0 * 0.0004)
    assert with_trees(costs, view, drafts)["r"].tree_p_min == 0.01
    assert StepPlan(widened).lookahead() == {"r": 9, "s": 2}


def test_alternatives_that_win_less_than_promised_raise_their_bar():
    """Calibration: accepted alternatives per unit of chance promised, taken at its word (1) until
    trees are judged; with_trees divides the alternatives' bar by it. Aged while nothing is judged, it
    drifts back toward 1, so alternatives priced out are tried again."""
    from engine.spec_decode.estimates import Calibration
    from engine.spec_decode.policy import with_trees

    calibration = Calibration()
    assert calibration.ratio() == 1.0
    for _ in range(20):
        calibration.observe(2.0, 0)   # alternatives that promise two tokens a step and win none
    calibration.observe(1.0, 1)
    low = calibration.ratio()
    assert low < 0.25
    for _ in range(200):
        calibration.observe(0.0, 0)
    assert low < calibration.ratio() < 1.0 and calibration.ratio() > 0.9

    costs = synthetic_costs()
    view = StepView((Candidate("r", {"ngram": 3}, {"ngram": 0}, trees={"ngram": 9}),))
    drafts = {"r": Draft("ngram", 3, 0.01)}
    base = with_trees(costs, view, drafts, shadow=100.0)["r"].tree_p_min
    assert with_trees(costs, view, drafts, shadow=100.0, calibration={"ngram": 0.5})["r"].tree_p_min == \
        pytest.approx(2 * base)
    assert with_trees(costs, view, drafts, shadow=100.0, calibration={"draft": 0.5})["r"].tree_p_min == \
        pytest.approx(base)


def test_the_goodput_policy_learns_its_calibration_from_verified_trees():
    """observe() feeds each proposer's calibration the step's tree alternatives."""
    policy = GoodputPolicy(["ngram", "suffix"], synthetic_costs())
    for _ in range(30):
        policy.observe(StepPlan(), StepOutcome((Verified("r", "ngram", 3, 1, 3.0, 0),
                                                Verified("s", "suffix", 3, 3, 1.0, 1)), None))
    assert policy.calibration["ngram"].ratio() < 0.3 and policy.calibration["suffix"].ratio() > 0.9
