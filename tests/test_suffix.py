"""Suffix drafting (engine/spec_decode/suffix.py): the index's matches and frequencies, eviction and
its memory bound, the proposer's lifecycle, sharing across requests, and losslessness in batches
that mix suffix drafts with a draft model's."""
from __future__ import annotations

import random

import pytest
from helpers import run_requests

from engine import SamplingParams
from engine.request import Request
from engine.spec_decode.suffix import SharedSuffixCache, SuffixIndex, SuffixProposer


def index_of(*documents: list[int], max_q: int = 3) -> SuffixIndex:
    index = SuffixIndex(max_q)
    for doc in documents:
        index.extend(doc)
        index.close_document()
    return index


def brute_force_longest(stream_docs: list[list[int]], context: list[int], max_match: int) -> int:
    """Longest suffix of context (<= max_match) found inside one document with a token after it."""
    best = 0
    for doc in stream_docs:
        for end in range(len(doc) - 1):   # occurrence ends at doc[end], continues at doc[end + 1]
            n = 0
            while n < min(max_match, end + 1, len(context)) and doc[end - n] == context[-1 - n]:
                n += 1
            best = max(best, n)
    return best


def test_longest_match_and_frequencies():
    # "1 2 3" is followed by 4 twice and by 5 once; "9 1 2 3" only by 5
    index = index_of([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 9, 1, 2, 3, 5, 0])
    draft = index.lookup([7, 1, 2, 3], k=3, max_match=8, min_prob=0.0)
    assert draft.match_length == 3 and draft.token_ids[0] == 4 and draft.frequency == 2
    assert draft.probs[0] == pytest.approx(2 / 3)
    assert draft.token_ids == [4, 0, 9]   # both occurrences of "1 2 3 4" go on with 0, then 1 and 9 (newest wins ties)
    longer = index.lookup([9, 1, 2, 3], k=2, max_match=8, min_prob=0.0)
    assert longer.match_length == 4 and longer.token_ids == [5, 0] and longer.frequency == 1
    assert longer.score == 4


