"""The engine at 8B scale: a Llama-3.1-8B-shaped target (random weights: `load_format: dummy`, so
nothing is downloaded or carried) in bf16 with CUDA graphs, as bench/gpu_check.sh runs it on a GPU.

1. bandwidth: what reading a large tensor reaches on this device (the bound's denominator);
2. plain decoding at each batch: output tokens/s against the bandwidth bound, batch / (bytes a decode
   step reads / bandwidth), the bytes being every weight but the input embedding plus the batch's KV
   at its mean context;
3. a verification pass by its rows (one sequence, 1 + drafts rows, on the grid CUDA graphs replay):
   what a draft tree's extra rows cost against a chain's;
4. the oracle sweep, chains against trees: a copying proposer (no draft forwards: prompt lookup's
   cost) drafts the target's own greedy continuation, each position's first candidate right with
   probability alpha; a tree adds beside each chain node a second candidate, right with probability
   beta where the first is wrong. Per alpha and batch: tokens/s of plain decoding, the chain (gamma 8)
   and the tree (the chain plus its alternatives, tree_nodes 16), runs alternating, fresh prompts each.
   In fp32 by default (--oracle-dtype): the oracle replays plain greedy output, which a bf16
   verification pass departs from wherever its rounding differs from a decode step's.

    python bench/gpu_scale.py [--shape llama-8b] [--batches 1,16] [--alphas 0.5,0.7,0.9] [--repeats 3]
    python bench/gpu_scale.py --shape tiny --device cpu     # the same run on a tiny shape (the tests')
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import read_bandwidth  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_runner import ForwardItem  # noqa: E402
from engine.spec_decode.base import Offer, Proposal  # noqa: E402
from engine.spec_decode.tree import DraftTree, copied_drafts, offered_tree  # noqa: E402

SHAPES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}
GAMMA, TREE_NODES, PROMPT_LEN = 8, 16, 32


class OracleCopy:
    """A copying proposer (n-gram's interface: no forwards) that drafts the target's own greedy
    continuation of each prompt: position i's first candidate is right where one fixed uniform draw
    per (prompt, position) falls below alpha, else off by one; a tree adds a second candidate beside
    each chain node, right where the first is wrong and a second draw falls below beta. The draws are
    fixed, so chains and trees of one cell face the same corruptions."""
    name = "ngram"

    def __init__(self, continuations: dict[tuple, list[int]], vocab: int, beta: float = 0.5, seed: int = 0):
        self.continuations, self.vocab, self.alpha, self.beta = continuations, vocab, 0.0, beta
        self.draws = {}
        for i, key in enumerate(sorted(continuations)):
            rng = random.Random(seed * 1_000_003 + i)
            self.draws[key] = [(rng.random(), rng.random()) for _ in range(len(continuations[key]) + GAMMA + 1)]
        self.enabled = True

    def _position(self, request) -> tuple[list[int], list[tuple[float, float]], int]:
        key = tuple(request.token_ids[:request.num_prompt_tokens])
        return self.continuations[key], self.draws[key], request.num_output_tokens

    def _chain(self, request, k: int) -> list[int]:
        truth, draws, start = self._position(request)
        return [t if u < self.alpha else (t + 1) % self.vocab for t, (u, _) in zip(truth[start:start + k], draws[start:])]

    def _tree(self, request, chain: list[int], max_nodes: int) -> tuple[DraftTree, list[float]]:
        truth, draws, start = self._position(request)
        tree, probs = DraftTree(), []
        for depth, token in enumerate(chain):
            tree.add(token, depth - 1)
            probs.append(self.alpha ** (depth + 1))
        for depth, (token, (_, v)) in enumerate(zip(chain[:max_nodes - len(chain)], draws[start:])):
            right = truth[start + depth]
            second = right if token != right and v < self.beta else (token + 2) % self.vocab
            tree.add(second, depth - 1)
            probs.append(self.alpha ** depth * (1 - self.alpha) * self.beta)
        return tree, probs

    def offer(self, request, limit: int, max_nodes: int = 0) -> Offer:
        if not self.enabled or limit <= 0:
            return Offer()
        chain = self._chain(request, limit)
        tree = offered_tree(chain, max_nodes, lambda: self._tree(request, chain, max_nodes))
        return Offer(len(chain), nodes=len(tree) if tree is not None else 0, chain=tuple(chain), tree=tree)

    def propose(self, jobs):
        drafts, trees = copied_drafts(jobs, lambda job: list(job.offer.chain[:job.k]))
        return Proposal(drafts, None, trees=trees)

    def on_verified(self, request) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass


def target_config(shape: str) -> str:
    from transformers import LlamaConfig

    path = os.path.join(tempfile.mkdtemp(prefix=f"gpu_scale_{shape}_"), "target")
    LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def streamed_bytes(llm: LLM) -> int:
    """Bytes of every weight a decode step reads: all but the input embedding (one row a token)."""
    model = llm.engine.target.model
    embedding = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


def kv_bytes_per_token(llm: LLM) -> int:
    caches = llm.engine.target.kv_caches
    per_slot = caches[0][0, 0, 0].numel() * caches[0].element_size() * 2   # keys and values of one slot, one layer
    return per_slot * len(caches)


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Seconds (synchronised), each prompt's output, and the speculation counters of one batch."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine_ = llm.engine
    for i, prompt in enumerate(prompts):
        engine_.add_request(f"r{i}", prompt, params)
    outputs, counts = {}, {"proposed": 0, "accepted": 0, "forwards": 0, "trees": 0}
    sync = torch.cuda.synchronize if engine_.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                counts["proposed"] += out.spec.proposed
                counts["accepted"] += out.spec.accepted
                counts["forwards"] += out.spec.target_forwards
        counts["trees"] += engine_.last_stats.num_tree_drafts
    sync()
    return time.perf_counter() - start, [outputs[f"r{i}"] for i in range(len(prompts))], counts


def pass_costs(llm: LLM, rows: list[int], repeats: int = 20) -> dict[int, float]:
    """Seconds of one target pass of each row count at one sequence (context 512), best of repeats."""
    engine_, table = llm.engine, []
    engine_.pool.allocate(table, 512 + max(rows))
    runner = engine_.target
    sync = torch.cuda.synchronize if engine_.device.type == "cuda" else (lambda: None)
    costs = {}
    for n in rows:
        item = ForwardItem([5] * n, 512, table, n)
        runner.forward([item])   # a graph is captured on first use
        best = float("inf")
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            runner.forward([item])
            sync()
            best = min(best, time.perf_counter() - start)
        costs[n] = best
    engine_.pool.free(table)
    return costs


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def engine_for(path: str, dtype: str, device: torch.device, graphs: bool, args) -> LLM:
    """One engine over the shape (random weights), speculating with the oracle in place of n-gram:
    silent (plain decoding) until it is given continuations."""
    llm = LLM(path, dtype=dtype, device=str(device), skip_tokenizer_init=True, load_format="dummy",
              cuda_graphs=graphs, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_cache_memory,
              speculative={"method": "ngram", "num_speculative_tokens": GAMMA, "tree_nodes": TREE_NODES,
                           "adaptive": False})
    silent = OracleCopy({}, llm.engine.vocab_size)
    silent.enabled = False
    llm.engine.spec.router.replace("ngram", silent)
    run(llm, [[5] * PROMPT_LEN], 8)   # warm-up (the first graphs captured)
    return llm


def plain_runs(llm: LLM, pool: list[list[int]], batch: int, args, continuations: dict) -> list[float]:
    """Plain decoding over the pool, batch prompts at a time: tokens/s of the first `repeats` runs,
    and every prompt's greedy continuation (into continuations)."""
    rates = []
    for start in range(0, len(pool), batch):
        seconds, outs, _ = run(llm, pool[start:start + batch], args.new_tokens)
        continuations.update((tuple(prompt), out) for prompt, out in zip(pool[start:start + batch], outs))
        if start // batch < args.repeats:
            rates.append(batch * args.new_tokens / seconds)
    return rates


def bandwidth_section(llm: LLM, device: torch.device, args, figures: dict) -> None:
    bandwidth = read_bandwidth(1 << 32 if device.type == "cuda" else 1 << 28, device=device)
    weights, kv_token = streamed_bytes(llm), kv_bytes_per_token(llm)
    figures["bandwidth_gb_s"], figures["weights_gb"] = bandwidth / 1e9, weights / 1e9
    print(f"\n1. bandwidth {bandwidth / 1e9:.0f} GB/s (reading a large tensor); weights a step reads {weights / 1e9:.2f} GB")
    print("\n2. plain decoding, output tokens/s against the bandwidth bound (mean, min-max)")
    generator = torch.Generator().manual_seed(1)
    for b in args.batches:
        pool = [torch.randint(3, llm.engine.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
                for _ in range(b * args.repeats)]
        rates = plain_runs(llm, pool, b, args, {})
        context = PROMPT_LEN + args.new_tokens / 2
        bound = b / ((weights + b * context * kv_token) / bandwidth)
        mean = statistics.mean(rates)
        figures[f"plain_b{b}"] = {"tok_s": rates, "bound_tok_s": bound, "of_bound": mean / bound}
        print(f"   batch {b:3d}: {spread(rates)} tok/s, bound {bound:.0f}: {mean / bound:.0%} of it")
    rows = [1, 2, 4, GAMMA + 1, TREE_NODES + 1]   # the grid holds up to a tree's rows
    costs = pass_costs(llm, rows)
    figures["pass_ms"] = {n: c * 1e3 for n, c in costs.items()}
    print("\n3. one sequence's pass by rows (context 512): "
          + ", ".join(f"{n}: {c * 1e3:.2f} ms ({c / costs[1]:.2f}x)" for n, c in costs.items()))


def oracle_section(llm: LLM, args, figures: dict) -> None:
    """Chains against trees at each alpha and batch, on fresh prompts whose plain continuations this
    engine decoded first (the oracle replays them: a dtype whose verification rows equal its decode
    rows keeps the replay true; bf16 rounding parts them, and acceptance falls for reasons of its own)."""
    print(f"\n4. oracle sweep ({args.oracle_dtype}): gamma {GAMMA}, tree_nodes {TREE_NODES}, beta {args.beta}; "
          "tokens/s (mean, min-max) and tokens per target pass; trees / chains")
    vocab, generator, continuations = llm.engine.vocab_size, torch.Generator().manual_seed(2), {}
    pools, plain = {}, {}
    for b in args.batches:
        pools[b] = [torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist()
                    for _ in range(b * args.repeats * (1 + 2 * len(args.alphas)))]
        plain[b] = statistics.mean(plain_runs(llm, pools[b], b, args, continuations))
    oracle = OracleCopy(continuations, vocab, args.beta)
    llm.engine.spec.router.replace("ngram", oracle)
    for b in args.batches:
        pool = pools[b][b * args.repeats:]
        for alpha in args.alphas:
            oracle.alpha = alpha
            cell = {"chain": [], "tree": []}
            counts = {mode: {"accepted": 0, "forwards": 0, "trees": 0} for mode in cell}
            for r in range(args.repeats):
                for mode in (("chain", "tree") if r % 2 == 0 else ("tree", "chain")):
                    prompts, pool = pool[:b], pool[b:]
                    llm.engine.spec.tree_nodes = TREE_NODES if mode == "tree" else 0
                    seconds, _, c = run(llm, prompts, args.new_tokens)
                    cell[mode].append(b * args.new_tokens / seconds)
                    for key in counts[mode]:
                        counts[mode][key] += c[key]
            ratios = [t / c for t, c in zip(cell["tree"], cell["chain"])]
            # tokens a verification pass emits: its accepted drafts and one of its own
            per_pass = {m: (n["accepted"] + n["forwards"]) / max(n["forwards"], 1) for m, n in counts.items()}
            figures[f"oracle_b{b}_a{alpha}"] = {**cell, "plain": plain[b], "tokens_per_pass": per_pass,
                                                "tree_passes": counts["tree"]["trees"]}
            print(f"   batch {b:3d} alpha {alpha:.1f}: plain {plain[b]:.1f}, chain {spread(cell['chain'])} "
                  f"({per_pass['chain']:.2f}/pass), tree {spread(cell['tree'])} ({per_pass['tree']:.2f}/pass), "
                  f"trees / chains {spread(ratios, 3)}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--alphas", default="0.5,0.7,0.9")
    p.add_argument("--beta", type=float, default=0.5, help="chance a tree's second candidate is right where the first is not")
    p.add_argument("--oracle-dtype", default="float32", help="the sweep's dtype (see oracle_section)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on where the device is CUDA")
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30)
    p.add_argument("--skip", default="", help="comma-separated sections to skip: plain, oracle")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.alphas = [float(a) for a in args.alphas.split(",")]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    graphs = device.type == "cuda" if args.cuda_graphs is None else args.cuda_graphs
    figures: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", "cuda_graphs": graphs}
    print(f"{args.shape} target, random weights, {figures['device']}, CUDA graphs {'on' if graphs else 'off'}")
    path, skip = target_config(args.shape), args.skip.split(",")
    if "plain" not in skip:   # bf16: what serving runs
        llm = engine_for(path, "bfloat16", device, graphs, args)
        bandwidth_section(llm, device, args, figures)
        del llm   # its weights and graphs freed before the sweep's engine loads
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "oracle" not in skip:
        oracle_section(engine_for(path, args.oracle_dtype, device, graphs, args), args, figures)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()
