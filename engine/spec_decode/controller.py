"""Adaptive speculation: every step, each decoding request's proposer and draft length k.

The goal is the batch's goodput, expected output tokens per second of the step:

- Expected tokens of k drafts from proposer m for request r are 1 + a + a^2 + ... + a^k, where a is
  the request's acceptance rate per judged draft token with m: decayed counts (recent steps weigh
  most, so a shift in the workload shows within a few steps), shrunk towards the engine-wide rate of
  m. One rate for every position: when acceptance collapses, it collapses at every position at once.
- Step time is StepCostModel.step_time: the target pass as a function of its tokens, plus every
  draft-model forward as a function of its rows (the first one also catches up the tokens the
  draft has not seen). The engine measures both online.
- The plan starts from plain decoding (k = 0 everywhere) and adds, one at a time, the draft token
  with the most expected tokens per added second, while that raises the step's tokens per second.
  Marginal gains fall with k and the bar (the step's current tokens per second) rises with the
  batch, so k shrinks smoothly as the batch grows: no batch-size table, no cliff.
- A request whose plan is k = 0 still probes now and then (k = 1 with its best proposer, at
  intervals that double while probes fail and shrink to every step once one succeeds, at most one
  request in eight per step, with a free proposer when there is one (a draft model only when it has
  little to catch up), on steps that are multiples of the interval so that
  requests probe together and share the draft forward), so it notices when acceptance comes back.
- Each drafting request also gets a confidence bar for the draft loop: it stops drafting once the
  draft's probability of its own tokens so far, multiplied, falls below the marginal gain the plan
  needed (or `draft_p_min`, when configured).

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.step_timer import StepCostModel

PRIOR_WEIGHT = 2.0        # pseudo-observations of the engine-wide rate behind each request's estimate
REQUEST_DECAY = 0.85      # per observation: a request's counts forget with a half-life of ~4 steps
GLOBAL_DECAY = 0.98       # the engine-wide rate: half-life ~35 observations (of any request)
PROBE_INTERVAL = 8        # steps of k = 0 before a probe; doubles after each failed probe ...
MAX_PROBE_INTERVAL = 16   # ... up to this
PROBES_PER_REQUESTS = 8   # at most one probe per 8 decoding requests in a step: probing a big batch costs
MAX_PROBE_CATCH_UP = 32   # a draft model probes a request only if it has at most this many tokens to catch up


@dataclass(frozen=True)
class Plan:
    method: str           # proposer name; "none" when k == 0
    k: int
    p_min: float = 0.0    # confidence stop: draft while the product of q(own token) stays >= p_min


NO_PLAN = Plan("none", 0)


class DecayedCounts:
    """Judged and accepted draft tokens, forgetting old observations geometrically."""

    def __init__(self, decay: float):
        self.decay = decay
        self.judged = 0.0
        self.accepted = 0.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        judged = min(num_drafted, num_accepted + 1)   # drafts past the first rejection were not judged
        self.judged = self.decay * self.judged + judged
        self.accepted = self.decay * self.accepted + num_accepted

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.judged + weight)


@dataclass
class RequestSpecState:
    """What the controller remembers of one request."""
    counts: dict[str, DecayedCounts] = field(default_factory=dict)
    steps_since_draft: int = 0
    probe_interval: int = PROBE_INTERVAL


class SpecController:
    def __init__(self, methods: list[str], max_k: int, costs: StepCostModel, adaptive: bool = True,
                 draft_p_min: float | None = None):
        self.methods = list(methods)
        self.max_k = max_k
        self.costs = costs
        self.adaptive = adaptive
        self.draft_p_min = draft_p_min
        self.global_counts = {m: DecayedCounts(GLOBAL_DECAY) for m in self.methods}
        self.states: dict[str, RequestSpecState] = {}
        self.last_predicted_time: float | None = None
        self.num_plans = 0   # steps planned: probes fall on shared steps, so they share draft forwards
        self._probes_left = 0

    # ---- estimates ---------------------------------------------------------------
    def acceptance(self, request_id: str, method: str) -> float:
        prior = self.global_counts[method].rate(prior=0.5, weight=1.0)
        state = self.states.get(request_id)
        counts = state.counts.get(method) if state else None
        return counts.rate(prior, PRIOR_WEIGHT) if counts else prior

    def gains(self, request_id: str, method: str, k: int) -> list[float]:
        """Marginal expected tokens of draft 1..k: a^j."""
        a = self.acceptance(request_id, method)
        return [a ** j for j in range(1, k + 1)]

    # ---- the plan ------------------------------------------------------------------
    def plan(self, candidates: list[tuple[str, dict[str, int], dict[str, int]]], num_prefill_tokens: int = 0
             ) -> dict[str, Plan]:
        """candidates: per decoding request (request id, {method: most drafts it can take now},
        {method: tokens that method must catch up on first}). Returns a Plan per request id."""
        if not self.adaptive:
            plans = {rid: self._static(caps) for rid, caps, _ in candidates}
            self.last_predicted_time = self.predicted_time(
                len(candidates) + num_prefill_tokens, {rid: p.k for rid, p in plans.items() if p.k},
                {rid: p.method for rid, p in plans.items()}, {rid: lag for rid, _, lag in candidates})
            return plans
        self.num_plans += 1
        self._probes_left = -(-len(candidates) // PROBES_PER_REQUESTS)
        base_tokens = len(candidates) + num_prefill_tokens
        plain_time = self.costs.step_time(base_tokens, [])
        # Plan as if the pass verifies drafts (its shape costs more than a plain pass of as many
        # tokens), then keep the plan only if it beats plain decoding at the plain pass's cost.
        drafting_time = self.costs.verify_time(base_tokens)
        per_token = self.costs.per_token(base_tokens)
        methods = {rid: self._choose_method(rid, caps, lag, len(candidates), drafting_time, per_token)
                   for rid, caps, lag in candidates}
        model_users = [rid for rid, m in methods.items() if m is not None and self._is_model(m)]
        lag_total = sum(lag.get(methods[rid], 0) for rid, _, lag in candidates if rid in model_users)
        draft_row = self._draft_row_cost(len(model_users), lag_total)
        # Every draft token of a request costs the same (a target row, plus its share of a draft
        # forward) and its expected gain falls with k: take them best first while goodput rises.
        increments = []
        for rid, caps, _ in candidates:
            method = methods[rid]
            if method is None:
                continue
            seconds = per_token + (draft_row if self._is_model(method) else 0.0)
            for gain in self.gains(rid, method, caps[method]):
                increments.append((gain / max(seconds, 1e-9), gain, seconds, rid))
        increments.sort(key=lambda item: -item[0])
        expected, time = float(len(candidates)), drafting_time
        ks: dict[str, int] = {}
        bars: dict[str, float] = {}
        for _, gain, seconds, rid in increments:
            if (expected + gain) / (time + seconds) <= expected / time:
                break
            expected, time = expected + gain, time + seconds
            ks[rid] = ks.get(rid, 0) + 1
            bars[rid] = gain
        time = self.predicted_time(base_tokens, ks, methods, {rid: lag for rid, _, lag in candidates}) \
            if ks else plain_time
        if ks and expected / time < len(candidates) / plain_time:   # the exact costs say plain is better
            ks, time = {}, plain_time
        self.last_predicted_time = time
        return {rid: self._finish(rid, caps, lag, methods[rid], ks.get(rid, 0), bars.get(rid, 0.0))
                for rid, caps, lag in candidates}

    def _choose_method(self, rid: str, caps: dict[str, int], lag: dict[str, int], batch: int,
                       base_time: float, per_token: float) -> str | None:
        """The proposer that would raise the step's tokens per second most if this request drafted
        alone with it (a model draft's forward priced as if the whole batch shared it)."""
        best, best_rate = None, batch / base_time
        for method in self.methods:
            cap = caps.get(method, 0)
            if cap <= 0:
                continue
            seconds = per_token + (self._draft_row_cost(batch, lag.get(method, 0) * batch)
                                   if self._is_model(method) else 0.0)
            expected, time = float(batch), base_time
            for gain in self.gains(rid, method, cap):
                if (expected + gain) / (time + seconds) <= expected / time:
                    break   # gains only fall from here: this method's best is behind us
                expected, time = expected + gain, time + seconds
                if expected / time > best_rate:
                    best, best_rate = method, expected / time
        return best

    def _draft_row_cost(self, rows: int, lag_tokens: int) -> float:
        """Seconds per drafting request per draft position: one forward shared by `rows` requests
        (the first one also feeds lag_tokens of catch-up)."""
        if rows <= 0:
            return self.costs.draft_forward(1 + lag_tokens)
        return self.costs.draft_forward(rows + lag_tokens) / rows

    def predicted_time(self, base_tokens: int, ks: dict[str, int], methods: dict[str, str | None],
                       lags: dict[str, dict[str, int]]) -> float:
        """StepCostModel's time of the step this plan makes."""
        rows: dict[int, int] = {}
        for rid, k in ks.items():
            if self._is_model(methods[rid]):
                for j in range(k):
                    rows[j] = rows.get(j, 0) + 1 + (lags[rid].get(methods[rid], 0) if j == 0 else 0)
        return self.costs.step_time(base_tokens + sum(ks.values()), [rows[j] for j in sorted(rows)], bool(ks))

    def _finish(self, rid: str, caps: dict[str, int], lag: dict[str, int], method: str | None, k: int,
                marginal_gain: float) -> Plan:
        state = self.states.setdefault(rid, RequestSpecState())
        if k == 0:
            probe = self._probe(rid, caps, lag, state)
            if probe is not None:
                return probe
            state.steps_since_draft += 1
            return NO_PLAN
        state.steps_since_draft = 0
        # Confidence stop: drafting on is worth it while P(all drafts so far accepted) stays near
        # the gain the plan's last draft token needed; the draft's own product of q estimates it.
        p_min = self.draft_p_min if self.draft_p_min is not None else 0.5 * marginal_gain
        return Plan(method, k, p_min)

    def _probe(self, rid: str, caps: dict[str, int], lag: dict[str, int], state: RequestSpecState) -> Plan | None:
        # A free proposer probes first; a draft model only if it is nearly caught up (a probe that
        # first feeds it the whole prompt costs a prefill).
        usable = [m for m in self.methods if caps.get(m, 0) > 0
                  and (not self._is_model(m) or lag.get(m, 0) <= MAX_PROBE_CATCH_UP)]
        free = [m for m in usable if not self._is_model(m)]
        usable = free or usable
        # Due, and on a step that is a multiple of the interval: requests due together probe together.
        aligned = self.num_plans % min(state.probe_interval, PROBE_INTERVAL) == 0
        if not usable or state.steps_since_draft + 1 < state.probe_interval or not aligned or self._probes_left <= 0:
            return None
        self._probes_left -= 1
        method = max(usable, key=lambda m: self.acceptance(rid, m))
        state.steps_since_draft = 0
        return Plan(method, 1, 0.0)

    def _static(self, caps: dict[str, int]) -> Plan:
        usable = [m for m in self.methods if caps.get(m, 0) > 0]
        if not usable:
            return NO_PLAN
        return Plan(usable[0], min(self.max_k, caps[usable[0]]), self.draft_p_min or 0.0)

    @staticmethod
    def _is_model(method: str) -> bool:
        return method == "draft"

    # ---- feedback -------------------------------------------------------------------
    def observe(self, request_id: str, method: str, num_drafted: int, num_accepted: int) -> None:
        """What verification made of a request's drafts this step."""
        if num_drafted == 0 or method not in self.global_counts:
            return
        state = self.states.setdefault(request_id, RequestSpecState())
        state.counts.setdefault(method, DecayedCounts(REQUEST_DECAY)).observe(num_drafted, num_accepted)
        self.global_counts[method].observe(num_drafted, num_accepted)
        if num_accepted > 0:     # acceptance may be back: while the plan still says k = 0, probe every step
            state.probe_interval = 1
        elif num_drafted == 1:   # a failed probe: wait longer before the next one
            state.probe_interval = min(max(2 * state.probe_interval, PROBE_INTERVAL), MAX_PROBE_INTERVAL)

    def on_finish(self, request_id: str) -> None:
        self.states.pop(request_id, None)
