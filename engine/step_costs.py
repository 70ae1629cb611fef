"""What engine steps cost: one table for target passes, one per draft model, and the host overhead.

The speculation policy prices a plan with these, and the metrics' speedup estimate prices the plain
steps a speculative step replaces. Each table is measured at start-up (engine.setup) through the
real forward paths and corrected online by one multiplicative factor: a moving geometric mean of
measured over tabled time. A machine's speed drifts (clocks, other tenants) more than its shape
changes, so one factor per table follows the drift and keeps the measured shape.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.1   # weight of the newest pass in a table's factor: a memory of ~10 passes
MAX_JUMP = 2.0    # one pass moves a factor as if it measured at most 2x (or 1/2x) the table: a stall is one pass


@dataclass(frozen=True)
class DraftForward:
    """One sequential forward of a model proposer: its rows (one per drafting request) and the
    tokens it fed beyond them (the first forward catches each request up on tokens it has not seen)."""
    proposer: str
    rows: int
    catch_up: int
    seconds: float


@dataclass(frozen=True)
class PassTiming:
    """The step as it ran: the target pass's shape and time, the model proposers' forwards, and the
    whole step's wall time (its host work besides the passes is step - target - forwards)."""
    num_seqs: int
    num_tokens: int
    target_seconds: float
    forwards: tuple[DraftForward, ...]
    step_seconds: float


class Correction:
    """A moving geometric mean of measured / predicted, each reading clamped to [1/MAX_JUMP, MAX_JUMP]."""

    def __init__(self):
        self.factor = 1.0

    def observe(self, predicted: float, measured: float) -> None:
        if predicted > 0 and measured > 0:
            ratio = min(max(measured / predicted, 1.0 / MAX_JUMP), MAX_JUMP)
            self.factor *= math.exp(SMOOTHING * (math.log(ratio) - math.log(self.factor)))


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points, extrapolated linearly (never downwards) past
    the last two, and flat below the first."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1] * (max(x, points[0][0]) / points[0][0] if len(points) == 1 else 1.0)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2:]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


class TargetTable:
    """Seconds of a target pass by (sequences, tokens per sequence): rows of points per measured
    batch size, interpolated in tokens per sequence within a row and linearly between rows."""

    def __init__(self):
        self.rows: dict[int, list[tuple[float, float]]] = {}   # sequences -> sorted (tokens per seq, seconds)
        self.correction = Correction()

    def add(self, num_seqs: int, tokens_per_seq: float, seconds: float) -> None:
        row = self.rows.setdefault(num_seqs, [])
        row.append((float(tokens_per_seq), seconds))
        row.sort()

    def tabled(self, num_seqs: int, num_tokens: int) -> float:
        """The table's time, without the online factor."""
        if not self.rows or num_seqs <= 0:
            return 0.0
        per_seq = num_tokens / num_seqs
        sizes = sorted(self.rows)
        if num_seqs >= sizes[-1]:   # past the largest measured batch: as many passes of it
            return _interpolate(self.rows[sizes[-1]], per_seq) * num_seqs / sizes[-1]
        upper = next(s for s in sizes if s >= num_seqs)
        lower = max((s for s in sizes if s <= num_seqs), default=upper)
        high = _interpolate(self.rows[upper], per_seq)
        if lower == upper:
            return high
        low = _interpolate(self.rows[lower], per_seq)
        return low + (high - low) * (num_seqs - lower) / (upper - lower)

    def __call__(self, num_seqs: int, num_tokens: int) -> float:
        return self.correction.factor * self.tabled(num_seqs, num_tokens)


class DraftTable:
    """Seconds of one forward of a model proposer by its rows, plus a price per catch-up token (fed
    without logits: cheaper than a row)."""

    def __init__(self):
        self.points: list[tuple[float, float]] = []   # sorted (rows, seconds)
        self.catch_up_price = 0.0
        self.correction = Correction()

    def add(self, rows: int, seconds: float) -> None:
        self.points = sorted(self.points + [(float(rows), seconds)])

    def tabled(self, rows: int, catch_up: int = 0) -> float:
        if rows <= 0 or not self.points:
            return 0.0
        return _interpolate(self.points, rows) + self.catch_up_price * catch_up

    def __call__(self, rows: int, catch_up: int = 0) -> float:
        return self.correction.factor * self.tabled(rows, catch_up)

    def catch_up(self, tokens: int) -> float:
        """Seconds a forward spends catching up on this many tokens."""
        return self.correction.factor * self.catch_up_price * tokens


class StepCosts:
    """The tables and the step's host overhead, and what a plan's step costs by them."""

    def __init__(self):
        self.target = TargetTable()
        self.drafts: dict[str, DraftTable] = {}   # model proposer ("draft", "eagle") -> its table
        self.overhead = 0.0   # seconds of host work a step spends besides its passes (moving average)
        self._overhead_seen = False

    def draft(self, proposer: str) -> DraftTable:
        if proposer not in self.drafts:
            self.drafts[proposer] = DraftTable()
        return self.drafts[proposer]

    def plain_step(self, batch_size: int) -> float | None:
        """A plain decode pass of this batch (the step a speculative step replaces, for the metrics);
        None without a table (an engine without speculation measures none at start-up)."""
        return self.target(batch_size, batch_size) if self.target.rows else None

    def step_time(self, num_seqs: int, num_tokens: int, forwards: dict[str, list[int]],
                  catch_up: dict[str, int]) -> float:
        """A step that feeds the target num_tokens over num_seqs sequences, after each model
        proposer's sequential forwards (rows of each; the first also feeds catch_up[proposer] tokens),
        with the step's host overhead."""
        seconds = self.target(num_seqs, num_tokens) + self.overhead
        for proposer, rows in forwards.items():
            table = self.draft(proposer)
            seconds += sum(table(r) for r in rows) + table.catch_up(catch_up.get(proposer, 0))
        return seconds

    def observe(self, timing: PassTiming) -> None:
        """Correct the tables by one step as it ran."""
        self.target.correction.observe(self.target.tabled(timing.num_seqs, timing.num_tokens), timing.target_seconds)
        for forward in timing.forwards:
            self.draft(forward.proposer).correction.observe(
                self.draft(forward.proposer).tabled(forward.rows, forward.catch_up), forward.seconds)
        host = timing.step_seconds - timing.target_seconds - sum(f.seconds for f in timing.forwards)
        host = max(host, 0.0)
        self.overhead = host if not self._overhead_seen else self.overhead + SMOOTHING * (host - self.overhead)
        self._overhead_seen = True
