"""The engine: one visible loop, schedule -> propose -> verify -> accept -> update."""
from __future__ import annotations

import itertools
import logging
import time

import torch

from engine.config import EngineConfig
from engine.decode_grid import work_clock
from engine.kv_cache import BlockPool
from engine.outputs import RequestOutput, RequestTiming, SpecTotals, StepStats
from engine.request import Request, RequestStatus
from engine.sampler import PositionalNoise
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.setup import EngineParts, build_engine_parts
from engine.spec_decode.base import Proposal
from engine.spec_decode.cadence import PlanCadence, luck_variance
from engine.verify import VerifyResult, verify

logger = logging.getLogger("specserve.engine")


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit the model's context."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on: the device failed, or max_step_failures steps in a row failed for
    every request in them. The process should exit so that its orchestrator restarts it."""


# Errors after which the device's state is unknown (CUDA's sticky errors): nothing on it is retried.
DEVICE_ERROR_MARKS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "illegal memory access",
                      "NCCL error", "HIP error")


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.device, self.dtype, self.quantization = parts.device, parts.dtype, parts.quantization
        self.target, self.proposer = parts.target, parts.proposer   # proposer: the Router over every proposer
        self.controller, self.costs = parts.controller, parts.costs
        # Static speculation plans (gamma everywhere) every step; the adaptive controller only
        # as often as its plans pay for their host time.
        self.cadence = PlanCadence() if self.controller.adaptive else None
        self._plan_host_time: float | None = None   # the host seconds of this step's plan (None: no plan)
        self.pool: BlockPool = parts.pool
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.gamma = config.speculative.gamma
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.gamma)
        self.step_timer = parts.step_timer
        self.requests: dict[str, Request] = {}
        self.last_stats: StepStats | None = None
        self.totals = SpecTotals()
        self._next_seed = config.seed
        self.num_failed_steps = 0   # consecutive steps in which every request failed

    @property
    def method(self) -> str:
        """The configured strategy: one of config.SPEC_METHODS."""
        return self.config.speculative.method

    # ---- requests ---------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue a request; bad input raises ValueError naming the problem."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        self.requests[request_id] = Request(
            request_id=request_id, token_ids=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids),
            params=params, arrival_time=time.monotonic(), generator=self._generator(params),
            noise=PositionalNoise(params.seed, self.vocab_size, self.device) if self._seeded(params) else None,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
        )
        self.scheduler.add(self.requests[request_id])

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_token_ids)} tokens and max_tokens is {params.max_tokens} "
                f"({len(prompt_token_ids) + params.max_tokens} in all)")

    @staticmethod
    def _seeded(params: SamplingParams) -> bool:
        return not params.greedy and params.seed is not None

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        """Unseeded sampled requests own a random stream (from the engine's seed), drawn in order and
        verified by rejection sampling, which accepts the most drafts; seeded ones sample through
        PositionalNoise, so their output does not depend on the batch."""
        if params.greedy or params.seed is not None:
            return None
        seed, self._next_seed = self._next_seed, self._next_seed + 1_000_003
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, request_id: str) -> None:
        """Drop a request at once (client gone, stop string hit): its blocks go back to the pool."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            request.finish_reason = "abort"
            self._publish_blocks(request)   # a chat ended by a stop string comes back as the next turn's prefix
            self.scheduler.remove(request)
            self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = work_clock()
        batch = self.scheduler.schedule(self._plan())
        if not batch.scheduled:
            return []
        try:
            passed = self._forward(batch)
        except Exception as exc:  # one bad request must not fail the batch, nor take the server down
            return self._isolate(batch, exc)
        self.num_failed_steps = 0
        proposal, result, draft_time, verify_time = passed
        outputs = self._finish(batch, proposal, result, draft_time, verify_time)
        if self.last_stats.pure_decode:   # the step's host work around its passes, for the plan's rates
            self.costs.observe_overhead(work_clock() - started - draft_time - verify_time)
        return outputs

    def _forward(self, batch: SchedulerOutput) -> tuple[Proposal, VerifyResult, float, float]:
        """The step's tensor work (proposer and target pass): no request's state changes in it, so
        a failed pass can be rerun. Returns the proposal, the verification and their times (by the
        work clock: without the one-off capture of a CUDA graph)."""
        t0 = work_clock()
        proposal = self.proposer.propose(batch.scheduled)
        t1 = work_clock()
        result = verify(self.target, batch.scheduled, proposal)
        return proposal, result, t1 - t0, work_clock() - t1

    def _finish(self, batch: SchedulerOutput, proposal: Proposal, result: VerifyResult, draft_time: float,
                verify_time: float) -> list[RequestOutput]:
        """The step's bookkeeping: learn its costs and acceptance, apply it to the requests."""
        self._learn(batch, proposal, result, verify_time, draft_time + verify_time)
        outputs, emitted_drafts = self._update(batch, proposal, result)
        self.last_stats = self._stats(batch, proposal, emitted_drafts, draft_time, verify_time, outputs)
        self.totals.add(self.last_stats)
        return outputs

    def _isolate(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A failed pass is rerun request by request: only a request that fails alone is failed
        (finish_reason "error"). A device error, or max_step_failures steps in a row in which every
        request failed, is fatal: EngineDeadError. (The step metrics then see the last rerun only.)"""
        self._check_device(exc)
        logger.error("an engine step of %d requests failed: %s: %s", len(batch.scheduled), type(exc).__name__, exc,
                     exc_info=exc)
        if len(batch.scheduled) == 1:
            outputs, num_failed = self._fail(batch.scheduled, exc), 1
        else:
            outputs, num_failed = [], 0
            for i, item in enumerate(batch.scheduled):
                single = SchedulerOutput([item], batch.preempted if i == 0 else [])
                try:
                    passed = self._forward(single)
                except Exception as alone:
                    self._check_device(alone)
                    logger.error("request %s failed alone: %s: %s", item.request.request_id, type(alone).__name__,
                                 alone)
                    outputs += self._fail([item], alone)
                    num_failed += 1
                else:
                    outputs += self._finish(single, *passed)
        self.num_failed_steps = self.num_failed_steps + 1 if num_failed == len(batch.scheduled) else 0
        if self.num_failed_steps >= self.config.max_step_failures:
            raise EngineDeadError(f"{self.num_failed_steps} engine steps in a row failed every request in them; "
                                  f"the last error: {type(exc).__name__}: {exc}") from exc
        return outputs

    @staticmethod
    def _check_device(exc: Exception) -> None:
        message = str(exc)
        if isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(m in message for m in DEVICE_ERROR_MARKS):
            raise EngineDeadError(f"the device failed: {type(exc).__name__}: {exc}") from exc

    # ---- speculation control ---------------------------------------------------------
    def _plan(self) -> dict:
        """The controller's (proposer, k) for every request whose next pass is a decode; none on
        the steps the cadence skips."""
        self._plan_host_time = None
        decoding = self.scheduler.decoding()
        if not decoding or not self.proposer.proposers:
            return {}
        if self.cadence is not None and not self.cadence.due():
            self.controller.skip()
            return {}
        started = time.perf_counter()
        candidates, evidence = [], {}
        for request in decoding:
            limit = self.scheduler.draft_limit(request)
            if request.params.num_speculative_tokens is not None:
                limit = min(limit, request.params.num_speculative_tokens)
            allowed = self._allowed(request)
            caps = {m: self.proposer.proposers[m].max_drafts(request, limit) for m in allowed} if limit else {}
            lags = {m: self.proposer.proposers[m].catch_up_tokens(request) for m in allowed}
            candidates.append((request.request_id, caps, lags))
            if self.controller.adaptive and self.controller.use_evidence:
                evidence[request.request_id] = self._evidence(request, caps)
        steps = self.cadence.last_steps if self.cadence is not None else 1
        plans = self.controller.plan(candidates, self._pending_prefill(len(decoding)), evidence, steps)
        self._plan_host_time = time.perf_counter() - started
        return plans

    def _evidence(self, request: Request, caps: dict[str, int]) -> dict[str, list]:
        """Per proposer that reports one (copying proposers; a model's confidence shows only while
        it drafts), the evidence key of each draft it could offer."""
        evidence = {}
        for method, cap in caps.items():
            report = getattr(self.proposer.proposers[method], "draft_evidence", None)
            if report is not None and cap > 0:
                evidence[method] = report(request, cap)
        return evidence

    def _allowed(self, request: Request) -> list[str]:
        """The proposers this request may use: the engine's, narrowed by the request's own choice."""
        wanted = request.params.speculative_method
        if wanted is None or wanted == "auto":
            return self.proposer.methods
        return [m for m in self.proposer.methods if m == wanted]

    def _pending_prefill(self, num_decoding: int) -> int:
        """Prompt tokens likely to share the next pass with the decodes (for the step-time estimate)."""
        scheduler = self.scheduler
        pending = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running if r.num_output_tokens == 0)
        free_slots = max(0, scheduler.max_num_seqs - len(scheduler.running))   # only these can be admitted
        pending += sum(r.num_tokens for r in itertools.islice(scheduler.waiting, free_slots))
        return max(0, min(pending, self.config.max_num_batched_tokens - num_decoding))

    def _learn(self, batch: SchedulerOutput, proposal: Proposal, result: VerifyResult, verify_time: float,
               step_time: float) -> None:
        """Feed the controller what verification made of each draft, the cost model the pass and
        step times, and the cadence what the step's plan delivered."""
        accepted, luck = 0, 0.0   # draft tokens accepted this step, and the variance of that count by chance
        for i, item in enumerate(batch.scheduled):
            if not item.is_decode:
                continue
            drafts = proposal.draft_token_ids[i]
            if drafts:
                rid = item.request.request_id
                self.controller.observe(rid, item.method, len(drafts), result.num_accepted[i])
                accepted += result.num_accepted[i]
                luck += luck_variance(self.controller.last_gains.get(rid, [])[:len(drafts)])
        num_drafts = sum(len(d) for d in proposal.draft_token_ids)
        self.costs.observe_pass(sum(s.num_new_tokens for s in batch.scheduled) + num_drafts, verify_time,
                                num_drafts > 0, len(batch.scheduled))
        predicted = self.controller.last_predicted_time
        pure_decode = all(item.is_decode for item in batch.scheduled)
        # Only steps the plan priced as drafting steps: a step whose only drafts are probes was
        # predicted as a plain step, and taking it for a drafting one inflated the scale of every
        # drafting step (to 1.4 at alpha 0.7, batch 4), which planned fewer drafts and left more
        # steps to probes alone.
        planned = self.controller.adaptive and self.controller.last_depth > 0
        if num_drafts and predicted and planned and pure_decode:
            self.costs.observe_drafting_step(predicted, step_time, self.controller.last_depth)
        elif pure_decode and self.controller.adaptive and not planned:
            self.costs.observe_idle_step()
        if self.cadence is not None and self._plan_host_time is not None:
            self._judge_plan(accepted, luck, num_drafts, pure_decode, step_time)

    def _judge_plan(self, accepted: int, luck: float, num_drafts: int, pure_decode: bool, step_time: float) -> None:
        """Tell the cadence what this step's plan delivered (see spec_decode/cadence.py). A drafting
        step of decodes alone is charged what it measured over plain decoding's curve: the plan's
        prediction of it ran 1.75x short at 13-16 requests (in part the draft model's catch-ups, in
        part the cost of verification rows), and a whole-step scale errs by a large share of the extra."""
        controller = self.controller
        if not num_drafts:
            extra = 0.0
        elif pure_decode:
            extra = step_time - controller.last_plain_time
        else:
            extra = max((controller.last_predicted_time or 0.0) - controller.last_plain_time, 0.0)
        token = controller.last_plain_token
        self.cadence.observe(accepted * token, extra, self._plan_host_time, luck * token * token)
        self._plan_host_time = None   # a failed pass rerun request by request is judged once

    def _forget(self, request_id: str) -> None:
        self.proposer.on_finish(request_id)
        self.controller.on_finish(request_id)

    # ---- update: bookkeeping only ------------------------------------------------
    def _update(self, batch: SchedulerOutput, proposal: Proposal, result: VerifyResult
                ) -> tuple[list[RequestOutput], list[int | None]]:
        """Apply the step to every request; also returns, per scheduled request, the drafts it emitted
        (None where the pass emitted no token after the request's first)."""
        outputs, emitted_drafts = [], [None] * len(batch.scheduled)
        for i, item in enumerate(batch.scheduled):
            request = item.request
            if request.wants_prompt_logprobs:
                self._store_prompt_logprobs(request, item, result.prompt_logprobs[i])
            if not item.samples:
                request.num_computed_tokens += item.num_new_tokens
                self._publish_blocks(request)
                continue
            request.num_computed_tokens += item.num_new_tokens + result.num_accepted[i]
            had_output = request.num_output_tokens > 0
            new_tokens = self._append_tokens(request, result.token_ids[i], result.logprobs[i])
            if request.noise is not None:
                request.noise.forget_before(request.num_output_tokens)
            request.num_proposed += len(proposal.draft_token_ids[i])
            if item.is_decode:
                method = item.method if proposal.draft_token_ids[i] else "none"
                request.passes_by_method[method] = request.passes_by_method.get(method, 0) + 1
                k = len(proposal.draft_token_ids[i])
                request.passes_by_k[k] = request.passes_by_k.get(k, 0) + 1
            if had_output:   # the prefill's first token is no target forward of the decode phase
                emitted_drafts[i] = len(new_tokens) - 1
                request.num_accepted += emitted_drafts[i]
                request.num_target_forwards += 1
            # Rollback past the first rejection: the proposers' cursors and the tail blocks.
            self.proposer.on_verified(request)
            if request.is_finished:
                self._publish_blocks(request)   # the next turn of a conversation starts with these
                self.scheduler.remove(request)
                self.requests.pop(request.request_id, None)
                self._forget(request.request_id)
            else:
                self.pool.trim(request.block_table, request.num_tokens)
                self._publish_blocks(request)
            outputs.append(self._output(request, new_tokens))
        return outputs, emitted_drafts

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs) -> list[int]:
        """Append accepted tokens, stopping inside the run at EOS / stop token / length."""
        params = request.params
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        new = []
        for j, token in enumerate(token_ids):
            request.token_ids.append(token)
            new.append(token)
            if logprobs is not None:
                request.logprobs.append(logprobs[j])
            if token in request.eos_token_ids or token in params.stop_token_ids:
                request.finish_reason = "stop"
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                request.status = RequestStatus.FINISHED
                break
        return new

    def _store_prompt_logprobs(self, request: Request, item, rows) -> None:
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        start = request.num_computed_tokens
        for j, entry in enumerate(rows):   # row j scores the token at position start + j + 1
            if start + j + 1 < request.num_prompt_tokens:
                request.prompt_logprobs[start + j + 1] = entry

    def _publish_blocks(self, request: Request) -> None:
        # Target KV only: a request that reuses a cached prefix starts its draft's cache empty. A stop
        # inside an accepted run leaves computed positions past the last kept token: those are not final.
        self.pool.cache_full_blocks(request.block_table, request.block_hashes, request.token_ids,
                                    min(request.num_computed_tokens, request.num_tokens))

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        prompt_logprobs = None
        if request.wants_prompt_logprobs:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        start = request.num_emitted
        request.num_emitted = request.num_output_tokens
        timing = None
        if request.is_finished:
            timing = RequestTiming(request.arrival_time, request.first_scheduled_time,
                                   request.first_token_time, time.monotonic())
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_tokens, finished=request.is_finished,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            new_logprobs=request.logprobs[start:] if request.params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs, spec=request.spec_stats, timing=timing,
        )

    def _fail(self, items: list[ScheduledRequest], exc: Exception) -> list[RequestOutput]:
        outputs = []
        for item in items:
            request = item.request
            request.finish_reason, request.status = "error", RequestStatus.FINISHED
            self.scheduler.remove(request)
            self.requests.pop(request.request_id, None)
            self._forget(request.request_id)
            outputs.append(RequestOutput(request.request_id, [], True, "error", request.num_prompt_tokens,
                                         request.num_output_tokens, error=f"{type(exc).__name__}: {exc}"))
        return outputs

    # ---- statistics ------------------------------------------------------------------
    def _stats(self, batch, proposal: Proposal, emitted_drafts: list[int | None], draft_time: float,
               verify_time: float, outputs: list[RequestOutput]) -> StepStats:
        per_position = [0] * self.gamma
        accepted_lengths = []
        for drafts, emitted in zip(proposal.draft_token_ids, emitted_drafts):
            if drafts and emitted is not None:
                accepted_lengths.append(emitted)
                for pos in range(emitted):
                    per_position[pos] += 1
        num_forwards = sum(e is not None for e in emitted_drafts)
        pure_decode = all(item.is_decode for item in batch.scheduled)
        by_method: dict[str, list[int]] = {}
        for item, drafts, emitted in zip(batch.scheduled, proposal.draft_token_ids, emitted_drafts):
            if drafts:
                counts = by_method.setdefault(item.method, [0, 0])
                counts[0] += len(drafts)
                counts[1] += emitted or 0
        num_draft_tokens = sum(len(d) for d in proposal.draft_token_ids)
        if pure_decode and num_draft_tokens == 0:
            self.step_timer.observe(len(batch.scheduled), verify_time)   # a real plain decode step
        return StepStats(
            method=self.method, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.pool.usage, batch_size=len(batch.scheduled),
            num_batched_tokens=sum(s.num_new_tokens for s in batch.scheduled) + num_draft_tokens,
            num_preemptions=len(batch.preempted), num_prompt_tokens=_first_token_prompts(outputs),
            num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
            num_drafts=len(accepted_lengths), num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=sum(accepted_lengths), num_target_forwards=num_forwards, pure_decode=pure_decode,
            accepted_per_position=tuple(per_position), accepted_lengths=tuple(accepted_lengths),
            draft_time_s=draft_time, verify_time_s=verify_time,
            plain_step_time_s=self.step_timer.estimate(len(batch.scheduled)) if pure_decode else None,
            finished_reasons=tuple(o.finish_reason for o in outputs if o.finished),
            chosen_k=tuple(len(d) for item, d in zip(batch.scheduled, proposal.draft_token_ids) if item.is_decode),
            drafts_by_method=tuple((m, p, a) for m, (p, a) in sorted(by_method.items())),
            predicted_time_s=self.controller.last_predicted_time if pure_decode else None,
            plan_stride=self._plan_stride(),
        )

    def _plan_stride(self) -> int | None:
        """Steps per plan: the cadence's; static speculation plans every step; none without proposers."""
        if not self.proposer.proposers:
            return None
        return self.cadence.stride if self.cadence is not None else 1


def _first_token_prompts(outputs: list[RequestOutput]) -> int:
    """Prompt tokens of the requests that got their first token this step (each prompt counted once,
    whatever prefix caching or recomputation after preemption did)."""
    return sum(o.num_prompt_tokens for o in outputs if o.new_token_ids and o.num_output_tokens == len(o.new_token_ids))
