"""Paged attention: the one function every layer calls, and the ops the backends compute it with.

Every layer reads the pass's metadata, built once per pass by the runner's attention backend
(engine/attention_backends.py: the C++ kernel, the torch reference, flash-attn, each with the
fixed-grid form that CUDA graphs capture), and attends through rope_paged_attention: RoPE on queries
and keys, keys and values into the paged cache at the pass's slots, then attention over each
sequence's pages. The metadata runs it the way its backend does; no layer asks which one that is.
This is the only file that imports flash-attn.

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim],
so kv_cache[0] / kv_cache[1] are exactly flash-attn's paged k_cache / v_cache.

The torch reference's two forms:
  padded     every sequence's pages gathered into one padded [B, H_kv, max_seq_len, D] tensor, one SDPA
             call with a dense mask (padded_gather_attention);
  grouped    decode and verification rows: sequences of one query length and close key counts share an
             SDPA call over their own blocks; a lone one whose blocks are consecutive ids reads a view of
             the cache, no copy; the query heads sharing a KV head are folded into query rows
             (sequence_attention).

Two per-layer extras change the scores themselves, so SDPA cannot compute them; the torch reference
then computes attention step by step (_attend):
  softcap  (Gemma 2) scores = softcap * tanh(scores / softcap), before the mask and the softmax;
  sinks    (gpt-oss) a learned logit per query head [H_q] that joins each softmax's denominator only:
           out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)).
The C++ kernel knows neither; flash-attn knows softcap (its `softcap` argument) but not sinks. A layer
that needs what its backend lacks attends through the torch reference over the same pass
(AttentionMetadata.reference), so the runner and the other layers keep the fast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_metadata import KeyGroup, SequencePlan

try:  # flash-attn is an optional GPU extra; the torch backend is the reference.
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # type: ignore
except Exception:  # ImportError, or a wheel built for another torch/CUDA
    flash_attn_varlen_func = flash_attn_with_kvcache = None

# flash-attn's paged kernels need pages of a multiple of 256 tokens.
FLASH_BLOCK_SIZE = 256


def flash_available(device: torch.device) -> bool:
    return flash_attn_varlen_func is not None and torch.device(device).type == "cuda"


class AttentionMetadata:
    """What one pass's layers attend over, built once per pass by an attention backend; each kind
    attends the way its backend does (attend). Every kind has `slot_mapping`, the cache slot of each
    new token (or grid row)."""

    slot_mapping: torch.Tensor

    def rope_attention(self, qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                       kv_cache: torch.Tensor, num_heads: int, scale: float, window: int | None,
                       softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """rope_paged_attention on this pass: RoPE here, then attention."""
        query, key = apply_rope(qk, cos, sin_signed).split([num_heads, qk.shape[1] - num_heads], dim=1)
        return self.attention(query, key, value, kv_cache, scale, window, softcap, sinks)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  scale: float, window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
        """paged_attention on this pass: keys and values into the cache, then attention."""
        write_kv(kv_cache, key, value, self.slot_mapping)
        return self.attend(query, kv_cache, scale, window, softcap, sinks)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """query [T, H_q, D] -> [T, H_q, D] over the cache, this pass's keys already in it."""
        raise NotImplementedError


def rope_paged_attention(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                         scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """qk [T, H_q + H_kv, D] (queries, then keys, before RoPE), value [T, H_kv, D] -> [T, H_q, D]:
    RoPE on queries and keys, keys and values into the cache, attention, as the pass's backend
    computes them (the C++ kernel does all three in one call). sliding_window: this layer's (None:
    full attention); softcap, sinks [H_q]: its score soft-capping and attention sinks (see the
    module's docstring)."""
    return meta.rope_attention(qk, value, cos, sin_signed, kv_cache, num_heads, scale, sliding_window, softcap, sinks)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, *, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H_q, D], key/value [T, H_kv, D] (RoPE applied) -> output [T, H_q, D]. sliding_window:
    this layer's (None: full attention); once it cuts anything, the metadata must have been built with
    it (the decode grid's masks are per layer). softcap, sinks [H_q]: see the module's docstring."""
    return meta.attention(query, key, value, kv_cache, scale, sliding_window, softcap, sinks)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotated [T, H, D] (neox style; see models.rope.RotaryEmbedding for the layout)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this pass's keys/values ([T, H_kv, D]) into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _flash_softcap(softcap: float | None) -> dict:
    """flash-attn's softcap argument, passed only when set (flash-attn before 2.6 has none)."""
    return {} if softcap is None else {"softcap": float(softcap)}


def flash_varlen_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                           block_tables: torch.Tensor, scale: float, window: int | None,
                           softcap: float | None) -> torch.Tensor:
    """query [T, H_q, D] -> [T, H_q, D]: flash-attn over the pages where they lie, causal per sequence."""
    return flash_attn_varlen_func(
        query, kv_cache[0], kv_cache[1],
        cu_seqlens_q=query_start_loc, cu_seqlens_k=seq_start_loc,
        max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0),
        block_table=block_tables,
        **_flash_softcap(softcap),
    )


def flash_grid_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, query_len: int, scale: float, window: int | None,
                         softcap: float | None) -> torch.Tensor:
    """query [B * Q, H_q, D] -> [B * Q, H_q, D] over a decode grid: flash_attn_with_kvcache reads the
    pages in place."""
    num_seqs, (_, num_heads, head_dim) = seq_lens.shape[0], query.shape
    out = flash_attn_with_kvcache(
        query.view(num_seqs, query_len, num_heads, head_dim), kv_cache[0], kv_cache[1], cache_seqlens=seq_lens,
        block_table=block_tables, softmax_scale=scale, causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0), **_flash_softcap(softcap))
    return out.view(num_seqs * query_len, num_heads, head_dim)


