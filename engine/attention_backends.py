"""Attention backends: one per model runner, chosen once at start-up (choose_backend).

A backend turns each pass's PassLayout (engine/attention_metadata.py) into metadata of its own, once per
pass; every layer hands that metadata to attention.rope_paged_attention, and the metadata attends the way
its backend does. No caller asks which backend it holds.

  TorchBackend   the reference, on every device: SDPA over the pages, gathered and padded with one mask;
                 on a CPU, decode and verification rows grouped into few SDPA calls over their own blocks
                 and each prefill chunk attended alone (its own optimisation: the same masks, fewer keys).
  KernelBackend  a CPU model on the fused ops (cpu_kernels.py): a decode-shaped pass (no sequence feeding
                 more than SEQUENCE_MAX_QUERY tokens) is one C++ call a layer (RoPE, cache write, attention
                 over the pages where they lie; a draft tree as each row's visible tree positions in bits);
                 a pass with prefill chunks takes its decode-shaped rows to the kernel and its chunks to the
                 torch reference (MixedMetadata).
  FlashBackend   flash-attn on CUDA in fp16 / bf16: flash_attn_varlen_func over the pages; draft trees take
                 the torch reference (flash-attn takes no tree mask).
  decode grid    each backend's grid_metadata: the fixed-shape form of decode-shaped passes that
                 engine/decode_grid.py replays as CUDA graphs (DecodeMetadata: SDPA over the grid;
                 FlashDecodeMetadata: flash_attn_with_kvcache).

One mechanism covers what a backend cannot compute: a layer with soft-capping or sinks on the kernel,
or with sinks on flash-attn, attends through the torch reference over the same layout
(PassMetadata.reference, built once per pass and window by the first layer that asks).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine import cpu_kernels
from engine.attention import (AttentionMetadata, flash_available, flash_grid_attention, flash_varlen_attention,
                              grid_attention, padded_gather_attention, sequence_attention)
from engine.attention_metadata import (SEQUENCE_MAX_QUERY, LayoutArrays, PassLayout, SequencePlan,
                                       causal_paged_mask, fed_positions, row_tree_bits)
from engine.config import ATTENTION_BACKENDS


@dataclass
class PassMetadata(AttentionMetadata):
    """A pass as its backend built it: the tensors every backend reads, the layout it came from, and
    the backend (whose torch reference serves the layers it cannot)."""
    slot_mapping: torch.Tensor      # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor   # [B + 1] int32: cumulative query lengths (cu_seqlens_q)
    seq_start_loc: torch.Tensor     # [B + 1] int32: cumulative context lengths (cu_seqlens_k)
    seq_lens: torch.Tensor          # [B] int32: context length of each sequence, new tokens included
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    layout: PassLayout
    backend: "AttentionBackend"
    sliding_window: int | None = None   # keys this metadata's masks (or flash-attn) keep per query; None: all
    # The same pass for sliding-window layers; None when no layer slides or the window cuts nothing.
    windowed: "PassMetadata | None" = None
    _references: dict = field(default_factory=dict, repr=False)   # window -> the torch reference's metadata

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def reference(self, window: int | None) -> "PassMetadata":
        """This pass on the torch reference, for a layer (of window `window`) whose soft-capping or sinks
        this backend cannot compute: built from the layout by the first such layer of the pass."""
        if window not in self._references:
            self._references[window] = self.backend.reference.build(self.layout, window)
        return self._references[window]

    def for_window(self, window: int | None) -> "PassMetadata":
        """The metadata a layer of this window reads: this one, or `windowed` once the window cuts keys."""
        if window is None or self.max_seq_len <= window or self.sliding_window == window:
            return self
        if self.windowed is None or self.windowed.sliding_window != window:
            raise ValueError(f"a layer with sliding window {window} got attention metadata built for "
                             f"window {self.windowed and self.windowed.sliding_window}")
        return self.windowed


def _pass_tensors(arrays: LayoutArrays, device: torch.device) -> dict:
    """PassMetadata's tensor fields from a layout's arrays."""
    as_i32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)
    return dict(slot_mapping=torch.from_numpy(arrays.slot_mapping).to(device), query_start_loc=as_i32(arrays.q_start),
                seq_start_loc=as_i32(arrays.s_start), seq_lens=as_i32(arrays.s_lens), block_tables=as_i32(arrays.table),
                max_query_len=arrays.max_q, max_seq_len=int(arrays.s_lens.max()))


@dataclass
class TorchMetadata(PassMetadata):
    """The torch reference's pass, in one of three forms: its sequences split into groups attended
    separately (groups), grouped decode-shaped sequences (plan), or one padded SDPA call."""
    # Padded form, built once per pass so layers do no index arithmetic:
    block_ids: torch.Tensor | None = None        # [B * max_blocks] int64 (int32 indexing is far slower on CPU)
    query_pad_index: torch.Tensor | None = None  # [T] int64 into the padded [B * max_query_len] queries
                                                 # (None: all q_len 1)
    attn_mask: torch.Tensor | None = None        # [B, 1, max_query_len, max_seq_len] bool, True = attend; None:
                                                 # one sequence, whose queries need no mask or a plain causal one
    causal: bool = False                         # with attn_mask None: queries are the whole sequence
    # (token rows [T_g] int64, metadata) per group of sequences attended separately, so one prefill chunk
    # does not pad every decode query to its length.
    groups: list[tuple[torch.Tensor, "TorchMetadata"]] | None = None
    plan: SequencePlan | None = None             # grouped decode-shaped sequences

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        return self.for_window(window)._attend(query, kv_cache, scale, softcap, sinks)

    def _attend(self, query, kv_cache, scale, softcap, sinks) -> torch.Tensor:
        if self.groups is not None:
            out = torch.empty_like(query)
            for rows, group in self.groups:
                out[rows] = group._attend(query[rows], kv_cache, scale, softcap, sinks)
            return out
        if self.plan is not None:
            return sequence_attention(query, kv_cache, self.plan, scale, softcap, sinks)
        return padded_gather_attention(query, kv_cache, self, scale, softcap, sinks)


@dataclass
class KernelMetadata(PassMetadata):
    """A decode-shaped pass for the C++ kernel (any window: the kernel masks per layer)."""
    tree_bits: torch.Tensor | None = None   # draft trees: [T] int64, bit j of a row = it sees its
                                            # sequence's tree position j (None: causal)
    tree_cols: torch.Tensor | None = None   # ... [B] int32: each sequence's tree positions, its last ones

    def rope_attention(self, qk, value, cos, sin_signed, kv_cache, num_heads, scale, window, softcap, sinks):
        if softcap is not None or sinks is not None:
            return self.reference(window).rope_attention(qk, value, cos, sin_signed, kv_cache, num_heads, scale,
                                                         window, softcap, sinks)
        return cpu_kernels.extension().rope_paged_attention(
            qk, value, cos, sin_signed, kv_cache, self.slot_mapping, self.query_start_loc, self.seq_lens,
            self.block_tables, num_heads, scale, window or 0, self.tree_bits, self.tree_cols)

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        # Queries already rotated (paged_attention): the kernel rotates them itself, so the reference attends.
        return self.reference(window).attend(query, kv_cache, scale, window, softcap, sinks)


@dataclass
class MixedMetadata(PassMetadata):
    """A pass with prefill chunks on the kernel backend: its decode-shaped rows a KernelMetadata group,
    each chunk a torch group (in the reference's grouping they cost verification rows several times
    more, and their results depended on whether a prompt shared their pass)."""
    groups: list[tuple[torch.Tensor, PassMetadata]] = field(default_factory=list)

    def rope_attention(self, qk, value, cos, sin_signed, kv_cache, num_heads, scale, window, softcap, sinks):
        if softcap is not None or sinks is not None:
            return self.reference(window).rope_attention(qk, value, cos, sin_signed, kv_cache, num_heads, scale,
                                                         window, softcap, sinks)
        meta = self.windowed if window is not None and self.windowed is not None else self
        out = qk.new_empty(qk.shape[0], num_heads, qk.shape[2])
        for rows, group in meta.groups:
            out[rows] = group.rope_attention(qk[rows], value[rows], cos[rows], sin_signed[rows], kv_cache, num_heads,
                                             scale, window, None, None)
        return out

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        return self.reference(window).attend(query, kv_cache, scale, window, softcap, sinks)


@dataclass
class FlashMetadata(PassMetadata):
    """A pass for flash_attn_varlen_func (its window in sliding_window)."""

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        if sinks is not None:   # flash-attn has no sinks
            return self.reference(window).attend(query, kv_cache, scale, window, softcap, sinks)
        meta = self.for_window(window)
        return flash_varlen_attention(query, kv_cache, meta.query_start_loc, meta.seq_start_loc, meta.max_query_len,
                                      meta.max_seq_len, meta.block_tables, scale, meta.sliding_window, softcap)


@dataclass
class DecodeMetadata(AttentionMetadata):
    """A decode-shaped pass as a grid of num_seqs rows of query_len queries each: sequence b's new
    tokens are the last ones of its row (right-aligned, so the causal mask stays aligned to its last
    key); the rows before them, and whole padding sequences, are padding, whose keys and values go to
    a scratch slot and whose outputs are ignored. Every tensor keeps its shape from pass to pass and
    the layers read no host value, so a CUDA graph can replay it with new contents. Attends with the
    torch reference's SDPA over the grid."""
    slot_mapping: torch.Tensor   # [B * Q] int64: cache slot of each grid row (padding: the scratch slot)
    seq_lens: torch.Tensor       # [B] int32: keys of each sequence, its new tokens included (padding: 1)
    block_tables: torch.Tensor   # [B, max_blocks] int32 (padding: the scratch block)
    block_ids: torch.Tensor      # [B * max_blocks] int64: the same, flat, for the gather
    query_len: int
    # A pass with draft trees: each grid row's position, its visible tree positions as bits (row_tree_bits;
    # padding rows 0) and each sequence's tree positions (its last).
    positions: torch.Tensor | None = None   # [B * Q] int64
    tree_bits: torch.Tensor | None = None   # [B * Q] int64
    tree_cols: torch.Tensor | None = None   # [B] int32
    _masks: dict = field(default_factory=dict)   # sliding window -> [B, 1, Q, keys] bool

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        num_keys = self.block_tables.shape[1] * kv_cache.shape[2]
        return grid_attention(query, kv_cache, self.block_ids, self.num_seqs, self.query_len,
                              self.mask(num_keys, window), scale, softcap, sinks)

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


