"""The engine: one visible loop, schedule -> propose -> verify -> accept -> update."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention_metadata import tree_window_ok
from engine.config import PROPOSERS, EngineConfig
from engine.decode_grid import work_clock
from engine.kv_cache import BlockPool
from engine.outputs import RequestOutput, RequestTiming, SpecTotals, StepStats
from engine.request import Request, RequestStatus
from engine.sampler import PositionalNoise
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.setup import EngineParts, build_engine_parts
from engine.tensor_parallel import WorkerGroupError
from engine.spec_decode.base import Offer, Proposal
from engine.spec_decode.policy import Candidate, StepOutcome, StepPlan, StepView, Verified
from engine.step_costs import PassTiming
from engine.step_stats import Masks, method_of, step_stats
from engine.structured import GrammarCompiler, GrammarQueue, constrain
from engine.verify import VerifyResult, verify

logger = logging.getLogger("specserve.engine")


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit the model's context."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on (the device failed, or max_step_failures steps in a row failed and
    so did the canary pass after each), or its loop has stopped: no request can be served. The
    process should exit so that its orchestrator restarts it."""


# The canary pass's prompt: token ids every vocabulary has.
CANARY_PROMPT = (0, 1, 2, 3)

# Errors after which the device's state is unknown (CUDA's sticky errors): nothing on it is retried.
DEVICE_ERROR_MARKS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "illegal memory access",
                      "NCCL error", "HIP error")


