"""Mixture-of-experts microbenchmark: our grouped MoE block against a per-token expert loop, and a
verification pass's cost as its rows grow, MoE against a dense MLP of the same active parameters.

Table 1: one MoE layer (engine/models/moe.py: pairs grouped by expert, one GEMM per selected expert)
against the naive per-token loop (each token runs its k experts one by one, so an expert chosen by
several tokens is read several times), at 1, 4, 16 and 64 rows, in fp32 and bf16. Two layer shapes:
Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8, moe_intermediate 768: 2.4 GB of experts in fp32)
and Mixtral-8x7B's scaled by 1/4 (hidden 1024, 8 experts, top-2, intermediate 3584). Routing comes
from a random router on random inputs: close to uniform, the worst case for sharing (a trained
router's popular experts are shared more). A CPU pass is bound by reading the experts' weights, so
the speedup is at most (token, expert) pairs / distinct experts hit: the "bound" column.

Table 2: a verification pass over 1, 2, 4, 8, 16 rows (a request's last token plus k - 1 drafts):
the MoE block against a dense SwiGLU MLP with the same active parameters (intermediate =
top_k * moe_intermediate). A dense pass reads its weights once whatever the rows; an MoE pass reads
every expert any row picked, so its cost grows with the rows until all experts are touched: a
speculative step's k buys less on an MoE target than on a dense one.

Each time is the median of --repeats rounds (cases interleaved within a round, so bursts of load
from other processes spread over all of them), with the min-max spread. One thread by default: on a
shared machine a second OpenMP thread waits for a scheduler slice at every op, which swamps
millisecond timings.

    python bench/moe_bench.py [--threads 1] [--repeats 5] [--shapes qwen3-30b-a3b mixtral-8x7b/4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.models.moe import SparseMoeBlock, route  # noqa: E402


def make_block(hidden: int, experts: int, top_k: int, inter: int, dtype: torch.dtype) -> SparseMoeBlock:
    """A Qwen3-MoE-style block (renormalised top-k) with random weights of a trained model's scale."""
    block = SparseMoeBlock(hidden, experts, top_k, inter, renormalize=True, fp32_weights=False, family="qwen3_moe")
    with torch.no_grad():
        for param in block.parameters():
            param.data = torch.empty(param.shape, dtype=dtype).uniform_(-1, 1).mul_(param.shape[-1] ** -0.5)
    return block.eval()


def per_token_loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The naive MoE: token by token, each of its k experts on its own."""
    weights, ids = route(block.gate(x), block.top_k, block.renormalize, block.fp32_weights)
    experts, inter = block.experts, block.experts.intermediate
    out = torch.zeros_like(x)
    for t in range(len(x)):
        row = x[t:t + 1]
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up = F.linear(row, experts.gate_up_proj[e])
            out[t] += w * F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], experts.down_proj[e])[0]
    return out


def dense_mlp(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    inter = down.shape[1]
    h = F.linear(x, gate_up)
    return F.linear(F.silu(h[:, :inter]) * h[:, inter:], down)


def timed(fn, x) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def measure(cases: dict, repeats: int) -> dict:
    """{name: (fn, x)} -> {name: [seconds per round]}, every case once per round, after one warm-up."""
    for fn, x in cases.values():
        fn(x)
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (fn, x) in cases.items():
            times[name].append(timed(fn, x))
    return times


def ms(samples: list[float]) -> str:
    return f"{1e3 * statistics.median(samples):8.2f} ({1e3 * min(samples):.2f}-{1e3 * max(samples):.2f})"


SHAPES = {   # hidden, experts, top_k, expert intermediate
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "mixtral-8x7b/4": (1024, 8, 2, 3584),
}


def experts_touched(block: SparseMoeBlock, x: torch.Tensor) -> int:
    return len(torch.topk(block.gate(x), block.top_k).indices.unique())


@torch.inference_mode()
def table_grouped_vs_loop(block: SparseMoeBlock, rows_list: list[int], repeats: int) -> None:
    hidden, dtype = block.gate.in_features, block.gate.weight.dtype
    generator = torch.Generator().manual_seed(0)
    print(f"{'rows':>5} {'experts hit':>11} {'bound':>6} {'per-token loop ms':>24} {'grouped ms (ours)':>24} "
          f"{'speedup':>8}")
    for rows in rows_list:
        x = torch.randn(rows, hidden, generator=generator).to(dtype)
        torch.testing.assert_close(block(x).float(), per_token_loop(block, x).float(), atol=5e-2, rtol=5e-2)
        times = measure({"loop": (lambda v: per_token_loop(block, v), x), "grouped": (block, x)},
                        max(2, repeats // 2) if rows >= 64 else repeats)
        ratio = statistics.median(times["loop"]) / statistics.median(times["grouped"])
        hit = experts_touched(block, x)
        print(f"{rows:>5} {hit:>11} {rows * block.top_k / hit:>5.2f}x {ms(times['loop']):>24} "
              f"{ms(times['grouped']):>24} {ratio:>7.2f}x")


@torch.inference_mode()
def table_verification_growth(block: SparseMoeBlock, repeats: int) -> None:
    hidden, dtype = block.gate.in_features, block.gate.weight.dtype
    dense_inter = block.top_k * block.experts.intermediate
    gate_up = torch.empty(2 * dense_inter, hidden, dtype=dtype).uniform_(-1, 1).mul_(hidden ** -0.5)
    down = torch.empty(hidden, dense_inter, dtype=dtype).uniform_(-1, 1).mul_(dense_inter ** -0.5)
    generator = torch.Generator().manual_seed(1)
    xs = {rows: torch.randn(rows, hidden, generator=generator).to(dtype) for rows in (1, 2, 4, 8, 16)}
    cases = {}
    for rows, x in xs.items():
        cases[("dense", rows)] = (lambda v: dense_mlp(gate_up, down, v), x)
        cases[("moe", rows)] = (block, x)
    times = measure(cases, repeats)
    print(f"verification pass over R rows: dense MLP (intermediate {dense_inter}) vs the MoE block, "
          f"same active parameters")
    print(f"{'rows':>5} {'dense ms':>22} {'/ rows=1':>9} {'MoE ms':>22} {'/ rows=1':>9} {'experts hit':>11} "
          f"{'MoE/dense':>10}")
    base = {kind: statistics.median(times[(kind, 1)]) for kind in ("dense", "moe")}
    for rows, x in xs.items():
        dense, moe = statistics.median(times[("dense", rows)]), statistics.median(times[("moe", rows)])
        print(f"{rows:>5} {ms(times[('dense', rows)]):>22} {dense / base['dense']:>8.2f}x "
              f"{ms(times[('moe', rows)]):>22} {moe / base['moe']:>8.2f}x {experts_touched(block, x):>11} "
              f"{moe / dense:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), torch {torch.__version__}; ms: median (min-max)")
    for shape in args.shapes:
        hidden, experts, top_k, inter = SHAPES[shape]
        for name in args.dtypes:
            print(f"\n== {shape}: hidden {hidden}, {experts} experts, top-{top_k}, intermediate {inter}; {name}")
            block = make_block(hidden, experts, top_k, inter, getattr(torch, name))
            table_grouped_vs_loop(block, args.rows, args.repeats)
            table_verification_growth(block, args.repeats)
            del block


if __name__ == "__main__":
    main()
