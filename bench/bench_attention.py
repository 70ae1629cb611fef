"""Attention microbenchmark: the torch reference backend padded (one gathered call) vs grouped ("sequences").

Prints, measured side by side in one run (the two paths alternate; best of --repeats rounds, each round
timing every case once, so bursts of load from other processes spread out), the time of one layer's
paged_attention call for batch x context x query length, in fp32 and bf16, with the default model's
shapes (9 query heads, 3 KV heads, head_dim 64, block size 16), for block tables whose blocks are
consecutive ids, scattered ones, and "mixed" ones (see block_tables). Context counts the new tokens.
With --engine, also batch-16 greedy tokens/s with each form in the same process: bench/bench_engine.py's
random ~270M Llama, and a random Llama of the default target's shapes with 256-token prompts.

    python bench/bench_attention.py [--threads N] [--repeats 5] [--engine]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.attention import paged_attention  # noqa: E402
from engine.attention_backends import TorchBackend  # noqa: E402
from engine.attention_metadata import PassLayout  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PATHS = ("padded", "sequences")


def torch_backend(path: str, block_size: int = BLOCK_SIZE) -> TorchBackend:
    """The torch reference in the form `path` names: one padded call, or sequences grouped."""
    return TorchBackend(block_size, torch.device("cpu"), group_sequences=path == "sequences")


def block_tables(batch: int, context: int, layout: str, generator: torch.Generator):
    """(block table per sequence, context length per sequence, number of blocks in the cache).
    consecutive: every sequence's blocks are consecutive ids; scattered: drawn from a pool twice the size
    needed; mixed: as the engine makes them while streams interleave, a consecutive run (the prompt's
    blocks) then scattered ones, and contexts spread over context/4..context."""
    seq_lens = [context] * batch
    if layout == "mixed":
        seq_lens = torch.randint(context // 4, context + 1, (batch,), generator=generator).tolist()
    counts = [-(-n // BLOCK_SIZE) for n in seq_lens]
    runs = [{"consecutive": n, "scattered": 0, "mixed": n // 2}[layout] for n in counts]
    num_blocks = 2 * sum(counts)
    # Runs take the lowest ids, in order; the other blocks come shuffled from the rest of the cache.
    pool = (sum(runs) + torch.randperm(num_blocks - sum(runs), generator=generator)).tolist()
    starts = [sum(runs[:i]) for i in range(batch)]
    tables = [list(range(start, start + run)) + [pool.pop() for _ in range(count - run)]
              for start, run, count in zip(starts, runs, counts)]
    return tables, seq_lens, num_blocks


def layer_call(batch: int, context: int, q_len: int, dtype: torch.dtype, layout: str):
    """fn(path) -> one layer's attention on a random cache, with the metadata of both paths built up front."""
    g = torch.Generator().manual_seed(batch * 7919 + context * 31 + q_len)
    tables, seq_lens, num_blocks = block_tables(batch, context, layout, g)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    key = torch.randn(batch * q_len, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    layout = PassLayout([q_len] * batch, seq_lens, tables)
    metas = {path: torch_backend(path).build(layout) for path in PATHS}
    return lambda path: paged_attention(query, key, key, cache, metas[path], HEAD_DIM ** -0.5)


def compare(cases: dict, repeats: int) -> dict:
    """{case: {path: best seconds per call}}. Each round times every case once per path (~10 ms each,
    the paths alternating), so bursts of load from other processes spread over all cases and paths
    instead of spoiling one; the best of the rounds is kept."""
    calls = {}
    for case, fn in cases.items():   # warm up, and size each timing to ~10 ms
        for path in PATHS:
            start = time.perf_counter()
            fn(path)
            calls[case, path] = max(1, int(0.01 / max(time.perf_counter() - start, 1e-6)))
    best = {case: dict.fromkeys(PATHS, float("inf")) for case in cases}
    for round_ in range(repeats):
        for case, fn in cases.items():
            for path in PATHS[::(-1) ** round_]:
                start = time.perf_counter()
                for _ in range(calls[case, path]):
                    fn(path)
                best[case][path] = min(best[case][path], (time.perf_counter() - start) / calls[case, path])
    return best


def attention_table(repeats: int) -> None:
    batches, contexts, q_lens = (1, 8, 16), (128, 512, 1024), (1, 5)
    layouts = ("consecutive", "scattered", "mixed")
    cases = {(dtype, layout, batch, context, q_len): layer_call(batch, context, q_len, dtype, layout)
             for dtype in (torch.float32, torch.bfloat16) for layout in layouts
             for batch in batches for context in contexts for q_len in q_lens}
    best = compare(cases, repeats)
    print("us per layer call: padded (reference) / sequences (new) and the speedup; columns: context, q_len")
    print(f"{'dtype':8s} {'blocks':11s} {'batch':>5s} "
          + " ".join(f"{f'{c} q{q}':>16s}" for c in contexts for q in q_lens))
    for dtype in (torch.float32, torch.bfloat16):
        for layout in layouts:
            for batch in batches:
                cells = []
                for context in contexts:
                    for q_len in q_lens:
                        times = best[dtype, layout, batch, context, q_len]
                        ref, new = times["padded"] * 1e6, times["sequences"] * 1e6
                        cells.append(f"{f'{ref:.0f}/{new:.0f}':>10s} {ref / new:4.1f}x")
                print(f"{str(dtype).replace('torch.', ''):8s} {layout:11s} {batch:5d} " + " ".join(cells), flush=True)


# The default target's shapes (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads), random weights.
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)


def engine_figure(name: str, overrides: dict, prompt_len: int, new_tokens: int, repeats: int) -> None:
    """Batch-16 greedy throughput of one engine with the target's attention on each form of the torch
    reference, alternating, in one process."""
    import tempfile

    from bench_engine import ours_tokens_per_s, prompts
    from common import random_llama

    from engine import LLM

    path = random_llama(os.path.join(tempfile.gettempdir(), "specserve-bench", name), **overrides)
    llm = LLM(path, dtype="auto", skip_tokenizer_init=True, max_num_seqs=16)
    batch = prompts(16, prompt_len)
    best = dict.fromkeys(PATHS, 0.0)
    target = llm.engine.target
    for _ in range(repeats):
        for path_name in PATHS:
            target.attention = torch_backend(path_name, target.block_size)
            best[path_name] = max(best[path_name], ours_tokens_per_s(llm, batch, new_tokens, 1))
    print(f"engine {name} (dtype {str(llm.engine.dtype).replace('torch.', '')}, 16 requests, {prompt_len}-token "
          f"prompts, {new_tokens} new tokens): padded {best['padded']:.1f} tok/s, sequences "
          f"{best['sequences']:.1f} tok/s, {best['sequences'] / best['padded']:.2f}x", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="also the whole-engine batch-16 figure")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} torch threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"shapes: {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}")
    with torch.inference_mode():
        attention_table(args.repeats)
    if args.engine:   # bench_engine.py's random ~270M Llama (16 heads = 16 KV heads), then the default's shapes
        engine_figure("target", {}, 32, 64, 2)
        engine_figure("smollm2-shaped", SMOLLM2_SHAPES, 256, 32, 2)


if __name__ == "__main__":
    main()
