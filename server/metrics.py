"""Prometheus metrics: request latencies, batching, KV cache, speculation acceptance and speedup.

Names follow vLLM's (``vllm:`` -> ``specserve:``) so existing dashboards and habits carry over.
Every series carries ``model_name``; the ``spec_decode_*`` series also carry ``method``, the
engine's configured strategy ("auto" | "draft" | "ngram" | "suffix" | "none"); the
``*_by_proposer`` counters also carry ``proposer`` ("draft" | "ngram" | "suffix"), the proposer that
drafted (under "auto", each request and step picks one).

Who calls what:
- ``observe_step`` once per ``Engine.step()``, on the engine thread. It must stay cheap: a few
  counter/histogram updates, one loop over ``accepted_per_position`` (gamma long) and a C-level
  count of ``accepted_lengths``.
- ``observe_request`` once per finished request (its final ``RequestOutput``), on the server thread.
- ``observe_token_gap`` for each streamed delta after the first.
- ``render`` from the /metrics handler.

Counting rules (so nothing is counted twice):
- prompt/generation token counters and all ``spec_decode_*`` counters come from ``StepStats`` only,
  so their rates are live while requests run; prompt tokens count prefill work, so a prompt
  recomputed after a preemption counts again (that is work the engine did).
- ``request_success_total{finished_reason}`` and the request latency histograms come from
  ``observe_request`` only (``StepStats.finished_reasons`` is ignored here).
- ``spec_decode_accepted_length`` counts accepted *draft* tokens per verification of one request
  (0..gamma); the request gains that plus one (the recovered or bonus token). When the output ends
  inside an accepted run (EOS, a stop token, max_tokens), the token it ends on is the pass's own and
  the drafts after it are not counted as accepted (see ``engine.outputs.SpecStats``), so
  ``generation_tokens = requests that got a first token + accepted + target_forwards`` holds.
- ``discarded_tokens`` counts generated tokens that no response returned (after a stop string,
  scoring requests), so ``generation_tokens = sum of usage.completion_tokens + discarded_tokens``
  over requests that completed.
- ``inter_token_latency_seconds`` is the gap between streamed deltas. With speculation one delta
  often carries several tokens, so this is the latency a client sees between updates.
- ``spec_decode_chosen_k`` counts decode passes (per request per step) by the number of drafts
  they verified, 0 (plain decoding) included: the speculation policy's k, as far as the
  proposer could fill it (an n-gram miss verifies 0; only passes with k >= 1 appear in
  ``accepted_length``). Its count equals the sum over responses of their ``speculative.k``
  histograms, its sum ``num_draft_tokens``.
- ``spec_decode_num_draft_tokens_by_proposer`` / ``..._num_accepted_tokens_by_proposer`` split
  ``num_draft_tokens`` / ``num_accepted_tokens`` by the proposer that drafted; summed over
  ``proposer`` they equal the unsplit counters. ``proposer="grammar"`` counts the tokens a
  request's grammar forced, drafted for free (structured outputs).
- ``spec_decode_num_tree_drafts_total`` counts decode passes whose drafts were a tree (several
  continuations verified at once: n-gram, suffix, draft-model and EAGLE drafts with
  ``speculative.tree_nodes``); their
  nodes count in ``num_draft_tokens``, their accepted path in ``num_accepted_tokens``.

Structured outputs: ``structured_requests_total{kind}`` counts constrained requests as the server
admits them (one per choice); ``structured_compile_seconds`` observes each request's matcher build
in the engine (its grammar string from the per-spec cache or compiled), ``structured_cache_hits_total``
the builds whose grammar was cached; ``structured_mask_seconds_total`` adds the time spent computing
grammar masks (its rate over that of ``spec_decode_draft_time_seconds_sum`` +
``..._verify_time_seconds_sum`` is the mask's share of a step), ``structured_masked_rows_total`` the
emitting rows masked.

Calibration of the cost tables the speculation policy prices plans with (engine/step_costs.py): on
every pure decode step whose plan was priced (``StepStats.predicted_time_s``; any policy, once the
tables are calibrated at start-up),
- ``spec_decode_predicted_step_time_seconds`` (histogram) observes the predicted draft + verify time,
- ``spec_decode_measured_step_time_seconds`` (counter) adds the measured draft + verify time of
  the same steps, so ``rate(measured_total) / rate(predicted_sum)`` is the calibration over any
  window (1 = right on average, > 1 = the model is optimistic: it under-prices speculation),
  and ``rate(predicted_sum) / rate(predicted_count)`` vs ``rate(measured_total) /
  rate(predicted_count)`` are the mean predicted and measured step times;
- ``spec_decode_step_time_ratio`` (histogram) observes measured / predicted per step, for the
  spread of the error (its quantiles), which the ratio of sums hides.

Gauges derived over a window (the last ``window_steps`` steps, see ``_SpecWindow``):
- ``spec_decode_acceptance_rate`` = accepted / proposed draft tokens over recent steps that
  verified drafts. Not exported until a step has verified a draft (no NaN, no misleading 0).
- ``spec_decode_estimated_speedup`` = (tokens per target forward) x (plain decode step time at the
  same batch sizes, ``StepStats.plain_step_time_s``, measured by the engine) / (draft + verify
  time), over recent pure decode steps (no prefill in the step, plain step time known). Steps in
  which the proposer found nothing to draft (n-gram misses) are included: they are part of what
  speculation costs. Exported as exactly 1.0 when the method is "none"; otherwise not exported
  until it can be computed.
"""
from __future__ import annotations