def grid_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int,
                   query_len: int, mask: torch.Tensor, scale: float, softcap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """query [B * Q, H_q, D] -> [B * Q, H_q, D] over a decode grid, the torch reference: every
    sequence's pages (block_ids [B * blocks]) gathered, then masked (mask [B, 1, Q, blocks * block_size])."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    grid = query.view(num_seqs, query_len, num_heads, head_dim)
    num_keys = mask.shape[-1]
    keys, values = (cache.index_select(0, block_ids).view(num_seqs, num_keys, num_kv_heads, head_dim)
                    .transpose(1, 2) for cache in kv_cache)
    out = _attend(grid.transpose(1, 2), keys, values, mask, scale, softcap=softcap,
                  sinks=None if sinks is None else sinks.view(1, num_heads, 1))   # [B, H_q, Q, D]
    return out.transpose(1, 2).reshape(num_seqs * query_len, num_heads, head_dim)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
            causal: bool = False, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [N, H, L, D], keys / values [N, H_kv, S, D] -> [N, H, L, D]: SDPA, or, for a layer that
    soft-caps its scores or has sinks, the same computed step by step (softmax in fp32). mask: bool
    (True = attend) or additive, broadcastable to [N, H, L, S]; causal: query i sees keys 0..i (SDPA's
    is_causal); sinks: one logit per score row, broadcastable to [N, H, L]."""
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    if num_heads != num_kv_heads:
        keys, values = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (keys, values))
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale   # [N, H, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:   # one more column in each softmax, dropped after: it only adds to the denominator
        sink = sinks.float().expand(scores.shape[:-1]).unsqueeze(-1)
        weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights.to(values.dtype), values)


def sequence_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: SequencePlan, scale: float,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H_q, D] -> [T, H_q, D]: one SDPA call per group of the plan, on a view of the cache for
    a lone sequence whose blocks are consecutive, else on the group's own blocks gathered (padded only
    to the group's longest sequence).

    The G = H_q / H_kv query heads that share a KV head become G query rows of that head,
    [n, H_kv, q_len * G, D]: CPU SDPA with enable_gqa and one query row per head is slower, most of all in bf16."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    group = query.shape[1] // num_kv_heads
    grouped = query.view(-1, num_kv_heads, group, head_dim)   # [T, H_kv, G, D]
    by_head = [x.view(1, -1, num_kv_heads, head_dim).transpose(1, 2) for x in kv_cache]   # [1, H_kv, slots, D] views
    sinks = None if sinks is None else sinks.view(num_kv_heads, 1, group)   # query head h * G + g
    outs = [_group_attention(grouped, kv_cache, by_head, g, mask, scale, softcap, sinks)
            for g, mask in zip(plan.groups, plan.masks(group, query.dtype))]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]   # [T, H_kv, G, D], rows in plan order
    if plan.rows is not None:
        out = torch.empty_like(grouped).index_copy_(0, plan.rows, out)
    return out.reshape(query.shape)


def _group_attention(grouped: torch.Tensor, kv_cache: torch.Tensor, by_head: list[torch.Tensor], g: KeyGroup,
                     mask: torch.Tensor | None, scale: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """grouped queries [T, H_kv, G, D] -> [n * q_len, H_kv, G, D] for the group's rows. sinks [H_kv, 1, G]."""
    n, q_len, (_, num_kv_heads, group, head_dim) = g.num_seqs, g.q_len, grouped.shape
    if g.block_ids is None:
        keys, values = (x.narrow(2, g.first_slot, g.num_keys) for x in by_head)   # [1, H_kv, keys, D]
    else:
        keys, values = (x.index_select(0, g.block_ids).view(n, -1, num_kv_heads, head_dim)[:, :g.num_keys]
                        .transpose(1, 2) for x in kv_cache)   # [n, H_kv, keys, D]
    rows = grouped.index_select(0, g.rows)   # [n * q_len, H_kv, G, D]
    if q_len > 1:
        rows = rows.view(n, q_len, num_kv_heads, group, head_dim).transpose(1, 2)
    rows = rows.reshape(n, num_kv_heads, q_len * group, head_dim)
    if sinks is not None:   # row i * G + g is query i of head h * G + g
        sinks = sinks.expand(num_kv_heads, q_len, group).reshape(num_kv_heads, q_len * group)
    o = _attend(rows, keys, values, mask, scale, softcap=softcap, sinks=sinks)   # [n, H_kv, q_len * G, D]
    o = o.view(n, num_kv_heads, q_len, group, head_dim).transpose(1, 2)   # [n, q_len, H_kv, G, D]
    return o.reshape(n * q_len, num_kv_heads, group, head_dim)


def padded_gather_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The padded torch reference: every sequence's pages gathered into one padded tensor, one SDPA call.
    meta: a TorchMetadata with its padded tensors (attention_backends.py)."""
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
    out = _attend(padded.transpose(1, 2), keys, values, meta.attn_mask, scale, causal=meta.causal, softcap=softcap,
                  sinks=None if sinks is None else sinks.view(1, num_heads, 1))  # [B, H_q, max_q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out if meta.query_pad_index is None else out[meta.query_pad_index]
