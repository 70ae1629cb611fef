"""Acceptance estimates behind the controller's plan: per-request counts that forget, a shift
detector that restarts them, and how much the engine-wide rate is worth to a request.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import math
import random
from typing import Hashable, Iterable

PRIOR_WEIGHT = 4.0        # pseudo-observations of the engine-wide rate behind a request's estimate, until
                          # finished requests say how alike requests are (PriorStrength)
MAX_PRIOR_WEIGHT = 32.0   # ... and at most this many, however alike they were
UNLIKE_LLR = math.log(100)   # a request whose own tokens contradict the population's rate this much gets PRIOR_WEIGHT
MIN_FINISHED = 8          # finished requests with drafts before PriorStrength overrides PRIOR_WEIGHT
REQUEST_DECAY = 0.93      # per judged draft token: a short memory, ~14 tokens (the ablation's "short memory")
STEADY_DECAY = 0.99       # a request's memory, ~100 tokens (half-life ~70), restarted on a shift
SHIFT_RATIO = 0.5         # the shift detector looks for the rejection rate (up) or the acceptance rate (down) halved
SHIFT_LLR = math.log(300) # log-likelihood ratio that makes a shift (a fall from 0.9 to 0.1: ~4 rejections)
GLOBAL_FALL_LLR = math.log(1e4)   # ... a fall in the engine-wide rate (ShiftDetector: why it asks for more)
MIN_JUDGED_FOR_SHIFTS = 4.0   # judged tokens before the memory's rate is worth testing against
GLOBAL_DECAY = 0.995      # per judged draft token (of any request): the engine-wide rate, half-life ~140


class ShiftDetector:
    """Two-sided Bernoulli CUSUM over a request's judged draft tokens, against its current estimate
    p0: one score for a rise (the rejection rate 1 - p0 halved), one for a fall (p0 halved), each summing
    the log-likelihood ratio of every judged token and floored at zero. A score past SHIFT_LLR says
    the rate changed where that score last left zero; observe then returns the (judged, accepted)
    tokens since then, the evidence of the new rate.

    It replaced a test between a short (~14-token) and the steady memory: the short memory still
    held the old tokens, so after acceptance came back from 0.1 to 0.9 twelve accepted probes in a
    row (0.34^12 ~ 2e-6 under the old rate) did not count as a shift, and the plan took 21 steps to
    draft 3 deep again. Here about eight accepted probes restart the estimate, and about four
    rejections after a fall. At a steady rate both scores drift down: false alarms come about once
    in 1,500 judged tokens, and cost a few steps of a wrong draft length (a tighter threshold,
    log(100), fired three times as often, and each restart from a short, extreme segment set off
    the next).

    The engine-wide rate asks more of a fall, `fall_llr` = GLOBAL_FALL_LLR: it judges the whole
    batch's tokens, so at one false alarm per ~1,100 tokens (log(300), simulated) it fired about
    once a cell at batch 4, alpha 0.9 (~10 judged tokens a step), and a false fall restarted every
    new request's prior from an unlucky window (17 tokens, 9 accepted: a prior of 0.53 where the
    traffic accepted 0.9, and a wave drafted 1 deep instead of 2). log(1e4) alarms ~50 times less
    often and follows a real fall from 0.9 to 0.1 ~3 judged tokens later, which a plan drafting
    on the old rate judges within a step. A rise keeps SHIFT_LLR: after a fall only probes judge
    tokens, and with the rise test at log(1e4) too, an engine carried from alpha 0.3 into 0.7 kept
    a prior of 0.24 through the whole 0.7 cell (0.78-0.85 of the static gamma 2). A false rise
    costs less: the plan drafts deeper and judges enough tokens to correct it within a few steps."""

    def __init__(self, fall_llr: float = SHIFT_LLR):
        self.thresholds = {"up": SHIFT_LLR, "down": fall_llr}
        self.reset()

    def reset(self) -> None:
        self.scores = {"up": 0.0, "down": 0.0}
        self.segments = {"up": [0, 0], "down": [0, 0]}   # (judged, accepted) since the score left zero

    def observe(self, p0: float, num_accepted: int, judged: int) -> tuple[int, int] | None:
        p0 = min(max(p0, 0.02), 0.98)
        targets = {"up": 1.0 - SHIFT_RATIO * (1.0 - p0), "down": SHIFT_RATIO * p0}
        outcomes = [1] * num_accepted + [0] * (judged - num_accepted)
        for side, p1 in targets.items():
            accept, reject = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
            for x in outcomes:
                self.scores[side] = max(0.0, self.scores[side] + (accept if x else reject))
                segment = self.segments[side]
                segment[:] = [segment[0] + 1, segment[1] + x] if self.scores[side] > 0 else [0, 0]
        for side, score in self.scores.items():
            if score > self.thresholds[side]:
                judged_since, accepted_since = self.segments[side]
                self.reset()
                return judged_since, accepted_since
        return None


def judged_tokens(num_drafted: int, num_accepted: int) -> int:
    """Drafts past the first rejection were not judged."""
    return min(num_drafted, num_accepted + 1)


class DecayedCounts:
    """Judged and accepted draft tokens, forgetting old ones geometrically per judged token.

    With `watch`, a ShiftDetector restarts the counts from the tokens since a detected change.
    Near the break-even the plan turns on a few hundredths of acceptance, so the memory must be
    long (a memory of ~14 tokens errs by +-0.06 at 0.9: the plan drafted 4-5 where 8 paid); the
    detector lets a long memory still follow a shift within a few steps."""

    def __init__(self, decay: float, watch: bool = False, fall_llr: float = SHIFT_LLR):
        self.decay = decay
        self.judged = 0.0
        self.accepted = 0.0
        self.shifts = ShiftDetector(fall_llr) if watch else None

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        judged = judged_tokens(num_drafted, num_accepted)
        if self.shifts is not None and self.judged >= MIN_JUDGED_FOR_SHIFTS:
            since = self.shifts.observe(self.accepted / self.judged, num_accepted, judged)
            if since is not None:
                self.judged, self.accepted = map(float, since)
                return
        forget = self.decay ** judged
        self.judged = forget * self.judged + judged
        self.accepted = forget * self.accepted + num_accepted

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.judged + weight)

    def posterior(self, prior: float, weight: float) -> tuple[float, float]:
        """The Beta posterior of the rate: (accepted, rejected) pseudo-counts, the prior's included."""
        mean, n = self.rate(prior, weight), self.judged + weight
        return max(mean * n, 1e-3), max((1.0 - mean) * n, 1e-3)

    def draw(self, prior: float, weight: float, rng: random.Random) -> float:
        """One draw from the Beta posterior of the rate, optimistic: never below its mean."""
        return max(self.rate(prior, weight), rng.betavariate(*self.posterior(prior, weight)))

    def chance_above(self, rate: float, prior: float, weight: float) -> float:
        """The Beta posterior's probability that the rate is at least `rate`."""
        return 1.0 - beta_cdf(rate, *self.posterior(prior, weight))


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b): the Beta(a, b) distribution's CDF, by its
    continued fraction (evaluated where it converges fast: below the mean, else by symmetry)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - beta_cdf(1.0 - x, b, a)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)) / a
    return front * _beta_fraction(x, a, b)


