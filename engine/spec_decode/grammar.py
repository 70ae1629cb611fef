"""Forced tokens as free drafts: where a request's grammar admits a single continuation (a JSON key,
its quotes and colon, the rest of an enum value), those tokens are proposed as a draft.

They are certain under the mask (the masked target distribution is one-hot on them), so they are
always accepted and cost only their verification rows: the policy learns their acceptance of 1 like
any other proposer's and prices them as a copying proposer (no draft forward). Nothing to catch up
on, no state of its own: the request's matcher (engine/structured.py) answers.
"""
from __future__ import annotations

from engine.request import Request
from engine.spec_decode.base import DraftJob, Offer, Proposal


class GrammarProposer:
    name = "grammar"

    def forced(self, request: Request, limit: int) -> list[int]:
        if request.grammar is None or limit <= 0:
            return []
        return request.grammar.forced_tokens()[:limit]

    def offer(self, request: Request, limit: int, max_nodes: int = 0) -> Offer:   # chains only
        forced = self.forced(request, limit)
        return Offer(len(forced), chain=tuple(forced))

    def propose(self, jobs: list[DraftJob]) -> Proposal:
        return Proposal([list(job.offer.chain[:job.k]) for job in jobs], None)

    def on_verified(self, request: Request) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass
