"""The attention backends: the torch reference's grouped sequences ("sequences") and, for decode-shaped
fp32 passes, the C++ kernel (engine/csrc/decode_ops.cpp) equal the padded-gather reference, and all equal
a dense float64 attention, for mixed batches of decode rows, verification rows and prefill chunks over
consecutive, scattered and partly consecutive block tables, with GQA and windows."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import engine.attention as attention
from engine import cpu_kernels
from engine.attention import paged_attention, rope_paged_attention
from engine.attention_backends import (DecodeMetadata, FlashBackend, FlashDecodeMetadata, KernelBackend,
                                       KernelMetadata, MixedMetadata, TorchBackend, TorchMetadata, choose_backend)
from engine.attention_metadata import SEQUENCE_MAX_QUERY, PassLayout

CPU = torch.device("cpu")
BLOCK_SIZE = 16
# The backends the tests compare: the torch reference padded, grouped, and as it picks for a CPU; the kernel.
BACKENDS = {"padded": TorchBackend(BLOCK_SIZE, CPU, group_sequences=False),
            "sequences": TorchBackend(BLOCK_SIZE, CPU, group_sequences=True),
            "torch": TorchBackend(BLOCK_SIZE, CPU),
            "kernel": KernelBackend(BLOCK_SIZE, CPU)}
NUM_BLOCKS = 512
HEAD_DIM = 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_tables(seq_lens: list[int], layouts: list[str], rng: np.random.Generator) -> list[list[int]]:
    """One block table per sequence (room for its tokens plus a spare block, as lookahead leaves):
    'consecutive' ids, 'scattered' ones, 'partial' (a consecutive run, then scattered: a prompt's blocks,
    then blocks allocated one by one while other streams allocate too), or 'descending' (a recycled pool)."""
    free = rng.permutation(NUM_BLOCKS).tolist()
    next_run = NUM_BLOCKS   # consecutive runs live above the scattered pool
    tables = []
    for seq_len, layout in zip(seq_lens, layouts):
        count = -(-seq_len // BLOCK_SIZE) + 1
        run = {"consecutive": count, "descending": count, "partial": count // 2, "scattered": 0}[layout]
        table = list(range(next_run, next_run + run))
        next_run += run
        if layout == "descending":
            table.reverse()
        table += [free.pop() for _ in range(count - run)]
        tables.append(table)
    return tables


def dense_attention(query, cache, q_lens, seq_lens, tables, scale, window=None, softcap=None, sinks=None):
    """float64, one sequence at a time, straight from the block tables: the ground truth (softcap, sinks:
    scores soft-capped, and a sink logit per query head in each softmax's denominator)."""
    out, row = [], 0
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    for q_len, seq_len, table in zip(q_lens, seq_lens, tables):
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)])
        keys, values = (cache[i].reshape(-1, num_kv_heads, HEAD_DIM)[slots].double() for i in (0, 1))
        keys, values = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (keys, values))
        q = query[row:row + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = scores.exp() / (scores.exp().sum(-1, keepdim=True)
                                  + (0 if sinks is None else sinks.double().exp()[:, None, None]))
        out.append(torch.einsum("hqk,khd->qhd", weights, values))
        row += q_len
    return torch.cat(out)


def build(backend: str, q_lens, seq_lens, tables, window=None, trees=None):
    """One pass's metadata as BACKENDS[backend] builds it."""
    return BACKENDS[backend].build(PassLayout(list(q_lens), list(seq_lens), list(tables), trees), window)


def run_paths(q_lens, seq_lens, layouts, num_heads=9, num_kv_heads=3, dtype=torch.float32, window=None, seed=0):
    """Attention output of each torch path and of dense_attention for one pass, written cache included."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    tables = make_tables(seq_lens, layouts, rng)
    num_blocks = max(max(t) for t in tables) + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    tokens = sum(q_lens)
    query = torch.randn(tokens, num_heads, HEAD_DIM, generator=g).to(dtype)
    key, value = (torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    scale = HEAD_DIM ** -0.5
    outs = {}
    for path in ("padded", "sequences"):
        meta = build(path, q_lens, seq_lens, tables, window)
        layer_cache = cache.clone()
        outs[path] = paged_attention(query, key, value, layer_cache, meta, scale, window).float()
    if dtype == torch.float32 and max(q_lens) <= SEQUENCE_MAX_QUERY and cpu_kernels.unavailable_reason() is None:
        outs["kernel"] = kernel_attention(query, key, value, cache, q_lens, seq_lens, tables, scale, window,
                                          expected_cache=layer_cache)
    outs["dense"] = dense_attention(query, layer_cache, q_lens, seq_lens, tables, scale, window).float()
    return outs


def kernel_attention(query, key, value, cache, q_lens, seq_lens, tables, scale, window, expected_cache):
    """The C++ kernel on the same pass, with RoPE the identity (cos 1, sin 0: the paths above take
    rotated queries and keys); it must leave the cache as paged_attention did."""
    meta = build("kernel", q_lens, seq_lens, tables, window)
    assert isinstance(meta, KernelMetadata) and meta.windowed is None
    layer_cache = cache.clone()
    tokens = query.shape[0]
    cos, sin = torch.ones(tokens, 1, HEAD_DIM), torch.zeros(tokens, 1, HEAD_DIM)
    out = rope_paged_attention(torch.cat((query, key), dim=1), value, cos, sin, layer_cache, meta, query.shape[1],
                               scale, window)
    assert torch.equal(layer_cache, expected_cache)
    return out


needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def assert_paths_agree(outs, dtype=torch.float32):
    tol = TOL[dtype]
    err = (outs["sequences"] - outs["padded"]).abs().max().item()
    assert err < tol, f"sequences vs padded: max abs error {err:.3g}"
    for path in ("padded", "sequences", "kernel"):
        if path not in outs:
            continue
        err = (outs[path] - outs["dense"]).abs().max().item()
        assert err < tol, f"{path} vs dense: max abs error {err:.3g}"


MIXED = [  # (q_len, seq_len, layout): every kind of row in one pass
    (1, 40, "consecutive"), (1, 200, "scattered"), (1, 16, "partial"), (1, 129, "descending"),
    (5, 77, "consecutive"), (5, 300, "partial"), (2, 2, "scattered"), (17, 144, "scattered"),
    (33, 400, "consecutive"), (34, 90, "scattered"), (64, 64, "partial"), (20, 260, "scattered"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_mixed_batch(dtype, heads):
    q_lens, seq_lens, layouts = zip(*MIXED)
    outs = run_paths(list(q_lens), list(seq_lens), list(layouts), *heads, dtype=dtype, seed=sum(heads))
    assert_paths_agree(outs, dtype)


DECODE_SHAPED = [row for row in MIXED if row[0] <= SEQUENCE_MAX_QUERY]


@needs_kernels
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 8, 24, 100])
def test_kernel_on_decode_shaped_passes(heads, window):
    q_lens, seq_lens, layouts = zip(*DECODE_SHAPED)
    outs = run_paths(list(q_lens), list(seq_lens), list(layouts), *heads, window=window, seed=sum(heads))
    assert "kernel" in outs
    assert_paths_agree(outs)


@needs_kernels
def test_kernel_rows_do_not_depend_on_the_pass():
    """A query's output is the same, bit for bit, decoded alone or as the last row of a verification
    pass beside other sequences: what makes speculative and plain greedy decoding agree exactly."""
    rng = np.random.default_rng(1)
    tables = make_tables([300, 90], ["scattered", "partial"], rng)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, NUM_BLOCKS + 200, BLOCK_SIZE, 3, HEAD_DIM, generator=g)
    qk, value = torch.randn(6, 12, HEAD_DIM, generator=g), torch.randn(6, 3, HEAD_DIM, generator=g)
    cos, sin = torch.rand(6, 1, HEAD_DIM, generator=g), torch.rand(6, 1, HEAD_DIM, generator=g)

    def run(q_lens, seq_lens, rows, layer_cache):
        meta = build("kernel", q_lens, seq_lens, [tables[i] for i in range(len(q_lens))])
        return rope_paged_attention(qk[rows], value[rows], cos[rows], sin[rows], layer_cache, meta, 9, 0.125)

    written = cache.clone()
    verification = run([5, 1], [300, 90], list(range(6)), written)   # positions 295..299 and 89
    assert torch.equal(run([1], [300], [4], written.clone())[0], verification[4])   # position 299 after 295..298
    assert torch.equal(run([1], [296], [0], cache.clone())[0], verification[0])     # position 295 before them


@needs_kernels
@pytest.mark.parametrize("q_len", [2, 5, 9])
def test_kernel_rows_equal_decode_rows_at_every_position(q_len):
    """Every row of a verification pass equals, bit for bit, the decode row at its position, wherever
    the pass starts relative to the 64-key chunks and the 8-key groups (a row once summed the later
    rows' masked keys into its chunk, and a chunk's last keys were reduced unlike the others: rows
    diverged at some positions, and greedy speculation drifted from plain decoding late in answers)."""
    rng = np.random.default_rng(2)
    table = make_tables([300], ["scattered"], rng)[0]
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, NUM_BLOCKS + 200, BLOCK_SIZE, 3, HEAD_DIM, generator=g)
    qk, value = torch.randn(q_len, 12, HEAD_DIM, generator=g), torch.randn(q_len, 3, HEAD_DIM, generator=g)
    cos, sin = torch.rand(q_len, 1, HEAD_DIM, generator=g), torch.rand(q_len, 1, HEAD_DIM, generator=g)

    def run(seq_len, rows, layer_cache):
        meta = build("kernel", [len(rows)], [seq_len], [table])
        return rope_paged_attention(qk[rows], value[rows], cos[rows], sin[rows], layer_cache, meta, 9, 0.125)

    for first in range(118, 131):   # the pass's last keys before, across and after a chunk boundary (128)
        written = cache.clone()
        verification = run(first + q_len, list(range(q_len)), written)
        for i in range(q_len):
            assert torch.equal(run(first + i + 1, [i], written.clone())[0], verification[i]), (first, i)


@needs_kernels
@pytest.mark.parametrize("window", [None, 24])
def test_kernel_rows_beside_prefill_chunks(window):
    """In a pass with prefill chunks, the decode-shaped rows go to the kernel and the chunks to torch: the
    whole pass equals a float64 dense attention, and the decode rows equal, bit for bit, the same rows in
    a pass of their own (a prompt sharing the pass changes nothing of theirs)."""
    q_lens, seq_lens, layouts = (list(x) for x in zip(*MIXED))
    rng = np.random.default_rng(3)
    tables = make_tables(seq_lens, layouts, rng)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, max(max(t) for t in tables) + 1, BLOCK_SIZE, 3, HEAD_DIM, generator=g)
    tokens = sum(q_lens)
    qk, value = torch.randn(tokens, 12, HEAD_DIM, generator=g), torch.randn(tokens, 3, HEAD_DIM, generator=g)
    cos, sin = torch.ones(tokens, 1, HEAD_DIM), torch.zeros(tokens, 1, HEAD_DIM)   # RoPE the identity
    starts = np.cumsum([0] + q_lens)

    def run(seqs, layer_cache):
        rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
        meta = build("kernel", [q_lens[i] for i in seqs], [seq_lens[i] for i in seqs], [tables[i] for i in seqs],
                     window)
        return rows, meta, rope_paged_attention(qk[rows], value[rows], cos[rows], sin[rows], layer_cache, meta, 9,
                                                HEAD_DIM ** -0.5, window)

    written = cache.clone()
    _, meta, out = run(range(len(q_lens)), written)
    assert isinstance(meta, MixedMetadata)
    dense = dense_attention(qk[:, :9], written, q_lens, seq_lens, tables, HEAD_DIM ** -0.5, window).float()
    assert (out - dense).abs().max().item() < TOL[torch.float32]
    short = [i for i, q in enumerate(q_lens) if q <= SEQUENCE_MAX_QUERY]
    rows, alone_meta, alone = run(short, cache.clone())
    assert isinstance(alone_meta, KernelMetadata) and torch.equal(alone, out[rows])


@needs_kernels
def test_kernel_rope_matches_apply_rope():
    """Real cos / sin: the kernel rotates queries and keys as apply_rope does (one sequence, keys and
    queries checked through the cache and the output of a one-key attention)."""
    from engine.models.rope import RotaryEmbedding
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=64)
    rotary = RotaryEmbedding(config, HEAD_DIM, 64)
    rotary.init_buffers(CPU, torch.float32)
    positions = torch.arange(3)
    cos, sin = rotary(positions)
    qk, value = torch.randn(3, 6, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, HEAD_DIM)
    meta = build("kernel", [3], [3], [[2]])
    out = rope_paged_attention(qk, value, cos, sin, cache, meta, 4, 0.5)
    rotated = attention.apply_rope(qk, cos, sin)
    torch.testing.assert_close(cache[0, 2, :3], rotated[:, 4:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1, 2, :3], value)
    reference = paged_attention(rotated[:, :4], rotated[:, 4:], value, torch.zeros_like(cache),
                                build("torch", [3], [3], [[2]]), 0.5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_kernel_only_for_decode_shaped_rows():
    """A prefill chunk longer than SEQUENCE_MAX_QUERY keeps the torch reference, and the decode-shaped rows
    of its pass form a kernel group; the torch backend never uses the kernel."""
    tables = [[0, 1, 2], [3, 4, 5]]
    assert isinstance(build("kernel", [1, 33], [40, 40], tables), KernelMetadata)
    long = build("kernel", [1, 34], [40, 40], tables)
    assert isinstance(long, MixedMetadata) and [type(g) for _, g in long.groups] == [KernelMetadata, TorchMetadata]
    assert isinstance(build("kernel", [34], [40], tables[:1]), TorchMetadata)
    for path in ("padded", "sequences", "torch"):
        assert isinstance(build(path, [1, 3], [40, 40], tables), TorchMetadata)


@pytest.mark.parametrize("layout", ["consecutive", "scattered", "partial", "descending"])
@pytest.mark.parametrize("q_len", [1, 5, 33])
def test_each_layout_alone(layout, q_len):
    """Contexts ending mid-block, on a block edge, within the first block, short and long."""
    seq_lens = [q_len + 7, 48, 129, 511, 1024]
    outs = run_paths([q_len] * len(seq_lens), seq_lens, [layout] * len(seq_lens), seed=q_len)
    assert_paths_agree(outs)


@pytest.mark.parametrize("q_len, seq_len", [(1, 1), (1, 300), (7, 7), (5, 700), (40, 40), (40, 500)])
def test_single_sequence(q_len, seq_len):
    assert_paths_agree(run_paths([q_len], [seq_len], ["consecutive"], seed=seq_len))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [8, 24, 100])
def test_sliding_window(dtype, window):
    """Windows cutting inside a block and on a block edge, shorter and longer than the query."""
    q_lens, seq_lens, layouts = zip(*MIXED)
    outs = run_paths(list(q_lens), list(seq_lens), list(layouts), dtype=dtype, window=window, seed=window)
    assert_paths_agree(outs, dtype)


def test_plan_groups_and_views():
    """Sequences share a call when their query lengths are equal and their key counts close; a lone
    sequence whose blocks (those it reads: with a window, only the ones inside it) are consecutive ids is
    read in place; prefill chunks go to the padded path."""
    tables = [list(range(100, 120)), [9, 2, 3, 8], [30, 31, 32, 33], [20, 21, 22, 23], [40, 41, 42, 43]]
    q_lens, seq_lens = [1, 1, 33, 5, 34], [300, 40, 60, 50, 64]
    meta = build("sequences", q_lens, seq_lens, tables, 20)
    (short_rows, short), (long_rows, long) = meta.groups
    assert long.plan is None and long.block_ids is not None and long_rows.tolist() == list(range(40, 74))
    groups = short.plan.groups   # by query length, then most keys first
    assert [(g.q_len, g.num_seqs, g.num_keys) for g in groups] == [(1, 1, 300), (1, 1, 40), (5, 1, 50), (33, 1, 60)]
    assert [g.first_slot for g in groups if g.block_ids is None] == [100 * BLOCK_SIZE, 20 * BLOCK_SIZE, 30 * BLOCK_SIZE]
    assert groups[1].block_ids.tolist() == [9, 2, 3] and groups[1].visible is None
    assert short.plan.rows.tolist() == [0, 1] + list(range(35, 40)) + list(range(2, 35))
    # Window 20: both decode rows see 20 keys, so they share a call over the blocks inside the window
    # (sequence 0: positions 280..299 in blocks 117, 118; sequence 1: 20..39 in blocks 2, 3).
    windowed = meta.windowed.groups[0][1].plan.groups
    assert windowed[0].num_seqs == 2 and windowed[0].block_ids.tolist() == [117, 118, 2, 3]
    assert windowed[0].visible.sum(axis=(1, 2)).tolist() == [20, 20]
    assert [(g.first_slot, g.num_keys) for g in windowed[1:]] == [(21 * BLOCK_SIZE + 10, 24), (30 * BLOCK_SIZE + 8, 52)]


def test_each_prefill_chunk_takes_its_own_call():
    """Prefill chunks are not padded to the longest together (many prompts arriving at once would cost many
    times the longest one's attention): each takes the padded path alone, a whole prompt causal without a mask,
    a chunk after cached keys with its own mask; decode rows keep their plan. Outputs: test_mixed_batch."""
    tables = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    meta = build("sequences", [40, 70, 1], [40, 90, 20], tables)
    (decode_rows, decode), (fresh_rows, fresh), (chunk_rows, chunk) = meta.groups
    assert decode.plan is not None and decode_rows.tolist() == [110]
    assert fresh.causal and fresh.attn_mask is None and fresh_rows.tolist() == list(range(40))
    assert not chunk.causal and chunk.attn_mask.shape == (1, 1, 70, 90) and chunk_rows.tolist() == list(range(40, 110))
    alone = build("sequences", [70], [90], tables[1:2])
    assert alone.groups is None and alone.attn_mask.shape == (1, 1, 70, 90)


def test_close_key_counts_share_a_call():
    plan = build("torch", [1, 1, 1, 5, 5], [200, 100, 40, 90, 80], [[i] * 13 for i in range(5)]).plan
    assert [g.rows.tolist() for g in plan.groups] == [[0, 1], [2], list(range(3, 13))]
    assert plan.groups[0].visible[1].sum() == 100 and plan.groups[0].num_keys == 200


def test_torch_grouping_by_device():
    """The torch reference groups sequences on a CPU (its default there) and pads elsewhere."""
    assert build("torch", [1], [10], [[0]]).plan is not None   # CPU default
    meta = build("padded", [1], [10], [[0]])
    assert meta.plan is None and meta.block_ids is not None
    assert not TorchBackend(BLOCK_SIZE, torch.device("cuda")).group_sequences


class _Model(torch.nn.Module):
    def __init__(self, fused_ops: bool):
        super().__init__()
        self.fused_ops = fused_ops


def test_backend_choice():
    """attention_backend's values: auto takes the kernel only for a model on the fused ops; torch keeps
    the reference beside them; an explicit kernel or flash that cannot serve is an error, as is a name
    that is no backend."""
    pick = lambda name, fused, dtype=torch.float32: choose_backend(name, _Model(fused), BLOCK_SIZE, CPU, dtype)
    assert type(pick("auto", True)) is KernelBackend and type(pick("auto", False)) is TorchBackend
    assert type(pick("kernel", True)) is KernelBackend and type(pick("torch", True)) is TorchBackend
    assert type(pick("auto", False, torch.bfloat16)) is TorchBackend   # no flash-attn on a CPU
    with pytest.raises(ValueError, match="needs the fused CPU ops"):
        pick("kernel", False)
    with pytest.raises(ValueError, match="flash needs flash-attn"):
        pick("flash", False, torch.bfloat16)
    with pytest.raises(ValueError, match="auto, kernel, torch, flash"):
        pick("fastest", False)


# ---------------------------------------------------------------- soft-capping and sinks

def test_sinks_against_a_naive_reference():
    """One sequence, written out: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)) per query head,
    the sink in the denominator only (a large negative sink leaves plain attention)."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 4, BLOCK_SIZE, 1, HEAD_DIM, generator=g)
    query, key, value = (torch.randn(3, h, HEAD_DIM, generator=g) for h in (2, 1, 1))
    sinks = torch.tensor([0.7, -1.3])
    meta = build("torch", [3], [20], [[2, 0]])
    out = paged_attention(query, key, value, cache, meta, 0.3, sinks=sinks)
    keys = torch.cat((cache[0, 2], cache[0, 0]))[:20, 0].double()   # [20, D]: positions 0..19
    values = torch.cat((cache[1, 2], cache[1, 0]))[:20, 0].double()
    for i in range(3):
        for h in range(2):
            scores = [float(query[i, h].double() @ keys[j]) * 0.3 for j in range(17 + i + 1)]
            numerator = sum(math.exp(s) * values[j] for j, s in enumerate(scores))
            expected = numerator / (math.exp(sinks[h].item()) + sum(math.exp(s) for s in scores))
            torch.testing.assert_close(out[i, h].double(), expected, rtol=1e-5, atol=1e-5)
    plain = paged_attention(query, key, value, cache.clone(), meta, 0.3)
    assert not torch.allclose(out, plain, atol=1e-3)
    torch.testing.assert_close(paged_attention(query, key, value, cache.clone(), meta, 0.3,
                                               sinks=torch.full((2,), -1e4)), plain)


