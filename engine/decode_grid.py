"""Decode-shaped passes on a fixed grid, replayed as CUDA graphs.

On a GPU a small model's decode step is bound by kernel launches, not by the weights (Python and
launches cost far more than streaming the default target's weights; README has the figures). A
CUDA graph records one pass's kernels once and replays them with a single launch, but it needs
every tensor's shape, and every address, fixed. So a decode-shaped pass (every fed token a query
whose logits are wanted: decode and verification rows; also a short run of tokens for one logit, a
draft model's catch-up) is laid out as a grid in persistent buffers:

    sequences    the batch padded up to a bucket (1, 2, 4, 8, 16, 24, 32, ...): padding sequences
                 attend to a scratch block that no request owns and write their keys there;
    query rows   every sequence's new tokens right-aligned in a row of Q = the bucket of the longest
                 (1, 2, 4, ... and the most a step verifies), so the causal mask stays aligned to each
                 one's last key; the rows before them are padding, written to the scratch slot;
    key blocks   the block table padded to a power of two of blocks (flash-attn reads only up to each
                 sequence's length; the torch reference gathers them all, so fewer is cheaper).

A pass that verifies a draft tree fills two more buffers, each row's visible tree positions as bits
and each sequence's number of tree positions (the encoding of the CPU attention kernel), and its
attention builds its mask from them on the device (flash-attn takes no such mask: tree passes take
the torch reference's SDPA over the grid, chain passes keep flash-attn).

The runner's attention backend gives the grid's metadata (AttentionBackend.grid_metadata: SDPA over
the grid, or flash_attn_with_kvcache with flash-attn).

One graph per (sequences, query rows, key blocks, tree or not) bucket is captured the first time a
pass needs it, all in one memory pool. Without capture (`capture=False`) the same grid runs eagerly: that is how the
CPU tests cover the bookkeeping, and how flash-attn's `flash_attn_with_kvcache` serves decode rows
when graphs are off (exact sizes, no buckets).
"""
from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from engine.attention_backends import AttentionBackend
from engine.attention_metadata import check_tree_mask, row_tree_bits

# Seconds this process has spent capturing graphs (see work_clock).
_capture_seconds = 0.0


def work_clock() -> float:
    """time.perf_counter() less the time spent capturing CUDA graphs: a clock for the cost model.
    A pass that records its bucket's graph takes many times longer than one replayed, once; timed in
    full, it makes a drafting step look far dearer than it is, and the policy stops drafting."""
    return time.perf_counter() - _capture_seconds


# The longest query row a grid takes: the last token plus up to 32 drafts (SpeculativeConfig's cap).
MAX_QUERY_LEN = 33


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_seqs (the last bucket is max_seqs itself)."""
    buckets = [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs, 8))
    return buckets + [max_seqs]


def power_buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below limit, then limit."""
    buckets, b = [], 1
    while b < limit:
        buckets.append(b)
        b *= 2
    return buckets + [limit]


