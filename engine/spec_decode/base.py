"""What every proposer hands the verifier."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.scheduler import ScheduledRequest


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]   # per scheduled request, in order; empty when it drafts nothing
    draft_probs: torch.Tensor | None   # [num_scheduled, max_lookahead, vocab] distributions the drafts came from;
                                       # None: every draft is a deterministic guess (q = one-hot)

    @classmethod
    def empty(cls, num_scheduled: int) -> "Proposal":
        return cls([[] for _ in range(num_scheduled)], None)


class Proposer(Protocol):
    method: str

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        """Up to item.num_lookahead draft tokens for each scheduled request."""
        ...


class NoProposer:
    """Plain autoregressive decoding through the same verification path."""
    method = "none"

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        return Proposal.empty(len(scheduled))
