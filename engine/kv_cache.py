"""The block pool: pure bookkeeping over a fixed number of KV blocks.

Each request owns a block table (a list of block ids); the model runner turns
it into slot mappings. A block may be shared by several requests (prefix
reuse), so blocks carry reference counts. A full block whose tokens are final
gets a chained hash (sha256 of its parent block's hash and its own tokens); when
its last reference goes, it stays in the free list with its hash until it is
reused for something else, so a later request with the same prefix can pick
it up without recomputing it. A hit is also checked against the block's own
parent hash and tokens, so even a hash collision can never hand one request
another's KV (the class of vLLM's CVE-2025-25183, where Python's hash() over
tuples could be made to collide).

A request's chain starts from its tenant's root (chain_root): the first block's
hash, and so every hash after it, depends on the tenant, so no block one tenant
computed ever matches another tenant's prefix, and whether a prompt hits the
cache says nothing about other tenants' prompts.

Reuse order of free blocks: blocks that hold nothing reusable (never published,
trimmed draft slots) are taken first, cached blocks last and least recently
freed first, so speculation's churn never evicts a cached prefix.

Verbs: match_prefix / take (prefix reuse), allocate (room for the tokens about
to be computed plus lookahead slots for draft tokens), trim (rollback), free,
and cache_full_blocks (publish finished blocks for reuse). Invariant, checked
by check_invariants: every block is either free (ref 0) or used, never both.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence

BlockHash = bytes


def chain_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """sha256 of a full block's tokens and its parent's hash: equal hashes mean equal prefixes."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


def chain_root(tenant: str | None) -> BlockHash | None:
    """The parent of a request's first block: None for the common partition (no tenant), else a
    digest of the tenant's name, which no chain_hash can equal without a sha256 collision."""
    return None if tenant is None else hashlib.sha256(b"specserve tenant\0" + tenant.encode()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # What each cached block holds, checked on every hit: (its parent's hash, its tokens).
        self.block_keys: list[tuple[BlockHash | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        # Free blocks in eviction order (least recently freed first); cached ones keep their hash.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix reuse --------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], tenant: str | None = None) -> list[int]:
        """Cached blocks holding the longest full-block prefix of token_ids in tenant's chains.

        The last token is never matched: the model must compute at least one
        token to produce the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        blocks, parent = [], chain_root(tenant)
        for start in range(0, len(token_ids) - self.block_size, self.block_size):
            tokens = tuple(token_ids[start:start + self.block_size])
            h = chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_keys[block] != (parent, tokens):
                break   # a miss, or a collision: never reuse KV computed for other tokens
            blocks.append(block)
            parent = h
        return blocks

    def take(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks found by match_prefix."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1

    # ---- allocation ----------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table in place to hold num_tokens positions (computed + new + lookahead).

        All or nothing: returns False, changing nothing, if the pool is short."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            block, _ = self.free_blocks.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            block_table.append(block)
        return True

    def trim(self, block_table: list[int], num_tokens: int) -> None:
        """Rollback: release whole tail blocks past num_tokens positions. Stale KV is overwritten later."""
        keep = self.blocks_needed(num_tokens)
        while len(block_table) > keep:
            self._release(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        """Release every block; tail blocks first so they are evicted before shared prefixes."""
        while block_table:
            self._release(block_table.pop())

    # ---- publishing finished blocks -----------------------------------
    def cache_full_blocks(self, block_table: list[int], block_hashes: list[BlockHash],
                          token_ids: Sequence[int], num_final_tokens: int, tenant: str | None = None) -> None:
        """Hash and publish blocks whose tokens are all final (computed and accepted).

        block_hashes is the request's own chain (rooted at its tenant's chain_root), extended in place."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_final_tokens // self.block_size, len(block_table))
        while len(block_hashes) < num_full:
            i = len(block_hashes)
            parent = block_hashes[-1] if block_hashes else chain_root(tenant)
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_hashes.append(h)
            block = block_table[i]
            if h not in self.hash_to_block and self.block_hashes[block] is None:
                self.block_hashes[block] = h
                self.block_keys[block] = (parent, tokens)
                self.hash_to_block[h] = block

    # ---- internals -----------------------------------------------------
    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released too often"
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None   # cached: reused last
            if self.block_hashes[block] is None:
                self.free_blocks.move_to_end(block, last=False)   # holds nothing worth keeping: reused first

    def _forget_hash(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hashes[block] = None
            self.block_keys[block] = None

    def check_invariants(self, block_tables: Iterable[Sequence[int]] = ()) -> None:
        """free + used == total; ref counts equal the number of tables holding each block."""
        refs = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                refs[block] += 1
        used = sum(1 for r in self.ref_counts if r > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
        assert refs == self.ref_counts, "reference counts disagree with the block tables"
        for block in self.free_blocks:
            assert self.ref_counts[block] == 0, f"free block {block} is referenced"
        for h, block in self.hash_to_block.items():
            assert self.block_hashes[block] == h, f"hash index out of sync at block {block}"