def _bucket(buckets: list[int], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class DecodeGrid:
    """Runs a model's decode-shaped passes on the grid. `attention`: the runner's backend, whose grid
    metadata the layers read; `pad`: round the grid up to buckets (needed for graphs, whose shapes
    repeat); `capture`: record each bucket's pass as a CUDA graph and replay it."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_seqs: int, max_query_len: int, max_blocks: int, device: torch.device,
                 attention: AttentionBackend, pad: bool = True, capture: bool = False):
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.scratch_block, self.attention, self.device = scratch_block, attention, torch.device(device)
        self.max_seqs, self.max_query_len, self.max_blocks = max_seqs, min(max_query_len, MAX_QUERY_LEN), max_blocks
        self.pad, self.capture = pad, capture
        self.seq_buckets, self.query_buckets = batch_buckets(max_seqs), power_buckets(self.max_query_len)
        self.block_buckets = power_buckets(max_blocks)
        rows = max_seqs * self.max_query_len
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs * max_blocks, dtype=torch.int32, device=device)
        self.block_ids = torch.zeros(max_seqs * max_blocks, dtype=torch.long, device=device)
        self.tree_bits = torch.zeros(rows, dtype=torch.long, device=device)
        self.tree_cols = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, items) -> bool:
        """A pass this grid can hold: no sequence feeds more tokens than its query rows. (The grid
        computes every fed token's final hidden state; the runner keeps the rows whose logits are
        wanted. So a draft model's catch-up, several tokens for one logit, replays a graph too: run
        eagerly, it costs several replayed draft steps.)"""
        return (0 < len(items) <= self.max_seqs
                and all(item.num_logits <= len(item.token_ids) <= self.max_query_len for item in items)
                and all(len(item.block_table) <= self.max_blocks for item in items))

    def shape(self, items) -> tuple[int, int, int]:
        """(sequences, query rows, key blocks) of the grid that holds items."""
        seqs, query = len(items), max(len(item.token_ids) for item in items)
        blocks = max(1, max(len(item.block_table) for item in items))
        if not self.pad:
            return seqs, query, blocks
        return (_bucket(self.seq_buckets, seqs), _bucket(self.query_buckets, query),
                _bucket(self.block_buckets, blocks))

    @torch.inference_mode()
    def run(self, items) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of every fed token, in item order, and their cache slots; their
        features (the model's `features`, for EAGLE heads) are in self.last_features."""
        key = (*self.shape(items), any(item.tree_mask is not None for item in items))
        rows = self._fill(items, *key)
        if not self.capture:
            hidden = self.model(*self._inputs(*key))
            features = self._features(hidden)
        else:
            if key not in self.graphs:
                self.graphs[key] = self._timed_record(key)
            graph, hidden, features = self.graphs[key]
            graph.replay()
        out = hidden[rows]
        self.last_features = out if features is hidden else None if features is None else features[rows]
        return out, self.slot_mapping[rows]

    def _features(self, hidden: torch.Tensor) -> torch.Tensor | None:
        features = getattr(self.model, "features", None)
        return None if features is None else features(hidden)

    def _fill(self, items, num_seqs: int, q_len: int, num_blocks: int, tree: bool) -> torch.Tensor:
        """Write the pass into the persistent buffers; returns the grid rows of the real tokens."""
        scratch_slot = self.scratch_block * self.block_size
        ids = np.zeros((num_seqs, q_len), dtype=np.int64)
        positions = np.zeros((num_seqs, q_len), dtype=np.int64)
        slots = np.full((num_seqs, q_len), scratch_slot, dtype=np.int64)
        seq_lens = np.ones(num_seqs, dtype=np.int32)
        tables = np.full((num_seqs, num_blocks), self.scratch_block, dtype=np.int64)
        bits = np.zeros((num_seqs, q_len), dtype=np.int64)   # trees: padding rows see no tree position
        cols = np.ones(num_seqs, dtype=np.int32)
        rows = []
        for b, item in enumerate(items):
            n, table = len(item.token_ids), np.asarray(item.block_table, dtype=np.int64)
            index = np.arange(item.start_pos, item.start_pos + n)   # cache slots: one per fed token, in order
            ids[b, q_len - n:] = item.token_ids
            positions[b, q_len - n:] = item.positions()
            slots[b, q_len - n:] = table[index // self.block_size] * self.block_size + index % self.block_size
            seq_lens[b] = item.start_pos + n
            tables[b, :len(table)] = table
            if tree:
                check_tree_mask(item.tree_mask, n, item.start_pos + n, b)
                bits[b, q_len - n:] = row_tree_bits(item.tree_mask, n)
                cols[b] = n if item.tree_mask is None else item.tree_mask.shape[1]
            rows.append(np.arange(b * q_len + q_len - n, (b + 1) * q_len))
        size, width = num_seqs * q_len, num_seqs * num_blocks
        self.input_ids[:size].copy_(torch.from_numpy(ids.reshape(-1)))
        self.positions[:size].copy_(torch.from_numpy(positions.reshape(-1)))
        self.slot_mapping[:size].copy_(torch.from_numpy(slots.reshape(-1)))
        self.seq_lens[:num_seqs].copy_(torch.from_numpy(seq_lens))
        self.block_tables[:width].copy_(torch.from_numpy(tables.reshape(-1)))
        self.block_ids[:width].copy_(self.block_tables[:width])
        if tree:
            self.tree_bits[:size].copy_(torch.from_numpy(bits.reshape(-1)))
            self.tree_cols[:num_seqs].copy_(torch.from_numpy(cols))
        return torch.from_numpy(np.concatenate(rows)).to(self.device)

    def _inputs(self, num_seqs: int, q_len: int, num_blocks: int, tree: bool) -> tuple:
        """The model's arguments as views of the persistent buffers (a fresh metadata: its masks are per pass)."""
        size, width = num_seqs * q_len, num_seqs * num_blocks
        meta = self.attention.grid_metadata(self.slot_mapping[:size], self.seq_lens[:num_seqs],
                                            self.block_tables[:width].view(num_seqs, num_blocks),
                                            self.block_ids[:width], q_len)
        if tree:
            meta.positions, meta.tree_bits, meta.tree_cols = \
                self.positions[:size], self.tree_bits[:size], self.tree_cols[:num_seqs]
        return self.input_ids[:size], self.positions[:size], meta, self.kv_caches

    def _timed_record(self, key: tuple[int, int, int, bool]):
        global _capture_seconds
        self._synchronize()   # the passes already queued are not the capture's
        start = time.perf_counter()
        try:
            return self._record(key)
        finally:
            self._synchronize()   # the capture's warm-up passes ran on a side stream
            _capture_seconds += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record(self, key: tuple[int, int, int, bool]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        """Capture one bucket's pass. The buffers already hold a real pass: the warm-up runs compute it
        (writing the same keys and values the replay will), then the capture records it. The capture
        gets metadata of its own: one that the warm-up had used would hand it the warm-up's cached
        masks, and the graph would replay those instead of building each pass's."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):   # lazy initialisation (cuBLAS handles, kernel selection) outside the capture
                self.model(*self._inputs(*key))
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*self._inputs(*key))
        return graph, hidden, self._features(hidden)   # the features' tensor, too, is the graph's to refill
