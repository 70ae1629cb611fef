"""EAGLE-style self-drafting: a one-layer head (engine/models/eagle.py) drafts from the target's
own features, a chain of up to k tokens per request (or a tree, EAGLE-2's dynamic tree: see
below), batched over its requests.

The head's input at position p is (the target's feature at p, the token at p + 1). The target
runner keeps every computed position's feature in a paged buffer (ModelRunner.keep_features), so
the head reads what it needs by block table: after a rejection, a preemption or a prefix-cache
hit there is nothing to repair, only positions to (re)feed. The head's KV cache shares the
target's block tables, like a draft model's; its cursor counts the positions fed with the
target's features. Drafting runs the chain on the head's own outputs in place of the target's
features, and those positions are fed again with the real ones once the target has computed them,
so the cursor never moves past the target's computed tokens.

Trees grow as a draft model's do (tree_growth.py: the head's own chain first, then the paying
alternatives from its top tokens, a depth per forward); what EAGLE adds is each node's feature:
the head's output at the node's parent (at the root, the catch-up's output), so every path of the
tree is drafted exactly as a chain along it would be.

Everything else (sampling, the confidence stop, seeded noise, cost reports) is the draft model's
loop: EagleProposer is a DraftModelProposer whose forwards take features.
"""
from __future__ import annotations

import torch

from engine.model_runner import ForwardItem, ModelRunner
from engine.request import Request
from engine.spec_decode.base import DraftJob
from engine.spec_decode.draft_model import DraftModelProposer, frontier_items
from engine.spec_decode.tree_growth import TreeGrowth


class EagleProposer(DraftModelProposer):
    name = "eagle"

    def __init__(self, head: ModelRunner, target: ModelRunner, target_vocab_size: int,
                 draft_temperature: float | None = None):
        super().__init__(head, target_vocab_size, draft_temperature)
        self.target = target
        self._chain: dict[str, torch.Tensor] = {}   # during a proposal: each request's newest head output [H]
        self._node_outputs: dict[str, dict[int, torch.Tensor]] = {}   # ... and its tree's, by node (-1: root)

    def catch_up_tokens(self, request: Request) -> int:
        # The first forward always feeds the newest computed position; past that, each position the
        # head has not seen with the target's feature (one plus the accepted drafts, every step).
        return max(0, request.num_computed_tokens - self.cursor(request) - 1)

    def _catch_up(self, items: list[DraftJob]) -> torch.Tensor:
        """Feed each request's pairs (feature p, token p + 1) from its cursor up to its newest
        computed position; logits for the first draft."""
        forward, spans, self._chain = [], [], {}
        for item in items:
            request = item.request
            computed = request.num_computed_tokens      # the last token (at `computed`) is not in the target yet
            start = min(self.cursor(request), computed - 1)   # always feed >= 1 position
            forward.append(ForwardItem(request.token_ids[start + 1:computed + 1], start, request.block_table, 1))
            spans.append((request.block_table, start, computed))
            self._set_cursor(request, computed)
        logits, hidden = self.runner.forward(forward, self.target.read_features(spans), return_hidden=True)
        self._node_outputs = {}
        self._remember(items, hidden)
        return logits

    def _feed(self, chains: list[DraftJob], drafts: list[list[int]], trees: list[DraftJob],
              growths: list[TreeGrowth]) -> torch.Tensor:
        """One forward: each chain's (newest head output, newest draft token), then each tree's frontier,
        each node paired with the head's output at its parent, at the slots from the request's newest
        computed position (the head's input at p is the feature at p and the token at p + 1), each
        node seeing the context and its ancestors. Logits for what follows each, in that order. The
        cursor stays: these positions hold the head's guesses, not the target's features."""
        forward = [ForwardItem([tokens[-1]], item.request.num_computed_tokens + len(tokens) - 1,
                               item.request.block_table, 1) for item, tokens in zip(chains, drafts)]
        features = [self._chain[item.request.request_id] for item in chains]
        for item, growth in zip(trees, growths):
            rid = item.request.request_id
            outputs = self._node_outputs.setdefault(rid, {-1: self._chain[rid]})
            features.extend(outputs[growth.tree.parents[n]] for n in growth.frontier)
        forward += frontier_items(trees, growths, lambda r: r.num_computed_tokens)
        logits, hidden = self.runner.forward(forward, torch.stack(features), return_hidden=True)
        self._remember(chains, hidden[:len(chains)])
        rows = iter(hidden[len(chains):])
        for item, growth in zip(trees, growths):
            self._node_outputs[item.request.request_id].update((n, next(rows)) for n in growth.frontier)
        return logits

    def _remember(self, items: list[DraftJob], hidden: torch.Tensor) -> None:
        for item, row in zip(items, hidden):
            self._chain[item.request.request_id] = row