@dataclass
class FlashDecodeMetadata(DecodeMetadata):
    """The grid for flash_attn_with_kvcache, which reads the pages in place; a layer with sinks, or a
    pass with draft trees (flash-attn has neither), takes the SDPA over the grid."""

    def attend(self, query, kv_cache, scale, window, softcap, sinks):
        if sinks is not None or self.tree_bits is not None:
            return super().attend(query, kv_cache, scale, window, softcap, sinks)
        return flash_grid_attention(query, kv_cache, self.seq_lens, self.block_tables, self.query_len, scale,
                                    window, softcap)


class AttentionBackend:
    """Builds each pass's metadata from its layout (build); a model runner holds one, chosen at start-up."""

    name: str
    decode_on_grid = False   # decode-shaped passes run best on a DecodeGrid even without CUDA graphs

    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, torch.device(device)

    @property
    def reference(self) -> "TorchBackend":
        """The torch reference over the same cache: what attends where this backend cannot."""
        return self._reference

    def build(self, layout: PassLayout, sliding_window: int | None = None) -> PassMetadata:
        """The pass's metadata, with the masks of the model's sliding window (None: full attention)."""
        if layout.tree_masks is not None:
            layout.check_trees(sliding_window)
            return self.build_tree(layout, sliding_window)
        return self.build_causal(layout, sliding_window)

    def build_causal(self, layout: PassLayout, sliding_window: int | None) -> PassMetadata:
        raise NotImplementedError

    def build_tree(self, layout: PassLayout, sliding_window: int | None) -> PassMetadata:
        return self.reference.build_tree(layout, sliding_window)

    def grid_metadata(self, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      block_ids: torch.Tensor, query_len: int) -> DecodeMetadata:
        """A decode grid's pass (engine/decode_grid.py) over its persistent buffers."""
        return DecodeMetadata(slot_mapping, seq_lens, block_tables, block_ids, query_len)