@dataclass(frozen=True)
class EngineStatus:
    """The engine's state between steps, for the server's health checks and gauges."""
    num_requests: int
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_cache_usage: float
    num_steps: int          # steps that ran a pass so far: a new step shows as a new count (last_stats)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.device, self.dtype, self.quantization = parts.device, parts.dtype, parts.quantization
        self.target, self.proposer = parts.target, parts.proposer   # proposer: the Router over every proposer
        self.policy, self.costs = parts.policy, parts.costs
        self.pool: BlockPool = parts.pool
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.gamma = config.speculative.gamma
        self.tree_nodes = self._tree_nodes(config)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.gamma, self.tree_nodes)
        self.requests: dict[str, Request] = {}
        self.last_stats: StepStats | None = None
        self.num_steps = 0
        self.totals = SpecTotals()
        self._next_seed = config.seed
        self.num_failed_steps = 0   # consecutive failed steps whose canary pass failed too
        # structured outputs: constrained requests wait here while their grammar compiles
        self.grammars = GrammarQueue(GrammarCompiler(config.model, self.vocab_size, self.eos_token_ids))

    def _tree_nodes(self, config: EngineConfig) -> int:
        """The most nodes of a request's draft tree (0: chains); a sliding window must be wider than any tree."""
        window = self.target.model.sliding_window
        if not tree_window_ok(window) and config.speculative.tree_nodes:
            logger.warning("speculative.tree_nodes is ignored: this target's sliding window (%d positions) could "
                           "cut a draft tree; drafts stay chains", window)
            return 0
        return config.speculative.tree_nodes if config.speculative.gamma else 0

    @property
    def configured_proposers(self) -> list[str]:
        """The proposers a request may name: the configured ones (the grammar's forced tokens are
        implicit, drafted for any constrained request whenever the engine speculates)."""
        return [m for m in self.proposer.methods if m in PROPOSERS]

    @property
    def method(self) -> str:
        """The configured strategy: one of config.SPEC_METHODS."""
        return self.config.speculative.method

    # ---- requests ---------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue a request; bad input raises ValueError naming the problem. A constrained
        request waits for its grammar to compile (off the loop) before it is scheduled."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        request = self.requests[request_id] = Request(
            request_id=request_id, token_ids=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids),
            params=params, arrival_time=time.monotonic(), generator=self._generator(params),
            noise=PositionalNoise(params.seed, self.vocab_size, self.device) if self._seeded(params) else None,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            tenant=None if self.config.share_caches_across_tenants else params.tenant,
        )
        if params.structured is None:
            self.scheduler.add(request)
        else:
            self.grammars.submit(request, params.structured)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A ValueError for a prompt or settings this model cannot take; its message starts with the
        field at fault (the server's 400 names it)."""
        self._check_vocabulary_fields(params)
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

    def _check_vocabulary_fields(self, params: SamplingParams) -> None:
        """The settings SamplingParams cannot bound alone: they are token ids or counts of this vocabulary."""
        if params.top_k > self.vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size, {self.vocab_size} (-1 or 0: no top-k), "
                             f"got {params.top_k}")
        outside = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if outside is not None:
            raise ValueError(f"stop_token_ids must be token ids of the vocabulary (0..{self.vocab_size - 1}), "
                             f"got {outside}")

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

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request at once (client gone, stop string hit): its blocks go back to the pool.
        Returns it, or None when it had finished already (its final output is on its way)."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return None
        request.finish_reason = "abort"
        if self.grammars.discard(request_id):   # still compiling: nothing scheduled, nothing to free
            request.status = RequestStatus.FINISHED
            return request
        self._publish_blocks(request)   # a chat ended by a stop string comes back as the next turn's prefix
        self.scheduler.remove(request)
        self._forget(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0

    def status(self) -> EngineStatus:
        pool = self.pool
        return EngineStatus(len(self.requests), len(self.scheduler.running),
                            len(self.scheduler.waiting) + len(self.grammars),
                            pool.num_free_blocks, pool.num_blocks, pool.usage, self.num_steps)

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = work_clock()
        refused = self._admit_compiled()
        plan = self._plan()
        batch = self.scheduler.schedule(plan.lookahead())
        if not batch.scheduled:
            if not refused:
                self.grammars.wait(0.01)   # only grammars to wait for: give their threads the CPU
            return refused
        try:
            passed = self._forward(batch, plan)
        except Exception as exc:  # one bad request must not fail the batch, nor take the server down
            return refused + self._isolate(batch, plan, exc)
        self.num_failed_steps = 0
        return refused + self._finish(batch, plan, *passed, started=started)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar is ready; end those whose grammar failed."""
        ready, failed = self.grammars.ready()
        for request in ready:
            self.scheduler.add(request)
        outputs = []
        for request, error in failed:
            request.finish_reason, request.status = "error", RequestStatus.FINISHED
            self.requests.pop(request.request_id, None)
            outputs.append(RequestOutput(request.request_id, [], True, "error", request.num_prompt_tokens, 0,
                                         error=error, invalid_request=True))
        return outputs

    def _forward(self, batch: SchedulerOutput, plan: StepPlan) -> tuple[Proposal, VerifyResult, float, float, Masks]:
        """The step's tensor work (proposer and target pass): no request's state changes in it, so
        a failed pass can be rerun. Returns the proposal, the verification, their times (by the work
        clock: without the one-off capture of a CUDA graph) and the grammar masks with their time."""
        t0 = work_clock()
        proposal = self.proposer.propose(batch.scheduled, plan)
        masks = Masks(constrain(batch.scheduled, proposal))   # cuts drafts a grammar forbids
        t1 = work_clock()
        result = verify(self.target, batch.scheduled, proposal, masks.rows)
        # the grammars' masks, computed while drafting (a draft model's) and for verification
        masks.seconds = sum(item.request.grammar.take_mask_seconds() for item in batch.scheduled
                            if item.request.grammar is not None)
        return proposal, result, t1 - t0, work_clock() - t1, masks

    def _finish(self, batch: SchedulerOutput, plan: StepPlan, proposal: Proposal, result: VerifyResult,
                draft_time: float, verify_time: float, masks: Masks, started: float | None = None
                ) -> list[RequestOutput]:
        """The step's bookkeeping: tell the policy (and, for a step timed whole since `started`, the
        cost tables) what it made of the plan, and apply it to the requests."""
        outcome = self._outcome(batch, plan, proposal, result, verify_time, started)
        if outcome.timing is not None:
            self.costs.observe(outcome.timing)
        self.policy.observe(plan, outcome)
        outputs, emitted_drafts = self._update(batch, plan, proposal, result)
        self.last_stats = step_stats(self, batch, plan, proposal, emitted_drafts, draft_time, verify_time, outputs,
                                      masks)
        self.totals.add(self.last_stats)
        self.num_steps += 1
        return outputs

    def _outcome(self, batch: SchedulerOutput, plan: StepPlan, proposal: Proposal, result: VerifyResult,
                 verify_time: float, started: float | None) -> StepOutcome:
        verified = tuple(Verified(item.request.request_id, plan.drafts[item.request.request_id].method,
                                  *self._judged(proposal, i, result.num_accepted[i]),
                                  *self._alternatives(proposal, i, result))
                         for i, (item, drafts) in enumerate(zip(batch.scheduled, proposal.draft_token_ids))
                         if item.is_decode and drafts)
        timing = None   # the tables are corrected by the shapes they hold: steps of decodes alone
        if started is not None and all(item.is_decode for item in batch.scheduled):
            num_tokens = sum(s.num_new_tokens for s in batch.scheduled) + sum(map(len, proposal.draft_token_ids))
            timing = PassTiming(len(batch.scheduled), num_tokens, verify_time, tuple(proposal.forwards),
                                work_clock() - started)
        return StepOutcome(verified, timing)

    @staticmethod
    def _judged(proposal: Proposal, i: int, num_accepted: int) -> tuple[int, int]:
        """(drafted, accepted) for the policy's rates: a tree counts as its chain (what the plan's k
        bought), its accepted path up to the chain's length (an alternative taken raises the rates)."""
        tree = proposal.trees[i] if proposal.trees else None
        if tree is None:
            return len(proposal.draft_token_ids[i]), num_accepted
        return tree.chain, min(num_accepted, tree.chain)

    @staticmethod
    def _alternatives(proposal: Proposal, i: int, result: VerifyResult) -> tuple[float, int]:
        """(chances promised, accepted) of a tree's alternatives, which calibrate the policy's bar for them."""
        tree = proposal.trees[i] if proposal.trees else None
        return (0.0, 0) if tree is None else tree.alternatives(result.tree_paths.get(i, []))

    def _isolate(self, batch: SchedulerOutput, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        """Judge a failed pass: the engine's fault or a request's. A device error is fatal
        (EngineDeadError). Otherwise the canary, a pass of the engine's own, decides: when it fails
        too, the engine is at fault, the step counts as failed (max_step_failures in a row are
        fatal) and its requests stay as they were, to run in the next step; when it passes, the
        failure is a request's, found by bisection (_bisect), and never counts against the engine."""
        self._check_device(exc)
        logger.error("an engine step of %d requests failed: %s: %s", len(batch.scheduled), type(exc).__name__, exc,
                     exc_info=exc)
        if self._canary_passes():
            self.num_failed_steps = 0
            return self._bisect(batch.scheduled, batch.preempted, plan, exc)
        self.num_failed_steps += 1
        if self.num_failed_steps >= self.config.max_step_failures:
            raise EngineDeadError(f"{self.num_failed_steps} engine steps in a row failed, and so did a pass of the "
                                  f"engine's own after each; the last error: {type(exc).__name__}: {exc}") from exc
        return []

    def _bisect(self, items: list[ScheduledRequest], preempted: list[Request], plan: StepPlan, exc: Exception
                ) -> list[RequestOutput]:
        """Rerun the requests of a failed pass in halves: a half that passes is done, one that fails is
        halved again, and a request that fails alone is failed (finish_reason "error"). One bad request
        among n costs about 2 log2(n) passes, and nobody is rerun once they pass. The reruns teach the
        policy what their drafts were worth, but not the cost tables: their timings are not those of
        the planned step. (The step metrics then see the last rerun only.)"""
        if len(items) == 1:
            logger.error("request %s failed alone: %s: %s", items[0].request.request_id, type(exc).__name__, exc)
            return self._fail(items, exc)
        half = len(items) // 2
        outputs = []
        for part, part_preempted in ((items[:half], preempted), (items[half:], [])):
            rerun = SchedulerOutput(part, part_preempted)
            try:
                passed = self._forward(rerun, plan)
            except Exception as failed:
                self._check_device(failed)
                outputs += self._bisect(part, part_preempted, plan, failed)
            else:
                outputs += self._finish(rerun, plan, *passed)
        return outputs

    def _canary_passes(self) -> bool:
        """One greedy target pass over a fixed short prompt, in blocks of its own that are freed after
        and never published: the engine's health, judged apart from any request. Without a free block
        it cannot run, and blames no one: the failure is then judged as a request's."""
        canary = Request(request_id="canary", token_ids=list(CANARY_PROMPT), num_prompt_tokens=len(CANARY_PROMPT),
                         params=SamplingParams(max_tokens=1, temperature=0.0), arrival_time=time.monotonic(),
                         generator=None)
        if not self.pool.allocate(canary.block_table, canary.num_tokens):
            logger.warning("no free KV block for the canary pass: the failed step is judged by its requests alone")
            return True
        try:
            verify(self.target, [ScheduledRequest.of(canary, canary.num_tokens)], Proposal.empty(1))
            return True
        except Exception as exc:
            self._check_device(exc)
            logger.error("the canary pass failed too: %s: %s", type(exc).__name__, exc)
            return False
        finally:
            self.pool.free(canary.block_table)

    def check_alive(self) -> None:
        """EngineDeadError when a part of the engine in another process (a tensor-parallel worker) has
        died. The engine core asks while it waits for requests, so a dead group turns /health to 503
        at once rather than at the next request's pass."""
        workers = getattr(self.target, "workers", None)
        if workers is not None:
            try:
                workers.check()
            except WorkerGroupError as exc:
                self._check_device(exc)

    @staticmethod
    def _check_device(exc: Exception) -> None:
        if isinstance(exc, WorkerGroupError):   # the shards are out of step: no pass can run again
            raise EngineDeadError(f"the tensor-parallel group failed: {exc}") from exc
        message = str(exc)
        if isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(m in message for m in DEVICE_ERROR_MARKS):
            raise EngineDeadError(f"the device failed: {type(exc).__name__}: {exc}") from exc

    # ---- speculation control ---------------------------------------------------------
    def _plan(self) -> StepPlan:
        """The policy's plan for the requests whose next pass is a decode."""
        decoding = self.scheduler.decoding()
        if not decoding or not self.proposer.methods:
            return StepPlan()
        offers = {r.request_id: self._offers(r) for r in decoding}
        plan = self.policy.plan(StepView(tuple(self._candidate(r, offers[r.request_id]) for r in decoding),
                                         *self._pending_prefill(len(decoding))))
        return dataclasses.replace(plan, offers={rid: offers[rid][d.method] for rid, d in plan.drafts.items()})

    def _offers(self, request: Request) -> dict[str, Offer]:
        """What each proposer the request may use can offer it now."""
        limit = self.scheduler.draft_limit(request)
        if request.params.num_speculative_tokens is not None:
            limit = min(limit, request.params.num_speculative_tokens)
        return self.proposer.offers(request, self._allowed(request), limit, self._max_nodes(request) if limit else 0)

    def _candidate(self, request: Request, offers: dict[str, Offer]) -> Candidate:
        """The request as the policy sees it: each proposer's chain, lag and tree (one past the chain)."""
        return Candidate(request.request_id, {m: o.drafts for m, o in offers.items()},
                         {m: o.catch_up for m, o in offers.items()}, self._remaining_tokens(request),
                         {m: o.nodes for m, o in offers.items() if o.nodes > o.drafts})

    def _max_nodes(self, request: Request) -> int:
        """The nodes a draft tree for the request may have; 0: chains only (a grammar masks and penalties
        judge each draft against one history: a chain's)."""
        if not self.tree_nodes or request.grammar is not None or request.params.has_penalties:
            return 0
        return min(self.tree_nodes, self.scheduler.slot_limit(request))

    def _remaining_tokens(self, request: Request) -> int:
        return max(0, min(request.params.max_tokens - request.num_output_tokens,
                          self.scheduler.max_model_len - request.num_tokens))

    def _allowed(self, request: Request) -> list[str]:
        """The proposers this request may use: the engine's, narrowed by the request's own choice."""
        wanted = request.params.speculative_method
        if wanted is None or wanted == "auto":
            return self.proposer.methods
        return [m for m in self.proposer.methods if m == wanted or (m == "grammar" and wanted != "none")]

    def _pending_prefill(self, num_decoding: int) -> tuple[int, int]:
        """Prompt tokens likely to share the next pass with the decodes, and their requests."""
        scheduler = self.scheduler
        prefilling = [r.num_tokens - r.num_computed_tokens for r in scheduler.running if r.num_output_tokens == 0]
        free_slots = max(0, scheduler.max_num_seqs - len(scheduler.running))   # only these can be admitted
        prefilling += [r.num_tokens for r in itertools.islice(scheduler.waiting, free_slots)]
        tokens = max(0, min(sum(prefilling), self.config.max_num_batched_tokens - num_decoding))
        return tokens, len(prefilling) if tokens else 0

    def _forget(self, request_id: str) -> None:
        self.proposer.on_finish(request_id)
        self.policy.on_finish(request_id)

    # ---- update: bookkeeping only ------------------------------------------------
    def _update(self, batch: SchedulerOutput, plan: StepPlan, proposal: Proposal, result: VerifyResult
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
                method = method_of(plan, item) if proposal.draft_token_ids[i] else "none"
                request.passes_by_method[method] = request.passes_by_method.get(method, 0) + 1
                k = len(proposal.draft_token_ids[i])
                request.passes_by_k[k] = request.passes_by_k.get(k, 0) + 1
            if had_output:   # the prefill's first token is no target forward of the decode phase
                emitted_drafts[i] = len(new_tokens) - 1
                request.num_accepted += emitted_drafts[i]
                request.num_target_forwards += 1
            # Rollback past the first rejection: the proposers' cursors and the tail blocks.
            self.proposer.on_verified(request, self._allowed(request))
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
            if request.grammar is not None and not self._advance_grammar(request, token):
                break
            if token in request.eos_token_ids or token in params.stop_token_ids:
                request.finish_reason = "stop"
            elif request.grammar is not None and request.grammar.finished:   # it admits nothing more
                request.finish_reason = "stop"
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                request.status = RequestStatus.FINISHED
                break
        return new

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> bool:
        """Move the request's matcher past an emitted token. A refusal (the grammar past llguidance's
        limits, or the grammar engine disagreeing with its own mask) ends this request with an error
        naming it, never the loop."""
        try:
            request.grammar.advance([token])
            return True
        except RuntimeError as exc:
            message = f"{request.params.structured.kind}: {str(exc).splitlines()[0]}"   # not llguidance's state dump
            logger.error("request %s: %s", request.request_id, message)
            request.finish_reason, request.status = "error", RequestStatus.FINISHED
            request.error, request.invalid_request = message, True
            return False

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
                                    min(request.num_computed_tokens, request.num_tokens), request.tenant)

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
            prompt_logprobs=prompt_logprobs, spec=request.spec_stats, timing=timing, error=request.error,
            invalid_request=request.invalid_request,
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