def test_continuations_as_a_draft_tree():
    """lookup_tree: every continuation of the longest matches, as branches, best first by the share of
    occurrences that agree with each node's path (so every prefix is the best tree of its size);
    min_prob, max_nodes and max_depth bound it."""
    index = index_of([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [8, 2, 3, 9])
    tree, probs = index.lookup_tree([0, 1, 2, 3], max_nodes=16, max_depth=8, max_match=8, min_prob=0.2)
    nodes = {tuple(tree.tokens[n] for n in tree.path(i)): p for i, p in enumerate(probs)}
    assert nodes == pytest.approx({(4,): 2 / 3, (7,): 1 / 3, (4, 5): 1 / 3, (4, 6): 1 / 3})   # 9 follows "8 2 3"
    assert tree.children(-1) == [0, 1]   # the commoner continuation first: the order verification judges
    assert probs == sorted(probs, reverse=True)
    small, _ = index.lookup_tree([0, 1, 2, 3], max_nodes=2, max_depth=8, max_match=8, min_prob=0.2)
    assert small.tokens == [4, 7]
    sure, _ = index.lookup_tree([0, 1, 2, 3], max_nodes=16, max_depth=8, max_match=8, min_prob=0.5)
    assert sure.tokens == [4]
    shallow, _ = index.lookup_tree([0, 1, 2, 3], max_nodes=16, max_depth=1, max_match=8, min_prob=0.0)
    assert shallow.tokens == [4, 7]
    assert len(index.lookup_tree([5, 5], max_nodes=16, max_depth=8, max_match=8, min_prob=0.0)[0]) == 0   # no match


def test_min_prob_cuts_the_walk():
    index = index_of([1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 5, 0])
    assert index.lookup([1, 2], k=4, max_match=8, min_prob=0.5).token_ids == []
    assert index.lookup([1, 2], k=4, max_match=8, min_prob=0.3).token_ids == [5, 0]   # newest of the tie


def test_draft_length_follows_the_match_length():
    """spec_factor x match length caps the draft: a long match is a copy in progress, a short one a guess."""
    passage = list(range(10, 40))
    index = index_of(passage)
    short = index.lookup([7, 8, 10, 11], k=24, max_match=24, min_prob=0.1, spec_factor=1.0)
    assert short.match_length == 2 and short.token_ids == passage[2:4]
    long = index.lookup([7] + passage[:12], k=24, max_match=24, min_prob=0.1, spec_factor=1.0)
    assert long.match_length == 12 and long.token_ids == passage[12:24]
    wide = index.lookup([7] + passage[:12], k=24, max_match=24, min_prob=0.1, spec_factor=2.0)
    assert wide.token_ids == passage[12:]   # up to k, and the document's end


def test_matches_agree_with_brute_force():
    rng = random.Random(0)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    index = index_of(*docs)
    for _ in range(200):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        draft = index.lookup(context, k=2, max_match=10, min_prob=0.0)
        # the q-gram seed limits candidates to the newest MAX_CANDIDATES occurrences; with these
        # sizes there are rarely more, so the longest match must be found
        assert draft.match_length == brute_force_longest(docs, context, 10), context


def test_no_match_crosses_documents():
    index = index_of([1, 2], [3, 4])
    assert index.lookup([2], k=2, max_match=4, min_prob=0.0).token_ids == []   # 2 ends its document
    assert index.lookup([1], k=4, max_match=4, min_prob=0.0).token_ids == [2]


def test_own_context_excludes_its_last_position():
    index = index_of([])
    index.extend([5, 6, 7, 5, 6])
    draft = index.lookup([5, 6, 7, 5, 6], k=4, max_match=8, min_prob=0.0)
    assert draft.token_ids == [7, 5, 6] and draft.match_length == 2


def test_eviction_keeps_the_cache_within_its_cap_under_endless_load():
    rng = random.Random(1)
    cache = SharedSuffixCache(max_tokens=500)
    for i in range(400):
        cache.add(None, [rng.randrange(50) for _ in range(rng.randrange(1, 120))])
        assert cache.num_tokens <= 500
        entries = sum(len(p) for p in cache.index(None).ends.values())
        assert entries <= 3 * cache.num_tokens   # one entry per q-gram end: memory is O(cap)
    # what is left is exactly the newest documents: an index built from them alone has the same entries
    index = cache.index(None)
    kept = [index.tokens[s - index.base:e - index.base] for s, e in zip([index.base] + index.doc_ends[:-1],
                                                                        index.doc_ends)]
    fresh = index_of(*kept)
    assert {k: list(v) for k, v in fresh.ends.items()} == \
        {k: [p - index.base for p in v] for k, v in index.ends.items()}


def test_updates_are_incremental():
    """extend() touches only the new tokens: appending one token to a long stream adds max_q entries."""
    index = index_of([])
    index.extend(list(range(1000)) * 3)
    before = sum(len(p) for p in index.ends.values())
    index.extend([7])
    assert sum(len(p) for p in index.ends.values()) - before == 3


def _request(rid: str, prompt: list[int], tenant: str | None = None) -> Request:
    return Request(rid, list(prompt), len(prompt), SamplingParams(max_tokens=64), arrival_time=0.0, generator=None,
                   tenant=tenant)


def test_proposer_shares_finished_outputs_across_requests():
    proposer = SuffixProposer(max_match=16, cache_tokens=1000, min_prob=0.1, min_score=2, spec_factor=2.0)
    first = _request("a", [1, 2, 3])
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    assert proposer.offer(first, 4).drafts == 0
    first.token_ids.extend(answer)
    proposer.on_verified(first)
    proposer.on_finish("a")
    assert proposer.shared.num_tokens == len(answer)   # its output, not its prompt
    second = _request("b", [9, 9, 40, 41])   # a new prompt that starts the same answer
    assert proposer.offer(second, 4).drafts == 4
    assert proposer.draft(second, 4).token_ids == [42, 43, 44, 45]
    assert proposer.offer(second, 2).drafts == 2   # never more than the limit


def _finish(proposer: SuffixProposer, request: Request, output: list[int]) -> None:
    proposer.offer(request, 4)
    request.token_ids.extend(output)
    proposer.on_verified(request)
    proposer.on_finish(request.request_id)


def test_a_tenant_drafts_only_from_its_own_tenants_outputs():
    """Alice's finished output serves Alice's next request, never Bob's nor a request without a
    tenant: what Bob is offered (and so his counters) is what he would get had Alice never asked."""
    proposer = SuffixProposer(max_match=16, cache_tokens=1000, min_prob=0.1, min_score=2, spec_factor=2.0)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    _finish(proposer, _request("a", [1, 2, 3], tenant="alice"), answer)
    copying = [9, 9, 40, 41]
    assert proposer.offer(_request("b", copying, tenant="bob"), 4).drafts == 0
    assert proposer.offer(_request("c", copying), 4).drafts == 0
    assert proposer.draft(_request("d", copying, tenant="alice"), 4).token_ids == [42, 43, 44, 45]
    # Bob's own outputs serve Bob.
    _finish(proposer, _request("e", [1, 2, 3], tenant="bob"), [40, 41, 50, 51, 52, 53])
    assert proposer.draft(_request("f", copying, tenant="bob"), 4).token_ids == [50, 51, 52, 53]
    assert proposer.draft(_request("g", copying, tenant="alice"), 4).token_ids == [42, 43, 44, 45]


def test_a_flood_of_tenants_stays_within_the_cap():
    """Thousands of tenants with an output each: the cache holds the newest outputs of all tenants
    together within its cap, and no index for a tenant whose outputs are all gone."""
    rng = random.Random(2)
    cache = SharedSuffixCache(max_tokens=500)
    added = []
    for i in range(3000):
        tenant = f"tenant-{rng.randrange(2000)}"
        document = [rng.randrange(50) for _ in range(rng.randrange(1, 60))]
        cache.add(tenant, document)
        added.append((tenant, document))
        assert cache.num_tokens <= 500
        assert len(cache.indexes) <= len(cache.document_tenants) <= 500
    entries = sum(len(p) for index in cache.indexes.values() for p in index.ends.values())
    assert entries <= 3 * cache.num_tokens   # one entry per q-gram end: memory is O(cap) however many tenants
    newest = added[-len(cache.document_tenants):]
    assert sum(len(d) for _, d in newest) == cache.num_tokens
    assert list(cache.document_tenants) == [t for t, _ in newest]
    assert set(cache.indexes) == {t for t, _ in newest}
    for tenant, index in cache.indexes.items():   # each tenant's index: exactly its newest outputs
        fresh = index_of(*[d for t, d in newest if t == tenant])
        assert {k: list(v) for k, v in fresh.ends.items()} == \
            {k: [p - index.base for p in v] for k, v in index.ends.items()}


def test_config_validation():
    from engine.config import SpeculativeConfig
    assert SpeculativeConfig(method="suffix").proposers == ("suffix",)
    assert "suffix" in SpeculativeConfig(method="auto").proposers
    with pytest.raises(ValueError, match="speculative.suffix.max_match"):
        SpeculativeConfig(method="suffix", suffix={"max_match": 0})
    with pytest.raises(ValueError, match="speculative.suffix.cache_tokens"):
        SpeculativeConfig(method="auto", suffix={"cache_tokens": -1})
    with pytest.raises(ValueError, match="speculative.suffix.min_prob"):
        SpeculativeConfig(method="suffix", suffix={"min_prob": 1.5})


# ---- the engine with suffix drafts -------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import make_noisy_copy, make_tiny_checkpoint
    root = tmp_path_factory.mktemp("suffix")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=0)
    return str(target), str(make_noisy_copy(target, root / "draft", noise=0.05))


