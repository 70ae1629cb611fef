"""One request's share of a verified pass, applied to it: the tokens it keeps (up to its end point),
its counters, its logprobs, and the delta it hands back. Bookkeeping only: no tensor work, no
lifecycle (the engine finishes, trims and publishes)."""
from __future__ import annotations

import logging
import time

from engine.outputs import RequestOutput, RequestTiming
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledRequest

logger = logging.getLogger("specserve.engine")


def store_prompt_logprobs(request: Request, rows) -> None:
    """The prompt logprobs of a prefill chunk: row j scores the token after the chunk's j-th position."""
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None] * request.num_prompt_tokens
    start = request.num_computed_tokens
    for j, entry in enumerate(rows):
        if start + j + 1 < request.num_prompt_tokens:
            request.prompt_logprobs[start + j + 1] = entry


def apply_pass(request: Request, item: ScheduledRequest, token_ids: list[int], logprobs, num_drafts: int,
               num_accepted: int, proposer: str, max_model_len: int) -> tuple[list[int], int | None]:
    """A sampling pass's tokens and counters. num_drafts: the drafts it verified (proposed by
    `proposer`), num_accepted of them kept. Returns the new tokens and the drafts among them (None for
    a request's first token, which is no target forward of the decode phase)."""
    request.num_computed_tokens += item.num_new_tokens + num_accepted
    had_output = request.num_output_tokens > 0
    new_tokens = append_tokens(request, token_ids, logprobs, max_model_len)
    if request.noise is not None:
        request.noise.forget_before(request.num_output_tokens)
    request.num_proposed += num_drafts
    if item.is_decode:
        proposer = proposer if num_drafts else "none"
        request.passes_by_method[proposer] = request.passes_by_method.get(proposer, 0) + 1
        request.passes_by_k[num_drafts] = request.passes_by_k.get(num_drafts, 0) + 1
    if not had_output:
        return new_tokens, None
    request.num_accepted += len(new_tokens) - 1
    request.num_target_forwards += 1
    return new_tokens, len(new_tokens) - 1


def append_tokens(request: Request, token_ids: list[int], logprobs, max_model_len: int) -> list[int]:
    """Append accepted tokens, stopping inside the run at EOS / stop token / grammar's end / length."""
    params = request.params
    if request.first_token_time is None:
        request.first_token_time = time.monotonic()
    new = []
    for j, token in enumerate(token_ids):
        request.token_ids.append(token)
        new.append(token)
        if logprobs is not None:
            request.logprobs.append(logprobs[j])
        if request.grammar is not None and not _advance_grammar(request, token):
            break
        if token in request.eos_token_ids or token in params.stop_token_ids:
            request.finish_reason = "stop"
        elif request.grammar is not None and request.grammar.finished:   # it admits nothing more
            request.finish_reason = "stop"
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            request.status = RequestStatus.FINISHED
            break
    return new


def _advance_grammar(request: Request, token: int) -> bool:
    """Move the request's matcher past an emitted token. A refusal (the grammar past llguidance's
    limits, or the grammar engine disagreeing with its own mask) ends this request with an error
    naming it, never the loop."""
    try:
        request.grammar.advance([token])
        return True
    except RuntimeError as exc:
        message = f"{request.params.structured.kind}: {str(exc).splitlines()[0]}"   # not llguidance's state dump
        logger.error("request %s: %s", request.request_id, message)
        request.finish_reason, request.status = "error", RequestStatus.FINISHED
        request.error, request.invalid_request = message, True
        return False


def request_output(request: Request, new_tokens: list[int]) -> RequestOutput:
    """The request's delta since its last output (the prompt logprobs once; the timing when it ends)."""
    prompt_logprobs = None
    if request.wants_prompt_logprobs:
        prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
    start = request.num_emitted
    request.num_emitted = request.num_output_tokens
    timing = None
    if request.is_finished:
        timing = RequestTiming(request.arrival_time, request.first_scheduled_time,
                               request.first_token_time, time.monotonic())
    return RequestOutput(
        request_id=request.request_id, new_token_ids=new_tokens, finished=request.is_finished,
        finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        new_logprobs=request.logprobs[start:] if request.params.logprobs is not None else None,
        prompt_logprobs=prompt_logprobs, spec=request.spec_stats, timing=timing, error=request.error,
        invalid_request=request.invalid_request,
    )