class TorchBackend(AttentionBackend):
    """The reference. group_sequences: attend decode-shaped sequences in groups over their own blocks and
    prefill chunks one by one (default: on a CPU, where it is measured to pay), else one padded call."""

    name = "torch"

    def __init__(self, block_size: int, device: torch.device, group_sequences: bool | None = None):
        super().__init__(block_size, device)
        self.group_sequences = self.device.type == "cpu" if group_sequences is None else group_sequences
        self._reference = self

    def build_causal(self, layout: PassLayout, sliding_window: int | None) -> TorchMetadata:
        meta = self._metadata(layout, None)
        if sliding_window is not None and max(layout.seq_lens) > sliding_window:
            meta.windowed = self._metadata(layout, sliding_window)
        return meta

    def build_tree(self, layout: PassLayout, sliding_window: int | None) -> TorchMetadata:
        """One padded mask, the trees written into it (no grouping); for sliding-window layers a second
        one (`windowed`)."""
        arrays = LayoutArrays(layout, self.block_size)
        meta = self._padded(layout, arrays, None, tree=True)
        for b, (tree, q_len, s_len) in enumerate(zip(layout.tree_masks, layout.query_lens, layout.seq_lens)):
            if tree is not None:
                meta.attn_mask[b, 0, :q_len, s_len - tree.shape[1]:s_len] = torch.from_numpy(tree).to(self.device)
        if sliding_window is not None and max(layout.seq_lens) > sliding_window:
            meta.windowed = _tree_windowed(meta, layout, sliding_window)
        return meta

    def _metadata(self, layout: PassLayout, window: int | None) -> TorchMetadata:
        arrays = LayoutArrays(layout, self.block_size)
        short = arrays.q_lens <= SEQUENCE_MAX_QUERY
        if self.group_sequences and short.all():
            plan = SequencePlan.build(arrays.table, arrays.q_lens, arrays.s_lens, arrays.q_start, self.block_size,
                                      self.device, window)
            return TorchMetadata(**_pass_tensors(arrays, self.device), layout=layout, backend=self,
                                 sliding_window=window, plan=plan)
        if self.group_sequences and (~short).sum() + short.any() > 1:
            # Prefill chunks one SDPA call each: padded to the longest together, many prompts arriving
            # at once would cost many times the longest one's attention; alone, a fresh prompt's chunk
            # is plainly causal, which CPU SDPA computes faster than a masked one.
            parts = ([np.flatnonzero(short)] if short.any() else []) + [[i] for i in np.flatnonzero(~short)]
            return self._split(layout, arrays, window, parts)
        if not self.group_sequences and arrays.max_q > 1 and 1 < (arrays.q_lens == 1).sum() < arrays.num_seqs:
            return self._split(layout, arrays, window, [np.flatnonzero(arrays.q_lens == 1),
                                                        np.flatnonzero(arrays.q_lens > 1)])
        return self._padded(layout, arrays, window)

    def _split(self, layout: PassLayout, arrays: LayoutArrays, window: int | None, parts) -> TorchMetadata:
        """The pass as groups of its sequences (each part a list of sequence indices), attended separately."""
        groups = [(torch.from_numpy(arrays.rows(seqs)).to(self.device), self._metadata(layout.subset(seqs), window))
                  for seqs in parts]
        return TorchMetadata(**_pass_tensors(arrays, self.device), layout=layout, backend=self,
                             sliding_window=window, groups=groups)

    def _padded(self, layout: PassLayout, arrays: LayoutArrays, window: int | None,
                tree: bool = False) -> TorchMetadata:
        """One padded SDPA call: a whole prompt alone needs no mask (causal), one-token rows no padding."""
        block_ids = torch.from_numpy(arrays.table.reshape(-1)).to(self.device)
        pad_index = torch.from_numpy(arrays.pad_index()).to(self.device) if arrays.max_q > 1 or tree else None
        max_kv, mask, causal = int(arrays.s_lens.max()), None, False
        windowed = window is not None and max_kv > window
        if not tree and arrays.num_seqs == 1 and arrays.max_q in (1, arrays.s_lens[0]) and not windowed:
            causal = arrays.max_q > 1
        else:
            mask = causal_paged_mask(arrays.q_lens, arrays.s_lens, arrays.max_q, max_kv, self.device, window)
        return TorchMetadata(**_pass_tensors(arrays, self.device), layout=layout, backend=self, sliding_window=window,
                             block_ids=block_ids, query_pad_index=pad_index, attn_mask=mask, causal=causal)


