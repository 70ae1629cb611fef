"""Suffix drafting: continue the context the way it continued before, in this request or in earlier ones.

Two indexes answer the same question, "where did the last tokens of this context occur before, and
what came next?":
- each request's own index over its prompt and output so far;
- one shared cache of the outputs of recent requests (tool calls, JSON, code an agent loop writes
  again and again), capped in tokens; the oldest outputs are evicted first. It keeps one index per
  tenant (Request.tenant): a request drafts only from its own tenant's outputs, so the drafts it is
  offered, and the `speculative` counters a response carries, say nothing about another tenant's.

An index maps every q-gram (q = 1..Q) to the newest MAX_CANDIDATES positions where it ends, so an
update costs O(Q) per new token (never a rebuild), memory is O(Q) per token, and eviction takes a
document's positions back out. A lookup takes the occurrences of the context's last Q-gram (or
shorter), extends each match backwards up to `max_match` tokens, keeps the longest matches, and
walks forward along the most frequent
continuation: at each step the share of the kept occurrences that agree is the empirical
probability of the next token, and drafting stops once the product of those probabilities falls
below `min_prob`. The draft's score is match length x frequency (how long the match and how many
occurrences back its first token); below `min_score` it drafts nothing. Its length is at most
`spec_factor` x the match length (as SuffixDecoding does): a match of 20 tokens is a copy in
progress, worth drafting far; a match of 2 is a guess. Of the two indexes the one
whose draft has more expected accepted tokens wins. The policy's confidence stop (the plan's
p_min) cuts the draft where its cumulative probability falls below the bar, as it cuts a draft
model's by the model's own probabilities.

Bookkeeping only: no tensors here.
"""
from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

from engine.request import Request
from engine.spec_decode.base import DraftJob, Offer, Proposal
from engine.spec_decode.tree import DraftTree, best_first_tree, copied_drafts, offered_tree

MAX_CANDIDATES = 64   # newest occurrences kept per q-gram: bounds lookups on common q-grams, and memory


@dataclass(frozen=True)
class SuffixDraft:
    token_ids: list[int]
    probs: list[float]       # empirical probability of each draft token given the ones before it
    match_length: int
    frequency: int           # occurrences behind the first draft token
    shared: bool = False     # from other requests' outputs (else the request's own context)

    @property
    def score(self) -> int:
        return self.match_length * self.frequency

    @property
    def expected_accepted(self) -> float:
        """Sum over positions of the probability that every draft up to it is right."""
        total, cumulative = 0.0, 1.0
        for p in self.probs:
            cumulative *= p
            total += cumulative
        return total


NO_DRAFT = SuffixDraft([], [], 0, 0)


