"""The decode grid (engine/decode_grid.py) on the CPU: the bookkeeping that CUDA graphs replay (batch
and query padding, right-aligned rows, the scratch block), run eagerly. Its passes give the eager
path's logits, its padding writes only the scratch block, and an engine whose runners use it decodes
exactly like plain decoding. tests/test_gpu.py captures the same grid as CUDA graphs."""
import time

import pytest
import torch
from helpers import make_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.decode_grid import batch_buckets, power_buckets, work_clock
from engine.model_runner import ForwardItem

PREFILL = [(list(range(3, 43)), [5, 9, 2]), ([7, 8, 9], [7]), (list(range(50, 70)), [11, 12])]


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(1) == [1]
    assert power_buckets(5) == [1, 2, 4, 5] and power_buckets(1) == [1] and power_buckets(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})])
def test_grid_pass_matches_the_eager_pass(tmp_path, arch, overrides):
    """Verification rows of 5 tokens, a catch-up of 2 tokens for one logit and a decode row, padded
    to a 4 x 8 grid: the sequence of 5 keys is shorter than the grid's 8 query rows (its padding
    rows come before its first key)."""
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=3, **overrides)
    runner = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=16,
                 skip_tokenizer_init=True).engine.target
    runner.forward([ForwardItem(tokens, 0, table, 1) for tokens, table in PREFILL])
    items = [ForwardItem([43, 44, 45, 46, 47], 40, [5, 9, 2], 5), ForwardItem([10, 11], 3, [7], 1),
             ForwardItem([70], 20, [11, 12], 1)]
    eager = runner.forward(items)

    runner.enable_decode_grid(max_seqs=8, max_query_len=8, max_blocks=4, pad=True, capture=False)
    assert runner.decode_grid.fits(items) and runner.decode_grid.shape(items) == (4, 8, 4)
    used = {5, 9, 2, 7, 11, 12}
    unused = [b for b in range(32) if b not in used]
    for cache in runner.kv_caches:
        cache[:, unused] = 7.0
    grid = runner.forward(items)
    torch.testing.assert_close(grid, eager, atol=1e-5, rtol=1e-5)
    for cache in runner.kv_caches:   # padding wrote the scratch block only
        assert torch.all(cache[:, unused] == 7.0)


def test_grid_takes_short_passes_only(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=1)
    runner = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, skip_tokenizer_init=True).engine.target
    runner.enable_decode_grid(max_seqs=2, max_query_len=5, max_blocks=4)
    grid = runner.decode_grid
    assert grid.fits([ForwardItem([1, 2], 9, [0], 2)])
    assert grid.fits([ForwardItem([1, 2, 3], 9, [0], 1)])                 # a catch-up: several tokens, one logit
    assert not grid.fits([ForwardItem([1] * 6, 9, [0], 6)])               # longer than the grid's rows
    assert not grid.fits([ForwardItem([1], 9, [0], 1)] * 3)               # more sequences than it holds
    assert not grid.fits([ForwardItem([1], 90, [0, 1, 2, 3, 4, 5], 1)])   # more blocks than it holds


def test_engine_on_decode_grids_decodes_like_plain(tiny_pair):
    """Draft-model speculation (static gamma: this draft is as big as its target, so the policy
    would hardly draft), target and draft on padded grids: greedy output identical to plain decoding,
    with both models' decode passes on the grids."""
    target, draft = tiny_pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7] * 40, [9, 8], list(range(20, 45))]
    plain = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True).generate(prompts, params)
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative={"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 4, "adaptive": False})
    runners = [llm.engine.target, llm.engine.spec.router.proposers["draft"].runner]
    passes = {"target": 0, "draft": 0}
    for runner, name, query_len in zip(runners, passes, (5, 5)):   # the draft's catch-ups on its grid too
        runner.enable_decode_grid(max_seqs=8, max_query_len=query_len, max_blocks=8)
        run = runner.decode_grid.run
        runner.decode_grid.run = lambda items, run=run, name=name: passes.update({name: passes[name] + 1}) or run(items)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert passes["target"] >= 5 and passes["draft"] >= 5 and sum(o.spec.proposed for o in out) > 0, passes


def test_engine_verifies_trees_on_decode_grids_like_plain(tiny_pair):
    """Draft trees (n-gram and draft model) verified on the grids, as CUDA graphs would replay them:
    each tree pass fills the grid's tree bits and its attention masks from them; greedy output
    identical to plain decoding, with tree passes on both runners' grids."""
    target, draft = tiny_pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    stem = [11, 12, 13]
    prompts = [stem + [1, 2] + stem + [3, 4] + stem + [5, 6] + stem, [7] * 40, list(range(20, 45))]
    plain = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True).generate(prompts, params)
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative={"method": "auto", "proposers": ["draft", "ngram"], "draft": {"model": str(draft)},
                           "num_speculative_tokens": 4, "tree_nodes": 8, "adaptive": False})
    runners = [llm.engine.target, llm.engine.spec.router.proposers["draft"].runner]
    tree_passes = {"target": 0, "draft": 0}
    for runner, name in zip(runners, tree_passes):
        runner.enable_decode_grid(max_seqs=8, max_query_len=9, max_blocks=8)
        run = runner.decode_grid.run

        def counted(items, run=run, name=name):
            tree_passes[name] += any(item.tree_mask is not None for item in items)
            return run(items)
        runner.decode_grid.run = counted
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert tree_passes["target"] >= 3 and tree_passes["draft"] >= 3, tree_passes


def test_cuda_graphs_need_a_gpu(tiny_pair):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        LLM(str(tiny_pair[0]), dtype="float32", device="cpu", cuda_graphs=True)


def test_graph_captures_stop_the_work_clock(tmp_path):
    """Recording a bucket's graph is a one-off (~30 ms on an H200, against ~2 ms for a replay): the
    cost model's clock leaves the recording out and counts the replays. On the CPU a stand-in
    recorder sleeps 0.2 s and its "graph" 0.05 s per replay."""
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=1)
    runner = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, skip_tokenizer_init=True).engine.target
    runner.enable_decode_grid(max_seqs=2, max_query_len=2, max_blocks=4, capture=False)
    grid = runner.decode_grid
    grid.capture = True

    class Graph:
        def replay(self):
            time.sleep(0.05)

    def record(shape):
        time.sleep(0.2)
        return Graph(), torch.zeros(shape[0] * shape[1], runner.model.hidden_size), None

    grid._record = record
    items = [ForwardItem([5], 3, [0], 1)]
    work, wall = work_clock(), time.perf_counter()
    for _ in range(2):
        grid.run(items)
    work, wall = work_clock() - work, time.perf_counter() - wall
    assert list(grid.graphs) == [(1, 1, 1, False)]   # recorded once, replayed twice
    assert 0.1 <= work <= wall - 0.2, (work, wall)
