"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request
from engine.spec_decode.base import DraftJob, Offer, Proposal
from engine.spec_decode.tree import DraftTree, best_first_tree, copied_drafts, offered_tree

MAX_MATCHES = 64   # newest occurrences a draft tree is built from: bounds a lookup on a common n-gram


def continuations(token_ids: np.ndarray, ngram_min: int, ngram_max: int) -> np.ndarray:
    """Where what followed each earlier occurrence of the longest matching suffix (ngram_max..ngram_min
    tokens) starts, oldest first; empty when no suffix occurred before."""
    num_tokens = len(token_ids)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        # Windows over token_ids[:-1] so every match has at least one token after it.
        windows = sliding_window_view(token_ids[:num_tokens - 1], n)
        hits = np.flatnonzero((windows == token_ids[num_tokens - n:]).all(axis=1))
        if len(hits):
            return hits + n
    return np.empty(0, dtype=np.int64)


def ngram_lookup(token_ids: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Longest suffix of length ngram_max..ngram_min that occurred earlier -> up to k following tokens."""
    starts = continuations(token_ids, ngram_min, ngram_max)
    if not len(starts):
        return []
    start = int(starts[-1])   # most recent occurrence: repetition tends to continue
    return token_ids[start:start + k].tolist()


def ngram_tree(token_ids: np.ndarray, ngram_min: int, ngram_max: int, max_nodes: int, max_depth: int,
               min_prob: float = 0.0) -> tuple[DraftTree, list[float]]:
    """What followed the newest MAX_MATCHES occurrences of the longest matching suffix (as
    ngram_lookup matches it), merged into a best-first draft tree (best_first_tree; ties go to the
    newer occurrence, so a lone branch is the chain ngram_lookup drafts). Returns the tree and each
    node's probability."""
    starts = continuations(token_ids, ngram_min, ngram_max)[::-1][:MAX_MATCHES].tolist()   # newest first
    return best_first_tree([token_ids[s:s + max_depth].tolist() for s in starts], max_nodes, max_depth, min_prob)


class NgramIndex:
    """Where each n-gram (ngram_min..ngram_max tokens) of one context last occurred with a token after
    it, kept up to date as tokens arrive: a lookup is a few dict probes, where ngram_lookup scans
    the whole context every step, a cost that grows with every request and every context token.
    Same answers as ngram_lookup."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}   # n-gram -> end (exclusive) of its latest occurrence

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with a context that grew (token_ids starts with the tokens already seen)."""
        start = len(self.tokens)
        self.tokens.extend(token_ids[start:])
        for end in range(max(start, 1), len(self.tokens)):   # tokens[end] now follows the n-grams ending there
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.last_end[tuple(self.tokens[end - n:end])] = end

    def lookup(self, k: int) -> list[int]:
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the longest matching suffix, its length n; 0 if none)."""
        num_tokens = len(self.tokens)
        for n in range(min(self.ngram_max, num_tokens - 1), self.ngram_min - 1, -1):
            end = self.last_end.get(tuple(self.tokens[num_tokens - n:]))
            if end is not None:
                return self.tokens[end:end + k], n
        return [], 0


class NgramProposer:
    """Free drafts from the request's own context. The engine asks for the match first (offer), so
    budget and blocks are reserved only for drafts that exist."""
    name = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[str, NgramIndex] = {}   # request id -> its context's index, as of its last step

    def _index(self, request: Request) -> NgramIndex:
        """The request's index as on_verified keeps it; where it is not current (a request not
        verified here yet), one built for this call alone."""
        index = self._indexes.get(request.request_id)
        if index is None or len(index.tokens) != request.num_tokens:
            index = NgramIndex(self.ngram_min, self.ngram_max)
            index.extend(request.token_ids)
        return index

    def offer(self, request: Request, limit: int, max_nodes: int = 0) -> Offer:
        if limit <= 0:
            return Offer()
        chain = self._index(request).lookup(limit)
        tree = offered_tree(chain, max_nodes, lambda: ngram_tree(
            np.asarray(request.token_ids), self.ngram_min, self.ngram_max, max_nodes, limit))
        return Offer(len(chain), nodes=len(tree) if tree is not None else 0, chain=tuple(chain), tree=tree)

    def propose(self, jobs: list[DraftJob]) -> Proposal:
        drafts, trees = copied_drafts(jobs, lambda job: list(job.offer.chain[:job.k]))
        return Proposal(drafts, None, trees=trees)

    def on_verified(self, request: Request) -> None:
        """The context grew by what verification kept: the index follows it."""
        index = self._indexes.get(request.request_id)
        if index is None or len(index.tokens) > request.num_tokens:   # new, or a context that shrank
            index = self._indexes[request.request_id] = NgramIndex(self.ngram_min, self.ngram_max)
        index.extend(request.token_ids)

    def on_finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