def _beta_fraction(x: float, a: float, b: float) -> float:
    """1 / (1 + d1 / (1 + d2 / (1 + ...))) for I_x(a, b), by the modified Lentz method; d(2m+1) =
    -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)), d(2m) = m (b - m) x / ((a + 2m - 1)(a + 2m))."""
    def nonzero(v: float) -> float:
        return v if abs(v) > 1e-30 else 1e-30
    c, d = 1.0, 1.0 / nonzero(1.0 - (a + b) * x / (a + 1.0))
    result = d
    for m in range(1, 200):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / nonzero(1.0 + numerator * d)
            c = nonzero(1.0 + numerator / c)
            result *= c * d
        if abs(c * d - 1.0) < 1e-10:
            break
    return result


def unlike(counts: "DecayedCounts", rate: float) -> bool:
    """Whether a request's own judged tokens contradict the population's rate: the log-likelihood
    ratio of its own rate against `rate` passes UNLIKE_LLR. A strong prior is right for a request
    like the rest and wrong for an outlier (an agentic request at 0.1 among chats at 0.7 would
    draft on for ~40 judged tokens under 32 pseudo-tokens of 0.7); an outlier at 0.1 among 0.7s
    shows in about 8 judged tokens, and an unlucky 2 of 8 among 0.5s does not."""
    n, x = counts.judged, counts.accepted
    if n <= 0:
        return False
    own, rate = min(max(x / n, 1e-6), 1 - 1e-6), min(max(rate, 1e-6), 1 - 1e-6)
    return x * math.log(own / rate) + (n - x) * math.log((1 - own) / (1 - rate)) > UNLIKE_LLR


