"""The adaptive speculation controller (engine/spec_decode/controller.py) on synthetic costs and
acceptance, and the engine with it: draft length per request and step, the router's choice of
proposer, probing after a workload shift, the confidence stop, and losslessness with mixed proposers."""
from __future__ import annotations

import random

import pytest
from helpers import run_requests

from engine import LLM, SamplingParams
from engine.spec_decode import controller as controller_module
from engine.spec_decode.controller import EXPLORATION, RequestSpecState, SpecController
from engine.spec_decode.estimates import GLOBAL_DECAY, DecayedCounts
from engine.step_timer import STALE_STEPS, StepCostModel

MAX_K = 8


def costs(verify_slope: float, draft_forward: float = 0.004) -> StepCostModel:
    """A target pass of 30 ms plus verify_slope per extra token; draft forwards of draft_forward."""
    model = StepCostModel()
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        model.calibrate_verify(1, tokens, 0.030 + verify_slope * (tokens - 1))
    for rows in (1, 4, 16, 64, 256):
        model.draft.calibrate(rows, draft_forward * (1 + rows / 64))
    return model


def with_history(controller: SpecController, alphas: dict[str, float], steps: int = 200, seed: int = 0,
                 decay: float = 1.0):
    """Engine-wide history: i.i.d. acceptance alpha per draft position, per method."""
    rng = random.Random(seed)
    controller.global_counts = {m: DecayedCounts(decay) for m in controller.methods}
    for _ in range(steps):
        for method, alpha in alphas.items():
            accepted = 0
            while accepted < MAX_K and rng.random() < alpha:
                accepted += 1
            controller.global_counts[method].observe(MAX_K, accepted)
    return controller


def plan_k(controller: SpecController, batch: int, methods=("draft",)) -> list[tuple[str, int]]:
    """(method, k) per request, probes left out ("none", 0): new requests probe at once."""
    candidates = [(f"r{i}", {m: MAX_K for m in methods}, {m: 0 for m in methods}) for i in range(batch)]
    plans = controller.plan(candidates).values()
    plan_k.probes = [p for p in plans if p.probe]
    return [("none", 0) if p.probe else (p.method, p.k) for p in plans]


def test_low_acceptance_plans_no_drafts():
    # At batch 16 a draft token costs a third of a plain token: acceptance 0.05 rules that out, and
    # one new request looks for all; at batch 4 (a fifth) each looks.
    for batch, looks in ((1, 1), (4, 4), (16, 1)):
        controller = with_history(SpecController(["draft"], MAX_K, costs(0.0005)), {"draft": 0.05})
        assert set(plan_k(controller, batch)) == {("none", 0)}
        # only probes draft: new requests' free first looks, one token each, all in one verification pass
        assert len(plan_k.probes) == looks and {p.k for p in plan_k.probes} == {1}
        assert set(plan_k(controller, batch)) == {("none", 0)} and not plan_k.probes   # looked: no credit yet


def test_high_acceptance_and_cheap_verification_plan_the_maximum():
    controller = with_history(SpecController(["draft"], MAX_K, costs(0.00005, draft_forward=0.0005)), {"draft": 0.97})
    assert set(plan_k(controller, 1)) == {("draft", MAX_K)}


def test_draft_length_shrinks_smoothly_as_the_batch_grows():
    """A CPU-like cost: each verified token costs 0.5 ms more. k falls with the batch one step at a
    time, never from the maximum to nothing at a threshold. (Exploration off: its draws would give
    new requests different k; the shape under test is the plan's for given estimates.)"""
    controller = with_history(SpecController(["draft"], MAX_K, costs(0.0005), explore=False), {"draft": 0.8})
    ks = []
    for batch in range(1, 65):
        plan = set(plan_k(controller, batch))
        assert len(plan) <= 2, plan   # the same estimates give (nearly) the same k to everyone
        ks.append(max(k for _, k in plan))
    assert ks[0] >= 4 and ks[-1] < ks[0]
    assert all(later <= earlier for earlier, later in zip(ks, ks[1:])), ks
    assert all(earlier - later <= 1 for earlier, later in zip(ks, ks[1:])), ks


def test_router_prefers_the_proposer_with_better_goodput():
    # n-gram is free; with equal acceptance it wins, with much lower acceptance the draft model does
    even = with_history(SpecController(["draft", "ngram"], MAX_K, costs(0.0002, 0.006)), {"draft": 0.7, "ngram": 0.7})
    assert {m for m, _ in plan_k(even, 2, ("draft", "ngram"))} == {"ngram"}
    skewed = with_history(SpecController(["draft", "ngram"], MAX_K, costs(0.0002, 0.002)),
                          {"draft": 0.9, "ngram": 0.1})
    assert {m for m, _ in plan_k(skewed, 2, ("draft", "ngram"))} == {"draft"}
    # a request whose n-gram lookup finds nothing (cap 0) can only use the draft model
    plans = skewed.plan([("a", {"draft": MAX_K, "ngram": 0}, {"draft": 0})])
    assert plans["a"].method == "draft"


def test_workload_shift_turns_drafting_down_and_back_up():
    """One stream: acceptance 0.9, then 0.1 from step 100, then 0.9 again from step 200."""
    controller = with_history(SpecController(["draft"], MAX_K, costs(0.0003)), {"draft": 0.9}, decay=GLOBAL_DECAY)
    rng = random.Random(1)
    ks = []
    for step in range(300):
        alpha = 0.1 if 100 <= step < 200 else 0.9
        plan = controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"]
        ks.append(plan.k)
        if plan.k:
            accepted = 0
            while accepted < plan.k and rng.random() < alpha:
                accepted += 1
            controller.observe("r", "draft", plan.k, accepted)
    assert min(ks[50:100]) >= 3                              # high acceptance: drafting
    down = next(i for i in range(100, 200) if all(k <= 1 for k in ks[i:i + 10]))
    assert down - 100 <= 20, ks[100:130]                     # turned down (to probes only) within 20 steps
    assert sum(ks[130:200]) <= 0.25 * sum(ks[50:100])        # and stays down
    up = next(i for i in range(200, 300) if ks[i] >= 3)
    assert up - 200 <= 40, ks[200:260]                       # back up once a probe succeeds


def test_exploration_recovers_from_an_unlucky_start():
    """Acceptance is 0.7, but the first judged drafts of every request in a batch of 4 were
    unlucky (2 of 8), so every estimate says drafting does not pay. A verification-shaped pass
    costs 4 ms more than a plain one (as on CPUs), which makes probes dear: without exploration
    draws and with every probe priced alone, the batch stays at k = 0; with draws, the requests draft
    again within 20 steps and keep drafting; without draws, the requests' pooled credit opens shared
    probe passes, which find the acceptance too."""
    model = costs(0.002)
    for tokens in (1, 2, 4, 8):
        model.plain.calibrate(tokens, 0.030 + 0.0005 * tokens)
    for tokens in (8, 16, 32, 64):
        model.calibrate_verify(4, tokens, 0.028 + 0.001 * tokens)

    def run(explore: bool, share: bool = True) -> list[int]:
        controller = SpecController(["draft"], MAX_K, model, explore=explore)
        controller.share_probes = share
        rng = random.Random(3)
        rids = [f"r{i}" for i in range(4)]
        for rid in rids:
            controller.plan([(rid, {"draft": MAX_K}, {"draft": 0})])   # first looks
            controller.observe(rid, "draft", 2, 1 if rid in ("r0", "r1") else 0)
            controller.observe(rid, "draft", 2, 0)
        drafted = []
        for _ in range(60):
            plans = controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids])
            drafted.append(sum(p.k for p in plans.values() if not p.probe))
            for rid, p in plans.items():
                accepted = 0
                while accepted < p.k and rng.random() < 0.7:
                    accepted += 1
                controller.observe(rid, p.method, p.k, accepted)
        return drafted
    assert sum(run(explore=False, share=False)[:30]) == 0
    exploring = run(explore=True)
    assert sum(exploring[:20]) > 0 and min(exploring[30:]) > 0 and sum(exploring[30:]) >= 4 * 30
    pooled = run(explore=False)
    assert sum(pooled[:30]) > 0 and sum(pooled[30:]) >= 4 * 30


