"""Adaptive speculation: every step, each decoding request's proposer and draft length k.

The goal is the batch's goodput, expected output tokens per second of the step:

- Expected tokens of k drafts from proposer m for request r are 1 + a + a^2 + ... + a^k, where a is
  the request's acceptance rate per judged draft token with m: counts that forget per judged token
  (a step that judged eight drafts does not outweigh eight steps that judged one), shrunk towards
  the engine-wide rate of m by as many pseudo-tokens as the requests so far (finished and live)
  show them to be alike (PriorStrength: many when they all accept at one rate, few when they
  differ). The memory is ~100 tokens long, and a change-point test (a two-sided CUSUM) restarts it
  from the tokens since a shift, so a shift in the workload shows within a few steps (all in
  estimates.py). One rate for every position: when acceptance collapses, it collapses at every
  position at once.
- Step time is StepCostModel.step_time: the target pass as a function of its tokens, plus every
  draft-model forward as a function of its rows, plus the tokens the draft has not seen yet, which
  its first forward catches up on, scaled by what whole drafting steps measured against their
  prediction (the parts miss some of a step's work). The engine measures all of it online. A
  catch-up serves the drafting steps after it too, so the plan's rates charge a step a share.
- The plan starts from plain decoding (k = 0 everywhere) and adds, one at a time, the draft token
  with the most expected tokens per added second, while that raises the step's tokens per second
  (a request's first tokens are ranked together when its catch-up makes one alone not worth it).
  Marginal gains fall with k and the bar (the step's current tokens per second) rises with the
  batch, so k shrinks smoothly as the batch grows: no batch-size table, no cliff. Prompt tokens
  sharing the pass are left out of the bar (they cost the same whatever is drafted, and yield no
  output token): a draft beside a long prompt must beat plain decoding's rate, as any other. A
  plan that promises less than HURDLE (5%) more goodput than plain decoding is dropped: predicted
  step times err by about that much, and in a close call plain decoding cannot lose.
- A request whose plan is k = 0 still probes now and then (k = 1 with its best proposer, a free
  one when there is one, else the draft model, its catch-up priced in), so it notices when
  acceptance comes back. Probing is paid from an exploration budget: each step adds EXPLORATION of
  the request's share of a plain step; a probe is charged its net cost (its extra time, less the
  plain-decoding time of the tokens it won). Failed probes can never cost more than EXPLORATION of
  plain decoding; probes that win pay for themselves, so once acceptance is back they run every
  step until the plan drafts again. A request the plan never drafted for, and whose evidence puts
  the chance that one draft token pays under RULED_OUT (5%), accrues a quarter of that
  (UNDRAFTED_EXPLORATION): its probes look for acceptance it never showed, where those of one that
  drafted and stopped look for acceptance coming back (an agent's prose after a tool call), and
  those of one with thin evidence for acceptance it may well have (at alpha 0.5, batch 4, half the
  first looks fail, and a quarter rate never probed again within a 64-token request). At alpha 0,
  batch 4, the full rate cost ~3% of plain decoding (a free first look and three pooled probes of
  ~30 ms in 64 steps). Probes share passes: the first probe of a plain step pays for
  the verification shape and a whole draft forward, and requests that probe beside it, or beside
  the plan's drafts, pay only their row and their row's share of the draft forward (at batch 4 a
  lone probe cost ~20 ms on a 70 ms step, and a fourth of the same forward ~1 ms). At most one
  request in eight starts a probing pass in a step. A new request takes one free look at once
  (requests that arrive together share its pass), unless that look costs more than
  FIRST_LOOK_STEPS plain steps, or its draft model's catch-up on the prompt more than
  FIRST_LOOK_TOKENS of the request's own plain tokens: then it is a paid probe like the others.
  Deferring it while the engine-wide prior was strong left a stale prior unchallenged: after
  low-acceptance traffic, an engine facing alpha 0.7 at batch 4 never drafted, its requests'
  catch-up making every paid probe too dear. But where the traffic's rate rules out, for a new
  request, any rate at which a draft token pays (the RULED_OUT test above), one look per plan
  speaks for all new requests: it keeps the engine-wide rate checked (a return of acceptance moves
  it, and the plan then drafts on that prior), where the others' looks would only confirm it. At
  batch 16, where no draft pays on the dev CPU, every new request's look cost a verification pass
  and the draft model's catch-up on 16 prompts: ~95 ms over a plain step once a wave, 3-4% of
  plain decoding (the steps of one look: 29 ms, against plain steps of 33.5).
- Estimates from a few judged tokens can be unluckily low, and a request that stops drafting stops
  learning. So a request that planned no drafts last step, and has judged fewer than EXPLORE_JUDGED
  tokens of its own, explores as a bandit does (optimistic Thompson sampling): the plan uses a
  draw from its acceptance posterior (the estimate's mean and its pseudo-count of judged tokens)
  when the draw is above the mean, for one draft token (the cheapest evidence; a drawn plan of 2-3
  tokens paid for the draw's optimism where the true rate made one token pay). One near the break-even drafts again now and then until its
  own evidence counts; one far from paying off almost never does. Requests that draft learn every
  step and plan on the mean; those with evidence of their own are watched by probes.
- How often the engine plans at all is the cadence's call (cadence.py): a plan is host work, and
  plans that do not pay for it are made only every few steps (`plan(steps=...)` says how many a
  plan stands for, so exploration credit accrues per step all the same).
- Each drafting request also gets a confidence bar for the draft loop: it stops drafting once the
  draft's probability of its own tokens so far, multiplied, falls below the marginal gain the plan
  needed (or `draft_p_min`, when configured).

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from engine.spec_decode.estimates import (GLOBAL_DECAY, GLOBAL_FALL_LLR, MAX_POSITION_RATE, PRIOR_WEIGHT,
                                          REQUEST_DECAY, STEADY_DECAY, CalibrationRatio, DecayedCounts,
                                          PositionCalibration, PriorStrength, judged_tokens, unlike)
from engine.step_timer import StepCostModel

EXPLORE_JUDGED = 16.0     # an idle request explores (optimistic posterior draws) until it judged this many
EXPLORATION = 0.02        # share of a request's plain decoding time that failed probes may cost
UNDRAFTED_EXPLORATION = 0.25   # its multiplier for a request not worth watching (SpecController._worth_watching)
RULED_OUT = 0.05          # a paying rate less likely than this is ruled out (never-drafted requests only)
PROBES_PER_REQUESTS = 8   # at most one probe per 8 decoding requests in a step: probing a big batch costs
MAX_CREDIT_STEPS = 4.0    # exploration credit saved up (or won by probes) is capped at this many plain steps
FIRST_LOOK_STEPS = 2.0    # a first look is free while its probe costs at most this many plain steps of the batch,
FIRST_LOOK_TOKENS = 2.0   # and its draft catch-up at most this many of the request's own plain tokens
MODEL_PROPOSERS = ("draft", "eagle")   # proposers that run a network per draft position (priced per forward)
CATCH_UP_STEPS = 4.0      # a draft model's catch-up is paid once and serves the drafting steps after it:
                          # the plan's rates spread it over this many
HURDLE = 0.05             # a plan must promise this much more goodput than plain decoding: the cost model
                          # errs by about as much, and plain decoding is the safe side of a close call


@dataclass(frozen=True)
class Plan:
    method: str           # proposer name; "none" when k == 0
    k: int
    p_min: float = 0.0    # confidence stop: draft while the product of q(own token) stays >= p_min
    probe: bool = False   # drafted only to learn whether acceptance is (back) up


NO_PLAN = Plan("none", 0)


def _ironed(rid: str, gains: list[float], row: float, first: float) -> list[tuple[float, float, float, int, str]]:
    """(ratio, gain, seconds, position, rid) per draft token of one request. A token comes only with
    the ones before it, so its ratio is that of the best bundle it can join: the first tokens are
    pooled up to the prefix with the best gain per second (which spreads the catch-up over them),
    and no later token ranks above an earlier one."""
    seconds = [row + (first if j == 0 else 0.0) for j in range(len(gains))]
    total_gain = total_time = 0.0
    pooled, best = 0, -1.0
    for j, (gain, time) in enumerate(zip(gains, seconds)):
        total_gain, total_time = total_gain + gain, total_time + time
        if total_gain / max(total_time, 1e-12) > best:
            pooled, best = j + 1, total_gain / max(total_time, 1e-12)
    out, ratio = [], best
    for j, (gain, time) in enumerate(zip(gains, seconds)):
        if j >= pooled:
            ratio = min(ratio, gain / max(time, 1e-12))
        out.append((ratio, gain, time, j, rid))
    return out


@dataclass(frozen=True)
class ProbePrices:
    """What a probe row costs in a step beyond its own draft token, and what its tokens are worth."""
    plain_token: float        # seconds per token of plain decoding at this batch
    per_token: float          # one more token in the verification pass
    shape_jump: float         # a verification-shaped pass over a plain one (paid by the probe that makes one)


def _add_credit(state: "RequestSpecState", seconds: float, plain_token: float) -> None:
    """Move a request's exploration credit, saved up to at most MAX_CREDIT_STEPS plain steps."""
    state.credit = min(state.credit + seconds, MAX_CREDIT_STEPS * plain_token)


