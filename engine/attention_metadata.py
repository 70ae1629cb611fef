"""The attention metadata of a forward pass: built once by the model runner, read by every layer.

A forward pass covers B sequences; sequence b contributes query_lens[b] new tokens (a prefill
chunk, one decode token, or the last token plus k draft tokens) whose keys/values are written into
the paged cache at `slot_mapping`, and which attend causally to the first seq_lens[b] cached
positions of that sequence (the new tokens are the last query_lens[b] of them). A draft tree's
rows see the context and their own ancestors instead (tree masks, or the kernel's tree bits).

Sliding-window layers (Mistral, Qwen with use_sliding_window, Gemma's local layers) attend to the
last `sliding_window` positions only, the query's own included: key j is visible to the query at
position i iff i - window < j <= i (transformers' rule; flash-attn's window_size=(window - 1, 0)).
The cache keeps every position; only the masks change.

Which path a pass takes is decided here, when its metadata is built: flash-attn (use_flash), the
C++ kernel (`kernel`, decode-shaped passes of a model with the fused CPU ops), or one of the two
torch paths (TORCH_ATTENTION: "sequences", "padded", "auto"); engine/attention.py runs them.
DecodeMetadata is the fixed-grid form of decode-shaped passes (engine/decode_grid.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np
import torch

# "sequences", "padded", or "auto" (sequences on CPU, padded elsewhere: measured on CPU only).
# Tests set it directly; SPECSERVE_TORCH_ATTENTION sets the default.
TORCH_ATTENTION = os.environ.get("SPECSERVE_TORCH_ATTENTION", "auto")
# Longest query the "sequences" path takes: the last token plus up to 32 drafts.
SEQUENCE_MAX_QUERY = 33
# Sequences with one query length whose numbers of keys differ by at most this share one SDPA call, the
# shorter ones padded: on a 2-core AVX512 CPU a call costs about as much as attending to this many keys.
SHARE_CALL_MAX_PAD = 128


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
    """The "sequences" torch path of one pass: its sequences, grouped."""
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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor   # [B + 1] int32: cumulative query lengths (cu_seqlens_q)
    seq_start_loc: torch.Tensor     # [B + 1] int32: cumulative context lengths (cu_seqlens_k)
    seq_lens: torch.Tensor          # [B] int32: context length of each sequence, new tokens included
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    use_flash: bool
    # Padded torch path only, built once per pass so layers do no index arithmetic:
    block_ids: torch.Tensor | None        # [B * max_blocks] int64 (int32 indexing is ~100x slower on CPU)
    query_pad_index: torch.Tensor | None  # [T] int64 into the padded [B * max_query_len] queries (None: all q_len 1)
    attn_mask: torch.Tensor | None        # [B, 1, max_query_len, max_seq_len] bool, True = attend;
                                          # None: one sequence, whose queries need no mask or a plain causal one
    causal: bool = False                  # with attn_mask None: queries are the whole sequence
    # Torch path, mixed passes: (token rows [T_g] int64, metadata) per group of sequences attended
    # separately, so one prefill chunk does not pad every decode query to its length (padded path: single-token
    # sequences and the rest; "sequences" path: decode / verification sequences and prefill chunks).
    groups: list[tuple[torch.Tensor, "AttentionMetadata"]] | None = None
    plan: SequencePlan | None = None      # "sequences" torch path: its groups of sequences
    sliding_window: int | None = None     # keys this metadata's masks (or flash-attn) keep per query; None: all
    # The same pass for sliding-window layers; None when no layer slides or the window cuts nothing.
    windowed: "AttentionMetadata | None" = None
    kernel: bool = False                  # decode-shaped: rope_paged_attention's C++ kernel attends, any window
    kernel_rows: bool = False             # groups: the decode-shaped rows of a pass with prefill chunks are a
                                          # kernel group (rope_paged_attention takes the pass group by group)
    tree_bits: torch.Tensor | None = None  # kernel, draft trees: [T] int64, bit j of a row = it sees its
                                           # sequence's tree position j (None: causal)
    tree_cols: torch.Tensor | None = None  # ... [B] int32: each sequence's tree positions, its last ones
    # Sliding window -> this pass for the torch path (torch_variant), made by the first layer that asks.
    _torch_variants: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def torch_variant(self, block_size: int, sliding_window: int | None) -> "AttentionMetadata":
        """This pass's metadata for the torch path, for a layer whose soft-capping or sinks the path it was
        built for (the C++ kernel, flash-attn) cannot compute; rebuilt from its own tensors (a draft tree's
        masks from its rows' bits), once per pass and window."""
        if sliding_window not in self._torch_variants:
            q_start = self.query_start_loc.tolist()
            q_lens = [b - a for a, b in zip(q_start, q_start[1:])]
            seq_lens, tables = self.seq_lens.tolist(), self.block_tables.tolist()
            device = self.slot_mapping.device
            if self.tree_bits is None:
                variant = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device,
                                                  sliding_window=sliding_window)
            else:
                bits, cols = self.tree_bits.cpu().numpy(), self.tree_cols.tolist()
                trees = [(bits[a:b, None] >> np.arange(n)) & 1 == 1 for a, b, n in zip(q_start, q_start[1:], cols)]
                variant = AttentionMetadata.build_tree(q_lens, seq_lens, tables, block_size, device, trees,
                                                       sliding_window)
            self._torch_variants[sliding_window] = variant
        return self._torch_variants[sliding_window]

    @classmethod
    def build_tree(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device, tree_masks: list[np.ndarray | None],
                   sliding_window: int | None = None, kernel: bool = False) -> "AttentionMetadata":
        """A pass in which some sequences feed (part of) a draft tree: tree_masks[b] (bool [q_len, cols],
        or None: causal) says which of the sequence's last `cols` positions, the tree's, each fed token
        sees (the fed tokens are the last q_len of them); every fed token sees the whole context before
        the tree. kernel (as for build): a decode-shaped pass goes to the attention kernel with each
        row's visible tree positions as bits; otherwise the padded torch path with one mask (no
        flash-attn), and for sliding-window layers a second one (`windowed`)."""
        if not tree_window_ok(sliding_window):
            raise ValueError(f"draft trees need full attention or a sliding window over {MAX_TREE_COLS} positions, "
                             f"not {sliding_window}")
        for b, (tree, q_len, s_len) in enumerate(zip(tree_masks, query_lens, seq_lens)):
            check_tree_mask(tree, q_len, s_len, b)
        if kernel and TORCH_ATTENTION == "auto" and max(query_lens) <= SEQUENCE_MAX_QUERY:
            meta = cls._build(query_lens, seq_lens, block_tables, block_size, device, False, None, "kernel")
            meta.tree_bits = torch.from_numpy(np.concatenate([row_tree_bits(tree, q_len) for tree, q_len
                                                              in zip(tree_masks, query_lens)])).to(device)
            meta.tree_cols = torch.tensor([q_len if tree is None else tree.shape[1] for tree, q_len
                                           in zip(tree_masks, query_lens)], dtype=torch.int32, device=device)
            return meta
        meta = cls._build(query_lens, seq_lens, block_tables, block_size, device, False, None, "tree")
        for b, (tree, q_len, s_len) in enumerate(zip(tree_masks, query_lens, seq_lens)):
            if tree is not None:
                meta.attn_mask[b, 0, :q_len, s_len - tree.shape[1]:s_len] = torch.from_numpy(tree).to(device)
        if sliding_window is not None and max(seq_lens) > sliding_window:
            meta.windowed = meta._tree_windowed(query_lens, seq_lens, tree_masks, sliding_window)
        return meta

    def _tree_windowed(self, query_lens, seq_lens, tree_masks, window: int) -> "AttentionMetadata":
        """This tree pass (padded path) for sliding-window layers: each row also loses the context keys
        `window` or more positions before its own (its depth's position, not its slot's)."""
        positions = np.zeros((self.num_seqs, self.max_query_len), dtype=np.int64)   # padding rows: 0, key 0 kept
        for b, (tree, q_len, s_len) in enumerate(zip(tree_masks, query_lens, seq_lens)):
            positions[b, :q_len] = fed_positions(tree, q_len, s_len)
        keys = torch.arange(self.attn_mask.shape[-1], device=self.attn_mask.device)
        in_window = keys > torch.from_numpy(positions - window).to(keys.device)[:, None, :, None]
        return replace(self, attn_mask=self.attn_mask & in_window, sliding_window=window, windowed=None,
                       _torch_variants={})

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, use_flash: bool = False,
              sliding_window: int | None = None, kernel: bool = False) -> "AttentionMetadata":
        """Host-side construction from plain lists (one entry per sequence). With sliding_window,
        `windowed` holds the variant its layers read, once some sequence reaches past the window.
        kernel: the model runs the fused CPU ops; a decode-shaped pass is then marked for the
        attention kernel, and so are the decode-shaped rows of a pass with prefill chunks (in the torch
        path's "sequences" they cost verification rows several times more, and their results depended
        on whether a prompt shared their pass); TORCH_ATTENTION "sequences" or "padded" turns that off."""
        path = _torch_path(torch.device(device))
        kernel = kernel and not use_flash and TORCH_ATTENTION == "auto"
        if kernel and max(query_lens) <= SEQUENCE_MAX_QUERY:
            return cls._build(query_lens, seq_lens, block_tables, block_size, device, False, None, "kernel")
        short_path = "kernel" if kernel else path
        meta = cls._build(query_lens, seq_lens, block_tables, block_size, device, use_flash, None, path, short_path)
        if sliding_window is not None and max(seq_lens) > sliding_window:
            meta.windowed = cls._build(query_lens, seq_lens, block_tables, block_size, device, use_flash,
                                       sliding_window, path, short_path)
        return meta

    @classmethod
    def _build(cls, query_lens, seq_lens, block_tables, block_size, device, use_flash,
               window: int | None, path: str, short_path: str | None = None) -> "AttentionMetadata":
        """short_path: the path of the decode-shaped rows in a pass with prefill chunks (default: path)."""
        num_seqs = len(query_lens)
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        assert np.all(q_lens >= 1) and np.all(s_lens >= q_lens), "every sequence needs >= 1 new token"
        max_blocks = max(len(t) for t in block_tables)
        table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = blocks
        # Absolute position of every new token, then its slot through the block table.
        seq_idx = np.repeat(np.arange(num_seqs), q_lens)
        q_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        positions = np.arange(int(q_start[-1])) - q_start[seq_idx] + (s_lens - q_lens)[seq_idx]
        blocks = table[seq_idx, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size
        s_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(s_lens, out=s_start[1:])
        max_q = int(q_lens.max())

        block_ids = pad_index = mask = groups = plan = None
        causal = False
        short = q_lens <= SEQUENCE_MAX_QUERY
        split = lambda parts: cls._groups(parts, q_lens, s_lens, q_start, block_tables, block_size, device, window)
        # Prefill chunks (the "sequences" path): one SDPA call each. Padded to the longest together,
        # 16 prompts arriving at once cost ~16x the longest one's attention; alone, a fresh prompt's
        # chunk is plainly causal, which CPU SDPA computes in about half the time of a masked one.
        prefills = [[i] for i in np.flatnonzero(~short)] if path == "sequences" else []
        if use_flash or path == "kernel":
            pass
        elif path == "tree":   # one padded mask, always (build_tree writes the trees into it)
            block_ids = torch.from_numpy(table.reshape(-1)).to(device)
            pad_index = torch.from_numpy(seq_idx * max_q + (np.arange(len(seq_idx)) - q_start[seq_idx])).to(device)
            mask = _causal_paged_mask(q_lens, s_lens, max_q, int(s_lens.max()), device)
        elif path == "sequences" and short.all():
            plan = SequencePlan.build(table, q_lens, s_lens, q_start, block_size, device, window)
        elif len(prefills) + short.any() > 1:
            groups = split(([(np.flatnonzero(short), short_path or path)] if short.any() else [])
                           + [(p, path) for p in prefills])
        elif max_q > 1 and 1 < (q_lens == 1).sum() < num_seqs:
            groups = split([(np.flatnonzero(q_lens == 1), path), (np.flatnonzero(q_lens > 1), path)])
        else:
            block_ids = torch.from_numpy(table.reshape(-1)).to(device)
            if max_q > 1:
                pad_index = torch.from_numpy(seq_idx * max_q + (np.arange(len(seq_idx)) - q_start[seq_idx])).to(device)
            windowed = window is not None and int(s_lens.max()) > window
            single = num_seqs == 1 and (max_q == 1 or max_q == s_lens[0]) and not windowed
            if single:
                causal = max_q > 1
            else:
                mask = _causal_paged_mask(q_lens, s_lens, max_q, int(s_lens.max()), device, window)

        as_i32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)
        return cls(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=as_i32(q_start),
            seq_start_loc=as_i32(s_start),
            seq_lens=as_i32(s_lens),
            block_tables=as_i32(table),
            max_query_len=max_q,
            max_seq_len=int(s_lens.max()),
            use_flash=use_flash,
            block_ids=block_ids,
            query_pad_index=pad_index,
            attn_mask=mask,
            causal=causal,
            groups=groups,
            plan=plan,
            sliding_window=window,
            kernel=path == "kernel",
            kernel_rows=groups is not None and any(g.kernel for _, g in groups),
        )

    @classmethod
    def _groups(cls, parts, q_lens, s_lens, q_start, block_tables, block_size, device, window):
        """(token rows, metadata) for each (sequence indices, path) in parts."""
        groups = []
        for seqs, part_path in parts:
            rows = np.concatenate([np.arange(q_start[i], q_start[i + 1]) for i in seqs])
            sub = cls._build(q_lens[seqs].tolist(), s_lens[seqs].tolist(), [block_tables[i] for i in seqs],
                             block_size, device, False, window if part_path != "kernel" else None, part_path)
            groups.append((torch.from_numpy(rows).to(device), sub))
        return groups