def test_a_batch_that_stopped_drafting_pools_its_credit_to_probe():
    """Sixteen idle requests whose estimates (0.8) say drafting does not pay, and a verification-
    shaped pass far dearer than a plain one (at 16 streams on the dev CPU it was 53 ms on a 115 ms
    step): more than any one request's capped credit, so priced alone no request ever probed and a
    batch that stopped drafting on an unlucky streak decoded plainly to its end (0.87 of the best
    static gamma at alpha 0.9). Together their credit opens a shared probe pass now and then,
    within the exploration budget, and each prober pays its share of the shape."""
    model = StepCostModel()
    for rows in (1, 2, 4, 8, 16):
        model.calibrate_plain(rows, 0.030 + 0.0053 * rows)
    for tokens, seconds in ((32, 0.250), (64, 0.330), (144, 0.520)):
        model.calibrate_verify(16, tokens, seconds)
    model.draft.calibrate(16, 0.017)
    rids = [f"r{i}" for i in range(16)]

    def run(share: bool) -> tuple[int, float]:
        controller = SpecController(["draft"], MAX_K, model, explore=False)
        controller.share_probes = share
        with_history(controller, {"draft": 0.8})
        for rid in rids:   # each has drafted: no first look left, an estimate of its own
            controller.states[rid] = RequestSpecState(look_due=False, drafted=True)
            for accepted in (3, 8, 0, 5, 2):
                controller.observe(rid, "draft", MAX_K, accepted)
        probes, extra = 0, 0.0
        for _ in range(300):
            plans = controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids])
            assert all(p.probe or p.k == 0 for p in plans.values())   # drafting itself never pays here
            probes += sum(p.probe for p in plans.values())
            extra += controller.last_predicted_time - model.step_time(16)
            for rid, p in plans.items():
                controller.observe(rid, p.method, p.k, 0)   # every probe fails: all cost, no win
        return probes, extra / (300 * model.step_time(16))

    assert run(share=False) == (0, 0.0)
    probes, overhead = run(share=True)   # 4 passes of all 16, one every ~68 steps
    assert probes >= 32 and 0.5 * EXPLORATION < overhead <= 1.1 * EXPLORATION


def finished_requests(controller: SpecController, rates, judged: int = 40, seed: int = 0) -> None:
    """Requests that each judged `judged` draft tokens, one by one, at their own rate, then finished."""
    rng = random.Random(seed)
    for i, rate in enumerate(rates):
        rid = f"done{i}"
        for _ in range(judged):
            controller.observe(rid, "draft", 1, int(rng.random() < rate))
        controller.on_finish(rid)


def test_the_prior_weighs_as_much_as_requests_are_alike():
    """Empirical Bayes over finished requests: forty requests that all accept at 0.5 differ only by
    the binomial noise of their 40 judged tokens, so the engine-wide rate is worth many
    pseudo-tokens; requests at 0.1 and 0.9 differ for real, so it is worth few."""
    from engine.spec_decode.estimates import MAX_PRIOR_WEIGHT, PRIOR_WEIGHT
    alike = SpecController(["draft"], MAX_K, costs(0.0005))
    assert alike.prior_weight("draft") == PRIOR_WEIGHT   # no finished requests yet
    finished_requests(alike, [0.5] * 40)
    assert alike.prior_weight("draft") >= 0.75 * MAX_PRIOR_WEIGHT
    unlike = SpecController(["draft"], MAX_K, costs(0.0005))
    finished_requests(unlike, [0.1, 0.9] * 20)
    assert unlike.prior_weight("draft") <= 2.0
    unlike.pool_evidence = False
    assert alike.prior_weight("draft") > PRIOR_WEIGHT and unlike.prior_weight("draft") == PRIOR_WEIGHT


def test_the_prior_stays_strong_when_the_traffic_moves_together():
    """Requests that all accept at one rate, and later all at another, are alike at every moment:
    the spread between requests that finished one after the other is binomial noise, so the prior
    (whose mean is the recent engine-wide rate) keeps many pseudo-tokens. Around the mean of every
    request remembered, the move read as requests that differ (2-4 pseudo-tokens, measured on the
    batch-4 row). Requests of two kinds interleaved still differ."""
    from engine.spec_decode.estimates import MAX_PRIOR_WEIGHT
    moved = SpecController(["draft"], MAX_K, costs(0.0005))
    finished_requests(moved, [0.7] * 20 + [0.9] * 20, judged=60)
    assert moved.prior_weight("draft") >= 0.75 * MAX_PRIOR_WEIGHT
    mixed = SpecController(["draft"], MAX_K, costs(0.0005))
    finished_requests(mixed, [0.7, 0.9] * 20, judged=60)
    assert mixed.prior_weight("draft") <= 0.5 * MAX_PRIOR_WEIGHT


def test_live_requests_count_towards_the_prior_strength():
    """A young engine: four requests finished, four live ones judged 30 tokens each. When all accept
    at 0.7, the live ones' totals make the pooled rate worth many pseudo-tokens already; when they
    accept at 0.1 and 0.9, worth few."""
    from engine.spec_decode.estimates import PRIOR_WEIGHT
    for rates, strong in (([0.7] * 4, True), ([0.1, 0.9] * 2, False)):
        controller = SpecController(["draft"], MAX_K, costs(0.0005))
        finished_requests(controller, rates, judged=30)
        assert controller.prior_weight("draft") == PRIOR_WEIGHT   # too few finished to tell
        rng = random.Random(1)
        for i, rate in enumerate(rates):
            for _ in range(30):
                controller.observe(f"live{i}", "draft", 1, int(rng.random() < rate))
        weight = controller.prior_weight("draft")
        assert weight > 3 * PRIOR_WEIGHT if strong else weight < PRIOR_WEIGHT, (rates, weight)


