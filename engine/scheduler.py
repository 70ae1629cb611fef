"""Continuous batching under a token budget.

Every request is just "the tokens it still needs": a prompt chunk, one decode
token, or one decode token plus k draft tokens. Each step the scheduler walks
the running requests (oldest first), then admits waiting ones while the
token budget, max_num_seqs and the block pool allow. When the pool runs dry,
the newest running request is preempted: its blocks are freed and it is
recomputed later from its tokens, so nothing is ever lost.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockPool
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step; flags are fixed at scheduling time, before any update."""
    request: Request
    num_new_tokens: int        # tokens from request.token_ids fed this step
    num_lookahead: int         # draft tokens it may verify this step (slots reserved)
    samples: bool              # feeds the request's last token, so a new token comes out
    is_decode: bool            # feeds only the last generated token: a decode / verification pass

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, num_lookahead: int = 0) -> "ScheduledRequest":
        samples = request.num_computed_tokens + num_new_tokens == request.num_tokens
        is_decode = samples and num_new_tokens == 1 and request.num_output_tokens > 0
        return cls(request, num_new_tokens, num_lookahead, samples, is_decode)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_speculative_tokens: int = 0):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.gamma = num_speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- membership ------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget this step
            item = self._schedule_running(request, budget, out)
            if item is not None:
                out.scheduled.append(item)
                budget -= item.num_new_tokens + item.num_lookahead
        if not out.preempted:  # admitting new work while evicting would thrash
            self._admit_waiting(budget, out)
        return out

    def _draft_budget(self, request: Request, budget: int) -> int:
        """Draft tokens worth verifying: no more than can still be emitted or fit the context."""
        room_in_output = request.params.max_tokens - request.num_output_tokens - 1
        room_in_context = self.max_model_len - request.num_tokens
        return max(0, min(self.gamma, budget - 1, room_in_output, room_in_context))

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = min(remaining, budget)
        decoding = num_new == remaining == 1 and request.num_output_tokens > 0
        lookahead = self._draft_budget(request, budget) if decoding else 0
        needed = request.num_computed_tokens + num_new + lookahead
        while not self.pool.allocate(request.block_table, needed):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return None
        return ScheduledRequest.of(request, num_new, lookahead)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.pool.free(request.block_table)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.block_table and not request.wants_prompt_logprobs:
                cached = self.pool.match_prefix(request.token_ids)
                self.pool.take(cached)
                request.block_table.extend(cached)
                request.num_computed_tokens = len(cached) * self.pool.block_size
                request.num_draft_computed_tokens = request.num_computed_tokens
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.pool.allocate(request.block_table, request.num_computed_tokens + num_new):
                # Not enough room yet: give the prefix blocks back and wait for running work to finish.
                self.pool.free(request.block_table)
                request.num_computed_tokens = request.num_draft_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