@dataclass
class RequestSpecState:
    """What the controller remembers of one request."""
    counts: dict[str, DecayedCounts] = field(default_factory=dict)
    credit: float = 0.0            # exploration budget in seconds
    look_due: bool = True          # new: one free probe due (SpecController._probes)
    probe: tuple[float, float] | None = None   # the probe in flight: (its extra seconds, seconds per plain token)
    idle: bool = False   # planned no drafts last step (a probe's one token is little evidence)
    drafted: bool = False   # the plan drafted for it at least once (probes and first looks aside)
    totals: dict[str, list[int]] = field(default_factory=dict)   # method -> [judged, accepted], never forgotten
    ratios: dict[str, CalibrationRatio] = field(default_factory=dict)   # method -> accepted / calibrated expectation


class SpecController:
    def __init__(self, methods: list[str], max_k: int, costs: StepCostModel, adaptive: bool = True,
                 draft_p_min: float | None = None, explore: bool = True, seed: int = 0):
        self.methods = list(methods)
        self.max_k = max_k
        self.costs = costs
        self.adaptive = adaptive
        self.draft_p_min = draft_p_min
        # The engine-wide rate is watched for shifts too: when traffic turns from one acceptance to
        # another across requests, its ~140-token memory held new requests to the old rate (under a
        # strong pooled prior) for most of a 64-token request.
        self.global_counts = {m: DecayedCounts(GLOBAL_DECAY, watch=True, fall_llr=GLOBAL_FALL_LLR)
                              for m in self.methods}
        self.calibration = PositionCalibration()   # per evidence key, for proposers that report one per draft
        self.use_evidence = True   # False: those proposers are planned on one rate too (the ablation's "one rate")
        self._keys: dict[str, dict[str, list]] = {}   # this plan's evidence keys: request -> method -> per position
        self.prior_strength = {m: PriorStrength() for m in self.methods}
        self.pool_evidence = True   # False: the prior weighs PRIOR_WEIGHT always (the ablation's "fixed prior")
        self._prior_weights: dict[str, float] = {}   # method -> prior_weight, until the next observation
        self.states: dict[str, RequestSpecState] = {}
        self.last_predicted_time: float | None = None
        self.last_depth = 0   # the longest draft of the last plan (what its predicted time was priced at)
        self.last_gains: dict[str, list[float]] = {}   # per request the last plan drafted for (probes aside),
                                                       # the chance of each draft and all before it accepted
        self.last_plain_time = 0.0    # the last plan's step as plain decoding, prompt tokens included
        self.last_plain_token = 0.0   # ... and plain decoding's seconds per output token at its batch
        self._steps = 1               # steps the current plan stands for (the cadence's skipped ones too)
        self.explore = explore
        self.hurdle = HURDLE
        self.first_look = True   # a new request's first probe is free (the ablation switches it off)
        self.sample_looks = True   # False: every new request looks, even where drafting is ruled out (the
                                   # ablation's "every look")
        self.share_probes = True   # False: every probe priced and charged as if alone in its pass (the ablation's
                                   # "lone probes")
        self.steady_decay: float | None = STEADY_DECAY   # None: the short memory alone, no shift detector
        self._rng = random.Random(seed)      # exploration draws (they choose k, never tokens)
        self._rates: dict[tuple[str, str], float] = {}   # this plan's acceptance per (request, method)
        self._drawn: set[tuple[str, str]] = set()          # ... of those, the exploration draws
        self._watched: set[str] = set()   # this plan's idle requests worth watching (_worth_watching)
        self.explore_judged = EXPLORE_JUDGED

    # ---- estimates ---------------------------------------------------------------
    def _new_counts(self) -> DecayedCounts:
        if self.steady_decay is None:
            return DecayedCounts(REQUEST_DECAY)
        return DecayedCounts(self.steady_decay, watch=True)

    def _evidence(self, request_id: str, method: str) -> tuple[DecayedCounts, float, float]:
        """The request's own counts for method (empty when it has none), the engine-wide prior rate
        and its weight in judged tokens."""
        state = self.states.get(request_id)
        counts = (state.counts.get(method) if state else None) or self._new_counts()
        prior = self.global_counts[method].rate(prior=0.5, weight=1.0)
        weight = self.prior_weight(method)
        if weight > PRIOR_WEIGHT and unlike(counts, prior):
            weight = PRIOR_WEIGHT   # its own tokens say it is not one of the many alike
        return counts, prior, weight

    def prior_weight(self, method: str) -> float:
        """Pseudo-tokens of the engine-wide rate behind a request's estimate (PriorStrength over the
        finished requests and the live ones); computed once between two observations."""
        if not self.pool_evidence:
            return PRIOR_WEIGHT
        if method not in self._prior_weights:
            live = (state.totals[method] for state in self.states.values() if method in state.totals)
            self._prior_weights[method] = self.prior_strength[method].weight(live)
        return self._prior_weights[method]

    def acceptance(self, request_id: str, method: str) -> float:
        counts, prior, weight = self._evidence(request_id, method)
        return counts.rate(prior, weight)

    def planning_rate(self, request_id: str, method: str) -> float:
        """The acceptance this step's plan uses: the estimate, or for an idle request with thin
        evidence an optimistic draw from its posterior (drawn once per plan, so choosing the
        proposer and k agree)."""
        key = (request_id, method)
        if key not in self._rates:
            counts, prior, weight = self._evidence(request_id, method)
            state = self.states.get(request_id)
            # Only thin evidence is worth a gamble: past PRIOR_WEIGHT judged tokens of its own the
            # estimate is the request's, and probes watch it for shifts.
            explore = self.explore and state is not None and state.idle and counts.judged < self.explore_judged
            self._rates[key] = counts.draw(prior, weight, self._rng) if explore else counts.rate(prior, weight)
            if explore:
                self._drawn.add(key)
        return self._rates[key]

    def gains(self, request_id: str, method: str, k: int) -> list[float]:
        """Marginal expected tokens of draft 1..k: a^j, a the planning rate; for a proposer that
        reported evidence per draft, the product of its calibrated positions' rates."""
        rates = self.position_rates(request_id, method)
        if rates is not None:
            gains, cumulative = [], 1.0
            for rate in rates[:k]:
                cumulative *= rate
                gains.append(cumulative)
            return gains
        a = self.planning_rate(request_id, method)
        if (request_id, method) in self._drawn:
            k = min(k, 1)   # an exploration draw buys the cheapest evidence: one draft token
        return [a ** j for j in range(1, k + 1)]

    def evidence_keys(self, request_id: str, method: str) -> list | None:
        """The evidence key of each draft this plan was offered for the request by method; None when
        the proposer reported none (or evidence is switched off)."""
        return (self._keys.get(request_id, {}).get(method) or None) if self.use_evidence else None

    def position_rates(self, request_id: str, method: str, scaled: bool = True) -> list[float] | None:
        """Each reported draft position's acceptance (given the ones before it) from its evidence key,
        scaled by the request's own ratio unless scaled is False; None without evidence."""
        keys = self.evidence_keys(request_id, method)
        if keys is None:
            return None
        prior = self.global_counts[method].rate(prior=0.5, weight=1.0)
        state = self.states.get(request_id)
        ratio = state.ratios[method].ratio() if scaled and state and method in state.ratios else 1.0
        return [min(MAX_POSITION_RATE, ratio * self.calibration.rate(method, key, prior)) for key in keys]

    # ---- the plan ------------------------------------------------------------------
    def skip(self) -> None:
        """A step without a plan (see spec_decode/cadence.py): plain decoding, nothing predicted."""
        self.last_predicted_time, self.last_depth, self.last_gains = None, 0, {}

    def plan(self, candidates: list[tuple[str, dict[str, int], dict[str, int]]], num_prefill_tokens: int = 0,
             evidence: dict[str, dict[str, list]] | None = None, steps: int = 1) -> dict[str, Plan]:
        """candidates: per decoding request (request id, {method: most drafts it can take now},
        {method: tokens that method must catch up on first}); evidence: per request and method, the
        evidence key of each draft it could offer, from proposers that report them; steps: how many
        steps this plan stands for (exploration credit accrues for each). Returns a Plan per
        request id."""
        self._keys = evidence or {}
        self._steps = steps
        if not self.adaptive:
            plans = {rid: self._static(caps) for rid, caps, _ in candidates}
            self.last_predicted_time = self.predicted_time(
                len(candidates) + num_prefill_tokens, {rid: p.k for rid, p in plans.items() if p.k},
                {rid: p.method for rid, p in plans.items()}, {rid: lag for rid, _, lag in candidates})
            return plans
        self._rates, self._drawn, self._watched = {}, set(), set()
        base_tokens = len(candidates) + num_prefill_tokens
        plain_time = self.costs.step_time(base_tokens)
        # Prompt tokens in the pass cost the same whatever is drafted, and yield no output token: a
        # step's tokens per second with them in is no bar for a draft, which must beat what its
        # seconds earn in plain decoding. (Priced with them in, a pass beside a long prompt made
        # the draft model's catch-ups look cheap: 41 ms for ~2 expected tokens on a 20 ms step.)
        # So the plan's rates leave the prompt's share out; its drafts' prices keep the pass's size.
        decode_time = self.costs.step_time(len(candidates)) if num_prefill_tokens else plain_time
        prompt_share = plain_time - decode_time
        self.last_plain_time, self.last_plain_token = plain_time, decode_time / len(candidates)
        # Plan as if the pass verifies drafts (its shape costs more than a plain pass of as many
        # tokens), then keep the plan only if it beats plain decoding at the plain pass's cost.
        bias = self.costs.drafting_bias   # what drafting steps measured over their prediction
        drafting_time = bias * self.costs.verify_time(base_tokens, base_tokens, len(candidates))
        per_token = bias * self.costs.per_token(base_tokens, len(candidates))
        # Every step also costs the engine's host work around its passes (scheduling, bookkeeping:
        # StepCostModel.step_overhead), paid once however many tokens the step yields. It is in
        # every rate below, not in the predicted pass times the engine checks against its timings.
        overhead = self.costs.step_overhead
        start_time = max(drafting_time - prompt_share, 1e-9) + overhead
        methods = {rid: self._choose_method(rid, caps, lag, len(candidates), start_time, per_token)
                   for rid, caps, lag in candidates}
        model_rows = Counter(m for m in methods.values() if m is not None and self._is_model(m))
        # Every draft token of a request costs a target row plus its share of a draft forward, and
        # its first one also the draft model's catch-up; expected gains fall with k. Take tokens best
        # first while goodput rises.
        increments, gains = [], {}
        for rid, caps, lag in candidates:
            if methods[rid] is not None:
                row, first = self._prices(methods[rid], lag, model_rows[methods[rid]], per_token)
                gains[rid] = self.gains(rid, methods[rid], caps[methods[rid]])
                increments += _ironed(rid, gains[rid], row, first)
        increments.sort(key=lambda item: (-item[0], item[3]))
        expected, time = float(len(candidates)), start_time
        taken: dict[str, list[tuple[float, float]]] = {}
        for ratio, gain, seconds, _, rid in increments:
            if ratio <= expected / time:
                break
            expected, time = expected + gain, time + seconds
            taken.setdefault(rid, []).append((gain, seconds))
        # A pooled bundle may end in tokens not worth their own row once the catch-up is paid.
        for tokens in taken.values():
            while len(tokens) > 1 and tokens[-1][0] <= tokens[-1][1] * expected / time:
                gain, seconds = tokens.pop()
                expected, time = expected - gain, time - seconds
        lags = {rid: lag for rid, _, lag in candidates}
        spread = self._spread_catch_up(taken, methods, lags)
        expected, time = self._trim_deep_positions(taken, expected, base_tokens, methods, lags,
                                                   prompt_share - overhead + spread)
        ks = {rid: len(tokens) for rid, tokens in taken.items()}
        bars = {rid: tokens[-1][0] for rid, tokens in taken.items()}
        plain_rate = len(candidates) / (decode_time + overhead)
        if ks and expected / time < (1.0 + self.hurdle) * plain_rate:   # plain is (about) as good
            ks = {}
        time = time - overhead + spread if ks else decode_time
        self.last_depth = max(ks.values(), default=0)
        time += prompt_share
        prices = ProbePrices(decode_time / len(candidates), per_token, max(0.0, drafting_time - plain_time))
        plans = {rid: self._finish(rid, caps, methods[rid], ks.get(rid, 0), bars.get(rid, 0.0), prices,
                                   len(candidates)) for rid, caps, _ in candidates}
        first_rows = Counter(methods[rid] for rid in ks if self._is_model(methods[rid]))
        self.last_gains = {rid: gains[rid][:plan.k] for rid, plan in plans.items() if plan.k}
        probes, probe_time = self._probes([c for c in candidates if not plans[c[0]].k], prices, bool(ks), first_rows,
                                          len(candidates))
        self.last_predicted_time = time + probe_time
        return {**plans, **probes}

    def _spread_catch_up(self, taken: dict, methods: dict, lags: dict) -> float:
        """Seconds of the drafting requests' catch-ups that their later drafting steps bear (all but
        1 / CATCH_UP_STEPS of each), left out of this step's rates. Charged whole to the step that
        pays it, a catch-up grew with every idle step (a token per request: 1.6 ms a step at 16
        requests), and a wave idle for 10-30 steps at alpha 0.87-0.89 planned no drafts where the
        same curves planned 5-6 each at a lag of one (a simulation with a logged run's curves)."""
        seconds = sum(self.costs.catch_up(lags[rid].get(methods[rid], 0), methods[rid])
                      for rid in taken if self._is_model(methods[rid]))
        return self.costs.drafting_bias * seconds * (1.0 - 1.0 / CATCH_UP_STEPS)

    def _trim_deep_positions(self, taken: dict[str, list[tuple[float, float]]], expected: float,
                             base_tokens: int, methods: dict, lags: dict, offset: float = 0.0
                             ) -> tuple[float, float]:
        """The greedy prices a model draft token at its share of a forward over every drafting
        request, but the draft runs one sequential forward per position: the deepest positions,
        reached by a few requests with the highest estimates, cost a whole forward each. So the plan
        is cut at the depth whose exact step time gives the best goodput, the shallower on a tie.
        Every depth is tried: step time is not convex in depth (a verification pass's cost per token
        falls past some size), and dropping one position at a time while goodput rose stopped at the
        deeper of two peaks (batch 4, estimates 0.91: 8 deep, predicted 72 ms, where 2 deep was 7%
        better by the same curves, and measured 81 ms). Returns the kept plan's expected tokens and
        predicted step time less offset (the prompt tokens' share of the pass, less the step's host
        overhead; 0.0 when nothing was taken)."""
        ks = {rid: len(tokens) for rid, tokens in taken.items()}
        if not ks:
            return expected, 0.0
        best = None   # (goodput, depth, expected tokens, time)
        for depth in range(max(ks.values()), 0, -1):
            capped = {rid: min(k, depth) for rid, k in ks.items()}
            kept = expected - sum(gain for tokens in taken.values() for gain, _ in tokens[depth:])
            time = max(self.predicted_time(base_tokens, capped, methods, lags) - offset, 1e-9)
            if best is None or kept / time >= best[0]:
                best = (kept / time, depth, kept, time)
        _, depth, expected, time = best
        for tokens in taken.values():
            del tokens[depth:]
        return expected, time

    def _choose_method(self, rid: str, caps: dict[str, int], lag: dict[str, int], batch: int,
                       base_time: float, per_token: float) -> str | None:
        """The proposer that would raise the step's tokens per second most if this request drafted
        alone with it (a model draft's forward priced as if the whole batch shared it)."""
        best, best_rate = None, batch / base_time
        for method in self.methods:
            cap = caps.get(method, 0)
            if cap <= 0:
                continue
            row, first = self._prices(method, lag, batch, per_token)
            expected, time = float(batch), base_time + first
            for gain in self.gains(rid, method, cap):
                expected, time = expected + gain, time + row
                if expected / time > best_rate:
                    best, best_rate = method, expected / time
        return best

    def _prices(self, method: str, lag: dict[str, int], model_rows: int, per_token: float) -> tuple[float, float]:
        """(seconds of each draft token, extra seconds of the first) for a request drafting with
        method: a target row, plus for a model proposer its share of forwards over model_rows
        requests, and on the first this step's share of its catch-up (see _spread_catch_up)."""
        if not self._is_model(method):
            return per_token, 0.0
        rows, bias = max(1, model_rows), self.costs.drafting_bias
        return (per_token + bias * self.costs.draft_forward(rows, method) / rows,
                bias * self.costs.catch_up(lag.get(method, 0), method) / CATCH_UP_STEPS)

    def predicted_time(self, base_tokens: int, ks: dict[str, int], methods: dict[str, str | None],
                       lags: dict[str, dict[str, int]]) -> float:
        """StepCostModel's time of the step this plan makes."""
        rows: dict[str, list[int]] = {}      # model proposer -> rows of each of its sequential forwards
        catch_up: Counter = Counter()
        for rid, k in ks.items():
            method = methods[rid]
            if self._is_model(method):
                catch_up[method] += lags[rid].get(method, 0)
                forwards = rows.setdefault(method, [])
                forwards += [0] * (k - len(forwards))
                for j in range(k):
                    forwards[j] += 1
        return self.costs.step_time(base_tokens + sum(ks.values()), rows, bool(ks), catch_up, base_tokens, len(lags),
                                    max(ks.values(), default=0))

    def _finish(self, rid: str, caps: dict[str, int], method: str | None, k: int, marginal_gain: float,
                prices: "ProbePrices", batch: int) -> Plan:
        state = self.states.setdefault(rid, RequestSpecState())
        state.idle = k == 0
        if k == 0:
            watched = self._worth_watching(rid, state, caps, prices, batch)
            if watched:
                self._watched.add(rid)
            share = EXPLORATION * (1.0 if watched else UNDRAFTED_EXPLORATION)
            _add_credit(state, share * prices.plain_token * self._steps, prices.plain_token)
            return NO_PLAN
        state.look_due = False   # it drafts: it learns without a look
        state.drafted = state.drafted or (rid, method) not in self._drawn   # an exploration draw is a gamble
        # Confidence stop: drafting on is worth it while P(all drafts so far accepted) stays near
        # the gain the plan's last draft token needed; the draft's own product of q estimates it.
        # Drafts planned on their own evidence were priced position by position already.
        p_min = self.draft_p_min if self.draft_p_min is not None else 0.5 * marginal_gain
        if self.draft_p_min is None and self.evidence_keys(rid, method) is not None:
            p_min = 0.0
        return Plan(method, k, p_min)

    def _worth_watching(self, rid: str, state: RequestSpecState, caps: dict[str, int], prices: "ProbePrices",
                        batch: int) -> bool:
        """Whether an idle request explores at the full rate: the plan drafted for it before (its
        acceptance may come back), or its evidence has not ruled out, with some proposer, a rate at
        which one draft token pays for its row (a chance of at least RULED_OUT under the posterior)."""
        usable = [m for m in self.methods if caps.get(m, 0) > 0]
        if state.drafted or not usable:
            return True
        for method in usable:
            row, _ = self._prices(method, {}, batch, prices.per_token)
            counts, prior, weight = self._evidence(rid, method)
            if counts.chance_above(min(1.0, row / prices.plain_token), prior, weight) >= RULED_OUT:
                return True
        return False

    def _probes(self, idle: list[tuple[str, dict[str, int], dict[str, int]]], prices: "ProbePrices",
                verifies: bool, first_rows: Counter, batch: int) -> tuple[dict[str, Plan], float]:
        """One-token probes for the requests planned at k = 0, and their predicted seconds. A probe
        runs when its price, less the plain time of the token it wins when accepted, is covered by
        the request's credit; the first probe of a plain pass prices in the verification shape (at
        most one such per PROBES_PER_REQUESTS requests), later ones only their rows, and all of
        them are then charged an equal share. The richest requests go first, so they open the pass
        the others can afford to join. Of the new requests not worth watching, one looks for all
        (unless sample_looks is off): the others' looks are dropped."""
        openers = -(-batch // PROBES_PER_REQUESTS)
        plans, paid, seconds = {}, {}, 0.0
        order = []   # (request, lag, its probe's proposer, that proposer's acceptance), richest first
        for rid, caps, lag in sorted(idle, key=lambda c: -self.states[c[0]].credit):
            # A free proposer probes first; a draft model's probe is priced with its catch-up.
            usable = [m for m in self.methods if caps.get(m, 0) > 0]
            usable = [m for m in usable if not self._is_model(m)] or usable
            if usable:
                rates = {m: self.acceptance(rid, m) for m in usable}
                method = max(usable, key=rates.get)
                order.append((rid, lag, method, rates[method]))
        verifies, jump = self._pooled_opening(order, prices, verifies, first_rows)
        sampled, spared = False, set()   # a look taken for requests ruled out; the looks it stood for
        # Two passes: a request that could not afford to open a pass may join one opened after its
        # turn (by a poorer request's free first look, or one whose catch-up is cheaper).
        for _ in range(2):
            for rid, lag, method, rate in order:
                state = self.states[rid]
                alone = not (verifies and self.share_probes)
                if rid in plans or (alone and openers <= 0):
                    continue
                price = self._probe_price(method, lag, prices, not alone, 0 if alone else first_rows[method])
                look = state.look_due and self.first_look and self._cheap_look(method, lag, price, prices, batch)
                # A request ruled out can teach only what the traffic accepts: one such look is enough.
                if look and self.sample_looks and rid not in self._watched:
                    look = not sampled
                    sampled = True
                    if not look:
                        spared.add(rid)
                if not look and state.credit < price - rate * prices.plain_token:
                    continue
                openers -= alone
                verifies = True
                first_rows[method] += self._is_model(method)
                state.look_due = False
                state.probe = None   # a first look is free; paying probers get their share below
                if not look:
                    paid[rid] = price
                plans[rid], seconds = Plan(method, 1, 0.0, probe=True), seconds + price
        for rid in spared - plans.keys():   # the sampled look spoke for them
            self.states[rid].look_due = False
        # The paying probers share the pass's cost: a joiner charged only its row would bank the
        # plain time of every token it wins, grow rich enough to open passes of its own, and turn
        # probing into drafting at acceptance where drafting loses (alpha 0.3, batch 4: 64% of rows
        # probed, 0.91x plain).
        for rid, price in paid.items():
            share = (sum(paid.values()) + jump) / len(paid) if self.share_probes else price
            self.states[rid].probe = (share, prices.plain_token)
        return plans, seconds + (jump if plans else 0.0)

    def _pooled_opening(self, order: list[tuple[str, dict[str, int], str, float]], prices: "ProbePrices",
                        verifies: bool, first_rows: Counter) -> tuple[bool, float]:
        """Whether the idle requests open a probe pass together: those that could each afford to
        join one, when their credit in all covers the verification shape as well as their rows.
        Returns (whether the pass verifies, the shape's seconds they share). One request's credit
        is capped at a few of its own plain tokens, and at 16 requests the shape alone cost seven
        of them (53 ms on a 115 ms step): no request could open a probe on its own, and a batch
        that had stopped drafting at alpha 0.9 (estimates 0.80-0.86) decoded plainly for its last
        38 steps without one."""
        if verifies or not self.share_probes:
            return verifies, 0.0
        rows, joiners, credit, net = Counter(first_rows), 0, 0.0, 0.0
        for rid, lag, method, rate in order:
            cost = self._probe_price(method, lag, prices, True, rows[method]) - rate * prices.plain_token
            state = self.states[rid]
            if state.credit >= cost:   # it could join a pass someone opened
                joiners, credit, net = joiners + 1, credit + state.credit, net + cost
                rows[method] += self._is_model(method)
        if joiners >= 2 and credit >= net + prices.shape_jump:
            return True, prices.shape_jump
        return False, 0.0

    def _cheap_look(self, method: str, lag: dict[str, int], price: float, prices: "ProbePrices", batch: int) -> bool:
        """Whether a first look costing `price` is free: at most FIRST_LOOK_STEPS plain steps in all,
        and a draft model's catch-up on its prompt at most FIRST_LOOK_TOKENS of the request's own
        plain tokens. The verification shape and the draft forward are shared by every look of the
        step (and learning the traffic's rate serves every request), but a catch-up is the request's
        own: with one bar per look, thirteen requests arriving together at 16 streams each caught
        the draft up on their prompts, 364 ms in one step (nine plain steps), about 6% of the run."""
        if price > FIRST_LOOK_STEPS * prices.plain_token * batch:
            return False
        if not self._is_model(method):
            return True
        catch_up = self.costs.drafting_bias * self.costs.catch_up(lag.get(method, 0), method)
        return catch_up <= FIRST_LOOK_TOKENS * prices.plain_token

    def _probe_price(self, method: str, lag: dict[str, int], prices: "ProbePrices", verifies: bool,
                     rows: int) -> float:
        """Seconds a probe adds to the step: its target row, the verification shape unless the pass
        has it already, and for a model proposer its row of the first draft forward (a whole
        forward when it is the only row) and its catch-up."""
        seconds = prices.per_token + (0.0 if verifies else prices.shape_jump)
        if self._is_model(method):
            curve, bias = self.costs.draft_forward, self.costs.drafting_bias
            row = curve(rows + 1, method) - (curve(rows, method) if rows else 0.0)
            seconds += bias * (max(row, 0.0) + self.costs.catch_up(lag.get(method, 0), method))
        return seconds

    def _static(self, caps: dict[str, int]) -> Plan:
        usable = [m for m in self.methods if caps.get(m, 0) > 0]
        if not usable:
            return NO_PLAN
        return Plan(usable[0], min(self.max_k, caps[usable[0]]), self.draft_p_min or 0.0)

    @staticmethod
    def _is_model(method: str | None) -> bool:
        return method in MODEL_PROPOSERS

    # ---- feedback -------------------------------------------------------------------
    def observe(self, request_id: str, method: str, num_drafted: int, num_accepted: int) -> None:
        """What verification made of a request's drafts this step."""
        if num_drafted == 0 or method not in self.global_counts:
            return
        state = self.states.setdefault(request_id, RequestSpecState())
        judged = judged_tokens(num_drafted, num_accepted)
        self._prior_weights.clear()
        keys = self.evidence_keys(request_id, method)
        if keys is not None:   # drafted on evidence: calibrate its keys, and this request's ratio
            expected = self.position_rates(request_id, method, scaled=False)
            self.calibration.observe(method, keys[:judged], num_accepted)
            state.ratios.setdefault(method, CalibrationRatio()).observe(expected[:judged], num_accepted)
        counts = state.counts.setdefault(method, self._new_counts())
        counts.observe(num_drafted, num_accepted)
        totals = state.totals.setdefault(method, [0, 0])
        totals[0] += judged
        totals[1] += num_accepted
        self.global_counts[method].observe(num_drafted, num_accepted)
        if state.probe is not None:   # charge the probe its net cost: won tokens pay for it
            extra, plain_token = state.probe
            _add_credit(state, num_accepted * plain_token - extra, plain_token)
            state.probe = None

    def on_finish(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        self._prior_weights.clear()
        if state is not None:
            for method, (judged, accepted) in state.totals.items():
                self.prior_strength[method].observe(judged, accepted)