def test_an_unlucky_start_keeps_drafting_when_requests_are_alike():
    """Finished requests all accepted at 0.7; a new one's first 8 judged drafts held 2 acceptances.
    With the population's evidence pooled, its estimate stays near 0.7 and it drafts; with the old
    fixed 4-token prior it falls to 0.4 and turns drafting off. A request that really accepts at 0.1
    is unlike the rest: its own tokens soon outweigh the pooled prior, and it stops drafting."""
    def controller(pool: bool) -> SpecController:
        c = with_history(SpecController(["draft"], MAX_K, costs(0.002, 0.004), explore=False), {"draft": 0.7},
                         decay=GLOBAL_DECAY)
        finished_requests(c, [0.7] * 30)
        c.pool_evidence = pool
        c.plan([("r", {"draft": MAX_K}, {"draft": 0})])   # its first look
        for drafted, accepted in ((2, 1), (1, 0), (1, 0), (2, 1), (1, 0), (1, 0)):
            c.observe("r", "draft", drafted, accepted)
        return c
    pooled, fixed = controller(True), controller(False)
    assert fixed.acceptance("r", "draft") < 0.45 < 0.55 < pooled.acceptance("r", "draft")
    assert fixed.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"].k <= 1
    assert pooled.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"].k >= 2
    rng, ks = random.Random(2), []
    for _ in range(40):
        plan = pooled.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"]
        accepted = 0
        while accepted < plan.k and rng.random() < 0.1:
            accepted += 1
        if plan.k:
            pooled.observe("r", plan.method, plan.k, accepted)
        ks.append(0 if plan.probe else plan.k)
    assert all(k == 0 for k in ks[-25:]), ks


def test_static_mode_always_drafts_the_maximum():
    controller = SpecController(["ngram"], MAX_K, costs(0.001), adaptive=False)
    plans = controller.plan([("a", {"ngram": 5}, {}), ("b", {"ngram": 0}, {})])
    assert (plans["a"].method, plans["a"].k) == ("ngram", 5) and plans["b"].k == 0


# ---- the engine with the controller ----------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import make_noisy_copy, make_tiny_checkpoint
    root = tmp_path_factory.mktemp("controller")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=0)
    return str(target), str(make_noisy_copy(target, root / "draft", noise=0.05))


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], list(range(40, 70)), [9] * 12]


def run(config_kwargs: dict, params) -> tuple[list[list[int]], list]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine, stats = Engine(EngineConfig(dtype="float32", **config_kwargs)), []
    tokens, finals = run_requests(engine, PROMPTS, params, after_step=lambda e: stats.append(e.last_stats))
    draft = engine.proposer.proposers.get("draft")   # every request's state was dropped at its end
    assert not engine.controller.states and (draft is None or not draft._cursors)
    run.stats = stats
    return tokens, finals


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("speculative", [
    {"method": "auto", "num_speculative_tokens": 4},
    {"method": "auto", "num_speculative_tokens": 4, "draft_p_min": 0.6},
    {"method": "auto", "num_speculative_tokens": 4, "adaptive": False},
])
def test_auto_is_lossless_and_mixes_proposers(pair, speculative):
    target, draft = pair
    plain, _ = run({"model": target}, GREEDY)
    # Alternate requests restricted to one proposer each, so both verify in the same passes.
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             speculative_method=("ngram", "draft", "auto", None)[i]) for i in range(len(PROMPTS))]
    tokens, finals = run({"model": target, "speculative": {**speculative, "model": draft}}, params)
    assert tokens == plain
    for t, f in zip(tokens, finals):
        assert len(t) == 1 + f.spec.accepted + f.spec.target_forwards
        assert sum(f.spec.passes_by_method.values()) == sum(f.spec.passes_by_k.values()) == f.spec.target_forwards
    assert set(finals[0].spec.passes_by_method) <= {"ngram", "none"}
    assert set(finals[1].spec.passes_by_method) <= {"draft", "none"}
    if not speculative.get("adaptive", True):   # static: every pass drafts, and both kinds share passes
        assert any({"ngram", "draft"} <= {m for m, _, _ in s.drafts_by_method} for s in run.stats)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_confidence_stop_cuts_drafting(pair, temperature):
    """Sampled rows judge by q; greedy rows (q one-hot) by the draft's own softmax."""
    target, draft = pair
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
    sampled = SamplingParams(max_tokens=24, temperature=temperature, ignore_eos=True)
    _, free = run({"model": target, "speculative": spec}, sampled)
    _, stopped = run({"model": target, "speculative": {**spec, "draft_p_min": 0.9}}, sampled)
    free_k = sum(k * n for f in free for k, n in f.spec.passes_by_k.items()) / sum(f.spec.target_forwards for f in free)
    stop_k = sum(k * n for f in stopped for k, n in f.spec.passes_by_k.items()) / \
        sum(f.spec.target_forwards for f in stopped)
    assert free_k > 3 and stop_k < free_k - 1, (free_k, stop_k)


def test_per_request_control(pair):
    target, draft = pair
    spec = {"method": "auto", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative_method="none"),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, num_speculative_tokens=2),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative_method="draft"),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, num_speculative_tokens=0)]
    _, finals = run({"model": target, "speculative": spec}, params)
    assert finals[0].spec.proposed == 0 and set(finals[0].spec.passes_by_method) == {"none"}
    assert max(finals[1].spec.passes_by_k) <= 2
    assert set(finals[2].spec.passes_by_method) <= {"draft"} and finals[2].spec.proposed > 0
    assert finals[3].spec.proposed == 0
    with pytest.raises(ValueError, match="speculative.method"):
        SamplingParams(speculative_method="medusa")
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=True)


def test_host_work_per_step_counts_for_drafting(pair):
    """A step's host work around its passes (~0.4 ms beside a 2 ms pass replayed as a CUDA graph) is
    paid once however many tokens the step yields: the more of it, the more drafting pays. The
    engine measures it on every decode step."""
    def planned(alpha: float, forward: float, overhead: float) -> tuple[str, int]:
        model = costs(0.0005, draft_forward=forward)
        model.step_overhead = overhead
        return plan_k(with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": alpha}), 1)[0]

    assert planned(0.5, 0.012, 0.0) == ("none", 0) and planned(0.5, 0.012, 0.015) == ("draft", 1)
    assert [planned(0.7, 0.004, s)[1] for s in (0.0, 0.015, 0.030)] == [3, 4, 5]
    target, draft = pair
    llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative={"method": "draft", "model": draft, "num_speculative_tokens": 4})
    llm.generate([[1, 2, 3, 4]], GREEDY)
    assert 0.0 < llm.engine.costs.step_overhead < 0.1


def test_stale_drafting_scales_relax_towards_one():
    """Drafting steps that ran over their prediction scale every later plan up, and they are
    learned only from drafting steps: a scale that stopped drafting holds. After STALE_STEPS decode
    steps without drafting it relaxes towards 1.0, the plan drafts again and so measures it anew."""
    model = costs(0.0005, draft_forward=0.008)
    model.calibrate_plain(1, 0.030)
    model.drafting_bias, model.depth_bias = 1.3, {1: 1.3}
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.6})
    assert plan_k(controller, 1) == [("none", 0)]
    for _ in range(STALE_STEPS):
        model.observe_idle_step()
    assert model.drafting_bias == 1.3
    for _ in range(23):
        model.observe_idle_step()
    assert 1.13 < model.drafting_bias < 1.15 and 1.13 < model.depth_bias[1] < 1.15   # half-way, in log space
    assert plan_k(controller, 1) == [("draft", 1)]
    model.observe_drafting_step(0.040, 0.052, 1)   # drafting again: learning, and fresh for STALE_STEPS more
    assert model.idle_steps == 0 and model.drafting_bias > 1.14


