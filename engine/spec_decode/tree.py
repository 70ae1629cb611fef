"""Draft trees, how the copying proposers build them, and their lossless verification.

A draft tree holds several continuations of a request at once: node i is a token whose parent is
node parents[i] (-1: the request's last token, the root). Verified in one target pass (a
ForwardItem of the root and the nodes whose tree_mask is the ancestor mask, the root seen by all),
each node sees the context and its ancestors, at position start + depth; the target's distribution
after the root and after each node comes back as rows 0 and 1 + i.

Verification walks from the root. At a node with children, the target's token is drawn among
them by multi-candidate rejection sampling (SpecInfer's, applied to one node's children in turn):

- a child drawn from a real distribution q (a sampled draft): accept it with probability
  min(1, p(x) / q(x)); on rejection p becomes normalize(max(0, p - q)) for the next child;
- a deterministic child (n-gram and suffix continuations, a draft model's top-k: q one-hot at x):
  accept with probability p(x); on rejection p loses x (normalize(p with x zeroed)).

The first accepted child is emitted and the walk goes on from its row; when every child is rejected
(or at a leaf) one token is drawn from the p that is left, and the step ends. Each emitted token is
then distributed exactly as p given the tokens before it: the output is the target's, whatever the
tree. Greedy requests accept the child equal to argmax p; coupled (seeded) ones the child equal to
the target's own draw argmax(p / E) at that position, so their output stays independent of the
batch and the tree. Bookkeeping and small [vocab] vectors only: the pass that produces the rows is
the engine's.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

import torch
from torch import Tensor


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)   # -1: a child of the root; else an earlier node
    q: list[Tensor | None] = field(default_factory=list)   # the distribution each node was drawn from (None: deterministic)
    chain: int = 0   # its first `chain` nodes are the proposer's own chain (each the child of the one before)
    # The proposer's chance that the target takes each node's path (empty where it gave none): what
    # the policy calibrates the alternatives' bar by (alternatives).
    chances: list[float] = field(default_factory=list)

    def add(self, token: int, parent: int = -1, q: Tensor | None = None) -> int:
        """A node drawn from q (children of one node drawn independently, duplicates kept: dropping a
        repeat would change the residuals), or deterministic (q None: distinct among its siblings)."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of this tree ({len(self.tokens)} nodes)")
        if q is None and any(t == token and p == parent and self.q[i] is None
                             for i, (t, p) in enumerate(zip(self.tokens, self.parents))):
            raise ValueError(f"token {token} is already a deterministic child of node {parent}")
        self.tokens.append(token)
        self.parents.append(parent)
        self.q.append(q)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of a node (-1: the root), in the order they were added: the order they are judged."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        """1 for the root's children: the position offset of each node after the last token."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    @property
    def is_chain(self) -> bool:
        """Every node the only child of the one before it: a plain draft chain."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def subtree_in_order(self, keep: list[int], chain: int = 0) -> "DraftTree":
        """The nodes `keep`, each node's parent kept before it (or not kept: then it must be the root),
        renumbered in that order."""
        index = {old: new for new, old in enumerate(keep)}
        parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        chances = [self.chances[i] for i in keep] if self.chances else []
        return DraftTree([self.tokens[i] for i in keep], parents, [self.q[i] for i in keep], chain, chances)

    def alternatives(self, accepted: list[int]) -> tuple[float, int]:
        """(the chances summed, how many were accepted) of the nodes past the chain, given the accepted
        path's nodes: what the proposer promised of its alternatives against what they earned."""
        if not self.chances:
            return 0.0, 0
        return sum(self.chances[self.chain:]), sum(node >= self.chain for node in accepted)

    def fed_mask(self) -> np.ndarray:
        """bool [1 + n, 1 + n]: which fed tokens (the root, then the nodes) each fed token sees, as
        ForwardItem.tree_mask takes it."""
        mask = np.zeros((len(self) + 1, len(self) + 1), dtype=bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask().numpy()
        return mask

    def ancestor_mask(self) -> Tensor:
        """bool [n, n]: node i attends to node j when j is i or one of its ancestors (and to the whole
        context, which is not in this mask)."""
        mask = torch.zeros(len(self), len(self), dtype=torch.bool)
        for i in range(len(self)):
            mask[i, self.path(i)] = True
        return mask


def best_first_tree(continuations: list[list[int]], max_nodes: int, max_depth: int, min_prob: float = 0.0
                    ) -> tuple[DraftTree, list[float]]:
    """What followed each earlier occurrence of the context's end (its continuations, most trusted
    first) merged into a draft tree of deterministic nodes. A node's probability is the share of the
    continuations that agree with its path: the empirical chance that the target takes that path.
    Nodes are added best first (ties: the earlier continuation), up to max_nodes, max_depth deep and
    down to min_prob, so every prefix of the tree is the best tree of its size. Returns the tree and
    each node's probability (non-increasing)."""
    tree, probs = DraftTree(), []
    if not continuations or max_nodes <= 0 or max_depth <= 0:
        return tree, probs
    order = 0   # the heap's tie-break: first pushed, first added
    frontier = [(-1.0, order, -1, -1, list(range(len(continuations))), 0)]   # (-p, order, parent, token, agreeing, depth)
    while frontier and len(tree) < max_nodes:
        neg_p, _, parent, token, agreeing, depth = heapq.heappop(frontier)
        node = parent if token < 0 else tree.add(token, parent)
        if token >= 0:
            probs.append(-neg_p)
        if depth == max_depth:
            continue
        groups: dict[int, list[int]] = {}
        for c in agreeing:
            if depth < len(continuations[c]):
                groups.setdefault(continuations[c][depth], []).append(c)
        for child_token, members in groups.items():   # in the order of their first continuation
            p = -neg_p * len(members) / len(agreeing)
            if p >= min_prob:
                order += 1
                heapq.heappush(frontier, (-p, order, node, child_token, members, depth + 1))
    return tree, probs


def chain_first(tree: DraftTree, probs: list[float], chain: list[int]) -> DraftTree:
    """The tree reordered with the proposer's own chain first (the part a node budget left out added
    back, at its last node's probability), then the other nodes in their order (best first); each
    node's probability goes with it as its chance (DraftTree.chances)."""
    tree, probs = DraftTree(list(tree.tokens), list(tree.parents), list(tree.q)), list(probs)
    path, node = [], -1
    for token in chain:
        child = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if child is None:
            child = tree.add(token, node)
            probs.append(probs[node] if node >= 0 else 1.0)
        path.append(node := child)
    on_path = set(path)
    order = path + [i for i in range(len(tree)) if i not in on_path]
    tree.chances = probs
    return tree.subtree_in_order(order, len(path))


def cut(tree: DraftTree, chain_length: int, max_nodes: int, p_min: float) -> DraftTree:
    """A chain-first tree cut to the plan: the first chain_length nodes of its chain (the chain the
    proposer drafts for the plan, its confidence stop applied), then the other nodes, in their order,
    whose probability clears p_min and whose parent is kept, up to max_nodes in all. Alternatives are
    added only where they pay: p_min is the break-even chance of an alternative's row (the plan's
    tree_p_min). A node's probability is its chance (chain_first)."""
    chain = min(chain_length, tree.chain, max_nodes)
    keep, kept = list(range(chain)), set(range(chain))
    for i in range(tree.chain, len(tree)):
        if len(keep) >= max_nodes:
            break
        if tree.chances[i] >= p_min and (tree.parents[i] < 0 or tree.parents[i] in kept):
            keep.append(i)
            kept.add(i)
    return tree.subtree_in_order(sorted(keep), chain)


def offered_tree(chain: list[int], max_nodes: int, build) -> DraftTree | None:
    """A copying proposer's tree for its offer: when max_nodes leaves room past its chain, the tree
    build() returns (tree, probs), the chain first (chain_first); else None (a chain only)."""
    return chain_first(*build(), chain) if max_nodes > len(chain) > 0 else None


def copied_drafts(jobs, chain) -> tuple[list[list[int]], list["DraftTree | None"] | None]:
    """A copying proposer's drafts for each job: chain(job), or where the job leaves room for
    alternatives and its offer holds a tree, that tree cut to the job around that chain; and the
    trees (None where a job drafts a chain; None for all when none does)."""
    drafts, trees = [], []
    for job in jobs:
        tokens, tree = chain(job), None
        if job.wants_tree and job.offer.tree is not None:
            tree = cut(job.offer.tree, len(tokens), job.num_lookahead, job.tree_p_min)
            tokens = tree.tokens
        drafts.append(tokens)
        trees.append(None if tree is None or tree.is_chain else tree)
    return drafts, trees if any(t is not None for t in trees) else None


def target_choices(rows: Tensor, depths: list[int], noise: list[Tensor] | None = None) -> list[int]:
    """The target's own token after the root and after each node, for the deterministic walks: the
    argmax of each row (greedy), or with noise (seeded requests: the noise E_d of each output position
    from here) argmax(p / E_depth), p the warped rows. depths: each node's (the root's row is depth 0)."""
    if noise is None:
        return rows.argmax(dim=-1).tolist()
    by_row = torch.stack([noise[d] for d in [0] + depths])
    return (rows.float() / by_row).argmax(dim=-1).tolist()


def verify_tree(tree: DraftTree, target_probs: Tensor | None = None, generator: torch.Generator | None = None,
                choices: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Walk the tree against the target. choices (greedy and seeded requests, from target_choices):
    accept the child whose token is the target's own choice. Otherwise target_probs: [1 + n, vocab],
    row 0 after the root, row 1 + i after node i (warped: what plain decoding samples from), judged by
    multi-candidate rejection sampling. Returns the emitted tokens (the accepted path, then one more)
    and the accepted nodes."""
    tokens, accepted, node = [], [], -1
    while True:
        children = tree.children(node)
        if choices is not None:
            choice = choices[node + 1]
            child = next((c for c in children if tree.tokens[c] == choice), None)
        else:
            child, choice = _sample_among(tree, children, target_probs[node + 1].float(), generator)
        if child is None:
            return tokens + [choice], accepted
        tokens.append(tree.tokens[child])
        accepted.append(child)
        node = child


def _sample_among(tree: DraftTree, children: list[int], p: Tensor, generator) -> tuple[int | None, int]:
    """(the accepted child, its token), or (None, a token drawn from what is left of p)."""
    for child in children:
        token, q = tree.tokens[child], tree.q[child]
        q_token = 1.0 if q is None else float(q[token])
        if q_token > 0 and float(torch.rand((), generator=generator, device=p.device)) * q_token < float(p[token]):
            return child, token
        p = _residual(p, token, q)
    return None, int(torch.multinomial(p, 1, generator=generator))


def _residual(p: Tensor, token: int, q: Tensor | None) -> Tensor:
    """What a rejected candidate leaves of p: max(0, p - q), normalised (q one-hot at token if None)."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = (p - q.float()).clamp_min(0.0)
    total = rest.sum()
    return rest / total if total > 0 else p   # nothing left: p and q agree, any draw from p is exact
