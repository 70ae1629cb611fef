"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For draft token x_j proposed from q_j, accept with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token drawn from
normalize(max(0, p_j - q_j)); if every draft is accepted emit a bonus token from
p_K. The emitted sequence is then distributed exactly as sampling from p token
by token. Greedy rows accept while argmax(p_j) == x_j.

All accept/reject math is batched; the only Python loop draws each seeded
sampled row's random numbers from its own generator, in a fixed order (num_draft
uniforms, then one V-sized exponential draw for the extra token); unseeded rows
draw in one call.

Coupled rows (seeded requests, engine.sampler.PositionalNoise) come with the
target's own draw at every row, argmax(p_j / E_j); their drafts were drawn as
argmax(q_j / E_j) with the same noise. A coupled row accepts while the target's
draw equals the draft and emits the target's draw at the first mismatch (or the
bonus): every emitted token is the target's draw, so the output is exactly p's,
and the same for the same seed whatever the drafts were.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.sampler import draw_exponentials, exponential_race


def rejection_sample(
    target_probs: Tensor,          # [B, K+1, V] warped target p; row j judges draft j, row num_draft[b] gives the bonus
    draft_token_ids: Tensor,       # [B, K], anything past num_draft[b]
    num_draft_tokens: Tensor,      # [B], 0..K
    draft_probs: Tensor | None,    # [B, K, V] warped draft q; None (or an all-zero row) = one-hot at the draft token
    is_greedy: Tensor,             # [B] bool
    generators: list[torch.Generator | None],
    coupled_choice: Tensor | None = None,   # [B, K+1] the target's draw per row for coupled rows, -1 elsewhere
) -> tuple[Tensor, Tensor]:
    """Returns output_token_ids [B, K+1] (padded with -1) and num_accepted [B].

    Row b emits num_accepted[b] accepted drafts followed by one more token (the
    recovered token at the first rejection, or the bonus): num_accepted[b] + 1
    valid tokens.
    """
    batch_size, num_rows, vocab_size = target_probs.shape
    max_draft = num_rows - 1
    device = target_probs.device
    rows = torch.arange(batch_size, device=device)
    num_draft = num_draft_tokens.to(device=device, dtype=torch.long)
    greedy = is_greedy.to(device=device, dtype=torch.bool)

    valid = torch.arange(max_draft, device=device).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.long), 0)    # safe to gather
    p_at_draft = target_probs[:, :max_draft].gather(2, drafts.unsqueeze(2)).squeeze(2)     # [B, K]
    if draft_probs is None:
        q_one_hot = torch.ones_like(valid)
        q_at_draft = torch.ones_like(p_at_draft)
    else:
        q_one_hot = draft_probs.amax(dim=-1) == 0
        q_at_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_at_draft = torch.where(q_one_hot, torch.ones_like(q_at_draft), q_at_draft)

    coupled = coupled_choice[:, 0] >= 0 if coupled_choice is not None else torch.zeros_like(greedy)
    draws_nothing = [g or c for g, c in zip(is_greedy.tolist(), coupled.tolist())]
    uniforms, noise = _draw_random(draws_nothing, num_draft_tokens.tolist(), generators, max_draft, vocab_size, device)

    # u < p/q, written without the division; p = 0 is never accepted (u >= 0),
    # p >= q always is (u < 1).
    accept_sampled = uniforms * q_at_draft < p_at_draft
    accept_greedy = target_probs[:, :max_draft].argmax(dim=-1) == drafts
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_sampled)
    if coupled_choice is not None:
        accept = torch.where(coupled.unsqueeze(1), coupled_choice[:, :max_draft] == drafts, accept)
    accept = accept & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)                                  # [B]

    # The extra token comes from p at the first unaccepted position; for a
    # sampled row that stopped on a rejection, from the residual max(0, p - q).
    extra_dist = target_probs[rows, num_accepted]                                           # [B, V]
    if max_draft > 0:
        position = num_accepted.clamp(max=max_draft - 1)
        rejected_token = drafts[rows, position]
        q_rows = torch.zeros_like(extra_dist).scatter_(1, rejected_token.unsqueeze(1), 1.0)
        if draft_probs is not None:
            q_rows = torch.where(q_one_hot[rows, position].unsqueeze(1), q_rows, draft_probs[rows, position])
        residual = (extra_dist - q_rows).clamp_min(0.0)
        # residual may be all zero when p == q up to rounding: fall back to p.
        use_residual = (num_accepted < num_draft) & ~greedy & (residual.sum(dim=-1) > 0)
        extra_dist = torch.where(use_residual.unsqueeze(1), residual, extra_dist)
    # Greedy rows carry noise of ones, so the race is a plain argmax there.
    extra_token = exponential_race(extra_dist, noise)
    if coupled_choice is not None:
        extra_token = torch.where(coupled, coupled_choice[rows, num_accepted], extra_token)

    positions = torch.arange(num_rows, device=device).unsqueeze(0)
    accepted_part = torch.cat([drafts, drafts.new_zeros(batch_size, 1)], dim=1)
    na = num_accepted.unsqueeze(1)
    output = torch.where(positions < na, accepted_part, torch.where(positions == na, extra_token.unsqueeze(1), -1))
    return output, num_accepted


def _draw_random(
    draws_nothing: list[bool],
    num_draft: list[int],
    generators: list[torch.Generator | None],
    max_draft: int,
    vocab_size: int,
    device,
) -> tuple[Tensor, Tensor]:
    """Per seeded sampled row, from its own generator in this order: num_draft uniforms, then V
    exponentials. Unseeded sampled rows share the global RNG (not reproducible anyway), so they are
    drawn together in one call of each (draw_exponentials does the same for the noise). Greedy and
    coupled rows draw nothing (their uniforms are unused, their noise is 1)."""
    uniforms = torch.ones(len(draws_nothing), max_draft, dtype=torch.float32, device=device)
    noise = torch.ones(len(draws_nothing), vocab_size, dtype=torch.float32, device=device)
    sampled = [b for b, skip in enumerate(draws_nothing) if not skip]
    if not sampled:
        return uniforms, noise
    for b in sampled:
        if generators[b] is not None and num_draft[b] > 0:
            uniforms[b, : num_draft[b]] = torch.rand(num_draft[b], generator=generators[b], device=device)
    unseeded = [b for b in sampled if generators[b] is None]
    if unseeded:
        index = torch.tensor(unseeded, dtype=torch.long, device=device)
        uniforms.index_copy_(0, index, torch.rand(len(unseeded), max_draft, device=device))
    index = torch.tensor(sampled, dtype=torch.long, device=device)
    noise.index_copy_(0, index, draw_exponentials([generators[b] for b in sampled], vocab_size, device))
    return uniforms, noise