def test_a_costly_verification_shape_keeps_plain_decoding():
    """Verifying even one draft takes a slower kernel than a plain pass of as many tokens: drafting
    must clear that jump, so moderate acceptance stays plain and high acceptance still drafts."""
    model = StepCostModel()
    for rows in (1, 4, 16, 64):
        model.draft.calibrate(rows, 0.004 * (1 + rows / 64))
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        model.plain.calibrate(tokens, 0.030 + 0.0005 * (tokens - 1))
    for tokens in (2, 4, 8, 16, 32, 64, 128, 256):
        model.calibrate_verify(1, tokens, 0.045 + 0.0005 * (tokens - 1))   # +15 ms for the verification shape
    moderate = with_history(SpecController(["draft"], MAX_K, model), {"draft": 0.4})
    assert set(plan_k(moderate, 4)) == {("none", 0)}
    high = with_history(SpecController(["draft"], MAX_K, model), {"draft": 0.95})
    assert all(k >= 3 for _, k in plan_k(high, 4))


def test_catch_up_is_priced_once_per_request():
    """A draft model that must first catch up on many tokens costs that once, on the request's
    first draft token: high acceptance still drafts several tokens, and the catch-up price comes
    from draft forwards the cost model saw (rows apart from catch-up tokens)."""
    model = costs(0.0003)
    model.observe_draft(1, 0.004 + 64 * 0.0001, catch_up=64)   # 0.1 ms per caught-up token
    assert model.catch_up(100) == pytest.approx(0.01, rel=0.05)
    price = model.catch_up_price["draft"]
    model.observe_draft(1, 0.127, catch_up=32)   # a stalled forward: 4 ms a token
    assert price < model.catch_up_price["draft"] <= 1.1 * price   # a tenth at most
    model.catch_up_price["draft"] = price
    controller = with_history(SpecController(["draft"], MAX_K, model), {"draft": 0.9})
    controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])   # no longer new: no first probe
    lagging = controller.plan([("r", {"draft": MAX_K}, {"draft": 100})])["r"]
    caught_up = controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"]
    assert lagging.k >= 3 and caught_up.k >= 3
    # a catch-up that costs more than all the drafts could win keeps plain decoding
    model.catch_up_price["draft"] = 0.05
    assert controller.plan([("r", {"draft": MAX_K}, {"draft": 100})])["r"].k <= 1


def test_a_catch_up_is_spread_over_the_drafting_steps_it_enables(monkeypatch):
    """A draft model's catch-up after idle steps is paid once, and the drafting steps after it need
    none: the plan's rates charge the step that pays it a share (CATCH_UP_STEPS), while its predicted
    time, which the engine checks against the measured step, holds all of it."""
    def plan(steps: float, lag: int):
        monkeypatch.setattr(controller_module, "CATCH_UP_STEPS", steps)
        model = costs(0.0003)
        model.calibrate_plain(1, 0.030)
        model.catch_up_price["draft"] = 0.0001   # 40 ms for 400 tokens, more than a plain step
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.7})
        controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])   # no longer new: no first probe
        return controller.plan([("r", {"draft": MAX_K}, {"draft": lag})])["r"].k, controller

    assert plan(1.0, 400)[0] == 0                 # charged whole, it outweighs what the drafts win
    k, controller = plan(4.0, 400)
    assert k >= plan(4.0, 0)[0] >= 3
    caught_up = controller.predicted_time(1, {"r": k}, {"r": "draft"}, {"r": {"draft": 0}})
    assert controller.last_predicted_time == pytest.approx(caught_up + 0.040)


def test_prompt_tokens_in_the_pass_do_not_lower_the_bar_for_drafts():
    """A long prompt chunk in the pass makes the step slow whatever is drafted: the plan must still
    weigh each draft against what its seconds earn in plain decoding. Priced against the step's own
    tokens per second (depressed by the prompt), a dear catch-up looked worth it beside a prompt and
    not without one; now the choice is the same, and the predicted time still holds the prompt."""
    model = costs(0.0005)
    model.catch_up_price["draft"] = 0.0004   # 100 tokens of catch-up: 40 ms, more than a step
    decisions = {}
    for prefill in (0, 512):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.7})
        requests = [(f"r{i}", {"draft": MAX_K}, {"draft": 0}) for i in range(4)]
        controller.plan(requests)   # no longer new: no first looks
        plans = controller.plan([(rid, caps, {"draft": 100}) for rid, caps, _ in requests], prefill)
        decisions[prefill] = {(p.method, p.k) for p in plans.values()}
        predicted = controller.last_predicted_time
        assert predicted >= model.step_time(4 + prefill), (prefill, predicted)
    assert decisions[0] == decisions[512] == {("none", 0)}, decisions
    # with the catch-up paid, drafting pays beside the prompt as it does without it
    for prefill in (0, 512):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.7})
        plans = controller.plan([(f"r{i}", {"draft": MAX_K}, {"draft": 0}) for i in range(4)], prefill)
        assert all(p.k >= 2 and not p.probe for p in plans.values()), (prefill, plans)


def test_failed_probes_cost_at_most_the_exploration_budget():
    """Acceptance 0: every probe fails. Over 400 steps the probes' extra time stays within
    EXPLORATION of the plain decoding time for a request the plan drafted for before (plus the first
    probe and the saved-up credit), and within a quarter of that for one it never drafted for.
    (Exploration draws off: this bounds the probes alone.)"""
    from engine.spec_decode.controller import EXPLORATION, MAX_CREDIT_STEPS, UNDRAFTED_EXPLORATION
    model = costs(0.0003)
    plain = model.step_time(1)
    extra = model.verify_time(2) - model.verify_time(1) + model.draft_forward(1)
    probes = {}
    for drafted, share in ((True, EXPLORATION), (False, EXPLORATION * UNDRAFTED_EXPLORATION)):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.0})
        controller.states["r"] = RequestSpecState(drafted=drafted)
        probes[drafted] = 0
        for _ in range(400):
            plan = controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"]
            assert plan.k == 0 or plan.probe
            if plan.probe:
                probes[drafted] += 1
                controller.observe("r", "draft", 1, 0)
        budget = share * 400 * plain + extra + MAX_CREDIT_STEPS * plain
        assert 2 <= probes[drafted] and probes[drafted] * extra <= budget
    assert probes[True] >= 2 * probes[False], probes


def test_exploration_slows_only_where_evidence_rules_acceptance_out():
    """A new request whose free first look failed, where a draft token pays at acceptance ~0.33 and
    drafting does not pay at the requests' 0.3: one failed draft leaves paying acceptance possible,
    and it saves up credit for probes at the full rate; where requests accept at 0, its evidence
    rules that out, and it saves at a quarter of the rate."""
    from engine.spec_decode.controller import UNDRAFTED_EXPLORATION
    model = costs(0.006)
    credit = {}
    for alpha in (0.3, 0.0):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": alpha})
        assert controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"].probe   # the first look
        controller.observe("r", "draft", 1, 0)
        for _ in range(5):
            assert controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"] == controller_module.NO_PLAN
        credit[alpha] = controller.states["r"].credit
    full = 6 * EXPLORATION * model.step_time(1)   # the first look's step and five more
    assert credit[0.3] == pytest.approx(full) and credit[0.0] == pytest.approx(UNDRAFTED_EXPLORATION * full)


