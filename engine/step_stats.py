"""A step's StepStats for the metrics, from what it scheduled, drafted, emitted and timed: bookkeeping
only, apart from the engine's loop."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import RequestOutput, StepStats
from engine.scheduler import ScheduledRequest
from engine.spec_decode.base import Proposal
from engine.spec_decode.policy import StepPlan


@dataclass
class Masks:
    """A step's grammar masks, by position in the batch (bool [1 + drafts, vocab]), and the time they took."""
    rows: dict[int, torch.Tensor]
    seconds: float = 0.0


def method_of(plan: StepPlan, item: ScheduledRequest) -> str:
    """The proposer that drafted for a scheduled request ("none" when it verifies no drafts)."""
    draft = plan.drafts.get(item.request.request_id)
    return draft.method if draft is not None and item.num_lookahead else "none"


def _first_token_prompts(outputs: list[RequestOutput]) -> int:
    """Prompt tokens of the requests that got their first token this step (each prompt counted once,
    whatever prefix caching or recomputation after preemption did)."""
    return sum(o.num_prompt_tokens for o in outputs if o.new_token_ids and o.num_output_tokens == len(o.new_token_ids))


def step_stats(engine, batch, plan: StepPlan, proposal: Proposal, emitted_drafts: list[int | None],
               draft_time: float, verify_time: float, outputs: list[RequestOutput], masks: Masks) -> StepStats:
    """engine: the Engine whose step this was (its scheduler, pool, cost tables and grammar queue);
    emitted_drafts: per scheduled request, the drafts it emitted (None: no token after its first)."""
    per_position = [0] * engine.gamma
    accepted_lengths = []
    for drafts, emitted in zip(proposal.draft_token_ids, emitted_drafts):
        if drafts and emitted is not None:
            accepted_lengths.append(emitted)
            for pos in range(emitted):
                per_position[pos] += 1
    num_forwards = sum(e is not None for e in emitted_drafts)
    pure_decode = all(item.is_decode for item in batch.scheduled)
    by_method: dict[str, list[int]] = {}
    for item, drafts, emitted in zip(batch.scheduled, proposal.draft_token_ids, emitted_drafts):
        if drafts:
            counts = by_method.setdefault(method_of(plan, item), [0, 0])
            counts[0] += len(drafts)
            counts[1] += emitted or 0
    num_draft_tokens = sum(len(d) for d in proposal.draft_token_ids)
    compiled = engine.grammars.drain_stats()
    return StepStats(
        method=engine.method, num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
        kv_cache_usage=engine.pool.usage, batch_size=len(batch.scheduled),
        num_batched_tokens=sum(s.num_new_tokens for s in batch.scheduled) + num_draft_tokens,
        num_preemptions=len(batch.preempted), num_prompt_tokens=_first_token_prompts(outputs),
        num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
        num_drafts=len(accepted_lengths), num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=sum(accepted_lengths), num_target_forwards=num_forwards, pure_decode=pure_decode,
        accepted_per_position=tuple(per_position), accepted_lengths=tuple(accepted_lengths),
        draft_time_s=draft_time, verify_time_s=verify_time,
        plain_step_time_s=engine.costs.plain_step(len(batch.scheduled)) if pure_decode else None,
        finished_reasons=tuple(o.finish_reason for o in outputs if o.finished),
        chosen_k=tuple(len(d) for item, d in zip(batch.scheduled, proposal.draft_token_ids) if item.is_decode),
        drafts_by_method=tuple((m, p, a) for m, (p, a) in sorted(by_method.items())),
        predicted_time_s=plan.predicted_time if pure_decode else None,
        mask_time_s=masks.seconds, num_masked_rows=sum(m.shape[0] for m in masks.rows.values()),
        grammar_compile_s=tuple(compiled.seconds), grammar_cache_hits=compiled.cache_hits,
        num_tree_drafts=sum(t is not None for t in proposal.trees or ()),
    )