@dataclass
class DecodeMetadata:
    """A decode-shaped pass as a grid of num_seqs rows of query_len queries each: sequence b's new
    tokens are the last ones of its row (right-aligned, so the causal mask stays aligned to its last
    key); the rows before them, and whole padding sequences, are padding, whose keys and values go to
    a scratch slot and whose outputs are ignored. Every tensor keeps its shape from pass to pass and
    the layers read no host value, so a CUDA graph can replay it with new contents."""
    slot_mapping: torch.Tensor   # [B * Q] int64: cache slot of each grid row (padding: the scratch slot)
    seq_lens: torch.Tensor       # [B] int32: keys of each sequence, its new tokens included (padding: 1)
    block_tables: torch.Tensor   # [B, max_blocks] int32 (padding: the scratch block)
    block_ids: torch.Tensor      # [B * max_blocks] int64: the same, flat, for the torch path's gather
    query_len: int
    use_flash: bool
    # A pass with draft trees (the torch path, never flash-attn): each grid row's position, its visible
    # tree positions as bits (row_tree_bits; padding rows 0) and each sequence's tree positions (its last).
    positions: torch.Tensor | None = None   # [B * Q] int64
    tree_bits: torch.Tensor | None = None   # [B * Q] int64
    tree_cols: torch.Tensor | None = None   # [B] int32
    _masks: dict = field(default_factory=dict)   # torch path: sliding window -> [B, 1, Q, keys] bool

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def mask(self, num_keys: int, window: int | None) -> torch.Tensor:
        """[B, 1, Q, num_keys] bool, True = attend, computed on the device from seq_lens (and a tree
        pass's bits; the first layer that asks builds it, a replayed graph rebuilds it with the pass's
        lengths)."""
        if window not in self._masks:
            device = self.seq_lens.device
            keys = torch.arange(num_keys, device=device)
            if self.tree_bits is None:
                query_pos = (self.seq_lens.long()[:, None] - self.query_len
                             + torch.arange(self.query_len, device=device))[:, :, None]   # [B, Q, 1]
                visible = keys <= query_pos
                padding = query_pos < 0
            else:
                visible, query_pos, padding = self._tree_visible(keys)
            if window is not None:
                visible &= keys > query_pos - window
            visible |= padding & (keys == 0)   # padding rows: key 0, no NaN
            self._masks[window] = visible[:, None]
        return self._masks[window]

    def _tree_visible(self, keys: torch.Tensor):
        """A tree pass's [B, Q, keys] visibility (the context before the tree, then the tree positions
        whose bits are set), each row's position [B, Q, 1] and its padding rows [B, Q, 1]. A window
        cuts context keys only: a tree spans at most 64 positions, and trees run only under windows
        wider than that (tree_window_ok)."""
        bits = self.tree_bits.view(self.num_seqs, self.query_len, 1)
        tree_start = (self.seq_lens - self.tree_cols).long()[:, None, None]   # [B, 1, 1]
        offset = keys - tree_start
        in_tree = (offset >= 0) & (keys < self.seq_lens.long()[:, None, None])
        sees = torch.bitwise_right_shift(bits, offset.clamp(0, 63)) & 1 == 1
        query_pos = self.positions.view(self.num_seqs, self.query_len, 1)
        return (offset < 0) | (in_tree & sees), query_pos, bits == 0


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


def _torch_path(device: torch.device) -> str:
    if TORCH_ATTENTION not in ("auto", "sequences", "padded"):
        raise ValueError(f"torch attention path must be auto, sequences or padded, got {TORCH_ATTENTION!r}")
    if TORCH_ATTENTION == "auto":
        return "sequences" if device.type == "cpu" else "padded"
    return TORCH_ATTENTION


def _causal_paged_mask(q_lens: np.ndarray, s_lens: np.ndarray, max_q: int, max_kv: int,
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
