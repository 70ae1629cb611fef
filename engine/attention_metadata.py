"""What a forward pass attends over, described once: the PassLayout the model runner builds for every
pass, and the pieces the backends (engine/attention_backends.py) build their metadata from.

A forward pass covers B sequences; sequence b contributes query_lens[b] new tokens (a prefill
chunk, one decode token, or the last token plus k draft tokens) whose keys/values are written into
the paged cache at their slots, and which attend causally to the first seq_lens[b] cached
positions of that sequence (the new tokens are the last query_lens[b] of them). A draft tree is
only a mask and positions: its fed tokens see the context and the tree positions their mask sets
(tree masks, or the same as bits for the kernel and the decode grid).

Sliding-window layers (Mistral, Qwen with use_sliding_window, Gemma's local layers) attend to the
last `sliding_window` positions only, the query's own included: key j is visible to the query at
position i iff i - window < j <= i (transformers' rule; flash-attn's window_size=(window - 1, 0)).
The cache keeps every position; only the masks change. The window is the layer's: a backend builds
the masks of the model's window with the pass's metadata, once per pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Longest query a decode-shaped row takes (the C++ kernel, the torch reference's grouped sequences):
# the last token plus up to 32 drafts.
SEQUENCE_MAX_QUERY = 33
# Sequences with one query length whose numbers of keys differ by at most this share one SDPA call, the
# shorter ones padded: on a CPU one more call costs about as much as attending to this many more keys.
SHARE_CALL_MAX_PAD = 128


@dataclass
class PassLayout:
    """One forward pass, per sequence: its new tokens (query_lens), its keys with them (seq_lens; the
    new tokens are the last query_lens of them) and its block table; for a pass that feeds draft trees,
    tree_masks[b] (bool [q_len, cols], or None: causal) says which of the sequence's last `cols`
    positions, the tree's, each fed token sees (the fed tokens are the last q_len of them; every fed
    token sees the whole context before the tree)."""
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    tree_masks: list[np.ndarray | None] | None = None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def subset(self, seqs) -> "PassLayout":
        """The pass of sequences `seqs` alone (no trees: only causal passes are split)."""
        return PassLayout([self.query_lens[i] for i in seqs], [self.seq_lens[i] for i in seqs],
                          [self.block_tables[i] for i in seqs])

    def check_trees(self, sliding_window: int | None) -> None:
        if not tree_window_ok(sliding_window):
            raise ValueError(f"draft trees need full attention or a sliding window over {MAX_TREE_COLS} positions, "
                             f"not {sliding_window}")
        for b, (tree, q_len, s_len) in enumerate(zip(self.tree_masks, self.query_lens, self.seq_lens)):
            check_tree_mask(tree, q_len, s_len, b)


class LayoutArrays:
    """A PassLayout as arrays, computed once per metadata build: lengths, block table, query offsets,
    and each new token's sequence and cache slot."""

    def __init__(self, layout: PassLayout, block_size: int):
        num_seqs = len(layout.query_lens)
        self.q_lens = np.asarray(layout.query_lens, dtype=np.int64)
        self.s_lens = np.asarray(layout.seq_lens, dtype=np.int64)
        assert np.all(self.q_lens >= 1) and np.all(self.s_lens >= self.q_lens), "every sequence needs >= 1 new token"
        max_blocks = max(len(t) for t in layout.block_tables)
        self.table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, blocks in enumerate(layout.block_tables):
            self.table[i, : len(blocks)] = blocks
        # Absolute position of every new token, then its slot through the block table.
        self.seq_idx = np.repeat(np.arange(num_seqs), self.q_lens)
        self.q_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(self.q_lens, out=self.q_start[1:])
        positions = np.arange(int(self.q_start[-1])) - self.q_start[self.seq_idx] + \
            (self.s_lens - self.q_lens)[self.seq_idx]
        blocks = self.table[self.seq_idx, positions // block_size]
        self.slot_mapping = blocks * block_size + positions % block_size
        self.s_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(self.s_lens, out=self.s_start[1:])
        self.max_q = int(self.q_lens.max())

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def rows(self, seqs) -> np.ndarray:
        """The token rows of sequences `seqs`, in that order."""
        return np.concatenate([np.arange(self.q_start[i], self.q_start[i + 1]) for i in seqs])

    def pad_index(self) -> np.ndarray:
        """Each token's row in the padded [B * max_q] queries."""
        return self.seq_idx * self.max_q + (np.arange(len(self.seq_idx)) - self.q_start[self.seq_idx])


@dataclass
class KeyGroup:
    """Sequences with one query length and similar numbers of keys, attended in one SDPA call."""
    rows: torch.Tensor              # [n * q_len] int64: their query rows, sequence by sequence
    num_seqs: int
    q_len: int
    num_keys: int                   # keys per sequence: the longest one's (the others padded, masked)
    first_slot: int                 # with block_ids None: slot of the first key in the flat cache
    block_ids: torch.Tensor | None  # [n * width] int64: each one's blocks from the first it sees, padded with
                                    # its last; None: a lone sequence whose blocks are consecutive (a view)
    visible: np.ndarray | None      # [n, q_len, num_keys] bool, True = attend; None: all visible


@dataclass
class SequencePlan:
    """The torch reference's grouped sequences in one pass (TorchBackend.group_sequences)."""
    groups: list[KeyGroup]
    rows: torch.Tensor | None       # the groups' rows concatenated; None when that is every row in order
    device: torch.device
    # (query heads per KV head, dtype) -> one additive mask per group (None: nothing masked), made by the
    # first layer that asks: the head grouping and the dtype are the model's, unknown to the runner.
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, table: np.ndarray, q_lens: np.ndarray, s_lens: np.ndarray, q_start: np.ndarray,
              block_size: int, device: torch.device, window: int | None) -> "SequencePlan":
        # The earliest key any query of a sequence sees; with a window, blocks before it are never read.
        first = np.zeros_like(s_lens) if window is None else np.maximum(0, s_lens - q_lens - window + 1)
        num_keys = s_lens - first
        members: list[list[int]] = []
        for i in np.lexsort((-num_keys, q_lens)).tolist():   # by query length, then most keys first
            head = members[-1][0] if members else None
            if head is None or q_lens[i] != q_lens[head] or num_keys[head] - num_keys[i] > SHARE_CALL_MAX_PAD:
                members.append([])
            members[-1].append(i)
        groups = [_key_group(np.asarray(m), table, q_lens, s_lens, first, q_start, block_size, device, window)
                  for m in members]
        rows = np.concatenate([np.arange(q_start[i], q_start[i + 1]) for m in members for i in m])
        in_order = bool(np.all(rows == np.arange(len(rows))))
        return cls(groups, None if in_order else torch.from_numpy(rows).to(device), torch.device(device))

    def masks(self, group: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """Per group [n, 1, q_len * group, num_keys] additive masks for GQA-folded query rows (row
        i * group + g is query i; with q_len 1, [n, 1, 1, num_keys] serves all of them)."""
        key = (group, dtype)
        if key not in self._masks:
            self._masks[key] = [None if g.visible is None else _additive_mask(g.visible, group, dtype, self.device)
                                for g in self.groups]
        return self._masks[key]


def _key_group(seqs: np.ndarray, table: np.ndarray, q_lens: np.ndarray, s_lens: np.ndarray, first: np.ndarray,
               q_start: np.ndarray, block_size: int, device: torch.device, window: int | None) -> KeyGroup:
    q_len = int(q_lens[seqs[0]])
    rows = np.concatenate([np.arange(q_start[i], q_start[i] + q_len) for i in seqs])
    lo, hi = first[seqs] // block_size, -(-s_lens[seqs] // block_size)   # blocks it reads: [lo, hi)
    blocks = table[seqs[0], lo[0]:hi[0]]
    if len(seqs) == 1 and np.all(np.diff(blocks) == 1):   # one sequence on consecutive blocks: a view, no copy
        key_pos = np.arange(first[seqs[0]], s_lens[seqs[0]])[None]
        first_slot, block_ids = int(blocks[0]) * block_size + int(first[seqs[0]] - lo[0] * block_size), None
    else:
        cols = np.minimum(lo[:, None] + np.arange(int((hi - lo).max())), (hi - 1)[:, None])
        block_ids = torch.from_numpy(np.take_along_axis(table[seqs], cols, axis=1).reshape(-1)).to(device)
        key_pos = lo[:, None] * block_size + np.arange(int((s_lens[seqs] - lo * block_size).max()))
        first_slot = 0
    # [n, q_len, keys]: query i sits at position s_len - q_len + i and sees keys up to it (within the window).
    query_pos = (s_lens[seqs] - q_len)[:, None, None] + np.arange(q_len)[None, :, None]
    visible = key_pos[:, None, :] <= query_pos
    if window is not None:
        visible &= key_pos[:, None, :] > query_pos - window
    return KeyGroup(torch.from_numpy(rows).to(device), len(seqs), q_len, key_pos.shape[1], first_slot, block_ids,
                    None if visible.all() else visible)


def _additive_mask(visible: np.ndarray, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, q_len, keys] bool -> [n, 1, q_len * group (1 when q_len is 1), keys]: 0 where visible, -inf
    elsewhere (SDPA's CPU kernel takes float masks as they are; bool ones it converts on every call)."""
    rows = torch.from_numpy(visible if visible.shape[1] == 1 else np.repeat(visible, group, axis=1)).to(device)
    return torch.zeros(rows.shape, dtype=dtype, device=device).masked_fill_(~rows, float("-inf"))[:, None]


# A tree's positions fit one int64 of bits (the kernel's and the decode grid's encoding).
MAX_TREE_COLS = 64


def tree_window_ok(sliding_window: int | None) -> bool:
    """Draft trees under this sliding window: none, or one wider than any tree, so that a window never
    cuts a node's ancestors (only the context before the tree)."""
    return sliding_window is None or sliding_window > MAX_TREE_COLS


def check_tree_mask(tree: np.ndarray | None, q_len: int, s_len: int, b: int) -> None:
    if tree is not None and not (tree.ndim == 2 and tree.shape[0] == q_len <= tree.shape[1] <= min(s_len, MAX_TREE_COLS)
                                 and tree[:, -q_len:].diagonal().all()):
        raise ValueError(f"tree mask {b}: [{q_len}, cols] with {q_len} <= cols <= {MAX_TREE_COLS} in which each "
                         "fed token sees itself")


def fed_positions(tree: np.ndarray | None, q_len: int, s_len: int) -> np.ndarray:
    """The positions of a sequence's q_len fed tokens, the last of its s_len: consecutive, or in a
    tree the tree's first position plus each token's depth (the tree positions it sees, less one)."""
    if tree is None:
        return np.arange(s_len - q_len, s_len)
    return s_len - tree.shape[1] + tree.sum(axis=1) - 1


def row_tree_bits(tree: np.ndarray | None, q_len: int) -> np.ndarray:
    """int64 [q_len]: bit j of row i set where fed token i sees tree position j (causal rows without a
    tree: their fed tokens are the tree positions)."""
    if tree is None:
        return (np.int64(1) << np.arange(1, q_len + 1, dtype=np.int64)) - 1
    return (tree.astype(np.int64) << np.arange(tree.shape[1], dtype=np.int64)).sum(axis=1)


def causal_paged_mask(q_lens: np.ndarray, s_lens: np.ndarray, max_q: int, max_kv: int,
                       device: torch.device, window: int | None = None) -> torch.Tensor:
    """Query i of sequence b sits at position s_len - q_len + i and sees keys 0..that position
    (with a window, only the last `window` of them).

    Padding query rows get key 0 only, so no softmax row is empty (no NaNs)."""
    row = np.arange(max_q)[None, :, None]
    col = np.arange(max_kv)[None, None, :]
    last_visible = (s_lens - q_lens)[:, None, None] + row
    mask = col <= last_visible
    if window is not None:
        mask &= col > last_visible - window
    padding = row >= q_lens[:, None, None]
    mask &= ~padding
    mask |= padding & (col == 0)
    return torch.from_numpy(mask[:, None]).to(device)