import threading
from collections import Counter as _Tally, deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily

from engine.config import MAX_SPEC_TOKENS, PROPOSERS
from engine.outputs import RequestOutput, StepStats

# The *_created series double the series count and nothing here reads them (process-wide switch).
disable_created_metrics()

PREFIX = "specserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST  # for the /metrics response header
FINISH_REASONS = ("stop", "length", "abort", "error")
WINDOW_STEPS = 64

# Latency buckets: vLLM's, with finer steps below 100 ms where GPU decode gaps live.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = tuple(sorted(set(TTFT_BUCKETS) | set(E2E_BUCKETS)))   # short and long waits alike
STEP_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
                     0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
BATCHED_TOKENS_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# measured / predicted step time: symmetric on a log scale around 1
STEP_TIME_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.11, 1.25, 1.5, 2.0, 4.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _IntHistogram:
    """A histogram of small non-negative integers with one bucket per value (le="0".."max").

    ``observe_many`` counts a whole tuple at C speed (collections.Counter) and then touches at most
    max+1 buckets, instead of one locked Histogram.observe per request per step.
    """

    def __init__(self, name: str, documentation: str, labels: dict[str, str], max_value: int):
        self.name, self.documentation, self.labels = name, documentation, labels
        self._counts = [0] * (max_value + 1)
        self._overflow = 0   # values > max_value: land in +Inf only
        self._sum = 0
        self._lock = threading.Lock()

    def observe_many(self, values: tuple[int, ...]) -> None:
        if not values:
            return
        tally = _Tally(values)
        with self._lock:
            self._sum += sum(values)
            for value, n in tally.items():
                if value < len(self._counts):
                    self._counts[max(value, 0)] += n
                else:
                    self._overflow += n

    def collect(self):
        with self._lock:
            counts, overflow, total = list(self._counts), self._overflow, self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        cumulative, buckets = 0, []
        for value, n in enumerate(counts):
            cumulative += n
            buckets.append((str(float(value)), cumulative))
        buckets.append(("+Inf", cumulative + overflow))
        family.add_metric(list(self.labels.values()), buckets, total)
        yield family