def extras_paths(q_lens, seq_lens, layouts, softcap, sinks, window, heads=(9, 3), dtype=torch.float32, seed=0):
    """Every path a layer with soft-capping / sinks can take over one pass, and the dense reference."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    tables = make_tables(seq_lens, layouts, rng)
    cache = torch.randn(2, max(max(t) for t in tables) + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=g)
    tokens, scale = sum(q_lens), HEAD_DIM ** -0.5
    qk = torch.randn(tokens, num_heads + num_kv_heads, HEAD_DIM, generator=g) * 3   # scores big enough to cap
    value = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=g)
    sinks = None if sinks is None else torch.randn(num_heads, generator=g)
    cos, sin = torch.ones(tokens, 1, HEAD_DIM), torch.zeros(tokens, 1, HEAD_DIM)   # RoPE the identity
    extras = dict(softcap=softcap, sinks=None if sinks is None else sinks.to(dtype))
    outs = {}
    for path in ("padded", "sequences", "kernel"):   # kernel: the kernel's metadata, its reference attending
        meta = build(path, q_lens, seq_lens, tables, window)
        layer_cache = cache.to(dtype)
        outs[path] = rope_paged_attention(qk.to(dtype), value.to(dtype), cos.to(dtype), sin.to(dtype), layer_cache,
                                          meta, num_heads, scale, window, **extras).float()
    outs["dense"] = dense_attention(qk[:, :num_heads], layer_cache.float(), q_lens, seq_lens, tables, scale, window,
                                    softcap, sinks).float()
    return outs


@pytest.mark.parametrize("softcap, sinks", [(1.5, None), (None, True), (2.0, True)], ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("window", [None, 24])
def test_softcap_and_sinks_on_every_path(softcap, sinks, window):
    """Mixed passes (decode, verification rows and prefill chunks): the padded and "sequences" forms and a
    pass whose metadata was built for the C++ kernel (its layers with extras take the torch reference)
    all equal the dense reference."""
    q_lens, seq_lens, layouts = (list(x) for x in zip(*MIXED))
    outs = extras_paths(q_lens, seq_lens, layouts, softcap, sinks, window, seed=7)
    for path in ("padded", "sequences", "kernel"):
        err = (outs[path] - outs["dense"]).abs().max().item()
        assert err < TOL[torch.float32], f"{path} vs dense: max abs error {err:.3g}"
    short = [row for row in MIXED if row[0] <= SEQUENCE_MAX_QUERY]   # a kernel pass, no prefill chunk
    outs = extras_paths(*(list(x) for x in zip(*short)), softcap, sinks, window, heads=(8, 1), seed=8)
    assert (outs["kernel"] - outs["dense"]).abs().max().item() < TOL[torch.float32]


def test_softcap_and_sinks_in_bfloat16():
    q_lens, seq_lens, layouts = (list(x) for x in zip(*MIXED))
    outs = extras_paths(q_lens, seq_lens, layouts, 2.0, True, None, dtype=torch.bfloat16, seed=9)
    for path in ("padded", "sequences"):
        assert (outs[path] - outs["dense"]).abs().max().item() < TOL[torch.bfloat16]


def test_extras_on_kernel_and_tree_metadata():
    """A kernel pass stays a kernel pass (other layers use it) and builds its torch reference once per
    window; a draft-tree pass built for the kernel attends through its reference with the same trees."""
    tables = [[0, 1, 2], [3, 4, 5]]
    meta = build("kernel", [1, 3], [40, 30], tables)
    assert isinstance(meta, KernelMetadata)
    reference = meta.reference(None)
    assert isinstance(reference, TorchMetadata) and reference.plan is not None and meta.reference(None) is reference
    assert meta.reference(8).windowed is not None
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)   # two branches
    g = torch.Generator().manual_seed(4)
    qk, value = torch.randn(5, 6, HEAD_DIM, generator=g), torch.randn(5, 2, HEAD_DIM, generator=g)
    cos, sin = torch.ones(5, 1, HEAD_DIM), torch.zeros(5, 1, HEAD_DIM)
    cache = torch.randn(2, 8, BLOCK_SIZE, 2, HEAD_DIM, generator=g)
    outs = []
    for backend in ("kernel", "torch"):
        tree_meta = build(backend, [1, 4], [20, 30], tables, trees=[None, tree])
        assert isinstance(tree_meta, KernelMetadata) == (backend == "kernel")
        outs.append(rope_paged_attention(qk, value, cos, sin, cache.clone(), tree_meta, 4, 0.2, softcap=1.0,
                                         sinks=torch.tensor([0.5, -0.5, 1.0, 0.0])))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_decode_grid_metadata_with_extras():
    """A DecodeMetadata (the grid CUDA graphs replay) with soft-capping and sinks equals the same pass on
    the padded torch reference; so does flash-attn's grid, whose sinks fall back to the same SDPA."""
    tables, seq_lens, q_len = [[5, 1, 7], [2, 6, 0]], [40, 23], 3
    slots = [tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for b, s in enumerate(seq_lens)
             for p in range(s - q_len, s)]
    grid_args = (torch.tensor(slots), torch.tensor(seq_lens, dtype=torch.int32),
                 torch.tensor(tables, dtype=torch.int32), torch.tensor(tables).flatten(), q_len)
    g = torch.Generator().manual_seed(6)
    query, key, value = (torch.randn(6, h, HEAD_DIM, generator=g) for h in (4, 2, 2))
    cache = torch.randn(2, 8, BLOCK_SIZE, 2, HEAD_DIM, generator=g)
    extras = dict(softcap=1.0, sinks=torch.tensor([0.5, -0.5, 1.0, 0.0]))
    padded = build("padded", [q_len] * 2, seq_lens, tables, 16)
    expected = paged_attention(query, key, value, cache.clone(), padded, 0.2, 16, **extras)
    for backend, kind in ((TorchBackend, DecodeMetadata), (FlashBackend, FlashDecodeMetadata)):
        grid = backend(BLOCK_SIZE, CPU).grid_metadata(*grid_args)
        assert type(grid) is kind
        torch.testing.assert_close(paged_attention(query, key, value, cache.clone(), grid, 0.2, 16, **extras),
                                   expected, rtol=1e-5, atol=1e-5)