class PriorStrength:
    """How many judged tokens the engine-wide rate of a proposer is worth to a new request: empirical
    Bayes from finished requests' own (judged, accepted) totals, by the method of moments for a
    beta-binomial. If every request accepts at about the same rate, the spread of their observed
    rates is only the binomial noise of their few judged tokens, and the engine-wide rate deserves
    many pseudo-tokens (up to MAX_PRIOR_WEIGHT): a request that met 3 rejections in its first 5
    drafts is then still planned near the population's rate instead of turning drafting off. If
    requests differ (code against chat under n-gram drafting), the spread is wider than the noise
    and the prior weighs little. With a mean rate mu, an observed rate varies by
    mu (1 - mu) (1/n + rho (1 - 1/n)), rho = 1 / (m + 1), m the prior's weight in tokens.

    The spread is measured between requests that finished one after the other (half the squared
    difference of their rates, the mean of successive differences), each pair's noise at the pair's
    mean rate: the prior's mean is the engine-wide rate of the last ~140 judged tokens, a mean local
    in time, and so must its spread be. Measured around the mean of every request remembered, a
    change in the traffic read as requests that differ: an engine carried through acceptance 0, 0.3,
    0.5 and 0.7 into 0.9 held requests that all accepted at 0.9 to 2-4 pseudo-tokens, and early
    lucky tokens drew plans 6-8 deep (57-71 ms steps where 2 deep took 31). Pairs are forgotten
    geometrically. Live requests' totals so far pair on after the finished ones: until MIN_FINISHED
    requests had finished, a young engine held every request to PRIOR_WEIGHT, and at alpha 0.9,
    batch 4, a wave whose own first tokens read 0.63-0.84 drafted 2 deep for 20 steps where the
    next wave, pooled, drafted 6-7."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.count = 0
        self.last: tuple[float, int] | None = None   # the last finished request's (rate, judged)
        self.sums = [0.0, 0.0, 0.0]   # decayed sums over successive pairs (_pair_terms)

    def observe(self, judged: int, accepted: int) -> None:
        """A finished request's totals."""
        if judged < 2:
            return   # one judged token is no rate
        self.count += 1
        self.sums, self.last = self._paired(self.sums, self.last, judged, accepted, self.decay)

    @staticmethod
    def _paired(sums: list[float], last: tuple[float, int] | None, judged: int, accepted: int,
                decay: float = 1.0) -> tuple[list[float], tuple[float, int]]:
        """The sums (earlier pairs forgotten by decay) and the last request after one more
        request's totals joined the sequence."""
        current = (accepted / judged, judged)
        if last is not None:
            sums = [decay * s + x for s, x in zip(sums, _pair_terms(last, current))]
        return sums, current

    def weight(self, live: Iterable[tuple[int, int]] = ()) -> float:
        """Pseudo-tokens of the engine-wide rate, from the finished requests and the live ones'
        (judged, accepted) totals so far."""
        count, sums, last = self.count, self.sums, self.last   # _paired builds new sums: no copy needed
        for judged, accepted in live:
            if judged >= 2:
                count += 1
                sums, last = self._paired(sums, last, judged, accepted)
        spread, noise, signal = sums
        if count < MIN_FINISHED or signal < 1e-9:
            return PRIOR_WEIGHT
        rho = (spread - noise) / signal
        if rho <= 1.0 / (MAX_PRIOR_WEIGHT + 1.0):
            return MAX_PRIOR_WEIGHT
        return min(max(1.0 / rho - 1.0, 1.0), MAX_PRIOR_WEIGHT)


def _pair_terms(first: tuple[float, int], second: tuple[float, int]) -> tuple[float, float, float]:
    """Two successive requests' (rate, judged): half their rates' squared difference, whose
    expectation is b (u + rho (1 - u)) with b the binomial variance at their mean rate and u the
    mean of 1/judged; and the terms b u (the noise) and b (1 - u) (what rho scales)."""
    (rate1, judged1), (rate2, judged2) = first, second
    mean = (rate1 + rate2) / 2.0
    binomial = mean * (1.0 - mean)
    inverse = (1.0 / judged1 + 1.0 / judged2) / 2.0
    return (rate1 - rate2) ** 2 / 2.0, binomial * inverse, binomial * (1.0 - inverse)


KEY_PRIOR = 2.0        # pseudo-tokens of the proposer's engine-wide rate behind an evidence key's own rate
RATIO_PRIOR = 2.0      # pseudo-tokens of "as calibrated" behind a request's own ratio
RATIO_DECAY = 0.97     # per judged token: a request's ratio remembers ~30 positions
MAX_POSITION_RATE = 0.98   # no draft token is a sure thing


class PositionCalibration:
    """How often a copying proposer's draft token is accepted, given what the proposer knew about
    it: its evidence key (suffix drafting: how far the match runs, how many earlier continuations
    agree, whether they come from this request or from others). One acceptance rate for a whole
    request averages long copies (almost always right) with two-token guesses (mostly wrong), so a
    request that met a few bad guesses stopped drafting its long copies too. Learned engine-wide
    from every judged position, each key shrunk towards the proposer's overall rate."""

    def __init__(self):
        self.counts: dict[tuple[str, Hashable], DecayedCounts] = {}

    def rate(self, method: str, key: Hashable, prior: float) -> float:
        counts = self.counts.get((method, key))
        return counts.rate(prior, KEY_PRIOR) if counts is not None else prior

    def observe(self, method: str, keys: list[Hashable], num_accepted: int) -> None:
        """keys of the judged positions, in order; the first num_accepted were accepted."""
        for j, key in enumerate(keys):
            self.counts.setdefault((method, key), DecayedCounts(GLOBAL_DECAY)).observe(1, int(j < num_accepted))


class CalibrationRatio:
    """A request's accepted draft tokens over what the calibration expected of them (both forgetting
    per judged token): a request whose context copies worse than the traffic's (an agent's tool
    output that never repeats) scales every position's rate down, one that copies better up."""

    def __init__(self):
        self.expected = 0.0
        self.accepted = 0.0

    def observe(self, expected: list[float], num_accepted: int) -> None:
        """expected: the calibrated rate of each judged position, in order."""
        forget = RATIO_DECAY ** len(expected)
        self.expected = forget * self.expected + sum(expected)
        self.accepted = forget * self.accepted + num_accepted

    def ratio(self) -> float:
        return (self.accepted + RATIO_PRIOR) / (self.expected + RATIO_PRIOR)
