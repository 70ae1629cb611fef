"""How long engine steps take.

PlainStepTimer: a plain (non-speculative) decode step at a given batch size, for the speedup
estimate (the cost of the steps speculation replaces). StepCostModel: the target pass and the
forwards of model proposers (draft model, EAGLE head) by size, for the controller's plan. The
engine times both at start-up (engine.setup) and keeps refining them with moving averages from the
steps it runs.
"""
from __future__ import annotations

import math
from collections import Counter

DEPTH_EVIDENCE = 5   # drafting steps of one depth before that depth's own scale is used
STALE_STEPS = 8      # decode steps without a drafting step after which the drafting scales count as stale,
BIAS_RELAX = 0.03    # ... and move this share (in log space) back towards 1.0 per further such step
PACE_SMOOTHING = 0.1   # per plain decode pass: the machine's pace follows a change within ~10 steps


class PlainStepTimer:
    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}   # power-of-two batch bucket -> seconds per step

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))

    def observe(self, batch_size: int, seconds: float) -> None:
        b = self.bucket(batch_size)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, batch_size: int) -> float | None:
        """Seconds per plain step at this batch size, from the nearest measured bucket at or above it."""
        if not self.seconds:
            return None
        b = self.bucket(batch_size)
        above = [k for k in self.seconds if k >= b]
        return self.seconds[min(above)] if above else self.seconds[max(self.seconds)] * b / max(self.seconds)


def _toward_capped(old: float, reading: float, smoothing: float) -> float:
    """A moving average's step towards one timing, the timing capped at 1.5x the average: a stall
    moves it by at most smoothing / 2 of itself, and never sets it."""
    return old + smoothing * (min(reading, 1.5 * old) - old)


