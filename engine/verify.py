"""Verification: one target forward pass over the whole batch, then batched accept/reject.

For each request that samples this step the target scores [its last token] +
its k draft tokens: logits row j judges draft token j, row k gives the bonus
token. Requests still prefilling contribute their prompt chunk (and logits
only when they asked for prompt logprobs). A request whose drafts are a tree
(Proposal.trees) feeds its nodes under the tree's mask and is walked by
spec_decode/tree.py's verify_tree; its accepted path's keys and values then
move to the positions the next step reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model_runner import ForwardItem, ModelRunner
from engine.outputs import TokenLogprob
from engine.sampler import SamplingTensors, apply_penalties, compute_logprobs, exponential_race, warp_probs
from engine.scheduler import ScheduledRequest
from engine.spec_decode.base import Proposal
from engine.spec_decode.rejection import rejection_sample
from engine.spec_decode.tree import DraftTree, target_choices, verify_tree
from engine.structured import mask_logits


@dataclass
class VerifyResult:
    token_ids: list[list[int]]                 # per scheduled request: accepted drafts + one more token
    num_accepted: list[int]
    logprobs: list[list[TokenLogprob] | None]  # per emitted token, when the request asked
    prompt_logprobs: list[list[TokenLogprob]]  # per fed prompt position, when the request asked
    tree_paths: dict[int, list[int]] = field(default_factory=dict)   # a tree's accepted nodes, by request


def verify(target: ModelRunner, scheduled: list[ScheduledRequest], proposal: Proposal,
           masks: dict[int, torch.Tensor] | None = None) -> VerifyResult:
    """masks: per scheduled position, bool [1 + drafts, vocab]: the tokens a grammar allows at each
    of that request's emitting rows (engine/structured.py); the rest get no probability."""
    items, sample_rows, prompt_rows = _forward_items(scheduled, proposal)
    logits = target.forward(items)
    n = len(scheduled)
    result = VerifyResult([[] for _ in range(n)], [0] * n, [None] * n, [[] for _ in range(n)])
    for i, rows in prompt_rows.items():
        request = scheduled[i].request
        start = request.num_computed_tokens
        targets = request.token_ids[start + 1:start + 1 + len(rows)]
        result.prompt_logprobs[i] = _logprobs(logits[rows[:len(targets)]], targets, request.params.prompt_logprobs)
    if masks:
        _mask(logits, sample_rows, masks)
    trees = {i: tree for i, tree in enumerate(proposal.trees or ()) if tree is not None and i in sample_rows}
    chains = {i: rows for i, rows in sample_rows.items() if i not in trees}
    if chains:
        _accept(scheduled, proposal, logits, chains, result)
    for i, tree in trees.items():
        _accept_tree(target, scheduled[i].request, tree, logits[sample_rows[i]], result, i)
    return result


def _mask(logits: torch.Tensor, sample_rows: dict[int, list[int]], masks: dict[int, torch.Tensor]) -> None:
    """Tokens a grammar forbids get no probability at the request's emitting rows (consecutive rows:
    masked in place through a view)."""
    for i, allowed in masks.items():
        rows = sample_rows[i]
        mask_logits(logits[rows[0]:rows[-1] + 1], allowed)


def _forward_items(scheduled, proposal):
    """Feed lists for the target, and which logits rows each request needs."""
    items, sample_rows, prompt_rows = [], {}, {}
    row = 0
    for i, (item, drafts) in enumerate(zip(scheduled, proposal.draft_token_ids)):
        request = item.request
        start = request.num_computed_tokens
        fed = request.token_ids[start:start + item.num_new_tokens] + drafts
        num_sample = 1 + len(drafts) if item.samples else 0
        num_logits = max(num_sample, item.num_new_tokens if request.wants_prompt_logprobs else 0)
        tree = proposal.trees[i] if proposal.trees else None
        items.append(ForwardItem(fed, start, request.block_table, num_logits,
                                 tree.fed_mask() if tree is not None else None))
        if num_sample:
            sample_rows[i] = list(range(row + num_logits - num_sample, row + num_logits))
        if request.wants_prompt_logprobs:
            prompt_rows[i] = list(range(row, row + num_logits))
        row += num_logits
    return items, sample_rows, prompt_rows