def test_a_first_look_is_free_unless_switched_off():
    """A new request probes at once (its first look is free); with first_look off (the ablation's
    "no first look"), it waits until its exploration credit pays for a probe."""
    model = costs(0.0003)
    for first_look in (True, False):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.0})
        controller.first_look = first_look
        steps = 0
        while not controller.plan([("r", {"draft": MAX_K}, {"draft": 0})])["r"].probe:
            steps += 1
        assert (steps == 0) == first_look, (first_look, steps)


def test_cost_curve_is_monotone_from_above():
    """A slow outlier at a small bucket does not lift the bigger ones (timings only err upwards);
    in between the curve interpolates, past its end it extrapolates."""
    from engine.step_timer import CostCurve
    curve = CostCurve()
    for rows, seconds in ((1, 0.010), (2, 0.050), (4, 0.012), (8, 0.016)):
        curve.calibrate(rows, seconds)
    assert curve(2) == pytest.approx(0.012) and curve(4) == pytest.approx(0.012)
    assert curve(6) == pytest.approx(0.014) and curve(16) == pytest.approx(0.024)
    assert all(curve(r) <= curve(r + 1) for r in range(1, 40))


def test_cost_curve_points_sit_at_the_rows_they_were_measured_at():
    """Sixteen sequences with four drafts each are 80 rows: the point is at 80, not at its bucket's
    128 (which made everything between the buckets look cheap). A bucket first seen far past the
    measured points takes the timing, not the curve's extrapolation."""
    from engine.step_timer import CostCurve
    curve = CostCurve()
    curve.calibrate(32, 0.100)
    curve.calibrate(80, 0.250)
    assert curve(80) == pytest.approx(0.250) and curve(56) == pytest.approx(0.175)
    decode = CostCurve()
    decode.calibrate(1, 0.050)
    decode.observe(32, 0.080)   # a prefill chunk: extrapolating the single point says 1.6 s
    assert decode(32) == pytest.approx(0.080)
    decode.observe(64, 5.0)     # a stall on a new shape: held at the curve's estimate
    assert decode(64) < 0.2



def test_a_seldom_run_shape_moves_with_the_machine_pace():
    """The machine slows to 1.5x for a while, the engine probes once in that minute, then the machine
    speeds up again and the engine decodes plainly: the verification pass is predicted at today's
    speed (its curve alone held the slow minute's 33 ms against plain decoding's 20), and a steady
    machine keeps its pace however the curves learn."""
    model = StepCostModel()
    model.calibrate_plain(1, 0.020)
    model.calibrate_verify(1, 2, 0.021)
    model.draft.calibrate(1, 0.004)
    for _ in range(30):
        model.observe_pass(1, 0.030, False, 1)   # a slow minute
    assert model.step_time(1) == pytest.approx(0.030, rel=0.05)
    model.observe_pass(2, 0.0315, True, 1)       # one probe in it
    model.observe_draft(1, 0.006)
    slow = model.verify_time(2, 1, 1)
    assert slow == pytest.approx(0.0315, rel=0.05) and model.draft_forward(1) == pytest.approx(0.006, rel=0.05)
    for _ in range(30):
        model.observe_pass(1, 0.020, False, 1)   # back to speed, no drafting
    assert model.verify_time(2, 1, 1) == pytest.approx(0.021, rel=0.05)
    assert model.draft_forward(1) == pytest.approx(0.004, rel=0.05)
    for _ in range(200):   # steady: verification and plain passes at their true cost
        model.observe_pass(1, 0.020, False, 1)
        model.observe_pass(2, 0.021, True, 1)
    assert model.pace == pytest.approx(1.0, rel=0.01)
class _TimedProposer:
    """A model proposer whose steps take the given seconds in turn (the first ones slow, as a new
    shape's are), reported through on_forward as the draft model reports them."""
    method = "draft"

    def __init__(self, seconds: list[float]):
        self.seconds, self.on_forward = iter(seconds), None
        self.reported = []

    def propose(self, items):
        self.on_forward(len(items), next(self.seconds), 0)


def test_draft_calibration_keeps_the_fastest_step_after_warm_up():
    """Start-up seeds the draft curve from warmed steps: a first step that created kernels or
    captured a CUDA graph (8 ms against 1) must not set what drafting costs, and the proposer's own
    reporting is back in place afterwards."""
    from engine.setup import _fastest_draft_step

    proposer = _TimedProposer([0.008, 0.0005, 0.0012, 0.001, 0.0011])
    proposer.on_forward = report = lambda rows, seconds, catch_up: proposer.reported.append(seconds)
    assert _fastest_draft_step(proposer, [object()]) == 0.001   # warm-up steps (even a fast one) skipped
    assert proposer.on_forward is report and proposer.reported == []