def _tree_windowed(meta: TorchMetadata, layout: PassLayout, window: int) -> TorchMetadata:
    """A tree pass (padded) for sliding-window layers: each row also loses the context keys `window` or
    more positions before its own (its depth's position, not its slot's)."""
    positions = np.zeros((meta.num_seqs, meta.max_query_len), dtype=np.int64)   # padding rows: 0, key 0 kept
    for b, (tree, q_len, s_len) in enumerate(zip(layout.tree_masks, layout.query_lens, layout.seq_lens)):
        positions[b, :q_len] = fed_positions(tree, q_len, s_len)
    keys = torch.arange(meta.attn_mask.shape[-1], device=meta.attn_mask.device)
    in_window = keys > torch.from_numpy(positions - window).to(keys.device)[:, None, :, None]
    return replace(meta, attn_mask=meta.attn_mask & in_window, sliding_window=window, windowed=None, _references={})


class KernelBackend(AttentionBackend):
    """The fused CPU ops' attention kernel for decode-shaped rows; the torch reference for the rest."""

    name = "kernel"

    def __init__(self, block_size: int, device: torch.device):
        super().__init__(block_size, device)
        self._reference = TorchBackend(block_size, device)

    def build_causal(self, layout: PassLayout, sliding_window: int | None) -> PassMetadata:
        if layout.max_query_len <= SEQUENCE_MAX_QUERY:
            return self._kernel(layout)
        short = [i for i, q_len in enumerate(layout.query_lens) if q_len <= SEQUENCE_MAX_QUERY]
        if not short:
            return self.reference.build_causal(layout, sliding_window)
        meta = self._mixed(layout, short, None)
        if sliding_window is not None and max(layout.seq_lens) > sliding_window:
            meta.windowed = self._mixed(layout, short, sliding_window)
        return meta

    def build_tree(self, layout: PassLayout, sliding_window: int | None) -> PassMetadata:
        if layout.max_query_len > SEQUENCE_MAX_QUERY:
            return self.reference.build_tree(layout, sliding_window)
        meta = self._kernel(layout)
        pairs = list(zip(layout.tree_masks, layout.query_lens))
        meta.tree_bits = torch.from_numpy(np.concatenate([row_tree_bits(tree, q_len) for tree, q_len in pairs])
                                          ).to(self.device)
        meta.tree_cols = torch.tensor([q_len if tree is None else tree.shape[1] for tree, q_len in pairs],
                                      dtype=torch.int32, device=self.device)
        return meta

    def _kernel(self, layout: PassLayout) -> KernelMetadata:
        arrays = LayoutArrays(layout, self.block_size)
        return KernelMetadata(**_pass_tensors(arrays, self.device), layout=layout, backend=self)

    def _mixed(self, layout: PassLayout, short: list[int], window: int | None) -> MixedMetadata:
        """The decode-shaped rows `short` on the kernel, each prefill chunk alone on the torch reference."""
        arrays = LayoutArrays(layout, self.block_size)
        chunks = [[i] for i in sorted(set(range(arrays.num_seqs)) - set(short))]
        groups = [(torch.from_numpy(arrays.rows(short)).to(self.device), self._kernel(layout.subset(short)))]
        groups += [(torch.from_numpy(arrays.rows(seqs)).to(self.device),
                    self.reference._metadata(layout.subset(seqs), window)) for seqs in chunks]
        return MixedMetadata(**_pass_tensors(arrays, self.device), layout=layout, backend=self,
                             sliding_window=window, groups=groups)