def _accept(scheduled, proposal: Proposal, logits: torch.Tensor, sample_rows: dict[int, list[int]],
            result: VerifyResult) -> None:
    order = list(sample_rows)
    requests = [scheduled[i].request for i in order]
    drafts = [proposal.draft_token_ids[i] for i in order]
    if all(_plain_greedy(r.params) and r.noise is None for r in requests):
        _accept_greedy(order, drafts, logits, sample_rows, result)
        return
    max_k = max(len(d) for d in drafts)
    # [B, K+1] row indices into logits, padded by repeating each request's last row.
    index = torch.tensor([rows + rows[-1:] * (max_k + 1 - len(rows)) for rows in (sample_rows[i] for i in order)],
                         dtype=torch.long, device=logits.device)
    raw = logits[index]                                        # [B, K+1, V]
    flat_params = [r.params for r in requests for _ in range(max_k + 1)]
    flat = raw.reshape(-1, raw.shape[-1])
    if any(p.has_penalties for p in flat_params):
        histories = [r.output_token_ids + d[:j] for r, d in zip(requests, drafts) for j in range(max_k + 1)]
        prompts = [r.token_ids[:r.num_prompt_tokens] for r in requests for _ in range(max_k + 1)]
        flat = apply_penalties(flat.clone(), flat_params, prompts, histories)
    tensors = SamplingTensors.from_params(flat_params, logits.device)
    target_probs = warp_probs(flat, tensors).view(len(order), max_k + 1, -1)

    draft_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in drafts], dtype=torch.long, device=logits.device)
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=logits.device)
    draft_probs = None
    if proposal.draft_probs is not None and max_k > 0:
        draft_probs = proposal.draft_probs
        if order != list(range(len(draft_probs))) or draft_probs.shape[1] != max_k:
            draft_probs = draft_probs[torch.tensor(order, device=logits.device), :max_k]
    is_greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
    out, num_accepted = rejection_sample(target_probs, draft_ids.view(len(order), max_k), num_drafts,
                                         draft_probs, is_greedy, [r.generator for r in requests],
                                         _coupled_choice(requests, target_probs))
    out, num_accepted = out.tolist(), num_accepted.tolist()
    for b, i in enumerate(order):
        tokens = out[b][:num_accepted[b] + 1]
        result.token_ids[i], result.num_accepted[i] = tokens, num_accepted[b]
        wanted = requests[b].params.logprobs
        if wanted is not None:
            result.logprobs[i] = _logprobs(raw[b, :len(tokens)], tokens, wanted)


def _accept_tree(target: ModelRunner, request, tree: DraftTree, rows: torch.Tensor, result: VerifyResult,
                 i: int) -> None:
    """Walk one request's draft tree against its rows (the root's, then each node's), then copy the
    accepted path's KV to the consecutive positions after the root."""
    params, depths, probs, choices = request.params, tree.depths(), None, None
    if params.greedy:
        choices = target_choices(rows, depths)
    else:
        probs = warp_probs(rows, SamplingTensors.from_params([params] * len(rows), rows.device))
    if request.noise is not None:   # seeded: the target's own draw at each output position
        noise = [request.noise.at(request.num_output_tokens + d) for d in range(max(depths) + 1)]
        choices = target_choices(probs, depths, noise)
    tokens, accepted = verify_tree(tree, probs, request.generator, choices)
    result.token_ids[i], result.num_accepted[i], result.tree_paths[i] = tokens, len(accepted), accepted
    if params.logprobs is not None:
        result.logprobs[i] = _logprobs(rows[[0] + [1 + node for node in accepted]], tokens, params.logprobs)
    first = request.num_computed_tokens + 1   # the first node's slot, and the accepted path's first position
    moves = [(first + node, first + depth) for depth, node in enumerate(accepted) if node != depth]
    if moves:
        target.move_kv(request.block_table, *map(list, zip(*moves)))


def _plain_greedy(params) -> bool:
    return params.greedy and not params.has_penalties and params.logprobs is None


def _accept_greedy(order: list[int], drafts: list[list[int]], logits: torch.Tensor,
                   sample_rows: dict[int, list[int]], result: VerifyResult) -> None:
    """Greedy rows without penalties or logprobs: accept drafts while they equal the target's
    argmax, then emit the argmax at the first mismatch (or the bonus row). The same tokens as the
    general path, which builds warped [B, K+1, V] vocabulary-wide distributions first, all for one
    argmax per row."""
    flat = [row for i in order for row in sample_rows[i]]
    best = logits[torch.tensor(flat, dtype=torch.long, device=logits.device)].argmax(dim=-1).tolist()
    start = 0
    for i, draft in zip(order, drafts):
        targets = best[start:start + len(sample_rows[i])]
        start += len(targets)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        result.token_ids[i], result.num_accepted[i] = draft[:accepted] + [targets[accepted]], accepted


def _coupled_choice(requests, target_probs: torch.Tensor) -> torch.Tensor | None:
    """[B, K+1]: the target's own draw at each row for requests with PositionalNoise, -1 for others."""
    coupled = [b for b, r in enumerate(requests) if r.noise is not None]
    if not coupled:
        return None
    rows = target_probs.shape[1]
    noise = torch.stack([torch.stack([requests[b].noise.at(requests[b].num_output_tokens + j) for j in range(rows)])
                         for b in coupled])                                    # [C, K+1, V]
    index = torch.tensor(coupled, device=target_probs.device)
    choice = torch.full(target_probs.shape[:2], -1, dtype=torch.long, device=target_probs.device)
    choice[index] = exponential_race(target_probs[index], noise)
    return choice


def _logprobs(rows: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    if not token_ids:
        return []
    ids = torch.tensor(token_ids, dtype=torch.long, device=rows.device)
    chosen, top_ids, top_lp = compute_logprobs(rows, ids, num_top)
    chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
    return [TokenLogprob(t, c, tuple(zip(ti, tl))) for t, c, ti, tl in zip(token_ids, chosen, top_ids, top_lp)]