def test_waiting_requests_count_as_prefill_only_when_they_can_be_admitted(pair):
    """With every sequence slot taken, waiting prompts cannot join the next pass, so they must not
    make the controller think the pass is big (and drafts nearly free)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    target, draft = pair
    engine = Engine(EngineConfig(model=target, dtype="float32", max_num_seqs=1,
                                 speculative={"method": "auto", "model": draft, "num_speculative_tokens": 4}))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    assert engine._pending_prefill(0) == len(PROMPTS[0])   # one free slot: only the first prompt counts
    engine.step()   # the first request's prefill; the others wait for its slot
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == len(PROMPTS) - 1
    assert engine._pending_prefill(1) == 0
    while engine.has_unfinished_requests():
        engine.step()


def draft_goodput(controller: SpecController, rids: list[str], plan: dict[str, int]) -> float:
    """Expected tokens per predicted second of a step of the decoding requests rids, drafting with
    the draft model as plan says ({request: k}), none catching up."""
    methods, lags = {rid: "draft" for rid in rids}, {rid: {"draft": 0} for rid in rids}
    gain = sum(sum(controller.gains(rid, "draft", k)) for rid, k in plan.items())
    return (len(rids) + gain) / controller.predicted_time(len(rids), plan, methods, lags)


def test_no_lone_deep_draft_positions():
    """A draft model runs one forward per draft position, whatever its rows: a position reached by
    one request with a high estimate costs a whole forward. The plan keeps its deepest position only
    when the exact step time says it pays."""
    from engine.spec_decode.controller import RequestSpecState
    from engine.spec_decode.estimates import REQUEST_DECAY, DecayedCounts
    model = costs(0.0002, draft_forward=0.006)
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.7})
    rids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(rids):   # one request far more predictable than the rest
        counts = DecayedCounts(REQUEST_DECAY)
        counts.observe(12, 12 if i == 0 else 6)
        controller.states[rid] = RequestSpecState(counts={"draft": counts}, credit=0.0)
    candidates = [(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids]
    plans = controller.plan(candidates)
    ks = {rid: p.k for rid, p in plans.items() if not p.probe}
    depth = max(ks.values())
    assert depth > 1
    shallower = {rid: min(k, depth - 1) for rid, k in ks.items()}
    assert draft_goodput(controller, rids, ks) >= draft_goodput(controller, rids, shallower)


def test_the_plan_takes_the_best_depth_when_goodput_has_two_peaks():
    """A verification pass's cost per token can fall past some size, so goodput over depth may
    peak twice: here one draft each (8 tokens in the pass, at 15 ms) beats eight each (36 tokens) by
    14%, with the depths between dearer than both. The plan must find the better peak, not stop at
    the deeper one on the way down."""
    model = StepCostModel()
    for tokens, ms in {1: 10, 2: 11, 4: 14, 8: 15, 16: 48, 32: 62, 64: 82}.items():
        model.calibrate_verify(4, tokens, ms / 1e3)
    for rows in (1, 4, 16, 64):
        model.draft.calibrate(rows, 0.001)
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.9})
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        counts = DecayedCounts(GLOBAL_DECAY)
        counts.observe(40, 36)
        controller.states[rid] = RequestSpecState(counts={"draft": counts})
    plans = controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids])
    def goodput(depth):
        return draft_goodput(controller, rids, {rid: depth for rid in rids})
    best = max(range(1, MAX_K + 1), key=goodput)
    assert goodput(MAX_K) > goodput(MAX_K - 1) and goodput(best) > 1.1 * goodput(MAX_K)   # two peaks
    assert {p.k for p in plans.values()} == {best}


def test_the_steady_memory_is_steadier_and_still_follows_a_shift():
    """At a fixed acceptance of 0.85 the estimate from the watched ~100-token memory usually strays
    about half as far as a ~14-token memory's (median error: a rare false alarm restarts it from a
    few tokens for some steps), and its shift detector rarely fires; after a drop to 0.2
    the estimate is below 0.5 within 8 judged tokens, and after a rise to 0.9 (judged one by one, as
    probes are) above 0.7 within 10."""
    from engine.spec_decode.estimates import REQUEST_DECAY, STEADY_DECAY
    rng = random.Random(3)
    counts, short = DecayedCounts(STEADY_DECAY, watch=True), DecayedCounts(REQUEST_DECAY)
    steady_rates, short_rates, restarts = [], [], 0
    for step in range(600):
        accepted = 0
        while accepted < 4 and rng.random() < 0.85:
            accepted += 1
        judged_before = counts.judged
        counts.observe(4, accepted)
        short.observe(4, accepted)
        restarts += counts.judged < judged_before - 1   # (a full memory's judged count sways by less)
        if step >= 100:
            steady_rates.append(counts.rate(0.85, 4.0))
            short_rates.append(short.rate(0.85, 4.0))
    spread = lambda xs: sorted(abs(x - 0.85) for x in xs)[len(xs) // 2]
    assert spread(steady_rates) < 0.6 * spread(short_rates), (spread(steady_rates), spread(short_rates))
    assert restarts <= 3, restarts   # in ~2,700 judged tokens
    judged = 0
    while counts.rate(0.85, 4.0) > 0.5:
        counts.observe(1, 1 if rng.random() < 0.2 else 0)
        judged += 1
    assert judged <= 8, judged
    for _ in range(60):   # settle at 0.2
        counts.observe(1, 1 if rng.random() < 0.2 else 0)
    judged = 0
    while counts.rate(0.2, 4.0) < 0.7:
        counts.observe(1, 1 if rng.random() < 0.9 else 0)
        judged += 1
    assert judged <= 10, judged


def test_the_shift_detector_fires_on_a_shift_and_not_on_chance():
    """Bernoulli CUSUM: over 10,000 judged tokens at a steady rate it raises few false alarms at
    every rate; a change from 0.9 to 0.1, or from 0.2 to 0.9, shows within a few tokens, and what
    it returns is the evidence since the change."""
    from engine.spec_decode.estimates import ShiftDetector
    rng = random.Random(5)
    for rate in (0.1, 0.3, 0.6, 0.9):
        detector, alarms = ShiftDetector(), 0
        for _ in range(10_000):
            alarms += detector.observe(rate, int(rng.random() < rate), 1) is not None
        assert alarms <= 40, (rate, alarms)
    for before, after, within in ((0.9, 0.1, 5), (0.2, 0.9, 9)):
        detector = ShiftDetector()
        for token in range(1, 100):
            since = detector.observe(before, int(rng.random() < after), 1)
            if since is not None:
                break
        assert token <= within, (before, after, token)
        judged, accepted = since
        assert 1 <= judged <= token and abs(accepted / judged - after) < 0.35


def test_the_engine_wide_rate_asks_more_of_a_fall():
    """The engine-wide rate judges the whole batch's tokens, so its watcher asks more of a fall
    (GLOBAL_FALL_LLR): over 20,000 judged tokens at a steady 0.9 it calls fewer false falls than a
    request's watcher, still follows a real fall from 0.9 to 0.1 within 8 tokens, and a rise from
    0.2 to 0.9 as soon as a request's watcher does."""
    from engine.spec_decode.estimates import GLOBAL_FALL_LLR, ShiftDetector
    def false_falls(detector: ShiftDetector) -> int:
        rng, alarms = random.Random(7), 0
        for _ in range(20_000):
            accepted = int(rng.random() < 0.9)
            since = detector.observe(0.9, accepted, 1)
            alarms += since is not None and since[1] < 0.9 * since[0]
        return alarms
    request, engine_wide = false_falls(ShiftDetector()), false_falls(ShiftDetector(GLOBAL_FALL_LLR))
    assert engine_wide <= 2 and request >= 5 * max(engine_wide, 1), (request, engine_wide)
    rng = random.Random(8)
    for before, after, within in ((0.9, 0.1, 8), (0.2, 0.9, 9)):
        detector = ShiftDetector(GLOBAL_FALL_LLR)
        for token in range(1, 100):
            if detector.observe(before, int(rng.random() < after), 1) is not None:
                break
        assert token <= within, (before, after, token)


def test_a_deeper_draft_is_never_predicted_to_scale_less():
    """Each depth's scale is learned alone: a few slow steps at depth 2 (1.08) beside depths 3 and
    4 that ran fast (1.01, 0.95) priced a third draft at 5 ms against 11 for the second, and plans
    jumped past depth 2. Pooled to be non-decreasing in depth, the third draft costs at least its
    parts again; a depth without evidence is held between its neighbours."""
    from collections import Counter
    model = costs(0.002, draft_forward=0.004)
    model.depth_bias, model.depth_steps = {1: 1.0, 2: 1.08, 3: 1.01, 4: 0.95}, Counter({1: 40, 2: 10, 3: 10, 4: 10})
    scales = [model.bias(depth) for depth in range(1, MAX_K + 1)]
    assert scales == sorted(scales) and scales[1] == pytest.approx((1.08 * 1.01 * 0.95) ** (1 / 3), rel=1e-6)
    step = [model.step_time(4 * (1 + k), {"draft": [4] * k}, True, None, 4, 4, k) for k in range(1, 5)]
    unscaled = [s / model.bias(k) for k, s in zip(range(1, 5), step)]
    assert all(b - a >= 0.99 * (ub - ua) for a, b, ua, ub in zip(step, step[1:], unscaled, unscaled[1:]))
    model.depth_bias, model.depth_steps = {2: 1.0, 6: 1.2}, Counter({2: 10, 6: 10})
    model.drafting_bias = 1.3
    assert model.bias(1) == 1.0 and model.bias(4) == 1.2 and model.bias(8) == 1.3


