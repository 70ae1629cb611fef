"""A step's StepStats for the metrics, from what it scheduled, drafted, emitted and timed: bookkeeping
only, apart from the engine's loop."""
from __future__ import annotations

from engine.outputs import RequestOutput, StepStats
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec_decode.decoder import StepResult
from engine.spec_decode.policy import StepPlan
from engine.step_costs import StepCosts
from engine.structured import CompileStats


def proposer_of(plan: StepPlan, item: ScheduledRequest) -> str:
    """The proposer that drafted for a scheduled request ("none" when it verifies no drafts)."""
    draft = plan.drafts.get(item.request.request_id)
    return draft.proposer if draft is not None and item.num_lookahead else "none"


def _first_token_prompts(outputs: list[RequestOutput]) -> int:
    """Prompt tokens of the requests that got their first token this step (each prompt counted once,
    whatever prefix caching or recomputation after preemption did)."""
    return sum(o.num_prompt_tokens for o in outputs if o.new_token_ids and o.num_output_tokens == len(o.new_token_ids))


def step_stats(batch: SchedulerOutput, plan: StepPlan, result: StepResult, emitted_drafts: list[int | None],
               outputs: list[RequestOutput], *, method: str, scheduler: Scheduler, costs: StepCosts,
               compiled: CompileStats) -> StepStats:
    """emitted_drafts: per scheduled request, the drafts it emitted (None: no token after its first);
    method: the configured strategy; compiled: the grammars compiled since the last step."""
    proposal, masks = result.proposal, result.masks
    per_position = [0] * scheduler.gamma
    accepted_lengths = []
    for drafts, emitted in zip(proposal.draft_token_ids, emitted_drafts):
        if drafts and emitted is not None:
            accepted_lengths.append(emitted)
            for pos in range(emitted):
                per_position[pos] += 1
    num_forwards = sum(e is not None for e in emitted_drafts)
    pure_decode = all(item.is_decode for item in batch.scheduled)
    by_proposer: dict[str, list[int]] = {}
    for item, drafts, emitted in zip(batch.scheduled, proposal.draft_token_ids, emitted_drafts):
        if drafts:
            counts = by_proposer.setdefault(proposer_of(plan, item), [0, 0])
            counts[0] += len(drafts)
            counts[1] += emitted or 0
    num_draft_tokens = sum(len(d) for d in proposal.draft_token_ids)
    return StepStats(
        method=method, num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        kv_cache_usage=scheduler.pool.usage, batch_size=len(batch.scheduled),
        num_batched_tokens=sum(s.num_new_tokens for s in batch.scheduled) + num_draft_tokens,
        num_preemptions=len(batch.preempted), num_prompt_tokens=_first_token_prompts(outputs),
        num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
        num_drafts=len(accepted_lengths), num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=sum(accepted_lengths), num_target_forwards=num_forwards, pure_decode=pure_decode,
        accepted_per_position=tuple(per_position), accepted_lengths=tuple(accepted_lengths),
        draft_time_s=result.draft_time, verify_time_s=result.verify_time,
        plain_step_time_s=costs.plain_step(len(batch.scheduled)) if pure_decode else None,
        finished_reasons=tuple(o.finish_reason for o in outputs if o.finished),
        chosen_k=tuple(len(d) for item, d in zip(batch.scheduled, proposal.draft_token_ids) if item.is_decode),
        drafts_by_proposer=tuple((m, p, a) for m, (p, a) in sorted(by_proposer.items())),
        predicted_time_s=plan.predicted_time if pure_decode else None,
        mask_time_s=masks.seconds, num_masked_rows=sum(m.shape[0] for m in masks.rows.values()),
        grammar_compile_s=tuple(compiled.seconds), grammar_cache_hits=compiled.cache_hits,
        num_tree_drafts=sum(t is not None for t in proposal.trees or ()),
    )