class _SpecWindow:
    """Running sums over the last ``size`` steps, for the acceptance-rate and speedup gauges."""

    def __init__(self, size: int):
        self.accept = deque(maxlen=size)    # (draft_tokens, accepted_tokens)
        self.speed = deque(maxlen=size)     # (emitted, forwards, plain_time, spec_time)
        self.accept_sums = [0, 0]
        self.speed_sums = [0.0, 0.0, 0.0, 0.0]

    @staticmethod
    def _push(window: deque, sums: list, item: tuple) -> None:
        if len(window) == window.maxlen:
            for i, old in enumerate(window[0]):
                sums[i] -= old
        window.append(item)
        for i, new in enumerate(item):
            sums[i] += new

    def add(self, stats: StepStats) -> None:
        if stats.num_draft_tokens > 0:
            self._push(self.accept, self.accept_sums, (stats.num_draft_tokens, stats.num_accepted_tokens))
        if stats.pure_decode and stats.num_target_forwards > 0 and stats.plain_step_time_s is not None:
            # Each request in a verify pass gains its accepted drafts plus one target token.
            emitted = stats.num_accepted_tokens + stats.num_target_forwards
            spec_time = stats.draft_time_s + stats.verify_time_s
            self._push(self.speed, self.speed_sums,
                       (emitted, stats.num_target_forwards, stats.plain_step_time_s, spec_time))

    def acceptance_rate(self) -> float | None:
        proposed, accepted = self.accept_sums
        return accepted / proposed if proposed > 0 else None

    def speedup(self) -> float | None:
        emitted, forwards, plain_time, spec_time = self.speed_sums
        if forwards <= 0 or spec_time <= 0 or plain_time <= 0:
            return None
        # Plain decoding would emit `forwards` tokens in `plain_time`; speculation emitted
        # `emitted` tokens in `spec_time`. The ratio of the two throughputs:
        return (emitted / forwards) * (plain_time / spec_time)


