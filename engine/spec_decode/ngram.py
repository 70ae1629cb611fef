"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
    method = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, scheduled: list[ScheduledRequest]) -> Proposal:
        drafts = []
        for item in scheduled:
            if item.num_lookahead == 0:
                drafts.append([])
                continue
            tokens = np.asarray(item.request.token_ids, dtype=np.int64)
            drafts.append(ngram_lookup(tokens, self.ngram_min, self.ngram_max, item.num_lookahead))
        return Proposal(drafts, None)