class SuffixIndex:
    """Positions of every q-gram (q = 1..max_q) in a stream of documents. Positions are absolute
    (they survive eviction of older documents); no q-gram spans two documents."""

    def __init__(self, max_q: int = 3):
        self.max_q = max_q
        self.tokens: list[int] = []          # the stream, oldest first
        self.base = 0                        # absolute position of tokens[0]
        self.doc_ends: list[int] = []        # absolute end (exclusive) of each closed document, ascending
        self.doc_start = 0                   # absolute start of the open document
        self.ends: dict[tuple[int, ...], list[int]] = {}   # q-gram -> newest absolute positions of its last token

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def extend(self, token_ids) -> None:
        for token in token_ids:
            self.tokens.append(token)
            position = self.end - 1
            for q in range(1, min(self.max_q, position - self.doc_start + 1) + 1):
                positions = self.ends.setdefault(tuple(self.tokens[len(self.tokens) - q:]), [])
                positions.append(position)
                if len(positions) > MAX_CANDIDATES:
                    del positions[0]

    def close_document(self) -> None:
        """End the open document: later tokens never continue it."""
        if self.end > self.doc_start:
            self.doc_ends.append(self.end)
            self.doc_start = self.end

    def evict_oldest(self) -> int:
        """Drop the oldest closed document and its positions; returns how many tokens it held."""
        end = self.doc_ends.pop(0)
        start = self.base
        for position in range(start, end):
            for q in range(1, min(self.max_q, position - start + 1) + 1):
                key = tuple(self.tokens[position - self.base - q + 1:position - self.base + 1])
                positions = self.ends.get(key)
                while positions and positions[0] < end:   # ascending: this document's are the oldest
                    del positions[0]
                if positions == []:
                    del self.ends[key]
        del self.tokens[:end - start]
        self.base = end
        return end - start

    def document_end(self, position: int) -> int:
        """Absolute end (exclusive) of the document holding position."""
        i = bisect_right(self.doc_ends, position)
        return self.doc_ends[i] if i < len(self.doc_ends) else self.end

    def document_start(self, position: int) -> int:
        i = bisect_right(self.doc_ends, position)
        return self.doc_ends[i - 1] if i > 0 else self.base

    def lookup(self, context: list[int], k: int, max_match: int, min_prob: float,
               spec_factor: float | None = None) -> SuffixDraft:
        """Up to k tokens (and at most spec_factor x the match length) that followed the longest
        occurrences of context's suffix that have a token after them (when the context is this
        index's open document, its own end has none)."""
        if k <= 0 or not context:
            return NO_DRAFT
        kept, longest = self._longest_matches(context, max_match)
        if not kept:
            return NO_DRAFT
        if spec_factor is not None:
            k = min(k, max(1, math.ceil(spec_factor * longest)))
        return self._follow(kept, longest, k, min_prob)

    def lookup_tree(self, context: list[int], max_nodes: int, max_depth: int, max_match: int, min_prob: float,
                    spec_factor: float | None = None) -> tuple[DraftTree, list[float]]:
        """The continuations of the longest matches as a draft tree (best_first_tree: best first by
        the share of occurrences agreeing with a node's path), up to max_nodes, max_depth deep (and
        spec_factor x the match length), down to min_prob. Returns the tree and each node's probability."""
        kept, longest = self._longest_matches(context, max_match) if context and max_nodes > 0 else ([], 0)
        if spec_factor is not None:
            max_depth = min(max_depth, max(1, math.ceil(spec_factor * longest)))
        continuations = [self.tokens[s - self.base:min(self.document_end(s - 1), s + max_depth) - self.base]
                         for s in kept]
        return best_first_tree(continuations, max_nodes, max_depth, min_prob)

    def _longest_matches(self, context: list[int], max_match: int) -> tuple[list[int], int]:
        """Where the continuations of the longest occurrences of context's suffix start (each with a
        token after it), and the match length."""
        candidates, q = [], min(self.max_q, len(context))
        while q >= 1 and not candidates:
            positions = self.ends.get(tuple(context[-q:]), ())
            candidates = [p for p in reversed(positions) if self.document_end(p) > p + 1]   # newest first
            q -= 1
        if not candidates:
            return [], 0
        lengths = [self._match_length(context, p, max_match) for p in candidates]
        longest = max(lengths)
        return [p + 1 for p, n in zip(candidates, lengths) if n == longest], longest

    def _match_length(self, context: list[int], position: int, max_match: int) -> int:
        """How many tokens of context's suffix equal the stream's tokens ending at position (same document)."""
        n, limit = 0, min(max_match, len(context), position - self.document_start(position) + 1)
        while n < limit and self.tokens[position - self.base - n] == context[-1 - n]:
            n += 1
        return n

    def _follow(self, starts: list[int], match_length: int, k: int, min_prob: float) -> SuffixDraft:
        """Walk the most frequent continuation of the occurrences whose continuations begin at starts."""
        ends = {s: self.document_end(s - 1) for s in starts}
        tokens, probs, frequency, cumulative = [], [], 0, 1.0
        for step in range(k):
            counts: dict[int, int] = {}
            for s in starts:
                if s + step < ends[s]:
                    token = self.tokens[s + step - self.base]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            p = count / len(starts)
            if cumulative * p < min_prob:
                break
            cumulative *= p
            tokens.append(token)
            probs.append(p)
            frequency = frequency or count
            starts = [s for s in starts if s + step < ends[s] and self.tokens[s + step - self.base] == token]
        return SuffixDraft(tokens, probs, match_length, frequency)


class SharedSuffixCache:
    """Outputs of recent requests, each a document in its tenant's index, within one cap in tokens over
    all tenants. The oldest document of any tenant is evicted first, and a tenant whose documents are
    all gone loses its index: a flood of tenants costs no more memory than one tenant's traffic."""

    def __init__(self, max_tokens: int, max_q: int = 3):
        self.max_tokens = max_tokens
        self.max_q = max_q
        self.indexes: dict[str | None, SuffixIndex] = {}
        self.document_tenants: deque[str | None] = deque()   # the tenant of every document, oldest first
        self.num_tokens = 0
        self._nothing = SuffixIndex(max_q)   # what a tenant without outputs here drafts from

    def index(self, tenant: str | None) -> SuffixIndex:
        """The tenant's outputs (read only: add() writes them)."""
        return self.indexes.get(tenant, self._nothing)

    def add(self, tenant: str | None, token_ids: list[int]) -> None:
        if not token_ids or self.max_tokens <= 0:
            return
        token_ids = token_ids[-self.max_tokens:]
        while self.document_tenants and self.num_tokens + len(token_ids) > self.max_tokens:
            self._evict_oldest()
        index = self.indexes.get(tenant)
        if index is None:
            index = self.indexes[tenant] = SuffixIndex(self.max_q)
        index.extend(token_ids)
        index.close_document()
        self.document_tenants.append(tenant)
        self.num_tokens += len(token_ids)

    def _evict_oldest(self) -> None:
        """A tenant's documents are in the order they were added, so its oldest is the oldest overall."""
        tenant = self.document_tenants.popleft()
        index = self.indexes[tenant]
        self.num_tokens -= index.evict_oldest()
        if not index.doc_ends:
            del self.indexes[tenant]