class FlashBackend(AttentionBackend):
    """flash-attn over the pages; draft trees on the torch reference."""

    name = "flash"
    decode_on_grid = True   # flash_attn_with_kvcache reads decode rows best

    def __init__(self, block_size: int, device: torch.device):
        super().__init__(block_size, device)
        self._reference = TorchBackend(block_size, device)

    def build_causal(self, layout: PassLayout, sliding_window: int | None) -> FlashMetadata:
        meta = FlashMetadata(**_pass_tensors(LayoutArrays(layout, self.block_size), self.device), layout=layout,
                             backend=self)
        if sliding_window is not None and meta.max_seq_len > sliding_window:
            meta.windowed = replace(meta, sliding_window=sliding_window, _references={})
        return meta

    def grid_metadata(self, slot_mapping, seq_lens, block_tables, block_ids, query_len) -> DecodeMetadata:
        return FlashDecodeMetadata(slot_mapping, seq_lens, block_tables, block_ids, query_len)


def uses_flash(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether backend `name` (attention_backend's value) serves a model of this dtype with flash-attn:
    "auto" where flash-attn is installed on a CUDA device and the dtype is not float32 (it has no fp32
    kernels); "flash" insists, and is an error where flash-attn cannot serve."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    usable = flash_available(device) and dtype != torch.float32
    if name == "flash" and not usable:
        raise ValueError(f"attention_backend flash needs flash-attn installed, a CUDA device and float16 or "
                         f"bfloat16; this model runs on {device} in {str(dtype).replace('torch.', '')}")
    return usable and name in ("auto", "flash")


def choose_backend(name: str, model: torch.nn.Module, block_size: int, device: torch.device,
                   dtype: torch.dtype) -> AttentionBackend:
    """A runner's backend, once at start-up: flash-attn where uses_flash says so; the C++ kernel where
    the model runs on the fused CPU ops (models.llama.use_fused_cpu_ops set its `fused_ops`); else
    the torch reference. An explicit "kernel" on a model without the fused ops is an error."""
    if uses_flash(name, device, dtype):
        return FlashBackend(block_size, device)
    fused = getattr(model, "fused_ops", False)
    if name == "kernel" and not fused:
        raise ValueError("attention_backend kernel needs the fused CPU ops: float32 on a CPU with AVX2, "
                         "cpu_kernels on, a head size that is a multiple of 16 and no soft-capped attention")
    if fused and name in ("auto", "kernel"):
        return KernelBackend(block_size, device)
    return TorchBackend(block_size, device)
