"""The engine: one visible loop, schedule -> speculate -> apply.

The scheduler picks the requests of the next pass (the speculative plan gives each decoding request
its drafts' slots); the SpecDecoder drafts and verifies them (engine/spec_decode/decoder.py), inside
fault isolation (engine/faults.py); the engine applies the result to its requests
(engine/request_update.py) and finishes those that ended, in one place (_finish_request).
"""
from __future__ import annotations

import time

import torch

from engine.config import EngineConfig
from engine.decode_grid import work_clock
from engine.faults import EngineDeadError, FaultIsolation
from engine.kv_cache import BlockPool
from engine.outputs import EngineStatus, RequestOutput, SpecTotals, StepStats
from engine.request import Request, RequestStatus
from engine.request_update import apply_pass, request_output, store_prompt_logprobs
from engine.sampler import PositionalNoise
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.setup import EngineParts, build_engine_parts
from engine.spec_decode.decoder import SpecDecoder, StepResult, tree_nodes
from engine.spec_decode.policy import StepPlan
from engine.step_stats import proposer_of, step_stats
from engine.structured import GrammarCompiler, GrammarQueue

__all__ = ["ContextLengthError", "Engine", "EngineDeadError", "EngineStatus"]


class ContextLengthError(ValueError):
    """The prompt plus max_tokens does not fit the model's context."""


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.device, self.dtype, self.quantization = parts.device, parts.dtype, parts.quantization
        self.target = parts.target
        self.pool: BlockPool = parts.pool
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.gamma = config.speculative.gamma
        nodes = tree_nodes(config, self.target)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.gamma, nodes)
        self.spec = SpecDecoder(self.target, parts.proposer, parts.policy, parts.costs, self.scheduler, nodes)
        self.faults = FaultIsolation(self.target, self.pool, config.max_step_failures)
        self.requests: dict[str, Request] = {}
        self.last_stats: StepStats | None = None
        self.num_steps = 0
        self.totals = SpecTotals()
        self._next_seed = config.seed
        # structured outputs: constrained requests wait here while their grammar compiles
        self.grammars = GrammarQueue(GrammarCompiler(config.model, self.vocab_size, self.eos_token_ids))

    @property
    def configured_proposers(self) -> list[str]:
        return self.spec.configured_proposers

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
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            self.requests.pop(request_id, None)
            return None
        self._finish_request(request, "abort")   # a chat ended by a stop string is the next turn's prefix
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0

    def status(self) -> EngineStatus:
        pool = self.pool
        return EngineStatus(len(self.requests), self.scheduler.num_running,
                            self.scheduler.num_waiting + len(self.grammars),
                            pool.num_free_blocks, pool.num_blocks, pool.usage, self.num_steps)

    def check_alive(self) -> None:
        """EngineDeadError when a part of the engine in another process (a tensor-parallel worker) died."""
        self.faults.check_alive()

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = work_clock()
        refused = self._admit_compiled()
        plan = self.spec.plan()
        batch = self.scheduler.schedule(plan.lookahead())
        if not batch.scheduled:
            if not refused:
                self.grammars.wait(0.01)   # only grammars to wait for: give their threads the CPU
            return refused

        def apply(part: SchedulerOutput, result: StepResult, whole: bool) -> list[RequestOutput]:
            return self._apply(part, plan, result, started if whole else None)
        return refused + self.faults.step(batch, lambda part: self.spec.run(part, plan), apply, self._fail)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar is ready; end those whose grammar failed."""
        ready, failed = self.grammars.ready()
        for request in ready:
            self.scheduler.add(request)
        outputs = []
        for request, error in failed:
            request.error, request.invalid_request = error, True
            self._finish_request(request, "error")
            outputs.append(request_output(request, []))
        return outputs

    def _apply(self, batch: SchedulerOutput, plan: StepPlan, result: StepResult, started: float | None
               ) -> list[RequestOutput]:
        """The step's bookkeeping: the policy (and, for a step timed whole since `started`, the cost
        tables) learn what the plan bought; the requests take their tokens; the step's stats."""
        self.spec.observe(batch, plan, result, started)
        outputs, emitted_drafts = self._update(batch, plan, result)
        self.last_stats = step_stats(batch, plan, result, emitted_drafts, outputs, method=self.method,
                                     scheduler=self.scheduler, costs=self.spec.costs,
                                     compiled=self.grammars.drain_stats())
        self.totals.add(self.last_stats)
        self.num_steps += 1
        return outputs

    def _update(self, batch: SchedulerOutput, plan: StepPlan, result: StepResult
                ) -> tuple[list[RequestOutput], list[int | None]]:
        """Apply the pass to every request; also returns, per scheduled request, the drafts it emitted
        (None where the pass emitted no token after the request's first)."""
        verification, drafts = result.verification, result.proposal.draft_token_ids
        outputs, emitted_drafts = [], [None] * len(batch.scheduled)
        for i, item in enumerate(batch.scheduled):
            request = item.request
            if request.wants_prompt_logprobs:
                store_prompt_logprobs(request, verification.prompt_logprobs[i])
            if not item.samples:   # a prefill chunk: nothing sampled
                request.num_computed_tokens += item.num_new_tokens
                self._publish_blocks(request)
                continue
            new_tokens, emitted_drafts[i] = apply_pass(
                request, item, verification.token_ids[i], verification.logprobs[i], len(drafts[i]),
                verification.num_accepted[i], proposer_of(plan, item), self.max_model_len)
            self.spec.on_verified(request)   # rollback past the first rejection: the proposers' cursors
            if request.is_finished:
                self._finish_request(request, request.finish_reason)
            else:
                self.pool.trim(request.block_table, request.num_tokens)   # ... and the tail blocks
                self._publish_blocks(request)
            outputs.append(request_output(request, new_tokens))
        return outputs, emitted_drafts

    def _fail(self, items: list[ScheduledRequest], exc: Exception) -> list[RequestOutput]:
        """End the requests a failed pass is blamed on, with the error."""
        outputs = []
        for item in items:
            item.request.error = f"{type(exc).__name__}: {exc}"
            self._finish_request(item.request, "error")
            outputs.append(request_output(item.request, []))
        return outputs

    # ---- lifecycle -------------------------------------------------------------------------
    def _finish_request(self, request: Request, reason: str) -> None:
        """The one way a request ends (stop, length, abort, error): out of the engine, its proposers'
        and the policy's state, its blocks freed. What it computed is published for the next turn of a
        conversation to reuse, unless it ended in an error (its cache is not trusted then)."""
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        if self.grammars.discard(request.request_id):   # still compiling: nothing scheduled, nothing to free
            request.status = RequestStatus.FINISHED
            return
        if reason != "error":
            self._publish_blocks(request)
        self.scheduler.remove(request)
        self.spec.forget(request.request_id)

    def _publish_blocks(self, request: Request) -> None:
        # Target KV only: a request that reuses a cached prefix starts its draft's cache empty. A stop
        # inside an accepted run leaves computed positions past the last kept token: those are not final.
        self.pool.cache_full_blocks(request.block_table, request.block_hashes, request.token_ids,
                                    min(request.num_computed_tokens, request.num_tokens), request.tenant)