def test_drafting_steps_that_run_over_their_prediction_draft_less():
    """Drafting steps measured 30% over the parts' prediction (work none of the parts times): the
    cost model learns the excess, and a plan that paid by a little on paper stops; plain steps are
    predicted as before."""
    model = costs(0.001, draft_forward=0.006)
    for batch in (1, 2, 4, 8, 16):
        model.plain.calibrate(batch, 0.030 + 0.001 * (batch - 1))
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.6})
    plan_k(controller, 8)   # past the new requests' first probes
    assert all(k == 1 for _, k in plan_k(controller, 8))
    plain = model.step_time(8)
    for _ in range(60):
        predicted = model.step_time(16, {"draft": [8]}, True, None, 8, 8)
        model.observe_drafting_step(predicted, 1.3 * predicted / model.drafting_bias)
    assert model.drafting_bias == pytest.approx(1.3, rel=0.05)
    assert all(k == 0 for _, k in plan_k(controller, 8)) and model.step_time(8) == plain


def test_deep_drafting_steps_that_run_over_their_prediction_draft_shallower():
    """Steps that draft 8 deep measure 40% over the parts' prediction, shallower ones as predicted
    (work that grows with k, unseen by the parts): the cost model learns a scale per depth and the
    plan stops short of the depths that do not pay, where one overall scale would keep them."""
    model = costs(0.0005, draft_forward=0.001)
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.85})
    plan_k(controller, 4)   # past the new requests' first probes
    before = max(k for _, k in plan_k(controller, 4))
    assert before == MAX_K
    for depth in range(1, MAX_K + 1):
        for _ in range(40):
            predicted = model.step_time(4 * (1 + depth), {"draft": [4] * depth}, True, None, 4, 4)
            unscaled = predicted / model.bias(depth)
            model.observe_drafting_step(predicted, unscaled * (1.0 if depth <= 4 else 1.0 + 0.1 * (depth - 4)), depth)
    assert model.bias(2) == pytest.approx(1.0, abs=0.05) and model.bias(8) == pytest.approx(1.4, abs=0.05)
    after = max(k for _, k in plan_k(controller, 4))
    assert 4 <= after < MAX_K, after
    model.depth_steps.clear()   # the overall scale alone moves every depth alike
    assert max(k for _, k in plan_k(controller, 4)) == MAX_K


def test_probe_only_steps_do_not_scale_drafting_steps():
    """A step whose only drafts are probes was predicted as a plain step: its time must not move the
    scale of drafting steps (it did, to 1.4, and the plan drafted less and less)."""
    from types import SimpleNamespace

    from engine.engine import Engine
    from engine.step_timer import STALE_STEPS, StepCostModel
    costs = StepCostModel()
    item = SimpleNamespace(is_decode=True, num_new_tokens=1, request=SimpleNamespace(request_id="r"), method="ngram")
    controller = SimpleNamespace(adaptive=True, last_predicted_time=0.05, last_depth=0, last_gains={},
                                 observe=lambda *a: None)
    engine = SimpleNamespace(controller=controller, costs=costs, cadence=None)
    batch = SimpleNamespace(scheduled=[item])
    proposal = SimpleNamespace(draft_token_ids=[[7]])   # one probe token
    result = SimpleNamespace(num_accepted=[0])
    Engine._learn(engine, batch, proposal, result, verify_time=0.06, step_time=0.09)
    assert costs.drafting_bias == 1.0 and not costs.depth_steps
    controller.last_depth = 1   # the plan drafted: its step does count
    Engine._learn(engine, batch, proposal, result, verify_time=0.06, step_time=0.09)
    assert costs.drafting_bias > 1.0


def test_probes_share_a_verification_pass():
    """The first probe of a plain step costs the verification shape and a whole draft forward;
    requests probing beside it add only their rows, so one step with credit for one lone probe
    carries probes for the whole batch, and each is charged an equal share of what they added."""
    from engine.spec_decode.controller import RequestSpecState
    model = costs(0.0005)
    controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.05})
    rids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(rids):   # past their first look; r0 saved up for a lone probe, the rest a little
        controller.states[rid] = RequestSpecState(credit=0.05 if i == 0 else 0.002, look_due=False)
    plans = controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids])
    assert all(p.probe and p.k == 1 for p in plans.values())
    charges = [controller.states[rid].probe[0] for rid in rids]
    assert len(set(charges)) == 1 and sum(charges) == pytest.approx(controller.last_predicted_time - model.step_time(4))
    assert charges[0] < 0.5 * model.draft_forward(1)   # a lone probe costs at least the whole forward
    # without the opener's credit nobody probes: a joiner's credit does not open a pass
    for rid in rids:
        controller.states[rid].credit, controller.states[rid].probe = 0.002, None
    assert not any(p.probe for p in controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids]).values())

    # the ablation's "lone probes": each probe priced as if alone, one per eight requests a step
    controller.share_probes = False
    for i, rid in enumerate(rids):
        controller.states[rid].credit = 0.05 if i == 0 else 0.002
    plans = controller.plan([(rid, {"draft": MAX_K}, {"draft": 0}) for rid in rids])
    assert [rid for rid, p in plans.items() if p.probe] == ["r0"]
    assert controller.states["r0"].probe[0] == pytest.approx(controller.last_predicted_time - model.step_time(4))


def test_the_engine_wide_rate_follows_a_shift_across_requests():
    """Traffic turns from acceptance 0.3 to 0.9 between requests. The engine-wide rate, the prior
    of every new request, remembers ~140 judged tokens; its shift detector restarts it from the
    tokens since the change, so within about 60 judged tokens it reads the new rate (forgetting
    alone would still read under 0.5)."""
    controller = SpecController(["draft"], MAX_K, costs(0.0005), explore=False)
    finished_requests(controller, [0.3] * 30)
    assert controller.global_counts["draft"].rate(0.5, 1.0) < 0.4
    rng = random.Random(1)
    for i in range(60):
        controller.observe(f"new{i // 20}", "draft", 1, int(rng.random() < 0.9))
    assert controller.global_counts["draft"].rate(0.5, 1.0) > 0.75
    assert controller.acceptance("fresh", "draft") > 0.75   # a new request starts from it


def test_a_first_look_is_free_only_while_it_is_cheap():
    """A draft model's first look on a short context is free; on a long one its catch-up costs more
    than FIRST_LOOK_TOKENS of the request's plain tokens, so it waits for credit like any probe."""
    from engine.spec_decode.controller import FIRST_LOOK_TOKENS
    model = costs(0.0003)
    model.calibrate_plain(1, 0.030)
    model.catch_up_price["draft"] = 0.0001   # 10 ms per 100 tokens
    long_lag = int(FIRST_LOOK_TOKENS * 0.030 / 0.0001) + 100
    for lag, free in ((50, True), (long_lag, False)):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.0})
        plan = controller.plan([("r", {"draft": MAX_K}, {"draft": lag})])["r"]
        assert bool(plan.probe) == free, (lag, plan)


