"""What every proposer hands the verifier, the proposer lifecycle, and the router over several.

A proposer first answers what it can offer a request this step (offer: an Offer, a value; asking
changes nothing), then drafts for the requests the policy's plan assigned to it (DraftJob: the
request, its Offer handed back, up to num_lookahead tokens, stopping early where its confidence
falls below p_min). It owns whatever state drafting takes across steps (a draft model's cache
cursors, a request's index), and changes it only when it drafts or is told an outcome: what
verification kept (on_verified) and when a request leaves (on_finish). A model proposer reports
each of its forwards (Proposal.forwards) for the cost tables.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch

from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.spec_decode.tree import DraftTree
from engine.step_costs import DraftForward

if TYPE_CHECKING:
    from engine.spec_decode.policy import StepPlan


@dataclass(frozen=True)
class Offer:
    """What one proposer can draft for one request this step, found by offer() and handed back to
    propose() in the request's DraftJob, so nothing found while planning is kept in the proposer."""
    drafts: int = 0       # the longest chain it can draft now (the plan's k is at most this)
    catch_up: int = 0     # tokens it must process before drafting (a draft model's lag)
    nodes: int = 0        # the nodes of a draft tree it offers, holding that chain and alternatives (0: none)
    chain: tuple[int, ...] = ()        # a copying proposer's chain, as found now (its first `drafts` tokens)
    chances: tuple[float, ...] = ()    # ... the chance of each of its tokens given those before (empty: unknown)
    tree: DraftTree | None = None      # ... and the tree of `nodes` it built around that chain (chain first)


@dataclass(frozen=True)
class DraftJob:
    """One request's drafting this step, as the plan asked for it."""
    request: Request
    num_lookahead: int    # the most drafts to propose (slots reserved): a chain's, or a tree's nodes
    p_min: float = 0.0    # confidence stop (see spec_decode/policy.py)
    depth: int | None = None   # the plan's k, when the slots leave room for a tree's alternatives
    tree_p_min: float = 0.0    # the chance an alternative must have to take a slot (pay for its row)
    offer: Offer = Offer()     # what the proposer offered the request when the step was planned

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
    name: str

    def offer(self, request: Request, limit: int, max_nodes: int = 0) -> Offer:
        """What it can draft for the request now: a chain of at most `limit` (n-gram: its match) and,
        with max_nodes, a proposer that drafts trees offers one of up to max_nodes nodes holding that
        chain (proposed when the plan leaves slots for its alternatives). Changes no state."""
        ...

    def propose(self, jobs: list[DraftJob]) -> Proposal:
        """Up to job.num_lookahead draft tokens for each job, from what job.offer promised."""
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
        self._proposers = dict(proposers)
        self.vocab_size = vocab_size

    @property
    def proposers(self) -> Mapping[str, Proposer]:
        """The proposers by name, read only (replace() swaps one)."""
        return MappingProxyType(self._proposers)

    @property
    def names(self) -> list[str]:
        return list(self._proposers)

    def replace(self, name: str, proposer: Proposer) -> Proposer:
        """Put `proposer` in the place of the one drafting as `name` (benches and tests swap in
        scripted drafts this way); returns the one it replaced."""
        replaced = self._proposers[name]
        self._proposers[name] = proposer
        return replaced

    def offers(self, request: Request, names: list[str], limit: int, max_nodes: int) -> dict[str, Offer]:
        """What each of these proposers can offer the request now."""
        return {m: self._proposers[m].offer(request, limit, max_nodes) for m in names}

    def propose(self, scheduled: list[ScheduledRequest], plan: StepPlan) -> Proposal:
        """plan.drafts: request id -> Draft (proposer, k, p_min); plan.offers: request id -> what that
        proposer offered the request."""
        drafts: list[list[int]] = [[] for _ in scheduled]
        trees: list[DraftTree | None] = [None for _ in scheduled]
        model_probs: list[tuple[list[int], torch.Tensor]] = []
        forwards: list[DraftForward] = []
        for name, proposer in self._proposers.items():
            mine = [i for i, item in enumerate(scheduled) if item.num_lookahead > 0
                    and plan.drafts[item.request.request_id].proposer == name]
            if not mine:
                continue
            drafts_of = [plan.drafts[scheduled[i].request.request_id] for i in mine]
            jobs = [DraftJob(scheduled[i].request, scheduled[i].num_lookahead, d.p_min, d.k, d.tree_p_min,
                             plan.offers[scheduled[i].request.request_id]) for i, d in zip(mine, drafts_of)]
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

    def on_verified(self, request: Request, names: list[str]) -> None:
        """Verification ran for a request these proposers may draft for (the others never see it: a
        request that pins one proposer adds nothing to another's shared cache)."""
        for name in names:
            self._proposers[name].on_verified(request)

    def on_finish(self, request_id: str) -> None:
        for proposer in self._proposers.values():
            proposer.on_finish(request_id)
