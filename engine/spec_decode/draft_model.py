"""A small causal LM that drafts gamma tokens per request, batched over the whole step.

The draft shares the target's block tables (same block ids, its own KV
buffers), so rollback, preemption and freeing are the target's bookkeeping.
Its cache may lag the target's: each step first feeds it every token it has
not seen (prompt chunks being prefilled, the recovered/bonus token of the last
step), then drafts one token per sequential batched forward.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.model_runner import ForwardItem, ModelRunner
from engine.sampler import SamplingTensors, sample, warp_probs
from engine.scheduler import ScheduledRequest
from engine.spec_decode.base import Proposal


class DraftModelProposer:
    method = "draft"

    def __init__(self, runner: ModelRunner, target_vocab_size: int, draft_temperature: float | None = None):
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.draft_temperature = draft_temperature

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in scheduled]
        max_k = max(item.num_lookahead for item in scheduled)
        drafting = [i for i, item in enumerate(scheduled) if item.num_lookahead > 0]
        logits = self._fit_vocab(self._catch_up(scheduled))   # one row per drafting request
        if not drafting:
            return Proposal(drafts, None)

        requests = [scheduled[i].request for i in drafting]
        params = [self._draft_params(r.params) for r in requests]
        generators = [r.generator for r in requests]
        draft_probs = logits.new_zeros(len(scheduled), max_k, logits.shape[-1])
        active = list(range(len(drafting)))   # positions in `drafting` still drafting
        for step in range(max_k):
            tensors = SamplingTensors.from_params([params[a] for a in active], logits.device)
            probs = warp_probs(logits, tensors)
            noise = [None if requests[a].noise is None else requests[a].noise.at(requests[a].num_output_tokens + step)
                     for a in active]   # seeded requests draft with the noise the target will draw with
            tokens = sample(probs, tensors.is_greedy, [generators[a] for a in active], noise).tolist()
            for row, a in enumerate(active):
                i = drafting[a]
                drafts[i].append(tokens[row])
                draft_probs[i, step] = probs[row]
            active = [a for a in active if scheduled[drafting[a]].num_lookahead > step + 1]
            if not active:
                break
            logits = self._fit_vocab(self._feed_drafts([scheduled[drafting[a]] for a in active],
                                                       [drafts[drafting[a]] for a in active]))
        return Proposal(drafts, draft_probs)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, draft_vocab] -> [n, target_vocab]: embedding tables padded to different sizes
        share one tokenizer; rows past the shorter table are padding, so q gives them no mass."""
        vocab = logits.shape[-1]
        if vocab == self.target_vocab_size:
            return logits
        if vocab > self.target_vocab_size:
            return logits[:, :self.target_vocab_size]
        return torch.nn.functional.pad(logits, (0, self.target_vocab_size - vocab), value=float("-inf"))

    def _draft_params(self, params):
        if self.draft_temperature is None or params.greedy:
            return params
        return dataclasses.replace(params, temperature=self.draft_temperature)

    def _catch_up(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Feed the draft every token the target will have after this step; logits for drafters."""
        items = []
        for item in scheduled:
            request = item.request
            end = request.num_computed_tokens + item.num_new_tokens
            start = min(request.num_draft_computed_tokens, end - 1)   # always feed >= 1 token
            items.append(ForwardItem(request.token_ids[start:end], start, request.block_table,
                                     1 if item.num_lookahead > 0 else 0))
            request.num_draft_computed_tokens = end
        return self.runner.forward(items)

    def _feed_drafts(self, items: list[ScheduledRequest], drafts: list[list[int]]) -> torch.Tensor:
        """Feed each request its newest draft token; logits for the next one."""
        forward = []
        for item, tokens in zip(items, drafts):
            request = item.request
            position = request.num_tokens + len(tokens) - 1
            forward.append(ForwardItem([tokens[-1]], position, request.block_table, 1))
            request.num_draft_computed_tokens = position + 1
        return self.runner.forward(forward)