def test_a_first_look_is_priced_in_the_requests_own_tokens():
    """A catch-up is the request's own cost: one that is free alone (under FIRST_LOOK_TOKENS plain
    steps at batch 1) is not free for each of 16 requests arriving together, whose catch-ups would
    together cost many plain steps. Short prompts' looks stay free at batch 16: the verification
    shape and the draft forward they share."""
    model = costs(0.0003)
    model.calibrate_plain(1, 0.030)
    model.calibrate_plain(16, 0.060)
    model.catch_up_price["draft"] = 0.0001
    for lag, size, free in ((300, 1, True), (300, 16, False), (10, 16, True)):
        requests = [(f"r{i}", {"draft": MAX_K}, {"draft": lag}) for i in range(size)]
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": 0.0})
        controller.sample_looks = False   # every look priced (one look for all: the next test)
        plans = controller.plan(requests)
        assert all(bool(plan.probe) == free for plan in plans.values()), (lag, size, plans)


def test_one_look_speaks_for_new_requests_where_drafting_is_ruled_out():
    """Where the traffic's rate rules out any rate at which a draft token pays (acceptance 0 at
    batch 16 here), one new request looks and the others' looks are dropped; the next wave again
    sends one. Where a draft token could still pay for a new request (batch 4 at 0.3; the plan
    drafts there for none), every one looks; and with sampling off, all 16 look."""
    model = costs(0.0005)
    for alpha, size, sample, looks in ((0.0, 16, True, 1), (0.0, 16, False, 16), (0.3, 4, True, 4)):
        controller = with_history(SpecController(["draft"], MAX_K, model, explore=False), {"draft": alpha})
        controller.hurdle = 10.0   # no drafting plans: the looks are the subject
        controller.sample_looks = sample
        wave = [(f"r{i}", {"draft": MAX_K}, {"draft": 0}) for i in range(size)]
        plans = controller.plan(wave)
        assert sum(p.probe for p in plans.values()) == looks, (alpha, size, sample)
        assert not any(state.look_due for state in controller.states.values())   # none left for later
        assert not any(p.probe for p in controller.plan(wave).values())
        second = [(f"s{i}", {"draft": MAX_K}, {"draft": 0}) for i in range(size)]
        plans = controller.plan(wave + second)
        assert sum(plans[rid].probe for rid, _, _ in second) == looks


# ---- the plan's cadence ------------------------------------------------------------------------

def test_cadence_plans_less_often_while_plans_do_not_pay():
    from engine.spec_decode.cadence import MAX_STRIDE, PlanCadence
    cadence = PlanCadence()
    due = [cadence.due() for _ in range(3)]
    assert due == [True] * 3 and cadence.last_steps == 1   # no verdict yet: every step
    strides = []
    for _ in range(4):   # plans that won nothing and cost host time
        cadence.observe(0.0, 0.001, 0.0005)
        strides.append(cadence.stride)
    assert strides == [2, 4, MAX_STRIDE, MAX_STRIDE] and MAX_STRIDE == 4
    due = [cadence.due() for _ in range(8)]
    assert due == [False, False, False, True] * 2 and cadence.last_steps == 4
    cadence.observe(0.2, 0.001, 0.0005)   # a plan whose drafts won plenty: every step again
    assert cadence.stride == 1 and cadence.due()


def share_of_steps_planned(win_chance: float, drafted: bool = True, seed: int = 0, plans: int = 4000) -> float:
    """One draft token a plan (drafted: the plan's, reported with its luck; else a probe's), won (a
    plain step of 11 ms) with win_chance, else 4 ms lost."""
    from engine.spec_decode.cadence import PlanCadence, luck_variance
    cadence, rng, steps = PlanCadence(), random.Random(seed), 0
    luck = luck_variance([win_chance]) * 0.011 ** 2 if drafted else 0.0
    for _ in range(plans):
        steps += cadence.stride
        cadence.observe(0.011 if rng.random() < win_chance else 0.0, 0.004, 0.0001, luck)
    return plans / steps


def test_cadence_keeps_planning_through_the_noise_of_plans_that_pay():
    """Acceptance 0.5 pays +1.4 ms a plan on average, but runs of rejections take a ten-plan average
    below zero now and then: the cadence must not take those for plans that do not pay (with a bar
    at zero it planned 70% of steps here, a quarter of them for stretches). Plans that lose on
    average are still made less often, and probes' outcomes (exploration, paid from its own budget)
    are taken at face value."""
    from engine.spec_decode.cadence import luck_variance
    # two drafts at 0.9: accepted 0, 1 or 2 with chances 0.1, 0.09 and 0.81
    assert luck_variance([0.5]) == 0.25 and abs(luck_variance([0.9, 0.81]) - 0.4059) < 1e-9
    assert share_of_steps_planned(0.5) > 0.9
    assert share_of_steps_planned(0.1) < 0.4
    assert share_of_steps_planned(0.5, drafted=False) < 0.8


class CopyDrafts:
    """A free proposer that drafts the plain greedy continuation, each token right with probability
    alpha (else another token): acceptance as set, whatever the tiny model writes."""
    method = "ngram"

    def __init__(self, truth: dict[tuple, list[int]], alpha: float, seed: int = 0):
        self.truth, self.alpha, self.rng = truth, alpha, random.Random(seed)

    def max_drafts(self, request, limit):
        return limit

    def catch_up_tokens(self, request):
        return 0

    def propose(self, items):
        from engine.spec_decode.base import Proposal
        drafts = []
        for item in items:
            request = item.request
            start = request.num_output_tokens
            truth = self.truth[tuple(request.token_ids[:request.num_prompt_tokens])][start:start + item.num_lookahead]
            drafts.append([t if self.rng.random() < self.alpha else (t + 1) % 256 for t in truth])
        return Proposal(drafts, None)

    def on_verified(self, request):
        pass

    def on_finish(self, request_id):
        pass


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_plans_that_do_not_pay_are_made_less_often(pair, alpha):
    """Planning costs host time. When its drafts win nothing, the engine plans only every few steps
    and decodes plainly in between, with no speculation work at all; when they win, it plans every
    step. The output is plain greedy output either way."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.spec_decode.cadence import MAX_STRIDE
    target, _ = pair
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain, _ = run({"model": target}, params)
    engine = Engine(EngineConfig(model=target, dtype="float32",
                                 speculative={"method": "ngram", "num_speculative_tokens": 4}))
    engine.proposer.proposers["ngram"] = CopyDrafts({tuple(p): t for p, t in zip(PROMPTS, plain)}, alpha)
    calls, plans = [0, 0], engine.controller.plan

    def counted(*args, **kwargs):
        calls[1] += 1
        return plans(*args, **kwargs)

    engine.controller.plan = counted
    due = engine.cadence.due
    engine.cadence.due = lambda: (calls.__setitem__(0, calls[0] + 1), due())[1]
    tokens, finals = run_requests(engine, PROMPTS, params)
    assert tokens == plain
    steps, planned = calls
    if alpha == 0.0:
        assert engine.cadence.stride == MAX_STRIDE and planned < steps / 2, (steps, planned)
    else:
        assert engine.cadence.stride == 1 and planned == steps, (steps, planned)
        assert engine.cadence.luck > 0.0   # the plan's own drafts reported the spread chance gives their wins
        assert sum(f.spec.accepted for f in finals) > 2 * sum(f.spec.target_forwards for f in finals)
