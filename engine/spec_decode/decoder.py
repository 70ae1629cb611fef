"""The speculative step, beside the engine: plan -> propose -> verify -> observe.

plan: what each decoding request's proposers can offer it now (Offers: values, nothing kept) and
the policy's choice among them: a proposer and k per request, or plain decoding. run: the step's
tensor work (drafting, the grammars' masks, the target's verification pass); it changes no
request's state, so a failed pass can be rerun. observe: the policy and the cost tables learn what
the plan bought. The engine applies the StepResult to its requests.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.attention_metadata import tree_window_ok
from engine.config import PROPOSERS, EngineConfig
from engine.decode_grid import work_clock
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode.base import Offer, Proposal, Router
from engine.spec_decode.policy import Candidate, Policy, StepOutcome, StepPlan, StepView, Verified
from engine.step_costs import PassTiming, StepCosts
from engine.structured import constrain
from engine.verify import VerifyResult, verify

logger = logging.getLogger("specserve.engine")


@dataclass
class Masks:
    """A step's grammar masks, by position in the batch (bool [1 + drafts, vocab]), and the time they took."""
    rows: dict[int, torch.Tensor]
    seconds: float = 0.0


@dataclass
class StepResult:
    """One pass's work: the drafts, their verification and what each part took (by the work clock,
    without the one-off capture of a CUDA graph)."""
    proposal: Proposal
    verification: VerifyResult
    draft_time: float
    verify_time: float
    masks: Masks


def tree_nodes(config: EngineConfig, target: ModelRunner) -> int:
    """The most nodes of a request's draft tree (0: chains); a sliding window must be wider than any tree."""
    window = target.model.sliding_window
    if not tree_window_ok(window) and config.speculative.tree_nodes:
        logger.warning("speculative.tree_nodes is ignored: this target's sliding window (%d positions) could "
                       "cut a draft tree; drafts stay chains", window)
        return 0
    return config.speculative.tree_nodes if config.speculative.gamma else 0


class SpecDecoder:
    """router: every proposer, behind one propose(); policy: picks each request's proposer and k;
    costs: what a pass costs on this machine; scheduler: asked what the next pass may hold."""

    def __init__(self, target: ModelRunner, router: Router, policy: Policy, costs: StepCosts,
                 scheduler: Scheduler, tree_nodes: int):
        self.target, self.router, self.policy, self.costs = target, router, policy, costs
        self.scheduler = scheduler
        self.tree_nodes = tree_nodes

    @property
    def configured_proposers(self) -> list[str]:
        """The proposers a request may name: the configured ones (the grammar's forced tokens are
        implicit, drafted for any constrained request whenever the engine speculates)."""
        return [m for m in self.router.names if m in PROPOSERS]

    # ---- plan --------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The policy's plan for the requests whose next pass is a decode."""
        decoding = self.scheduler.decoding()
        if not decoding or not self.router.names:
            return StepPlan()
        offers = {r.request_id: self._offers(r) for r in decoding}
        view = StepView(tuple(self._candidate(r, offers[r.request_id]) for r in decoding),
                        *self.scheduler.pending_prefill(len(decoding)))
        plan = self.policy.plan(view)
        return dataclasses.replace(plan, offers={rid: offers[rid][d.proposer] for rid, d in plan.drafts.items()})

    def _offers(self, request: Request) -> dict[str, Offer]:
        """What each proposer the request may use can offer it now."""
        limit = self.scheduler.draft_limit(request)
        if request.params.num_speculative_tokens is not None:
            limit = min(limit, request.params.num_speculative_tokens)
        return self.router.offers(request, self.allowed(request), limit, self._max_nodes(request) if limit else 0)

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

    def allowed(self, request: Request) -> list[str]:
        """The proposers this request may use: the engine's, narrowed by the request's own choice."""
        wanted = request.params.speculative_method
        if wanted is None or wanted == "auto":
            return self.router.names
        return [m for m in self.router.names if m == wanted or (m == "grammar" and wanted != "none")]

    # ---- propose and verify ------------------------------------------------------------------
    def run(self, batch: SchedulerOutput, plan: StepPlan) -> StepResult:
        """Draft as planned, mask what a grammar forbids, verify in one target pass. Tensor work only."""
        t0 = work_clock()
        proposal = self.router.propose(batch.scheduled, plan)
        masks = Masks(constrain(batch.scheduled, proposal))   # cuts drafts a grammar forbids
        t1 = work_clock()
        verification = verify(self.target, batch.scheduled, proposal, masks.rows)
        # the grammars' masks, computed while drafting (a draft model's) and for verification
        masks.seconds = sum(item.request.grammar.take_mask_seconds() for item in batch.scheduled
                            if item.request.grammar is not None)
        return StepResult(proposal, verification, t1 - t0, work_clock() - t1, masks)

    # ---- observe -----------------------------------------------------------------------------
    def observe(self, batch: SchedulerOutput, plan: StepPlan, result: StepResult, started: float | None) -> None:
        """Tell the policy (and, for a step timed whole since `started`, the cost tables) what the plan bought."""
        outcome = StepOutcome(self._verified(batch, plan, result), self._timing(batch, result, started))
        if outcome.timing is not None:
            self.costs.observe(outcome.timing)
        self.policy.observe(plan, outcome)

    def _verified(self, batch: SchedulerOutput, plan: StepPlan, result: StepResult) -> tuple[Verified, ...]:
        proposal, accepted = result.proposal, result.verification.num_accepted
        return tuple(Verified(item.request.request_id, plan.drafts[item.request.request_id].proposer,
                              *_judged(proposal, i, accepted[i]), *_alternatives(proposal, i, result.verification))
                     for i, (item, drafts) in enumerate(zip(batch.scheduled, proposal.draft_token_ids))
                     if item.is_decode and drafts)

    @staticmethod
    def _timing(batch: SchedulerOutput, result: StepResult, started: float | None) -> PassTiming | None:
        """The step's timing for the cost tables, which hold the shapes of steps of decodes alone."""
        if started is None or not all(item.is_decode for item in batch.scheduled):
            return None
        proposal = result.proposal
        num_tokens = sum(s.num_new_tokens for s in batch.scheduled) + sum(map(len, proposal.draft_token_ids))
        return PassTiming(len(batch.scheduled), num_tokens, result.verify_time, tuple(proposal.forwards),
                          work_clock() - started)

    # ---- request lifecycle -------------------------------------------------------------------
    def on_verified(self, request: Request) -> None:
        """Rollback past the first rejection: the proposers' cursors follow what the target kept."""
        self.router.on_verified(request, self.allowed(request))

    def forget(self, request_id: str) -> None:
        self.router.on_finish(request_id)
        self.policy.on_finish(request_id)


def _judged(proposal: Proposal, i: int, num_accepted: int) -> tuple[int, int]:
    """(drafted, accepted) for the policy's rates: a tree counts as its chain (what the plan's k
    bought), its accepted path up to the chain's length (an alternative taken raises the rates)."""
    tree = proposal.trees[i] if proposal.trees else None
    if tree is None:
        return len(proposal.draft_token_ids[i]), num_accepted
    return tree.chain, min(num_accepted, tree.chain)


def _alternatives(proposal: Proposal, i: int, verification: VerifyResult) -> tuple[float, int]:
    """(chances promised, accepted) of a tree's alternatives, which calibrate the policy's bar for them."""
    tree = proposal.trees[i] if proposal.trees else None
    return (0.0, 0) if tree is None else tree.alternatives(verification.tree_paths.get(i, []))
