"""Acceptance estimates: a Beta posterior over the chance that a draft token is accepted (given the
ones before it were), with exponential forgetting and one change detector; and a proposer's pair of
them, its first draft token and the later ones (DraftRates).

A verified draft of k tokens of which n were accepted judged n + 1 tokens when it was cut by a
rejection (n accepted, one rejected), k when all were accepted. Evidence ages by FORGET per judged
token, so an estimate remembers about 1 / FORGET of them; a request's estimate also ages per step
it sits idle (its evidence grows stale while nothing tests it, and its posterior widens back towards
the prior, which is what lets exploration find acceptance that came back). The change detector is
a two-sided Bernoulli CUSUM: when the tokens since some point are far likelier under a rate halved
towards 0 or 1 than under the current mean, the memory restarts from them.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import math

FORGET = 1.0 / 32     # a request's evidence ages by this share per judged token or idle step
POOL_FORGET = 1.0 / 128   # the engine-wide rate's memory: four requests' worth
PRIOR_WEIGHT = 4.0    # pseudo-tokens of the engine-wide rate behind a request's estimate
SHIFT_LLR = math.log(100)   # log-likelihood ratio that signals a change of rate (~4 rejections after 0.9 -> 0.1)
UPPER_Z = 2.0         # the optimistic bound is the posterior mean plus this many standard deviations


def judged_tokens(num_drafted: int, num_accepted: int) -> int:
    return num_accepted + (num_accepted < num_drafted)


class AcceptanceRate:
    """Decayed counts of accepted and rejected draft tokens, with a change detector."""

    def __init__(self, forget: float = FORGET):
        self.keep = 1.0 - forget
        self.accepted = self.rejected = 0.0
        self._scores = {"up": 0.0, "down": 0.0}                 # CUSUM scores for a rise and a fall
        self._since = {"up": [0, 0], "down": [0, 0]}            # (judged, accepted) since each score left zero

    @property
    def judged(self) -> float:
        return self.accepted + self.rejected

    def mean(self, prior: float = 0.5, weight: float = 0.0) -> float:
        """The posterior mean, shrunk toward `prior` by `weight` pseudo-tokens (and by one to 0.5)."""
        return (self.accepted + weight * prior + 0.5) / (self.judged + weight + 1.0)

    def upper(self, prior: float = 0.5, weight: float = 0.0) -> float:
        """An optimistic bound: the mean plus UPPER_Z posterior standard deviations."""
        mean, n = self.mean(prior, weight), self.judged + weight + 1.0
        return min(1.0, mean + UPPER_Z * math.sqrt(mean * (1.0 - mean) / (n + 1.0)))

    def observe(self, num_drafted: int, num_accepted: int, clock: int | None = None) -> None:
        """Add a draft's judged tokens; the evidence before ages by `clock` judged tokens (default:
        these), the clock a pair of rates shares (DraftRates)."""
        judged = judged_tokens(num_drafted, num_accepted)
        if judged == 0:
            return
        self._detect(judged, num_accepted)
        decay = self.keep ** (judged if clock is None else clock)
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + (judged - num_accepted)

    def age(self, tokens: int = 1) -> None:
        """Evidence grows stale as if `tokens` had been judged (one per idle step)."""
        self.accepted *= self.keep ** tokens
        self.rejected *= self.keep ** tokens

    def _detect(self, judged: int, accepted: int) -> None:
        """Feed the CUSUMs; on an alarm keep only the tokens since the score left zero."""
        p0 = self.mean()
        if self.judged < PRIOR_WEIGHT:
            return   # too little to test against
        alternatives = {"up": 1.0 - (1.0 - p0) / 2.0, "down": p0 / 2.0}
        for side, p1 in alternatives.items():
            llr = accepted * math.log(p1 / p0) + (judged - accepted) * math.log((1.0 - p1) / (1.0 - p0))
            if self._scores[side] <= 0.0:
                self._since[side] = [0, 0]
            self._scores[side] = max(0.0, self._scores[side] + llr)
            self._since[side][0] += judged
            self._since[side][1] += accepted
            if self._scores[side] > SHIFT_LLR:
                since_judged, since_accepted = self._since[side]
                self.accepted, self.rejected = float(since_accepted - accepted), float(since_judged - judged
                                                                                         - since_accepted + accepted)
                self._scores = {"up": 0.0, "down": 0.0}
                return


class DraftRates:
    """A proposer's acceptance as two rates: its first draft token, and each later one given the ones
    before it were accepted. Copying proposers differ most there (a copy's first token is a guess
    whether the copy applies; once it does, the later ones follow): one rate for all positions would
    under-price a copy in progress, and a one-token probe would judge it by its weakest token."""

    def __init__(self, forget: float = FORGET):
        self.first, self.rest = AcceptanceRate(forget), AcceptanceRate(forget)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Both rates age on one clock, the draft's judged tokens: together they remember what one rate
        would (about 1 / forget judged tokens), split by position."""
        clock = judged_tokens(num_drafted, num_accepted)
        if clock == 0:
            return
        self.first.observe(1, min(num_accepted, 1), clock)
        if num_accepted >= 1 and num_drafted >= 2:   # the later tokens were judged only past an accepted first
            self.rest.observe(num_drafted - 1, num_accepted - 1, clock)
        else:
            self.rest.age(clock)

    def age(self) -> None:
        self.first.age()
        self.rest.age()

    def mean(self, prior: tuple[float, float] | None = None, weight: float = 0.0) -> tuple[float, float]:
        """(first, rest), each shrunk toward its prior by `weight` pseudo-tokens. Without a prior (the
        engine-wide rates) a later token is taken to be as likely as the first until later tokens
        have been judged: the rest rate is only judged where a draft goes past its first token, and
        a prior far below the first rate (0.5 against a good draft model's first rate) would keep
        every draft at one token, which never judges the rest."""
        if prior is None:
            first = self.first.mean()
            return first, self.rest.mean(first, PRIOR_WEIGHT)
        return self.first.mean(prior[0], weight), self.rest.mean(prior[1], weight)



class Calibration:
    """How a proposer's chances for its tree alternatives compare with what the target accepts: the
    alternatives accepted per unit of chance promised, decayed sums aged by FORGET a step, shrunk
    toward 1 (taken at its word) by PRIOR_WEIGHT units. A draft's softmax or a share of matching
    continuations is not a probability of acceptance; the policy divides the break-even chance of an
    alternative's row by this ratio. Aged while no tree is verified, the ratio drifts back toward 1,
    so a proposer whose alternatives were priced out is tried again."""

    def __init__(self, forget: float = FORGET):
        self.keep = 1.0 - forget
        self.promised = self.accepted = 0.0

    def observe(self, promised: float, accepted: int) -> None:
        """One step's verified trees: their alternatives' chances summed, and how many were accepted."""
        self.promised = self.promised * self.keep + promised
        self.accepted = self.accepted * self.keep + accepted

    def ratio(self) -> float:
        return (self.accepted + PRIOR_WEIGHT) / (self.promised + PRIOR_WEIGHT)
