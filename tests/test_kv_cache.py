"""Block pool: invariants under random operation sequences, prefix reuse, rollback."""
import random

import pytest

from engine.kv_cache import BlockPool


def test_allocate_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    table = []
    assert pool.allocate(table, 10)           # 3 blocks
    assert len(table) == 3 and pool.num_free_blocks == 1
    other = []
    assert not pool.allocate(other, 8)        # needs 2, only 1 free
    assert other == [] and pool.num_free_blocks == 1
    pool.check_invariants([table])


def test_prefix_reuse_and_eviction_order():
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(13))                  # 3 full blocks + 1 token
    a = []
    pool.allocate(a, len(tokens))
    pool.cache_full_blocks(a, hashes_a := [], tokens, num_final_tokens=13)
    assert len(hashes_a) == 3
    # Same prefix, different tail: the three full blocks are shared.
    hit = pool.match_prefix(tokens[:12] + [99, 98])
    assert hit == a[:3]
    pool.take(hit)
    pool.check_invariants([a, hit])
    # The last token is never matched: a prompt of exactly 3 blocks reuses only 2.
    assert pool.match_prefix(tokens[:12]) == a[:2]
    shared = list(hit)
    pool.free(a)
    pool.free(hit)
    assert a == [] and hit == []              # free empties the tables
    pool.check_invariants([])
    assert pool.num_free_blocks == 8
    # Freed but cached blocks still serve a later request...
    assert pool.match_prefix(tokens) == shared
    # ...until their space is reused: allocating everything evicts them.
    everything = []
    assert pool.allocate(everything, 8 * 4)
    assert pool.match_prefix(tokens) == []
    pool.free(everything)
    pool.check_invariants([])


def test_trim_releases_tail_blocks():
    pool = BlockPool(num_blocks=6, block_size=4)
    table = []
    pool.allocate(table, 4 + 1 + 8)           # computed 4, last token + 8 lookahead slots -> 4 blocks
    assert len(table) == 4
    pool.trim(table, 6)                       # only 6 positions are real after rejection
    assert len(table) == 2 and pool.num_free_blocks == 4
    pool.check_invariants([table])


def test_unfinished_blocks_are_not_published():
    pool = BlockPool(num_blocks=4, block_size=4)
    table, hashes = [], []
    tokens = list(range(8))
    pool.allocate(table, 8)
    pool.cache_full_blocks(table, hashes, tokens, num_final_tokens=7)   # block 2 not final yet
    assert len(hashes) == 1
    assert pool.match_prefix(tokens + [1]) == table[:1]


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=24, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: dict[int, dict] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:   # a new request, maybe sharing a prefix
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            hit = pool.match_prefix(tokens)
            pool.take(hit)
            table = list(hit)
            if pool.allocate(table, len(tokens)):
                live[next_id] = {"table": table, "hashes": [], "tokens": tokens, "computed": len(tokens)}
                next_id += 1
            else:
                pool.free(table)
        elif op < 0.6 and live:   # a decode step with lookahead, then rollback
            r = live[rng.choice(list(live))]
            k = rng.randrange(0, 5)
            if pool.allocate(r["table"], r["computed"] + 1 + k):
                accepted = rng.randrange(0, k + 1)
                r["tokens"] += [rng.randrange(50) for _ in range(accepted + 1)]
                r["computed"] += 1 + accepted
                pool.trim(r["table"], len(r["tokens"]))
                pool.cache_full_blocks(r["table"], r["hashes"], r["tokens"], r["computed"])
        elif live:   # finish or preempt
            pool.free(live.pop(rng.choice(list(live)))["table"])
        pool.check_invariants([r["table"] for r in live.values()])
    for r in live.values():
        pool.free(r["table"])
    pool.check_invariants([])
    assert pool.num_free_blocks == pool.num_blocks


def test_a_hash_collision_never_reuses_other_tokens_kv(monkeypatch):
    """Force every block to collide (what a crafted prompt did to Python's hash() over tuples): a hit
    is checked against the block's parent and tokens, so the other request's KV is not reused."""
    import engine.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: b"collision")
    pool = BlockPool(num_blocks=8, block_size=4)
    victim = []
    pool.allocate(victim, 9)
    pool.cache_full_blocks(victim, [], list(range(9)), num_final_tokens=8)
    assert pool.match_prefix(list(range(9))) == victim[:1]          # the same tokens still hit
    assert pool.match_prefix([7, 7, 7, 7, 7, 7, 7, 7, 7]) == []     # other tokens, same hash: a miss
    pool.check_invariants([victim])


