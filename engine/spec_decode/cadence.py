"""How often the engine plans speculation: a plan costs host time too, and must pay for itself.

A plan looks up every decoding request's drafts (suffix and n-gram indexes), calibrates their
evidence and prices every proposer: ~1 ms of host time a step at 10-16 requests on the 2-core
dev machine, 2-4% of the step. Where drafting wins little (large batches on CPU, low acceptance)
that is all a plan achieves: on Spec-Bench at 16 streams, plans that were made and then thrown
away (plain decoding) cost 3.6% of plain decoding's throughput.

So each plan is judged by what it delivered: the plain-decoding time of the draft tokens its step
accepted, less the extra time its drafts and probes took (a step of decodes alone: measured against
plain decoding's cost curve; one with prompt work: as predicted), less the host time of the plan
itself. While the average over recent plans is below zero by more than luck explains, the engine
plans only every `stride` steps (doubling up to MAX_STRIDE) and decodes plainly in between, with
no host work for speculation; once the average is back above that bar, it plans every step.

The margin is for luck: at batch 1, acceptance 0.5, one draft token wins a plain step (~11 ms
on the dev CPU) or loses ~4 ms, worth +1.9 ms a plan on average, and a run of rejections took a
ten-plan average below zero often enough that the engine planned only a quarter of its steps for
stretches of 30-40 steps (40% of decode rows drafted, 0.94x the static gamma 1). So each plan
reports the variance that chance alone gives its accepted tokens, from the acceptance the plan
priced each of its drafts at (probes aside: they are exploration, paid from their own budget),
and the margin is the standard error that makes in the running average. The spread of the
measured values is no such margin: at 16 streams it is mostly the cost of catch-ups and pass
shapes, which the cadence must see, and with it (or half of it) as the margin Spec-Bench at 16
streams measured 0.950-0.976 of plain decoding, against 0.969-0.997 without a margin. Judging
plans by their expected wins instead of their real ones took the luck out too, but also judged
them by the estimate that was wrong: a batch-1 engine carried from alpha 0.3 into 0.5 planned
one step in four and drafted in 9% of rows (0.84 of g=1).

The controller's exploration credit accrues for every step a plan covers, so probes look for
acceptance coming back as often per step as before.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import math

MAX_STRIDE = 4        # at most this many steps per plan: recovery waits at most MAX_STRIDE - 1 steps
VALUE_WEIGHT = 0.1    # weight of the newest plan in the running average (a memory of ~10 plans)
NOISE_MARGIN = 1.0    # standard errors of that average below zero before plans are made less often


class PlanCadence:
    """Whether this step plans; the running value of recent plans decides how often."""

    def __init__(self, max_stride: int = MAX_STRIDE):
        self.max_stride = max_stride
        self.stride = 1
        self.value = 0.0          # running average of what a plan delivered, in seconds
        self.luck = 0.0           # running average of the variance chance gives a plan's wins (seconds^2)
        self._since_plan = 0      # steps since the last plan
        self.last_steps = 1       # steps the last plan stands for (itself and those skipped before it)

    def due(self) -> bool:
        """Called once per step with decoding requests: whether this one plans."""
        self._since_plan += 1
        if self._since_plan < self.stride:
            return False
        self.last_steps, self._since_plan = self._since_plan, 0
        return True

    def observe(self, won_seconds: float, extra_seconds: float, host_seconds: float, luck: float = 0.0) -> None:
        """A plan's outcome: the plain-decoding time of the tokens its drafts won, the extra step
        time its drafts and probes took, and the host time of planning; luck: the variance of the
        first by chance alone (see luck_variance), in seconds squared."""
        value = won_seconds - extra_seconds - host_seconds
        self.value += VALUE_WEIGHT * (value - self.value)
        self.luck += VALUE_WEIGHT * (luck - self.luck)
        paying = self.value >= -NOISE_MARGIN * self.standard_error()
        self.stride = 1 if paying else min(self.max_stride, 2 * self.stride)

    def standard_error(self) -> float:
        """Of the running average, by luck alone: an exponential average with weight w over values
        of variance v varies by v * w / (2 - w)."""
        return math.sqrt(self.luck * VALUE_WEIGHT / (2.0 - VALUE_WEIGHT))


def luck_variance(chances: list[float]) -> float:
    """The variance of one request's accepted draft count, its drafts accepted up to the first
    rejection with cumulative chances g_1 >= g_2 >= ... (g_j: draft j and all before it accepted):
    E[A] = sum g_j and E[A^2] = sum (2j - 1) g_j."""
    mean = sum(chances)
    square = sum((2 * j + 1) * g for j, g in enumerate(chances))
    return max(square - mean * mean, 0.0)
