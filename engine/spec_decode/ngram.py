"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.spec_decode.base import Proposal


def ngram_lookup(token_ids: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Longest suffix of length ngram_max..ngram_min that occurred earlier -> up to k following tokens."""
    num_tokens = len(token_ids)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        suffix = token_ids[num_tokens - n:]
        # Windows over token_ids[:-1] so every match has at least one token after it.
        windows = sliding_window_view(token_ids[:num_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n   # most recent occurrence: repetition tends to continue
            return token_ids[start:start + k].tolist()
    return []


class NgramProposer:
    """Free drafts from the request's own context. The controller asks for the match first
    (max_drafts), so budget and blocks are reserved only for drafts that exist."""
    method = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._matches: dict[str, tuple[int, list[int]]] = {}   # request id -> (num_tokens, drafts) this step

    def _lookup(self, request: Request, k: int) -> list[int]:
        cached = self._matches.get(request.request_id)
        if cached is not None and cached[0] == request.num_tokens and len(cached[1]) >= k:
            return cached[1][:k]
        tokens = ngram_lookup(np.asarray(request.token_ids, dtype=np.int64), self.ngram_min, self.ngram_max, k)
        self._matches[request.request_id] = (request.num_tokens, tokens)
        return tokens

    def max_drafts(self, request: Request, limit: int) -> int:
        return len(self._lookup(request, limit)) if limit > 0 else 0

    def catch_up_tokens(self, request: Request) -> int:
        return 0

    def propose(self, items: list[ScheduledRequest]) -> Proposal:
        return Proposal([self._lookup(item.request, item.num_lookahead)[:item.num_lookahead] for item in items], None)

    def on_verified(self, request: Request) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        self._matches.pop(request_id, None)
