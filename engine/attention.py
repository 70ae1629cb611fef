"""Paged attention: the only file that knows flash-attn from torch SDPA.

One AttentionMetadata is built per forward pass by the model runner and read
by every layer. A forward pass covers B sequences; sequence b contributes
query_lens[b] new tokens (a prefill chunk, one decode token, or the last token
plus k draft tokens) whose keys/values are written into the paged cache at
`slot_mapping`, and which attend causally to the first seq_lens[b] cached
positions of that sequence (the new tokens are the last query_lens[b] of them).

Sliding-window layers (Mistral, Qwen with use_sliding_window) attend to the last
`sliding_window` positions only, the query's own included: key j is visible to the
query at position i iff i - window < j <= i (transformers' rule; flash-attn's
window_size=(window - 1, 0)). The cache keeps every position; only the masks change.

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim],
so kv_cache[0] / kv_cache[1] are exactly flash-attn's paged k_cache / v_cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:  # flash-attn is an optional GPU extra; the torch path is the reference.
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # ImportError, or a wheel built for another torch/CUDA
    flash_attn_varlen_func = None

# flash-attn's paged kernels need pages of a multiple of 256 tokens.
FLASH_BLOCK_SIZE = 256


def flash_available(device: torch.device) -> bool:
    return flash_attn_varlen_func is not None and torch.device(device).type == "cuda"


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
    # Torch path only, built once per pass so layers do no index arithmetic:
    block_ids: torch.Tensor | None        # [B * max_blocks] int64 (int32 indexing is ~100x slower on CPU)
    query_pad_index: torch.Tensor | None  # [T] int64 into the padded [B * max_query_len] queries (None: all q_len 1)
    attn_mask: torch.Tensor | None        # [B, 1, max_query_len, max_seq_len] bool, True = attend;
                                          # None: one sequence, whose queries need no mask or a plain causal one
    causal: bool = False                  # with attn_mask None: queries are the whole sequence
    # Torch path, mixed passes: (token rows [T_g] int64, metadata) for the single-token sequences and for
    # the rest, attended separately, so one prefill chunk does not pad every decode query to its length.
    groups: list[tuple[torch.Tensor, "AttentionMetadata"]] | None = None
    sliding_window: int | None = None     # keys this metadata's masks (or flash-attn) keep per query; None: all
    # The same pass for sliding-window layers; None when no layer slides or the window cuts nothing.
    windowed: "AttentionMetadata | None" = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, use_flash: bool = False,
              sliding_window: int | None = None) -> "AttentionMetadata":
        """Host-side construction from plain lists (one entry per sequence). With sliding_window,
        `windowed` holds the variant its layers read, once some sequence reaches past the window."""
        meta = cls._build(query_lens, seq_lens, block_tables, block_size, device, use_flash, None)
        if sliding_window is not None and max(seq_lens) > sliding_window:
            meta.windowed = cls._build(query_lens, seq_lens, block_tables, block_size, device, use_flash,
                                       sliding_window)
        return meta

    @classmethod
    def _build(cls, query_lens, seq_lens, block_tables, block_size, device, use_flash,
               window: int | None) -> "AttentionMetadata":
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

        block_ids = pad_index = mask = groups = None
        causal = False
        if not use_flash and max_q > 1 and 1 < (q_lens == 1).sum() < num_seqs:
            groups = []
            for seqs in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)):
                rows = np.concatenate([np.arange(q_start[i], q_start[i + 1]) for i in seqs])
                sub = cls._build(q_lens[seqs].tolist(), s_lens[seqs].tolist(), [block_tables[i] for i in seqs],
                                 block_size, device, False, window)
                groups.append((torch.from_numpy(rows).to(device), sub))
        elif not use_flash:
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
            sliding_window=window,
        )


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


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this pass's keys/values ([T, H_kv, D]) into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """query [T, H_q, D], key/value [T, H_kv, D] -> output [T, H_q, D]. sliding_window: this
    layer's (None: full attention); once it cuts anything, the metadata must have been built with it."""
    write_kv(kv_cache, key, value, meta.slot_mapping)
    if sliding_window is not None and meta.max_seq_len > sliding_window:
        if meta.windowed is None or meta.windowed.sliding_window != sliding_window:
            raise ValueError(f"a layer with sliding window {sliding_window} got attention metadata built for "
                             f"window {meta.windowed and meta.windowed.sliding_window}")
        meta = meta.windowed
    if meta.use_flash:
        window = (-1, -1) if meta.sliding_window is None else (meta.sliding_window - 1, 0)
        return flash_attn_varlen_func(
            query, kv_cache[0], kv_cache[1],
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True, window_size=window, block_table=meta.block_tables,
        )
    return _torch_paged_attention(query, kv_cache, meta, scale)


def _torch_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.groups is not None:
        out = torch.empty_like(query)
        for rows, group in meta.groups:
            out[rows] = _torch_paged_attention(query[rows], kv_cache, group, scale)
        return out
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    # Gather each sequence's pages into a contiguous [B, H_kv, max_seq_len, D] view.
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_kv = meta.block_tables.shape[1] * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        pages = cache.index_select(0, meta.block_ids).view(num_seqs, max_kv, num_kv_heads, head_dim)
        return pages[:, :meta.max_seq_len].transpose(1, 2)

    keys, values = gather(kv_cache[0]), gather(kv_cache[1])

    if meta.query_pad_index is None:  # every sequence has one query token: no padding needed
        padded = query.view(num_seqs, 1, num_heads, head_dim)
    else:
        padded = query.new_zeros(num_seqs * max_q, num_heads, head_dim)
        padded[meta.query_pad_index] = query
        padded = padded.view(num_seqs, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys, values, attn_mask=meta.attn_mask, is_causal=meta.causal, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H_q, max_q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out if meta.query_pad_index is None else out[meta.query_pad_index]
