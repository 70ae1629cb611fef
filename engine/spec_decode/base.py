"""What every proposer hands the verifier, the proposer lifecycle, and the router over several.

A proposer drafts for the requests the policy's plan assigned to it (DraftJob: up to
num_lookahead tokens each, stopping early where its confidence falls below p_min), and owns
whatever state that takes (a draft model's cache cursors). The engine tells it what verification
kept (on_verified) and when a request leaves (on_finish). A model proposer reports each of its
forwards (Proposal.forwards) for the cost tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.spec_decode.tree import DraftTree
from engine.step_costs import DraftForward


@dataclass(frozen=True)
class DraftJob:
    """One request's drafting this step, as the plan asked for it."""
    request: Request
    num_lookahead: int    # the most drafts to propose (slots reserved): a chain's, or a tree's nodes
    p_min: float = 0.0    # confidence stop (see spec_decode/policy.py)
    depth: int | None = None   # the plan's k, when the slots leave room for a tree's alternatives
    tree_p_min: float = 0.0    # the chance an alternative must have to take a slot (pay for its row)

    @property
    def k(self) -> int:
        """The chain the plan asked for; a tree holds it and alternatives in the other slots."""
        return self.num_lookahead if self.depth is None else min(self.depth, self.num_lookahead)

    @property
    def wants_tree(self) -> bool:
        return self.num_lookahead > self.k


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]   # per scheduled request, in order; empty when it drafts nothing
    draft_probs: torch.Tensor | None   # [num_scheduled, max_lookahead, vocab] distributions the drafts came from;
                                       # None, or an all-zero row: a deterministic guess (q = one-hot)
    forwards: list[DraftForward] = field(default_factory=list)   # model proposers' forwards, timed
    # Per scheduled request, a draft tree (None: its drafts are a chain); None: no request has one.
    # A tree's draft_token_ids are its nodes' tokens, in node order: the order they are fed.
    trees: list[DraftTree | None] | None = None

    @classmethod
    def empty(cls, num_scheduled: int) -> "Proposal":
        return cls([[] for _ in range(num_scheduled)], None)


class Proposer(Protocol):
    method: str

    def max_drafts(self, request: Request, limit: int, max_nodes: int = 0) -> int:
        """How many drafts it could offer the request now, at most `limit` (n-gram: its match). With
        max_nodes, a proposer that builds draft trees prepares one of up to max_nodes nodes holding
        that chain (proposed this step when the plan leaves slots for its alternatives)."""
        ...

    def tree_size(self, request: Request) -> int:
        """The nodes of the tree max_drafts prepared for the request this step (0: none)."""
        ...

    def catch_up_tokens(self, request: Request) -> int:
        """Tokens it must process before drafting for the request (a draft model's lag)."""
        ...

    def propose(self, jobs: list[DraftJob]) -> Proposal:
        """Up to job.num_lookahead draft tokens for each job."""
        ...

    def on_verified(self, request: Request) -> None:
        """Verification ran; request.num_computed_tokens is what its target cache holds now."""
        ...

    def on_finish(self, request_id: str) -> None:
        ...


class Router:
    """Several proposers in one step: each drafts for the requests assigned to it, and their drafts
    verify together in one target pass (deterministic guesses as one-hot rows of q)."""

    def __init__(self, proposers: dict[str, Proposer], vocab_size: int):
        self.proposers = proposers
        self.vocab_size = vocab_size

    @property
    def methods(self) -> list[str]:
        return list(self.proposers)

    def propose(self, scheduled: list[ScheduledRequest], plan: dict) -> Proposal:
        """plan: request id -> Draft (method, k, p_min), as the policy's StepPlan.drafts."""
        drafts: list[list[int]] = [[] for _ in scheduled]
        trees: list[DraftTree | None] = [None for _ in scheduled]
        model_probs: list[tuple[list[int], torch.Tensor]] = []
        forwards: list[DraftForward] = []
        for method, proposer in self.proposers.items():
            mine = [i for i, item in enumerate(scheduled) if item.num_lookahead > 0
                    and plan[item.request.request_id].method == method]
            if not mine:
                continue
            drafts_of = [plan[scheduled[i].request.request_id] for i in mine]
            jobs = [DraftJob(scheduled[i].request, scheduled[i].num_lookahead, d.p_min, d.k, d.tree_p_min)
                    for i, d in zip(mine, drafts_of)]
            proposal = proposer.propose(jobs)
            forwards += proposal.forwards
            for i, tokens in zip(mine, proposal.draft_token_ids):
                drafts[i] = tokens
            for i, tree in zip(mine, proposal.trees or ()):
                trees[i] = tree
            if proposal.draft_probs is not None:
                model_probs.append((mine, proposal.draft_probs))
        return Proposal(drafts, self._merge_probs(len(scheduled), drafts, model_probs), forwards,
                        trees if any(t is not None for t in trees) else None)

    def _merge_probs(self, num_scheduled: int, drafts: list[list[int]],
                     model_probs: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor | None:
        """The model proposers' draft distributions as one [num_scheduled, max_k, vocab] block."""
        if not model_probs:
            return None
        max_k = max(len(d) for d in drafts)
        rows, block = model_probs[0]
        if len(model_probs) == 1 and rows == list(range(num_scheduled)) and block.shape[1] == max_k:
            return block   # one proposer drafted for every row: its block as it is
        probs = block.new_zeros(num_scheduled, max_k, self.vocab_size)
        for rows, block in model_probs:
            width = min(max_k, block.shape[1])
            probs[torch.tensor(rows, device=probs.device), :width] = block[:, :width]
        return probs

    def on_verified(self, request: Request) -> None:
        for proposer in self.proposers.values():
            proposer.on_verified(request)

    def on_finish(self, request_id: str) -> None:
        for proposer in self.proposers.values():
            proposer.on_finish(request_id)