class CostCurve:
    """Seconds of one forward pass as a function of the rows (tokens) it processes: moving averages
    per power-of-two bucket of rows, each at the average rows it was measured at (a bucket filled by
    passes of 80 rows is a point at 80, not at 128: treating it as 128 made everything between the
    buckets look cheap), made non-decreasing (timings are noisy; more rows never cost less) from
    above, interpolated linearly in between and extrapolated past the largest point."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}   # bucket -> seconds
        self.rows: dict[int, float] = {}      # bucket -> the rows those seconds were measured at
        self._points: list[tuple[float, float]] | None = None   # the envelope, until the next timing

    def observe(self, rows: int, seconds: float) -> None:
        """Move the bucket's estimate towards one timing; one timing moves an estimate by at most
        half of it, so a stall never sets the curve. A bucket seen for the first time takes the
        timing or the curve's current value there, whichever is lower: a new shape's first pass is
        often slow (kernel creation, allocation), and far past the measured points the curve's
        extrapolation can be far too high (prefill chunks past calibrated decode batches)."""
        b = PlainStepTimer.bucket(rows)
        old = self.seconds.get(b)
        self._points = None
        if old is None:
            self.calibrate(rows, min(seconds, self(rows)) if self.seconds else seconds)
            return
        self.seconds[b] = _toward_capped(old, seconds, self.smoothing)
        self.rows[b] += self.smoothing * (rows - self.rows[b])

    def calibrate(self, rows: int, seconds: float) -> None:
        """Set a bucket from a start-up measurement (the fastest of several passes)."""
        b = PlainStepTimer.bucket(rows)
        self.seconds[b], self.rows[b] = seconds, float(rows)
        self._points = None

    def __call__(self, rows: int) -> float:
        if rows <= 0 or not self.seconds:
            return 0.0
        points = self._points or self._envelope()
        if rows <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / max(x1 - x0, 1e-9)
        if len(points) == 1:
            return points[0][1] * rows / points[0][0]
        (x0, y0), (x1, y1) = points[-2:]
        return y1 + max(0.0, (y1 - y0) / max(x1 - x0, 1e-9)) * (rows - x1)

    def _envelope(self) -> list[tuple[float, float]]:
        """Non-decreasing by the lowest reading at or above each point: timings only err upwards, so
        a slow outlier at a small bucket must not lift every bigger one. (A plan asks a curve
        dozens of times between two timings: built once per timing.)"""
        points, lowest = [], float("inf")
        for b in sorted(self.seconds, reverse=True):
            lowest = min(lowest, self.seconds[b])
            points.append((self.rows[b], lowest))
        points.reverse()
        self._points = points
        return points

    @property
    def ready(self) -> bool:
        return bool(self.seconds)


class StepCostModel:
    """Predicted time of one engine step: the target pass as a function of the tokens in it, plus
    each draft-model forward as a function of its rows (one row per drafting request), plus the
    tokens a draft model catches up on in its first forward. A pass that verifies drafts and a plain
    decode pass of as many tokens cost differently (multi-token queries take other matmul and
    attention kernels), and sixteen sequences with two tokens each cost more than two with sixteen
    (attention and its gathers are per sequence), so verification passes have one curve over tokens
    per power-of-two bucket of sequences (`targets`), and plain passes their own (`plain`, over
    sequences = tokens). Catch-up tokens cost less than rows (no logits: a shallow draft's cost is
    mostly its LM head), so they have their own per-token price. The engine calibrates all of these
    at start-up and refines them from every step and draft forward.

    A machine's speed drifts (other tenants, memory bandwidth, clocks: the bench target's plain
    decode pass moved between 15 and 24 ms within a minute on the dev machine), and a shape the
    engine seldom runs kept the speed of its last passes: an engine that had probed in a slow minute
    held its one-sequence verification pass at 22.5 ms against plain decoding's 16.3 (steady engines
    measured ~1.05x), so drafting looked dear, the engine seldom drafted, and the curve stayed stale.
    So every curve holds times at the start-up pace, and `pace` scales them all: plain decode passes
    (which run at every batch size the engine serves) against their start-up timing, a moving
    average. The reference is frozen, so the pace cannot wander with the curves' own learning."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.plain = CostCurve(smoothing)
        self.targets: dict[int, CostCurve] = {}   # sequence bucket -> verification time over tokens
        self.drafts: dict[str, CostCurve] = {}    # model proposer ("draft", "eagle") -> forward time over rows
        self.catch_up_price: dict[str, float] = {}   # model proposer -> seconds per token fed beyond its rows
        self.drafting_bias = 1.0   # measured / predicted time of drafting steps (see observe_drafting_step)
        self.depth_bias: dict[int, float] = {}   # the same, per depth (the step's longest draft)
        self.depth_steps: Counter = Counter()    # drafting steps seen at each depth
        self.idle_steps = 0   # decode steps since the last drafting step
        self.pace = 1.0   # the machine's speed now against start-up (see the class doc)
        self.step_overhead = 0.0   # seconds of host work a decode step spends around its passes
        self.reference: dict[int, float] = {}   # batch bucket -> plain decode pass timed at start-up

    @property
    def draft(self) -> CostCurve:
        """The draft model's forward curve."""
        return self.draft_curve("draft")

    def draft_curve(self, method: str) -> CostCurve:
        return self.drafts.setdefault(method, CostCurve(self.smoothing))

    # ---- measurements -------------------------------------------------------------
    def calibrate_plain(self, batch_size: int, seconds: float) -> None:
        """A plain decode pass timed at start-up: a point of the plain curve and the pace's reference."""
        self.plain.calibrate(batch_size, seconds)
        self.reference[PlainStepTimer.bucket(batch_size)] = seconds

    def calibrate_verify(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        self._curve(num_seqs, create=True).calibrate(num_tokens, seconds)

    def observe_pass(self, num_tokens: int, seconds: float, with_drafts: bool, num_seqs: int | None = None) -> None:
        reference = self.reference.get(PlainStepTimer.bucket(num_tokens))
        if not with_drafts and num_tokens == (num_seqs or num_tokens) and reference:   # a plain decode pass
            ratio = min(max(seconds / reference, 0.5 * self.pace), 2.0 * self.pace)
            self.pace *= (ratio / self.pace) ** PACE_SMOOTHING
        curve = self._curve(num_seqs or num_tokens, create=True) if with_drafts else self.plain
        curve.observe(num_tokens, seconds / self.pace)

    def observe_draft(self, rows: int, seconds: float, catch_up: int = 0, method: str = "draft") -> None:
        """One forward of a model proposer: `rows` requests, feeding `catch_up` tokens besides their
        last ones. A forward with little catch-up times the rows; one with much prices the catch-up.
        That price moves as a curve's bucket does, by at most a tenth of itself per forward: a
        new request's draft steps that stalled on its prompt's catch-up (127 ms for 32 tokens and 3
        drafts, against ~8 ms) left it at 0.66 ms a token (from 0.064), every catch-up then looked
        10x as dear, and a wave of 16 requests at alpha 0.9 never drafted again (0.85 of static
        gamma 2)."""
        curve, seconds = self.draft_curve(method), seconds / self.pace
        if catch_up < max(8, rows):
            curve.observe(rows, seconds)
            return
        if not curve.ready:
            return   # nothing yet to tell the rows' share from the catch-up's
        price, old = max(0.0, seconds - curve(rows)) / catch_up, self.catch_up_price.get(method)
        self.catch_up_price[method] = _toward_capped(old, price, self.smoothing) if old else price

    def observe_overhead(self, seconds: float) -> None:
        """The host work of one decode step besides its passes (planning, scheduling, bookkeeping):
        a moving average. A step pays it once however many tokens it yields, so it counts for
        drafting: ~0.2-0.7 ms on the dev CPU beside 40-300 ms passes, but ~0.4 ms beside a 2 ms
        pass replayed as a CUDA graph."""
        self.step_overhead += PACE_SMOOTHING * (max(seconds, 0.0) - self.step_overhead)

    def observe_drafting_step(self, predicted: float, measured: float, depth: int | None = None) -> None:
        """A whole drafting step (drafts and verification) of this depth (its longest draft), against
        what step_time predicted for it. The parts are timed one by one, but a step also spends time
        none of them sees (draft-probability buffers that grow with batch x k x vocabulary, sampling,
        bookkeeping): drafting steps ran 10-20% over their prediction at batch 16, and more the
        deeper they drafted, so a plan priced by one scale drafted 8 deep where 4 paid. Predictions
        are scaled by a moving geometric mean of measured / unscaled prediction (between 0.8 and
        1.5): one per depth once that depth has DEPTH_EVIDENCE steps, before that the overall one."""
        if predicted <= 0 or measured <= 0:
            return
        self.idle_steps = 0
        ratio = min(max(measured * self.bias(depth) / predicted, 0.5), 2.0)   # against the unscaled parts
        self.drafting_bias = self._toward(self.drafting_bias, ratio)
        if depth:
            self.depth_bias[depth] = self._toward(self.depth_bias.get(depth, self.drafting_bias), ratio)
            self.depth_steps[depth] += 1

    def observe_idle_step(self) -> None:
        """A decode step that drafted nothing (by plan). The drafting scales are learned only from
        drafting steps, so once an engine stops drafting they hold whatever its last ones measured,
        and those can be unlike the steady state (a wave's last steps, a few requests each
        catching up): at 16 streams, alpha 0.9, a scale of 1.105 learned so made every plan lose
        to plain decoding by the model (1.0: 6 drafts each, predicted 1.14x; static gamma 2
        measured 1.20x), and the engine decoded 60 steps plainly, the scale never corrected. So a
        scale without fresh evidence relaxes towards 1.0 (half-way in ~23 steps), and the plan
        gets to draft again and measure it."""
        self.idle_steps += 1
        if self.idle_steps <= STALE_STEPS:
            return
        keep = 1.0 - BIAS_RELAX
        self.drafting_bias **= keep
        self.depth_bias = {depth: bias ** keep for depth, bias in self.depth_bias.items()}

    def _toward(self, bias: float, ratio: float) -> float:
        return min(max(bias * (ratio / bias) ** (self.smoothing / 2), 0.8), 1.5)

    def bias(self, depth: int | None = None) -> float:
        """The scale of a drafting step's predicted time at this depth: its own (made non-decreasing
        in depth) once it has DEPTH_EVIDENCE steps, else the overall one held between those of the
        nearest depths that have."""
        if not depth:
            return self.drafting_bias
        scales = self._depth_scales()
        if depth in scales:
            return scales[depth]
        below = [scales[d] for d in scales if d < depth]
        above = [scales[d] for d in scales if d > depth]
        return min(max(self.drafting_bias, max(below, default=0.0)), min(above, default=math.inf))

    def _depth_scales(self) -> dict[int, float]:
        """The scales of the depths with evidence, made non-decreasing in depth (pool-adjacent-
        violators in log space, each depth weighted by the steps its moving average remembers).
        Each depth's scale is learned alone, so a few slow steps at one depth could make it dearer
        than the next: at batch 4, with depth 2's scale at 1.08 and depth 3's at 1.01, 2 drafts each
        were predicted at 38 ms and 3 at 43, the third draft looked nearly free, and at alpha 0.7 the
        plan drafted 3 deep where 1-2 paid. Work that none of the parts time grows with k; it never
        shrinks, so neither may the scale."""
        memory = 2.0 / self.smoothing   # steps a depth's scale remembers (_toward moves it by smoothing / 2)
        blocks: list[tuple[float, float, list[int]]] = []   # (mean log scale, weight, depths) per pooled run
        for depth in sorted(d for d in self.depth_bias if self.depth_steps[d] >= DEPTH_EVIDENCE):
            weight = min(float(self.depth_steps[depth]), memory)
            blocks.append((math.log(self.depth_bias[depth]), weight, [depth]))
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (high, w1, d1), (low, w2, d2) = blocks[-2:]
                blocks[-2:] = [((high * w1 + low * w2) / (w1 + w2), w1 + w2, d1 + d2)]
        return {depth: math.exp(scale) for scale, _, depths in blocks for depth in depths}

    # ---- predictions ----------------------------------------------------------------
    def step_time(self, num_tokens: int, draft_rows: dict[str, list[int]] | None = None,
                  verifying: bool | None = None, catch_up: dict[str, int] | None = None,
                  base_tokens: int | None = None, num_seqs: int | None = None, depth: int | None = None) -> float:
        """num_tokens fed to the target (base_tokens of them without drafts) for num_seqs sequences;
        draft_rows: per model proposer, the rows of each of its sequential forwards (the first also
        catches up catch_up[method] tokens); verifying: whether the pass verifies drafts (default:
        whether a model proposer ran); depth: the longest draft (default: the most forwards)."""
        draft_rows, catch_up = draft_rows or {}, catch_up or {}
        verifying = any(draft_rows.values()) if verifying is None else verifying
        if not verifying and self.plain.ready:
            return self.pace * self.plain(num_tokens)
        drafting = sum(self.draft_forward(rows, method) for method, forwards in draft_rows.items() for rows in forwards)
        drafting += sum(self.catch_up(catch_up.get(method, 0), method) for method, forwards in draft_rows.items() if forwards)
        depth = depth or max((len(forwards) for forwards in draft_rows.values()), default=0)
        return self.bias(depth) * (self.verify_time(num_tokens, base_tokens, num_seqs) + drafting)

    def verify_time(self, num_tokens: int, base_tokens: int | None = None, num_seqs: int | None = None) -> float:
        """The target pass alone, shaped as a verification (drafts, from any proposer), over
        num_tokens of which base_tokens are the batch's own, never less than a plain pass of the
        batch (the drafted pass holds it)."""
        floor = self.plain(base_tokens) if base_tokens and self.plain.ready else 0.0
        return self.pace * max(self._curve(num_seqs or base_tokens or num_tokens)(num_tokens), floor)

    def draft_forward(self, rows: int, method: str = "draft") -> float:
        return self.pace * self.draft_curve(method)(rows)

    def catch_up(self, tokens: int, method: str = "draft") -> float:
        return self.pace * self.catch_up_price.get(method, 0.0) * tokens

    def per_token(self, num_tokens: int, num_seqs: int | None = None) -> float:
        """Marginal cost of one more token in a verification pass of num_tokens: the slope over the
        next max(4, num_tokens) tokens (the range drafts add to a pass), steadier than one token's step."""
        curve, span = self._curve(num_seqs or num_tokens), max(4, num_tokens)
        return self.pace * max(curve(num_tokens + span) - curve(num_tokens), 0.0) / span

    def _curve(self, num_seqs: int, create: bool = False) -> CostCurve:
        """The verification curve of this many sequences' bucket; without one, the nearest bucket's."""
        bucket = PlainStepTimer.bucket(num_seqs)
        if bucket in self.targets or create:
            return self.targets.setdefault(bucket, CostCurve(self.smoothing))
        if not self.targets:
            return CostCurve(self.smoothing)
        return self.targets[min(self.targets, key=lambda b: (abs(math.log2(b / bucket)), -b))]
