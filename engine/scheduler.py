"""Continuous batching under a token budget.

Every request is just "the tokens it still needs": a prompt chunk, one decode
token, or one decode token plus k draft tokens. Each step the scheduler serves
the decoding requests first (oldest first; each one's k comes from the plan the
engine's speculation policy makes for them), then the running requests still
prefilling, then admits waiting ones, while the token budget, max_num_seqs and
the block pool allow: a long prompt never starves the decodes. When the pool
runs dry, a request first gives up its drafts; only then is the newest running
request preempted: its blocks are freed and it is recomputed later from its
tokens, so nothing is ever lost.
"""
from __future__ import annotations

import itertools
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
                 max_model_len: int, num_speculative_tokens: int = 0, tree_nodes: int = 0):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.gamma = num_speculative_tokens   # the most drafts one request may verify in a step
        self.max_lookahead = max(num_speculative_tokens, tree_nodes)   # ... and slots it may reserve (a draft tree)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- membership ------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, aborted or failed) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------
    def draft_limit(self, request: Request) -> int:
        """Draft tokens worth verifying: no more than gamma, than can still be emitted or fit the context."""
        room_in_output = request.params.max_tokens - request.num_output_tokens - 1
        room_in_context = self.max_model_len - request.num_tokens
        return max(0, min(self.gamma, room_in_output, room_in_context))

    def slot_limit(self, request: Request) -> int:
        """Draft slots a request may reserve: a chain's drafts or a tree's nodes, within the context."""
        return max(0, min(self.max_lookahead, self.max_model_len - request.num_tokens))

    def pending_prefill(self, num_decoding: int) -> tuple[int, int]:
        """Prompt tokens likely to share the next pass with num_decoding decodes, and their requests:
        the running requests still prefilling, then the waiting ones the free sequence slots admit."""
        prefilling = [r.num_tokens - r.num_computed_tokens for r in self.running if r.num_output_tokens == 0]
        free_slots = max(0, self.max_num_seqs - len(self.running))
        prefilling += [r.num_tokens for r in itertools.islice(self.waiting, free_slots)]
        tokens = max(0, min(sum(prefilling), self.max_num_batched_tokens - num_decoding))
        return tokens, len(prefilling) if tokens else 0

    def decoding(self) -> list[Request]:
        """Running requests whose next pass is a decode (or verification): only their last token is new."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens > 0]

    def schedule(self, lookahead: dict[str, int] | None = None) -> SchedulerOutput:
        """lookahead: request id -> the drafts the plan gives a decoding request; absent: none."""
        out = SchedulerOutput()
        lookahead = lookahead or {}
        decoding = self.decoding()
        decoding_ids = {r.request_id for r in decoding}
        budget = self.max_num_batched_tokens
        for i, request in enumerate(decoding):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue   # preempted earlier in this loop, or out of budget this step
            # Every later decode keeps its one token of budget.
            k = min(lookahead.get(request.request_id, 0), self.slot_limit(request), budget - 1 - (len(decoding) - 1 - i))
            item = self._schedule_decode(request, max(k, 0), out)
            if item is not None:
                out.scheduled.append(item)
                budget -= 1 + item.num_lookahead
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0 or request.request_id in decoding_ids:
                continue
            item = self._schedule_prefill(request, budget, out)
            if item is not None:
                out.scheduled.append(item)
                budget -= item.num_new_tokens
        if not out.preempted:  # admitting new work while evicting would thrash
            self._admit_waiting(budget, out)
        return out

    def _schedule_decode(self, request: Request, k: int, out: SchedulerOutput) -> ScheduledRequest | None:
        """Blocks for the last token plus k drafts; drop the drafts before preempting anyone."""
        for lookahead in dict.fromkeys((k, 0)):
            if self.pool.allocate(request.block_table, request.num_tokens + lookahead):
                return ScheduledRequest.of(request, 1, lookahead)
        if not self._make_room(request, request.num_tokens, out):
            return None
        return ScheduledRequest.of(request, 1)

    def _schedule_prefill(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self._make_room(request, request.num_computed_tokens + num_new, out):
            return None
        return ScheduledRequest.of(request, num_new)

    def _make_room(self, request: Request, needed: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `needed` slots fit; False if it was this one."""
        while not self.pool.allocate(request.block_table, needed):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

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
                cached = self.pool.match_prefix(request.token_ids, request.tenant)
                self.pool.take(cached)
                request.block_table.extend(cached)
                request.num_computed_tokens = len(cached) * self.pool.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.pool.allocate(request.block_table, request.num_computed_tokens + num_new):
                # Not enough room yet: give the prefix blocks back and wait for running work to finish.
                self.pool.free(request.block_table)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