class SuffixProposer:
    """Free drafts from the request's own context and from recent requests' outputs."""
    name = "suffix"

    def __init__(self, max_match: int = 24, cache_tokens: int = 1 << 16, min_prob: float = 0.1,
                 min_score: int = 2, spec_factor: float = 1.0, max_q: int = 3):
        self.max_match, self.min_prob, self.min_score = max_match, min_prob, min_score
        self.spec_factor = spec_factor
        self.max_q = max_q
        self.shared = SharedSuffixCache(cache_tokens, max_q)
        # request id -> (its own index, as of its last step; its prompt length; its tenant)
        self._own: dict[str, tuple[SuffixIndex, int, str | None]] = {}

    # ---- the lifecycle ------------------------------------------------------------
    def offer(self, request: Request, limit: int, max_nodes: int = 0) -> Offer:
        if limit <= 0:
            return Offer()
        chain = self.draft(request, limit)
        tokens = chain.token_ids[:limit]
        tree = offered_tree(tokens, max_nodes, lambda: self._tree(request, chain, max_nodes, limit))
        return Offer(len(tokens), nodes=len(tree) if tree is not None else 0, chain=tuple(chain.token_ids),
                     chances=tuple(chain.probs), tree=tree)

    def _tree(self, request: Request, chain: SuffixDraft, max_nodes: int, max_depth: int):
        """A draft tree of the continuations in the index the chain came from."""
        index = self.shared.index(request.tenant) if chain.shared else self._index(request)
        return index.lookup_tree(request.token_ids, max_nodes, max_depth, self.max_match, self.min_prob,
                                 self.spec_factor)

    def propose(self, jobs: list[DraftJob]) -> Proposal:
        drafts, trees = copied_drafts(jobs, self._confident)
        return Proposal(drafts, None, trees=trees)

    @staticmethod
    def _confident(job: DraftJob) -> list[int]:
        """The offered chain cut to the plan's k and its confidence stop: keep drafts while their
        cumulative empirical probability stays at or above job.p_min (as a draft model does with its
        own probabilities)."""
        tokens, cumulative = [], 1.0
        for token, p in zip(job.offer.chain[:job.k], job.offer.chances):
            cumulative *= p
            if tokens and cumulative < job.p_min:
                break
            tokens.append(token)
        return tokens

    def on_verified(self, request: Request) -> None:
        """The request's own index takes what verification kept (only accepted tokens enter it:
        nothing to roll back)."""
        own = self._own.get(request.request_id)
        if own is None:
            own = self._own[request.request_id] = (SuffixIndex(self.max_q), request.num_prompt_tokens, request.tenant)
        index = own[0]
        index.extend(request.token_ids[len(index):])

    def on_finish(self, request_id: str) -> None:
        own = self._own.pop(request_id, None)
        if own is not None:
            index, prompt_length, tenant = own
            self.shared.add(tenant, index.tokens[prompt_length:])

    # ---- drafting ----------------------------------------------------------------
    def draft(self, request: Request, k: int) -> SuffixDraft:
        """The better of the request's own and its tenant's shared index's drafts."""
        context = request.token_ids
        own = self._index(request).lookup(context, k, self.max_match, self.min_prob, self.spec_factor)
        best = own
        if own.expected_accepted < k:   # else k certain tokens: the shared index could only tie, and ties go to own
            shared = self.shared.index(request.tenant).lookup(context, k, self.max_match, self.min_prob,
                                                              self.spec_factor)
            shared = dataclasses.replace(shared, shared=True)
            best = max((own, shared), key=lambda d: (d.expected_accepted, d is own))
        return NO_DRAFT if best.score < self.min_score else best

    def _index(self, request: Request) -> SuffixIndex:
        """The request's own index as on_verified keeps it; where it is not current (a request not
        verified here yet), one built for this call alone."""
        own = self._own.get(request.request_id)
        if own is not None and len(own[0]) == request.num_tokens:
            return own[0]
        index = SuffixIndex(self.max_q)
        index.extend(request.token_ids)
        return index
