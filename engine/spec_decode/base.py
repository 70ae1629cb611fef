"""What every proposer hands the verifier, the proposer lifecycle, and the router over several.

A proposer drafts for the requests the controller assigned to it (ScheduledRequest.method) up to
item.num_lookahead tokens each, and owns whatever state that takes (a draft model's cache cursors).
The engine tells it what verification kept (on_verified) and when a request leaves (on_finish).
A copying proposer may also report, per draft it could offer, an evidence key (draft_evidence:
how long its match runs, how many earlier continuations agree), which the controller calibrates
into an acceptance per position; a model draft's confidence shows only while it drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request import Request
from engine.scheduler import ScheduledRequest


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]   # per scheduled request, in order; empty when it drafts nothing
    draft_probs: torch.Tensor | None   # [num_scheduled, max_lookahead, vocab] distributions the drafts came from;
                                       # None, or an all-zero row: a deterministic guess (q = one-hot)

    @classmethod
    def empty(cls, num_scheduled: int) -> "Proposal":
        return cls([[] for _ in range(num_scheduled)], None)


class Proposer(Protocol):
    method: str

    def max_drafts(self, request: Request, limit: int) -> int:
        """How many drafts it could offer the request now, at most `limit` (n-gram: its match)."""
        ...

    def catch_up_tokens(self, request: Request) -> int:
        """Tokens it must process before drafting for the request (a draft model's lag)."""
        ...

    def propose(self, items: list[ScheduledRequest]) -> Proposal:
        """Up to item.num_lookahead draft tokens for each item (all assigned to this proposer)."""
        ...

    # Optional: def draft_evidence(self, request: Request, limit: int) -> list[Hashable]
    #     one evidence key per draft that max_drafts(request, limit) counted.

    def on_verified(self, request: Request) -> None:
        """Verification ran; request.num_computed_tokens is what its target cache holds now."""
        ...

    def on_finish(self, request_id: str) -> None:
        ...


def length_bucket(n: int) -> int:
    """1, 2-3, 4-7, 8-15, 16+ -> 0..4: how long a match runs, as an evidence key."""
    return min(4, max(n, 1).bit_length() - 1)


class NoProposer:
    """Plain autoregressive decoding through the same verification path."""
    method = "none"

    def max_drafts(self, request: Request, limit: int) -> int:
        return 0

    def catch_up_tokens(self, request: Request) -> int:
        return 0

    def propose(self, items: list[ScheduledRequest]) -> Proposal:
        return Proposal.empty(len(items))

    def on_verified(self, request: Request) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass


class Router:
    """Several proposers in one step: each drafts for the requests assigned to it, and their drafts
    verify together in one target pass (deterministic guesses as one-hot rows of q)."""

    def __init__(self, proposers: dict[str, Proposer], vocab_size: int):
        self.proposers = proposers
        self.vocab_size = vocab_size

    @property
    def methods(self) -> list[str]:
        return list(self.proposers)

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in scheduled]
        model_probs: list[tuple[list[int], torch.Tensor]] = []
        for method, proposer in self.proposers.items():
            mine = [i for i, item in enumerate(scheduled) if item.method == method and item.num_lookahead > 0]
            if not mine:
                continue
            proposal = proposer.propose([scheduled[i] for i in mine])
            for i, tokens in zip(mine, proposal.draft_token_ids):
                drafts[i] = tokens
            if proposal.draft_probs is not None:
                model_probs.append((mine, proposal.draft_probs))
        if not model_probs:
            return Proposal(drafts, None)
        max_k = max(len(d) for d in drafts)
        rows, block = model_probs[0]
        if len(model_probs) == 1 and rows == list(range(len(scheduled))) and block.shape[1] == max_k:
            return Proposal(drafts, block)   # one proposer drafted for every row: its block as it is
        probs = model_probs[0][1].new_zeros(len(scheduled), max_k, self.vocab_size)
        for rows, block in model_probs:
            width = min(max_k, block.shape[1])
            probs[torch.tensor(rows, device=probs.device), :width] = block[:, :width]
        return Proposal(drafts, probs)

    def on_verified(self, request: Request) -> None:
        for proposer in self.proposers.values():
            proposer.on_verified(request)

    def on_finish(self, request_id: str) -> None:
        for proposer in self.proposers.values():
            proposer.on_finish(request_id)