class Metrics:
    """All specserve metrics for one served model, in their own registry by default."""

    def __init__(self, model_name: str, method: str, registry: CollectorRegistry | None = None,
                 window_steps: int = WINDOW_STEPS, proposers: tuple[str, ...] | list[str] | None = None):
        """``proposers``: the engine's configured proposers (``engine.configured_proposers``), whose per-proposer
        series then exist at 0 from the start; others appear when they first draft."""
        self.model_name, self.method = model_name, method
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        base = {"model_name": model_name}
        spec = {"model_name": model_name, "method": method}
        self._window = _SpecWindow(window_steps)

        def counter(name, doc, labels=base):
            # prometheus_client appends "_total" to counter names on exposition.
            return Counter(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name, doc, buckets, labels=base):
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        def gauge(name, doc, labels=base):
            return Gauge(PREFIX + name, doc, list(labels), registry=self.registry)

        # Speculation counters.
        self.num_drafts = counter("spec_decode_num_drafts", "Verifications of at least one draft token (per request per step).", spec)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed to the target model.", spec)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target model and emitted (none past the token an output ends on).", spec)
        self._accepted_per_pos_family = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first draft token).",
            ["model_name", "method", "position"], registry=self.registry)
        self._accepted_per_pos: list = []   # children by position, created as positions appear
        self.num_target_forwards = counter("spec_decode_num_target_forwards", "Target passes that emitted tokens to a request after its first (per request per step: decode / verify passes, recomputation after a preemption).", spec)
        self.accepted_length = _IntHistogram(
            PREFIX + "spec_decode_accepted_length",
            "Draft tokens accepted per verification of one request (the request also gains one target token).",
            spec, MAX_SPEC_TOKENS)
        self.registry.register(self.accepted_length)
        self.draft_time = histogram("spec_decode_draft_time_seconds", "Time spent proposing draft tokens, per step.", STEP_TIME_BUCKETS, spec)
        self.verify_time = histogram("spec_decode_verify_time_seconds", "Time spent in the target forward and rejection sampling, per step.", STEP_TIME_BUCKETS, spec)
        self.chosen_k = _IntHistogram(
            PREFIX + "spec_decode_chosen_k",
            "Drafts verified per decode pass of one request (0: plain decoding), as the speculation policy chose.",
            spec, MAX_SPEC_TOKENS)
        self.registry.register(self.chosen_k)
        by_proposer = ["model_name", "method", "proposer"]
        self._draft_tokens_by_proposer_family = Counter(
            PREFIX + "spec_decode_num_draft_tokens_by_proposer",
            "Draft tokens proposed to the target model, by the proposer that drafted them.",
            by_proposer, registry=self.registry)
        self._accepted_tokens_by_proposer_family = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_by_proposer",
            "Draft tokens accepted and emitted, by the proposer that drafted them.",
            by_proposer, registry=self.registry)
        self._by_proposer: dict[str, tuple] = {}   # proposer -> (draft tokens child, accepted tokens child)
        if proposers is None:   # a one-proposer strategy names it; under "auto" each appears when it drafts
            proposers = (method,) if method in PROPOSERS else ()
        for proposer in proposers:
            self._proposer_children(proposer)
        self.predicted_time = histogram(
            "spec_decode_predicted_step_time_seconds",
            "The cost tables' predicted draft + verify time of a pure decode step (the speculation policy's plan).",
            STEP_TIME_BUCKETS, spec)
        self.measured_time = counter(
            "spec_decode_measured_step_time_seconds",
            "Measured draft + verify time of the steps spec_decode_predicted_step_time_seconds observed "
            "(rate of this / rate of its _sum: measured / predicted).", spec)
        self.time_ratio = histogram(
            "spec_decode_step_time_ratio",
            "Measured / predicted draft + verify time per pure decode step with a prediction.",
            STEP_TIME_RATIO_BUCKETS, spec)
        self._acceptance_rate = gauge("spec_decode_acceptance_rate", f"Accepted / proposed draft tokens over the last {window_steps} steps that verified drafts.", spec)
        self._speedup = gauge("spec_decode_estimated_speedup", f"Estimated decode speedup over plain decoding at the same batch sizes, over the last {window_steps} decode steps; 1 for method none.", spec)
        if method == "none":
            self._speedup.labels(**spec).set(1.0)

        self.num_tree_drafts = counter("spec_decode_num_tree_drafts", "Decode passes whose drafts were a tree "
                                       "(several continuations verified in one pass).", spec)

        # Structured outputs.
        self._structured_family = Counter(PREFIX + "structured_requests", "Constrained requests admitted, by kind.",
                                          ["model_name", "kind"], registry=self.registry)
        self.compile_time = histogram("structured_compile_seconds", "Time to build a constrained request's grammar "
                                      "matcher (off the engine loop).", COMPILE_BUCKETS)
        self.compile_cache_hits = counter("structured_cache_hits", "Matcher builds whose grammar came from the "
                                          "per-spec cache.")
        self.mask_time = counter("structured_mask_seconds", "Time spent computing grammar masks for emitting rows.")
        self.masked_rows = counter("structured_masked_rows", "Emitting rows (decode, verification, bonus) a "
                                   "grammar masked.")

        # Engine and request counters.
        self.num_preemptions = counter("num_preemptions", "Requests preempted (their KV cache freed, to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (recomputation after preemption included).")
        self.generation_tokens = counter("generation_tokens", "Tokens the engine generated for requests.")
        self.discarded_tokens = counter(
            "discarded_tokens", "Generated tokens no response returned: those after a stop string (generated in "
            "the same step, or before the abort landed) and the token of a scoring request (max_tokens 0).")
        self.rejected_requests = counter(
            "num_requests_rejected", "Requests answered 429 because max_num_waiting requests were queued already.")
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self._success_family = success
        self._success = {reason: success.labels(model_name=model_name, finished_reason=reason)
                         for reason in FINISH_REASONS}

        # Latency and batching histograms.
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive streamed deltas of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.", QUEUE_BUCKETS)
        self.batch_size = histogram("batch_size", "Requests that ran in one engine step.", BATCH_SIZE_BUCKETS)
        self.num_batched_tokens = histogram("num_batched_tokens", "Tokens fed to the target model in one engine step.", BATCHED_TOKENS_BUCKETS)

        # Engine state gauges: set every step.
        self.num_running = gauge("num_requests_running", "Requests in the running batch.").labels(**base)
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(**base)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).").labels(**base)
        self._spec_labels = spec

    # ------------------------------------------------------------------ engine thread

    def observe_step(self, stats: StepStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.num_target_forwards.inc(stats.num_target_forwards)
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        self.num_tree_drafts.inc(stats.num_tree_drafts)
        if stats.accepted_per_position:
            self._count_positions(stats.accepted_per_position)
        self.accepted_length.observe_many(stats.accepted_lengths)
        self.chosen_k.observe_many(stats.chosen_k)
        for proposer, proposed, accepted in stats.drafts_by_proposer:
            drafted, taken = self._by_proposer.get(proposer) or self._proposer_children(proposer)
            drafted.inc(proposed)
            taken.inc(accepted)
        if stats.predicted_time_s is not None and stats.pure_decode and stats.batch_size > 0:
            measured = stats.draft_time_s + stats.verify_time_s
            self.predicted_time.observe(stats.predicted_time_s)
            self.measured_time.inc(measured)
            if stats.predicted_time_s > 0:
                self.time_ratio.observe(measured / stats.predicted_time_s)
        for seconds in stats.grammar_compile_s:
            self.compile_time.observe(seconds)
        self.compile_cache_hits.inc(stats.grammar_cache_hits)
        if stats.num_masked_rows:
            self.mask_time.inc(stats.mask_time_s)
            self.masked_rows.inc(stats.num_masked_rows)
        if stats.batch_size > 0:
            self.batch_size.observe(stats.batch_size)
            self.num_batched_tokens.observe(stats.num_batched_tokens)
            # Every step that ran, so draft and verify times share one count (compare per step).
            if self.method != "none":
                self.draft_time.observe(stats.draft_time_s)
            self.verify_time.observe(stats.verify_time_s)
        self._update_window_gauges(stats)

    def _proposer_children(self, proposer: str) -> tuple:
        labels = {"model_name": self.model_name, "method": self.method, "proposer": proposer}
        children = (self._draft_tokens_by_proposer_family.labels(**labels),
                    self._accepted_tokens_by_proposer_family.labels(**labels))
        self._by_proposer[proposer] = children
        return children

    def _count_positions(self, accepted_per_position: tuple[int, ...]) -> None:
        children = self._accepted_per_pos
        while len(children) < len(accepted_per_position):
            children.append(self._accepted_per_pos_family.labels(
                model_name=self.model_name, method=self.method, position=str(len(children))))
        for child, n in zip(children, accepted_per_position):
            child.inc(n)   # inc(0) too: every drafted position gets a series

    def _update_window_gauges(self, stats: StepStats) -> None:
        if self.method == "none":
            return
        self._window.add(stats)
        rate = self._window.acceptance_rate()
        if rate is not None:
            self._acceptance_rate.labels(**self._spec_labels).set(rate)
        speedup = self._window.speedup()
        if speedup is not None:
            self._speedup.labels(**self._spec_labels).set(speedup)

    # ------------------------------------------------------------------ server thread

    def observe_request(self, output: RequestOutput, num_deltas_times: list[float] | None = None) -> None:
        """Record one finished request from its final output.

        ``num_deltas_times``: optional time.monotonic() stamps of the request's output deltas, in
        order; their consecutive gaps are observed as inter-token latency. Pass them only for
        requests whose gaps were not already reported through ``observe_token_gap``.
        """
        reason = output.finish_reason or "stop"
        child = self._success.get(reason)
        if child is None:   # an unexpected reason still counts, under its own label
            child = self._success[reason] = self._success_family.labels(
                model_name=self.model_name, finished_reason=reason)
        child.inc()
        timing = output.timing
        if timing is not None:
            arrival = timing.arrival_time
            self.e2e.observe(max(timing.finished_time - arrival, 0.0))
            if timing.first_scheduled_time is not None:
                self.queue_time.observe(max(timing.first_scheduled_time - arrival, 0.0))
            if timing.first_token_time is not None:
                self.ttft.observe(max(timing.first_token_time - arrival, 0.0))
        if num_deltas_times:
            for earlier, later in zip(num_deltas_times, num_deltas_times[1:]):
                self.itl.observe(max(later - earlier, 0.0))

    def observe_structured(self, kind: str, num_requests: int = 1) -> None:
        self._structured_family.labels(model_name=self.model_name, kind=kind).inc(num_requests)

    def observe_rejected(self) -> None:
        self.rejected_requests.inc()

    def observe_discarded(self, num_tokens: int) -> None:
        self.discarded_tokens.inc(num_tokens)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
