"""The speculation policy: each step, every decoding request's proposer and draft length k.

The engine asks `plan(view) -> StepPlan` before scheduling and tells `observe(plan, outcome)` what
verification made of it; `on_finish` forgets a request. Two policies:

- StaticPolicy (`adaptive: false`): gamma drafts from the first proposer that can offer any.
- GoodputPolicy (the default): the plan with the most expected output tokens per second of the
  step (SmartSpec's goodput). k drafts whose first is accepted at rate f and each later one at r
  yield 1 + f (1 + r + ... + r^(k-1)) tokens in expectation (estimates.DraftRates: copies in
  progress accept later tokens far more often than the first); a step costs what the cost tables
  (engine/step_costs.py) say for its target pass, each model proposer's sequential forwards and
  catch-up, and the step's host overhead. Each
  request takes, per proposer, the drafts whose chance of acceptance beats their time priced at
  the step's goodput (the shadow price of a second), and the proposer that nets most; then every
  depth cap is priced exactly (a draft model runs one forward per depth, so deep drafts of a few
  requests can cost more than they yield) and the best kept, twice, the second time at the goodput
  the first found. A plan must beat plain decoding by HURDLE: predictions err by about as much,
  and plain decoding is the safe side of a close call.
  Exploration: requests planned at k = 0 probe with the drafts the optimistic bound of their
  acceptance would plan, when that bound says drafting could pay, paid from a budget of EXPLORE of
  plain decoding (each accepted probe token refunds a plain token's time). Idle evidence ages (estimates.py), so
  the bound widens and a request whose acceptance may have come back is tested again.
  Confidence stop: a drafting request stops once its draft's own chance of its tokens so far falls
  below the break-even chance of one more draft token.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.spec_decode.estimates import POOL_FORGET, PRIOR_WEIGHT, Calibration, DraftRates
from engine.step_costs import PassTiming, StepCosts

if TYPE_CHECKING:
    from engine.spec_decode.base import Offer

MODEL_PROPOSERS = ("draft", "eagle")   # proposers that run a network per draft position
HURDLE = 0.03    # a plan must promise this much more goodput than plain decoding
EXPLORE = 0.02   # share of plain decoding time that probes may spend (net of what they win)


@dataclass(frozen=True)
class Candidate:
    """A request whose next pass is a decode."""
    request_id: str
    caps: dict[str, int]   # proposer -> the most drafts it can offer now (0: none)
    lags: dict[str, int]   # proposer -> tokens it must catch up on before drafting
    remaining: int = 1 << 30   # tokens the request may still generate (its max_tokens left)
    trees: dict[str, int] = field(default_factory=dict)   # proposer -> the nodes of a draft tree it offers, holding
                                                          # its chain of `caps` drafts and alternatives


@dataclass(frozen=True)
class StepView:
    candidates: tuple[Candidate, ...]
    num_prefill_tokens: int = 0   # prompt tokens likely to share the pass
    num_prefill_seqs: int = 0     # ... and the sequences they belong to


@dataclass(frozen=True)
class Draft:
    proposer: str
    k: int
    p_min: float = 0.0    # confidence stop: draft while the draft's chance of its tokens so far stays >= p_min
    probe: bool = False   # drafted to learn whether acceptance is (back) up
    nodes: int = 0        # a draft tree's slots: its chain of k and the alternatives that clear tree_p_min (0: a chain)
    tree_p_min: float = 0.0   # the chance an alternative needs to pay for its row

    @property
    def slots(self) -> int:
        return max(self.k, self.nodes)


@dataclass(frozen=True)
class StepPlan:
    drafts: dict[str, Draft] = field(default_factory=dict)   # request id -> its draft; absent: plain decoding
    predicted_time: float | None = None   # the passes' seconds by the cost tables (None: not priced)
    # request id -> what its draft's proposer offered it, handed back to the proposer (the engine adds them)
    offers: dict[str, Offer] = field(default_factory=dict)

    def lookahead(self) -> dict[str, int]:
        return {rid: draft.slots for rid, draft in self.drafts.items()}


@dataclass(frozen=True)
class Verified:
    request_id: str
    proposer: str
    num_drafted: int
    num_accepted: int
    alternatives_chance: float = 0.0   # a tree's alternatives: their chances summed (Calibration)
    alternatives_accepted: int = 0     # and how many of them the target accepted


@dataclass(frozen=True)
class StepOutcome:
    verified: tuple[Verified, ...]   # the decoding requests that drafted
    timing: PassTiming | None        # None: not a timing of the planned step (a failed step's reruns)


class Policy(Protocol):
    def plan(self, view: StepView) -> StepPlan: ...
    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None: ...
    def on_finish(self, request_id: str) -> None: ...


def plan_time(costs: StepCosts, view: StepView, ks: dict[str, tuple]) -> float:
    """The step's seconds by the cost tables, with these drafts (request id -> (proposer, k), or
    (proposer, k, slots) for a draft tree of `slots` nodes whose chain is k long)."""
    forwards: dict[str, list[int]] = {}
    catch_up: dict[str, int] = {}
    by_id = {c.request_id: c for c in view.candidates}
    for rid, (proposer, k, *tree) in ks.items():
        if proposer in MODEL_PROPOSERS:
            rows = forwards.setdefault(proposer, [])
            per_forward = forward_rows(tree[0], k) if tree else forward_rows(k, None)
            rows += [0] * (len(per_forward) - len(rows))
            for j, n in enumerate(per_forward):
                rows[j] += n
            catch_up[proposer] = catch_up.get(proposer, 0) + by_id[rid].lags.get(proposer, 0)
    num_drafts = sum(tree[0] if tree else k for _, k, *tree in ks.values())
    return costs.step_time(len(view.candidates) + view.num_prefill_seqs,
                           len(view.candidates) + view.num_prefill_tokens + num_drafts, forwards, catch_up)


def forward_rows(k: int, depth: int | None) -> list[int]:
    """The rows a model proposer's sequential forwards run for one request's k drafts: a chain's k
    forwards of one row; a tree of k nodes at most `depth` deep, its first forward the root, the next
    ones its levels (their nodes taken as spread evenly)."""
    if depth is None or k <= depth:
        return [1] * k
    levels = [(k - 1) // (depth - 1) + (j < (k - 1) % (depth - 1)) for j in range(depth - 1)] if depth > 1 else []
    return [1] + levels


def priced(costs: StepCosts, view: StepView, drafts: dict[str, Draft]) -> StepPlan:
    """The plan with its passes' predicted seconds (the step's time less its host overhead), which
    the metrics set against the measured draft + verify time."""
    if not costs.target.rows:
        return StepPlan(drafts)
    planned = {rid: (d.proposer, d.k, d.slots) for rid, d in drafts.items()}
    return StepPlan(drafts, plan_time(costs, view, planned) - costs.overhead)


def with_trees(costs: StepCosts, view: StepView, drafts: dict[str, Draft], shadow: float | None = None,
               calibration: dict[str, float] | None = None) -> dict[str, Draft]:
    """Each draft whose proposer offers its request a tree gets the tree's slots: its chain of k and
    alternatives, which the proposer keeps only where their chance clears tree_p_min. With a shadow
    price (the plan's goodput), that bar is an alternative row's price in tokens: the seconds all the
    offered alternatives would add to the step, per alternative, at that goodput (rows past the
    chain's cost more than the chain's first: the cost tables' slope steepens), divided by the
    proposer's calibration (accepted alternatives per unit of chance promised); without, p_min."""
    offers = {c.request_id: c.trees for c in view.candidates}
    widened = {rid: dataclasses.replace(d, nodes=offers[rid][d.proposer]) for rid, d in drafts.items()
               if offers[rid].get(d.proposer, 0) > d.k}
    if not widened:
        return drafts
    bar = None
    if shadow is not None and costs.target.rows:
        chains = {rid: (d.proposer, d.k) for rid, d in drafts.items()}
        trees = {**chains, **{rid: (d.proposer, d.k, d.slots) for rid, d in widened.items()}}
        extra = sum(d.slots - d.k for d in widened.values())
        bar = min(1.0, shadow * (plan_time(costs, view, trees) - plan_time(costs, view, chains)) / extra)
    calibration = calibration or {}
    return {**drafts, **{rid: dataclasses.replace(d, tree_p_min=d.p_min if bar is None else
                                                  max(d.p_min, bar / calibration.get(d.proposer, 1.0)))
                         for rid, d in widened.items()}}


class StaticPolicy:
    """gamma drafts (or as many as the proposer offers) every step, from the first usable proposer
    (in a draft tree with every alternative the proposer offers, when it offers one)."""

    def __init__(self, proposers: list[str], gamma: int, costs: StepCosts, p_min: float | None = None):
        self.proposers, self.gamma, self.costs, self.p_min = list(proposers), gamma, costs, p_min or 0.0

    def plan(self, view: StepView) -> StepPlan:
        drafts = {}
        for c in view.candidates:
            proposer = next((m for m in self.proposers if c.caps.get(m, 0) > 0), None)
            if proposer is not None:
                drafts[c.request_id] = Draft(proposer, min(self.gamma, c.caps[proposer]), self.p_min)
        return priced(self.costs, view, with_trees(self.costs, view, drafts))

    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass


def expected_tokens(first: float, rest: float, k: int) -> float:
    """Expected accepted drafts of k whose first is accepted at `first` and each later one (given the
    ones before) at `rest`: first (1 + rest + ... + rest^(k-1))."""
    if k <= 0:
        return 0.0
    return first * ((1.0 - rest ** k) / (1.0 - rest) if rest < 1.0 else float(k))


def paying_depth(first: float, rest: float, bar: float, cap: int) -> int:
    """The most drafts (up to cap) whose last one is still reached and accepted with a chance above bar."""
    if first <= bar:
        return 0
    if bar <= 0 or rest >= 1.0:
        return cap
    if rest <= 0.0:
        return 1
    return min(cap, 1 + int(math.log(bar / first) / math.log(rest)))


@dataclass
class _Choice:
    """A request's best draft at one shadow price: proposer, k, rates (first, rest), seconds per draft token."""
    proposer: str
    k: int
    rates: tuple[float, float]
    row: float


class GoodputPolicy:
    hurdle = HURDLE          # (class attributes: bench/policy_ablation.py varies them in subclasses)
    explore = EXPLORE
    pricing_rounds = 2       # the second prices drafts at the goodput the first found

    def __init__(self, proposers: list[str], costs: StepCosts, p_min: float | None = None):
        self.proposers, self.costs, self.fixed_p_min = list(proposers), costs, p_min
        self.pool = {m: DraftRates(POOL_FORGET) for m in self.proposers}   # the engine-wide rates per proposer
        self.rates: dict[str, dict[str, DraftRates]] = {}   # request id -> proposer -> its own rates
        self.credit = 0.0   # the exploration budget, seconds
        self.refund = 0.0   # seconds an accepted probe token is worth (a plain token at the probe's batch)
        self.calibration = {m: Calibration() for m in self.proposers}   # per proposer, its tree alternatives'

    # ---- estimates ---------------------------------------------------------------
    def _own(self, rid: str, proposer: str) -> DraftRates:
        rates = self.rates.setdefault(rid, {})
        if proposer not in rates:
            rates[proposer] = DraftRates()
        return rates[proposer]

    def acceptance(self, rid: str, proposer: str) -> tuple[float, float]:
        """(first, rest): the request's rates, shrunk toward the engine-wide ones."""
        return self._own(rid, proposer).mean(self.pool[proposer].mean(), PRIOR_WEIGHT)

    def optimistic(self, rid: str, proposer: str) -> tuple[float, float]:
        """The first rate at its optimistic bound, the later ones at their mean: the first token gates
        whether a request drafts at all, and a probe tests it (an untested continuation's wide bound
        would make every probe a deep, dear one)."""
        rates, prior = self._own(rid, proposer), self.pool[proposer].mean()
        return rates.first.upper(prior[0], PRIOR_WEIGHT), rates.rest.mean(prior[1], PRIOR_WEIGHT)

    # ---- the plan ----------------------------------------------------------------
    def plan(self, view: StepView) -> StepPlan:
        candidates = view.candidates
        if not candidates:
            return StepPlan()
        seqs, base = len(candidates) + view.num_prefill_seqs, len(candidates) + view.num_prefill_tokens
        plain_time = plan_time(self.costs, view, {})
        decode_time = self._decode_time(view, plain_time)
        sunk = plain_time - decode_time
        plain_rate = len(candidates) / decode_time
        token = (self.costs.target(seqs, base + seqs) - self.costs.target(seqs, base)) / seqs
        rows = self._row_prices(token, len(candidates))
        shadow, ks, best_rate = plain_rate, {}, plain_rate
        for _ in range(self.pricing_rounds):
            choices = {c.request_id: self._choose(c, shadow, rows) for c in candidates}
            choices = {rid: choice for rid, choice in choices.items() if choice is not None}
            depth_ks, depth_rate = self._best_depth(view, choices, sunk)
            if depth_rate > best_rate:
                ks, best_rate = depth_ks, depth_rate
            shadow = max(shadow, depth_rate)
        if best_rate < (1.0 + self.hurdle) * plain_rate:
            ks = {}
        drafts = {rid: Draft(proposer, k, self._p_min(shadow, rows[proposer])) for rid, (proposer, k) in ks.items()}
        drafts.update(self._probes(view, drafts, shadow, decode_time, rows))
        calibration = {m: c.ratio() for m, c in self.calibration.items()}
        return priced(self.costs, view, with_trees(self.costs, view, drafts, shadow, calibration))

    def _decode_time(self, view: StepView, plain_time: float) -> float:
        """The decodes' share of a plain pass. The prompts sharing the pass cost their time whatever the
        plan, so only this share buys tokens: counted in, a long prompt chunk makes any draft look
        like a bargain (a few more rows against a pass the prompt makes long)."""
        return plan_time(self.costs, StepView(view.candidates), {})

    def _row_prices(self, token: float, batch: int) -> dict[str, float]:
        """Seconds of one draft token per proposer: a target row, and for a model proposer its share
        of a forward over the batch."""
        return {m: token + (self.costs.draft(m)(batch) / batch if m in MODEL_PROPOSERS else 0.0) for m in self.proposers}

    def _choose(self, c: Candidate, shadow: float, rows: dict[str, float], optimistic: bool = False
                ) -> _Choice | None:
        """The proposer and k that net this request the most expected tokens less their seconds
        at the shadow price (at the optimistic bound of acceptance, if asked); None when no draft pays."""
        best, best_value = None, 0.0
        for proposer in self.proposers:
            cap = c.caps.get(proposer, 0)
            if cap <= 0:
                continue
            rates = (self.optimistic if optimistic else self.acceptance)(c.request_id, proposer)
            row = rows[proposer]
            k = paying_depth(*rates, shadow * row, cap)   # shadow * row: the chance a draft token needs to pay
            tokens = expected_tokens(*rates, k)
            value = tokens - shadow * (k * row + self._catch_up_share(c, proposer, tokens))
            if k > 0 and value > best_value:
                best, best_value = _Choice(proposer, k, rates, row), value
        return best

    def _catch_up(self, c: Candidate, proposer: str) -> float:
        """Seconds a model proposer spends first catching up on the request (its prompt, at first)."""
        return self.costs.draft(proposer).catch_up(c.lags.get(proposer, 0)) if proposer in MODEL_PROPOSERS else 0.0

    def _catch_up_share(self, c: Candidate, proposer: str, tokens: float) -> float:
        """The catch-up's share charged to a step that expects `tokens` drafts accepted: catching up
        buys drafting for the rest of the request, so its price is spread over the tokens the request
        may still generate. Charged whole to one step, a draft model's first catch-up (the whole
        prompt) outweighs any one step's gain, and a draft the target accepts almost always would
        never be tried."""
        full = self._catch_up(c, proposer)
        return full * min(1.0, (1.0 + tokens) / max(c.remaining, 1))

    def _catch_up_rebate(self, c: Candidate, proposer: str, tokens: float) -> float:
        """What a step's price (plan_time, which counts a catch-up whole) overstates: all of the catch-up
        but the step's share of it."""
        return self._catch_up(c, proposer) - self._catch_up_share(c, proposer, tokens)

    def _best_depth(self, view: StepView, choices: dict[str, _Choice], sunk: float
                    ) -> tuple[dict[str, tuple[str, int]], float]:
        """The choices cut at the depth whose exact step time (less the prompts' sunk share) gives the best
        goodput."""
        best, best_rate = {}, 0.0
        for depth in range(1, max((c.k for c in choices.values()), default=0) + 1):
            ks, rate = self._at_depth(view, choices, sunk, depth)
            if rate > best_rate:
                best, best_rate = ks, rate
        return best, best_rate

    def _at_depth(self, view: StepView, choices: dict[str, _Choice], sunk: float, depth: int
                  ) -> tuple[dict[str, tuple[str, int]], float]:
        """The choices cut at `depth` drafts, and the goodput of that step by its exact time."""
        by_id = {c.request_id: c for c in view.candidates}
        ks = {rid: (c.proposer, min(c.k, depth)) for rid, c in choices.items()}
        drafted = {rid: expected_tokens(*c.rates, min(c.k, depth)) for rid, c in choices.items()}
        tokens = len(view.candidates) + sum(drafted.values())
        rebate = sum(self._catch_up_rebate(by_id[rid], c.proposer, drafted[rid]) for rid, c in choices.items())
        return ks, tokens / (plan_time(self.costs, view, ks) - rebate - sunk)

    def _p_min(self, shadow: float, row: float) -> float:
        """The break-even chance of one more draft token: its row priced at the step's goodput."""
        if self.fixed_p_min is not None:
            return self.fixed_p_min
        return min(1.0, shadow * row)

    def _probes(self, view: StepView, drafts: dict[str, Draft], shadow: float, plain_time: float,
                rows: dict[str, float]) -> dict[str, Draft]:
        """A probe step: every idle request whose optimistic rate says drafting could pay drafts what
        that rate would plan, once the exploration budget covers what they add to the step. The
        budget saves up to one such step (probes that share a draft model's forwards cost less
        together than one by one), and at least one plain step (plain_time: the decodes' share of a
        plain pass)."""
        idle = [c for c in view.candidates if c.request_id not in drafts and any(c.caps.values())]
        for c in idle:
            for proposer in (m for m in self.proposers if c.caps.get(m, 0) > 0):
                self._own(c.request_id, proposer).age()
        self.credit += self.explore * plain_time
        self.refund = plain_time / len(view.candidates)   # a plain token at this batch
        choices = {c.request_id: self._choose(c, shadow, rows, optimistic=True) for c in idle}
        choices = {rid: choice for rid, choice in choices.items() if choice is not None}
        planned = {rid: (d.proposer, d.k) for rid, d in drafts.items()}
        price = plan_time(self.costs, view, {**planned, **{rid: (c.proposer, c.k) for rid, c in choices.items()}}) - \
            plan_time(self.costs, view, planned) if choices else 0.0
        by_id = {c.request_id: c for c in idle}   # catch-ups are investments: the probe pays its share
        price -= sum(self._catch_up_rebate(by_id[rid], c.proposer, c.k) for rid, c in choices.items())
        self.credit = min(self.credit, max(price, plain_time))
        if not choices or self.credit < price:
            return {}
        self.credit -= price
        return {rid: Draft(c.proposer, c.k, self._p_min(shadow, c.row), probe=True) for rid, c in choices.items()}

    # ---- feedback ------------------------------------------------------------------
    def observe(self, plan: StepPlan, outcome: StepOutcome) -> None:
        for proposer, calibration in self.calibration.items():
            calibration.observe(sum(v.alternatives_chance for v in outcome.verified if v.proposer == proposer),
                                sum(v.alternatives_accepted for v in outcome.verified if v.proposer == proposer))
        for v in outcome.verified:
            if v.proposer not in self.pool or v.num_drafted == 0:
                continue
            self._own(v.request_id, v.proposer).observe(v.num_drafted, v.num_accepted)
            self.pool[v.proposer].observe(v.num_drafted, v.num_accepted)
            draft = plan.drafts.get(v.request_id)
            if draft is not None and draft.probe:   # what a probe wins pays for probing
                self.credit += v.num_accepted * self.refund

    def on_finish(self, request_id: str) -> None:
        self.rates.pop(request_id, None)
