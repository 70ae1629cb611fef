"""bench/gpu_scale.py, the device check's 8B-scale run, on a tiny shape on the CPU: random weights
(`load_format: dummy`), its oracle's chains and trees verified in the engine, and the figures it
reports. (Its timings mean nothing here; the GPU run is bench/gpu_check.sh's.)"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_scale  # noqa: E402


def test_the_tiny_run_reports_every_figure(tmp_path):
    """beta 1: where a chain's token is wrong, the tree's second candidate is right, so trees emit
    more tokens a pass than chains at alpha 0.5 (both face the same corruptions)."""
    figures = gpu_scale.main(["--shape", "tiny", "--device", "cpu", "--batches", "1,2", "--alphas", "0.5,0.9",
                              "--beta", "1.0", "--repeats", "2", "--new-tokens", "24",
                              "--kv-cache-memory", str(16 << 20), "--out", str(tmp_path / "figures.json")])
    assert (tmp_path / "figures.json").is_file()
    assert figures["bandwidth_gb_s"] > 0 and figures["weights_gb"] > 0 and not figures["cuda_graphs"]
    for b in (1, 2):
        plain = figures[f"plain_b{b}"]
        assert len(plain["tok_s"]) == 2 and plain["bound_tok_s"] > 0
        for alpha in (0.5, 0.9):
            cell = figures[f"oracle_b{b}_a{alpha}"]
            assert len(cell["chain"]) == len(cell["tree"]) == 2 and cell["tree_passes"] > 0
        half = figures[f"oracle_b{b}_a0.5"]["tokens_per_pass"]
        assert half["tree"] > half["chain"] > 1.2, half
    assert sorted(figures["pass_ms"]) == [1, 2, 4, gpu_scale.GAMMA + 1, gpu_scale.TREE_NODES + 1]


def test_the_oracles_tree_holds_its_chain_and_a_second_candidate_at_each_depth():
    prompt = (3, 4, 5)
    oracle = gpu_scale.OracleCopy({prompt: [10, 11, 12, 13]}, vocab=64, beta=1.0)
    oracle.alpha = 0.0   # every first candidate wrong: every second one right

    class Request:
        request_id, token_ids, num_prompt_tokens, num_output_tokens, num_tokens = "r", list(prompt), 3, 0, 3
    chain = oracle._chain(Request, 3)
    assert chain == [11, 12, 13]
    tree, probs = oracle._tree(Request, chain, max_nodes=5)
    assert tree.tokens == [11, 12, 13, 10, 11] and tree.parents == [-1, 0, 1, -1, 0]
    assert probs == [0.0, 0.0, 0.0, 1.0, 0.0]   # alpha 0: only the first second candidate is reachable