def test_hashes_are_sha256_chained_over_parent_and_tokens():
    from engine.kv_cache import chain_hash
    first = chain_hash(None, [1, 2, 3, 4])
    assert len(first) == 32 and first != chain_hash(None, [1, 2, 3, 5])
    assert chain_hash(first, [5, 6, 7, 8]) != chain_hash(None, [5, 6, 7, 8])   # the parent is part of it


def test_empty_blocks_are_reused_before_cached_ones():
    pool = BlockPool(num_blocks=6, block_size=4)
    cached, scratch = [], []
    pool.allocate(cached, 8)
    pool.cache_full_blocks(cached, [], list(range(8)), num_final_tokens=8)
    pool.allocate(scratch, 12)                 # draft lookahead slots, say
    pool.free(cached)                          # cached prefix: to the back of the reuse order
    pool.trim(scratch, 4)                      # two trimmed blocks, holding nothing
    fresh = []
    assert pool.allocate(fresh, 12)            # three blocks: two trimmed ones and the never-used one
    assert pool.match_prefix(list(range(9))) == [0, 1], "a cached prefix was evicted before empty blocks"
    pool.check_invariants([scratch, fresh])


# ---- tenants -------------------------------------------------------------------------------------

def test_a_tenants_blocks_match_only_that_tenants_prefixes():
    """The chain starts at the tenant's root, so the same tokens cached for one tenant are a miss for
    any other (and for no tenant), while the tenant itself reuses them as before."""
    pool = BlockPool(num_blocks=16, block_size=4)
    tokens = list(range(13))
    alice = []
    pool.allocate(alice, len(tokens))
    pool.cache_full_blocks(alice, alice_hashes := [], tokens, num_final_tokens=13, tenant="alice")
    assert pool.match_prefix(tokens, tenant="alice") == alice[:3]
    assert pool.match_prefix(tokens, tenant="bob") == []
    assert pool.match_prefix(tokens) == []
    # Bob computes the same prompt: his own blocks, published beside Alice's, each tenant hitting its own.
    bob = []
    pool.allocate(bob, len(tokens))
    pool.cache_full_blocks(bob, bob_hashes := [], tokens, num_final_tokens=13, tenant="bob")
    assert not set(alice_hashes) & set(bob_hashes)
    assert pool.match_prefix(tokens, tenant="bob") == bob[:3]
    assert pool.match_prefix(tokens, tenant="alice") == alice[:3]
    pool.check_invariants([alice, bob])


def test_a_tenants_chain_is_salted_from_its_first_block():
    from engine.kv_cache import chain_hash, chain_root
    assert chain_root(None) is None
    assert chain_root("alice") != chain_root("bob") and len(chain_root("alice")) == 32
    assert chain_root("alice") == chain_root("alice")
    pool = BlockPool(num_blocks=4, block_size=4)
    table = []
    pool.allocate(table, 8)
    pool.cache_full_blocks(table, hashes := [], list(range(8)), num_final_tokens=8, tenant="alice")
    assert hashes[0] == chain_hash(chain_root("alice"), [0, 1, 2, 3]) != chain_hash(None, [0, 1, 2, 3])
    assert hashes[1] == chain_hash(hashes[0], [4, 5, 6, 7])


def test_a_tenant_cannot_reach_another_tenants_blocks_through_a_collision(monkeypatch):
    """Even with every hash equal, a hit is checked against the block's parent: the first block's
    parent is its tenant's root, so another tenant's block is never handed out."""
    import engine.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: b"collision")
    pool = BlockPool(num_blocks=8, block_size=4)
    alice = []
    pool.allocate(alice, 9)
    pool.cache_full_blocks(alice, [], list(range(9)), num_final_tokens=8, tenant="alice")
    assert pool.match_prefix(list(range(9)), tenant="alice") == alice[:1]
    assert pool.match_prefix(list(range(9)), tenant="bob") == []
    pool.check_invariants([alice])