def generate(config: dict, prompts, params) -> tuple[list[list[int]], list]:
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine = Engine(EngineConfig(dtype="float32", **config))
    generate.engine = engine
    return run_requests(engine, prompts, params)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], list(range(40, 70)), [9] * 12]


def test_suffix_drafts_are_lossless_beside_model_drafts(pair):
    target, draft = pair
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain, _ = generate({"model": target}, PROMPTS, greedy)
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_method=m)
              for m in ("suffix", "draft", "suffix", "draft")]
    spec = {"method": "auto", "draft": {"model": draft}, "proposers": ["draft", "suffix"], "num_speculative_tokens": 4,
            "adaptive": False}
    tokens, finals = generate({"model": target, "speculative": spec}, PROMPTS, params)
    assert tokens == plain
    assert finals[0].spec.passes_by_method.get("suffix", 0) > 0 and finals[0].spec.accepted > 0
    assert set(finals[1].spec.passes_by_method) <= {"draft", "none"}
    for t, f in zip(tokens, finals):
        assert len(t) == 1 + f.spec.accepted + f.spec.target_forwards


def test_a_second_request_reuses_the_first_ones_output(pair):
    """The same greedy answer twice: the second request's suffix drafts come from the shared cache,
    so it accepts more than the first, which only had its own context."""
    target, _ = pair
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine = Engine(EngineConfig(model=target, dtype="float32", speculative={
        "method": "suffix", "num_speculative_tokens": 6, "adaptive": False}))
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompt = list(range(100, 140))
    finals = []
    for rid in ("first", "second"):
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals.append(out)
    first, second = finals
    assert second.spec.accepted > first.spec.accepted, (first.spec, second.spec)
    assert second.spec.target_forwards < first.spec.target_forwards / 2


def test_the_plans_confidence_stop_cuts_suffix_drafts():
    from engine.spec_decode.base import DraftJob, Offer
    offer = Offer(4, chain=(1, 2, 3, 4), chances=(1.0, 0.5, 0.5, 1.0))   # a suffix draft's tokens and chances
    request = _request("c", [0])
    cut = lambda p_min, k=4: SuffixProposer._confident(DraftJob(request, k, p_min, offer=offer))
    assert cut(0.0) == [1, 2, 3, 4] and cut(0.3) == [1, 2] and cut(0.6) == [1] and cut(1.0, k=1) == [1]
    assert cut(0.0, k=2) == [1, 2]
