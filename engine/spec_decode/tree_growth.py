"""A draft tree grown by a draft model, a depth per forward (EAGLE-2's dynamic trees, in our terms).

The draft scores each frontier node's children (its top tokens and its probabilities of them); a
child's score is its path's probability under the draft, the product down from the root. The
draft's own chain (its top token after its top token, what a chain would draft for the plan's k,
cut by p_min past the first as a chain is) grows first, and each depth leaves room for one node
per deeper depth, so the tree holds that chain: a tree verifies at least what the chain would.
The other slots (the budget the plan reserved) go to the alternatives scoring at least tree_p_min
(the chance an alternative needs to pay for its row), best first, depth by depth; the children
that are neither an end of sequence nor at the depth limit are the next frontier. A draft sure of
its chain spends nothing on alternatives, an unsure one spends them near the root, where the most
is at stake. The nodes are deterministic children (q one-hot): verification judges them as it
judges n-gram branches.

Bookkeeping only: the forwards and the top-k are the proposer's.
"""
from __future__ import annotations

import numpy as np

from engine.spec_decode.tree import DraftTree


class TreeGrowth:
    def __init__(self, budget: int, max_depth: int, p_min: float, eos_token_ids: frozenset[int],
                 tree_p_min: float | None = None):
        self.budget, self.max_depth, self.p_min, self.eos = budget, max_depth, p_min, eos_token_ids
        self.tree_p_min = p_min if tree_p_min is None else tree_p_min   # the alternatives' bar
        self.tree = DraftTree()
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.frontier: list[int] = [-1]   # nodes whose children the next scores are for (-1: the root)
        self.chain: int | None = -1       # the tip of the draft's own chain while it grows (-1: the root)
        self.chain_nodes: list[int] = []

    @property
    def room(self) -> int:
        return self.budget - len(self.tree)

    def expand(self, children: list[tuple[list[int], list[float]]]) -> None:
        """children: for each frontier node in order, its top tokens (best first) and the draft's
        probability of each. Adds the chain's next node and the paying alternatives, best first,
        within the budget; the expandable new nodes become the frontier, last in node order (the
        tokens the next forward feeds)."""
        candidates = []   # (not the chain's, -score, parent, token, depth)
        for parent, (tokens, probs) in zip(self.frontier, children):
            base = 1.0 if parent < 0 else self.scores[parent]
            depth = 1 if parent < 0 else self.depths[parent] + 1
            for rank, (token, q) in enumerate(zip(tokens, probs)):
                chain = parent == self.chain and rank == 0 and (parent < 0 or base * q >= self.p_min)
                if chain or base * q >= self.tree_p_min:
                    candidates.append((not chain, -base * q, parent, token, depth))
        candidates.sort()
        depth = candidates[0][4] if candidates else self.max_depth
        kept = candidates[:min(self.room, max(1, self.room - (self.max_depth - depth)))]   # room for the chain to go on
        self.frontier, self.chain = [], None
        for not_chain, neg_score, parent, token, depth in sorted(kept, key=self._expandable):   # leaves first
            node = self.tree.add(token, parent)
            self.scores.append(-neg_score)
            self.depths.append(depth)
            if not not_chain:
                self.chain_nodes.append(node)
            if self._expandable((not_chain, neg_score, parent, token, depth)):
                self.frontier.append(node)
                if not not_chain:
                    self.chain = node
        if not self.room:   # the budget is spent: nothing more to score
            self.frontier, self.chain = [], None

    def _expandable(self, candidate) -> bool:
        return candidate[3] not in self.eos and candidate[4] < self.max_depth

    def feed_mask(self) -> np.ndarray:
        """bool [frontier, nodes]: which of the tree's positions each frontier node sees (ancestors, itself)."""
        return self.tree.ancestor_mask().numpy()[-len(self.frontier):] if self.frontier else np.zeros((0, 0), bool)

    def result(self) -> DraftTree:
        """The tree with the draft's chain first (DraftTree.chain), then the alternatives best first by
        score (ties: the older node)."""
        chain = set(self.chain_nodes)
        others = sorted((i for i in range(len(self.tree)) if i not in chain), key=lambda i: (-self.scores[i], i))
        self.tree.chances = list(self.scores)
        return self.tree.subtree_in_order(self.chain_nodes + others, len(self.chain_nodes))
