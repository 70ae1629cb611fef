"""Speculative decoding at controlled acceptance: static gamma against the adaptive policy.

For a random ~270M target, an "oracle" proposer replays the target's own greedy continuation,
each token corrupted with probability 1 - alpha, so acceptance is alpha by construction; a small
random draft model runs underneath so drafting costs what a real draft costs. Printed side by side
from one run:

1. theory (batch 1): measured speedup of static gamma against S = (1 - alpha^(gamma+1)) /
   ((1 - alpha)(gamma c + v)), with c the draft/target step cost and v the cost of a verification
   pass (measured);
2. the oracle sweep: alpha in {0, 0.3, 0.5, 0.7, 0.9} x batch in {1, 4, 16}: throughput of plain
   decoding, static gamma in {1, 2, 4, 8} and the adaptive policy, each as a ratio to plain, and
   adaptive / best static;
3. the workload shift: one stream whose acceptance drops from 0.9 to 0.1 halfway and comes back:
   the policy's draft length step by step, and how many steps it took to turn down and back up.

    python bench/bench_spec.py [--dtype auto] [--new-tokens 64] [--alphas 0,0.3,0.5,0.7,0.9] [--batches 1,4,16]
                               [--repeats 3] [--skip theory,sweep,shift]

The oracle replays greedy output, so every engine must compute each row alike whatever the pass's
shape. On a CPU with native bf16, dtype auto's wide passes go to oneDNN's bf16 matmul, whose rows
depend on the pass (engine/models/streamed_linear.py), which breaks that at batches 4 and 16: run
those with --dtype float32, or with --row-exact, which keeps every pass of up to 512 rows in the
blocked AVX512-BF16 kernel (each row computed alike in any pass): the product's weights and kernel,
without the oneDNN passes the product takes from 48-64 rows (there it would be faster).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import tempfile
import time

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SMALL_DRAFT, random_llama, timed  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_runner import ForwardItem  # noqa: E402
from engine.spec_decode.base import Offer, Proposal  # noqa: E402
from engine.spec_decode.policy import GoodputPolicy  # noqa: E402

STATIC_GAMMAS = (1, 2, 4, 8)


class OracleProposer:
    """The real draft model runs (for its cost); its tokens are swapped for the target's own
    continuation, the token at each output position corrupted with probability 1 - alpha (alpha may
    change between steps). Whether a position is corrupted comes from one fixed uniform draw per
    (prompt, position), so every configuration of a cell faces the same corruptions."""
    name = "draft"

    def __init__(self, draft, continuations: dict[tuple, list[int]], vocab: int, alpha: float, seed: int = 0):
        self.draft, self.continuations, self.vocab, self.alpha = draft, continuations, vocab, alpha
        self.uniforms = {}
        for i, key in enumerate(sorted(continuations)):
            rng = random.Random(seed * 1_000_003 + i)
            self.uniforms[key] = [rng.random() for _ in range(len(continuations[key]) + 16)]

    def offer(self, request, limit: int, max_nodes: int = 0) -> Offer:
        return self.draft.offer(request, limit)   # chains only

    def propose(self, items) -> Proposal:
        # The draft's confidence says nothing about the oracle's tokens: no confidence stop.
        real = self.draft.propose([dataclasses.replace(item, p_min=0.0) for item in items])
        drafts = []
        for item, tokens in zip(items, real.draft_token_ids):
            request = item.request
            key = tuple(request.token_ids[:request.num_prompt_tokens])
            truth, uniforms, start = self.continuations[key], self.uniforms[key], request.num_output_tokens
            drafts.append([t if u < self.alpha else (t + 1) % self.vocab
                           for t, u in zip(truth[start:start + len(tokens)], uniforms[start:])])
        return Proposal(drafts, None)

    def on_verified(self, request) -> None:
        self.draft.on_verified(request)

    def on_finish(self, request_id: str) -> None:
        self.draft.on_finish(request_id)


# Options every engine of the run gets (main adds cuda_graphs from --cuda-graphs). No prefix caching:
# an engine that met a prompt before (the warm-up, the theory table's alphas) recomputes only its last
# token, in a pass of one row where the plain continuation's prefill had it among 32, and with dtype
# auto on a native-bf16 CPU the two can take different kernels (each shape's crossing is measured).
ENGINE_OPTIONS: dict = {"enable_prefix_caching": False}
KV_BYTES = 512 << 20   # 4,096 tokens of the fp32 target: batch 16 needs ~1,700; seven engines of 1 GiB ran out of memory


def speculative_llm(target: str, draft: str, dtype: str, gamma: int, adaptive: bool, batch: int) -> LLM:
    return LLM(target, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=max(batch, 16), kv_cache_memory_bytes=KV_BYTES,
               **ENGINE_OPTIONS,
               speculative={"method": "draft", "draft": {"model": draft}, "num_speculative_tokens": gamma,
                            "adaptive": adaptive})


def with_oracle(llm: LLM, continuations, alpha: float) -> OracleProposer:
    router = llm.engine.spec.router
    real = router.proposers["draft"]
    real = getattr(real, "draft", real)
    oracle = OracleProposer(real, continuations, llm.engine.vocab_size, alpha)
    router.replace("draft", oracle)
    return oracle


def throughput(llm: LLM, prompts: list[list[int]], new_tokens: int, expected=None) -> float:
    """Output tokens per second of one engine alone; with expected, the output must equal it."""
    return lockstep_throughput({"engine": llm}, prompts, new_tokens, expected)["engine"]


def lockstep_throughput(llms: dict, prompts: list[list[int]], new_tokens: int, expected=None,
                        seed: int = 0) -> dict[str, float]:
    """Output tokens per second of several engines run in lock-step: one step of each in turn, each
    step timed, so that whatever slows the machine for a while (other tenants, frequency changes)
    slows them all alike. The order of each round is shuffled: in a fixed order, identical engines
    measured 2-4% apart by their place in it. With expected (the plain greedy outputs), every output
    must equal it."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seconds = {name: 0.0 for name in llms}
    outputs = {name: {} for name in llms}
    for name, llm in llms.items():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))   # warm-up
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), prompt, params)
    running, rng = dict(llms), random.Random(seed)
    while running:
        order = list(running.items())
        rng.shuffle(order)
        for name, llm in order:
            start = time.perf_counter()
            for out in llm.engine.step():
                outputs[name].setdefault(out.request_id, []).extend(out.new_token_ids)
            seconds[name] += time.perf_counter() - start
            if not llm.engine.has_unfinished_requests():
                del running[name]
    for name, got in outputs.items():
        assert expected is None or [got[str(i)] for i in range(len(prompts))] == expected, \
            f"{name}: output must equal plain greedy output (results that depend on the pass's shape, as " \
            f"with bf16 or dtype auto on a CPU with native bf16, break the oracle: use --dtype float32)"
    return {name: len(prompts) * new_tokens / s for name, s in seconds.items()}


def step_costs(llm: LLM, gamma: int, repeats: int = 20) -> tuple[float, float]:
    """Batch 1, short context, relative to one target decode forward: c = one draft decode forward;
    v = one target forward verifying gamma drafts (gamma + 1 tokens)."""
    engine = llm.engine
    table = []
    engine.pool.allocate(table, 64)
    draft_runner = engine.spec.router.proposers["draft"]
    draft_runner = getattr(draft_runner, "draft", draft_runner).runner

    def run(runner, num_tokens: int):
        item = ForwardItem([5] * num_tokens, 40, table, num_tokens)
        return timed(lambda: [runner.forward([item]) for _ in range(repeats)])
    target = run(engine.target, 1)
    draft = run(draft_runner, 1)
    verify = run(engine.target, gamma + 1)
    engine.pool.free(table)
    return draft / target, verify / target


def theory_table(target, draft, dtype, prompts, continuations, plain_tps, new_tokens, gamma, alphas) -> None:
    llm = speculative_llm(target, draft, dtype, gamma, adaptive=False, batch=1)
    c, v = step_costs(llm, gamma)
    print(f"\n1. theory, batch 1, static gamma {gamma}: draft/target step cost c = {c:.3f}; verifying "
          f"{gamma + 1} tokens costs v = {v:.2f} decode steps")
    print(f"{'alpha':>5} {'measured':>9} {'theory_v':>9} {'ratio':>6}")
    for alpha in alphas:
        with_oracle(llm, continuations, alpha)
        measured = throughput(llm, prompts[:1], new_tokens, [continuations[tuple(prompts[0])]]) / plain_tps
        expected_tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1
        theory_v = expected_tokens / (gamma * c + v)
        print(f"{alpha:5.2f} {measured:8.2f}x {theory_v:8.2f}x {measured / theory_v:6.2f}")


def oracle_prompts(plain_llm: LLM, count: int, new_tokens: int) -> tuple[list[list[int]], dict]:
    """count random 32-token prompts (seeded) and the plain greedy continuation of each, each prompt
    generated alone: with dtype auto on a native-bf16 CPU, a prompt prefilled beside others can go
    through oneDNN's bf16 matmul where alone it stays in the row-exact kernel (each shape's crossing
    is measured), and its continuation then differs from what a batch-1 cell decodes."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, plain_llm.engine.vocab_size, (32,), generator=generator).tolist()
               for _ in range(count)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return prompts, {tuple(p): plain_llm.generate([p], params)[0].token_ids for p in prompts}


def prompt_sets(prompts: list[list[int]], batch: int, repeats: int) -> list[list[list[int]]]:
    """repeats + 1 disjoint sets of batch prompts: the untimed run's, then one per timed run."""
    assert len(prompts) >= batch * (repeats + 1), "oracle_prompts made too few prompts"
    return [prompts[i * batch:(i + 1) * batch] for i in range(repeats + 1)]


def oracle_cell(llms: dict, continuations: dict, sets: list[list[list[int]]], alpha: float, new_tokens: int
                ) -> tuple[dict[str, float], float]:
    """One sweep cell: every engine but "plain" drafts through the oracle at alpha, all run in
    lock-step once per prompt set, every output checked against plain greedy; the first run is
    untimed. Returns each engine's throughput as a ratio to plain's (tokens over total time of the
    timed runs) and plain's tokens per second.

    The untimed run is the steady state's warm-up: an engine's first passes at the cell's shapes
    cost more (the adaptive engine's first batch-16 prefill took 1.1-1.2 s against plain's 0.6-0.7 s,
    6% of the cell), and a server that has run a while knows its step costs and the workload's
    engine-wide acceptance (the policy's prior for new requests). Each run has its own prompts:
    the oracle's corruptions are fixed per prompt and position, so repeating one prompt repeats one
    draw of them, and at batch 1 how a static gamma's steps happen to line up with those 13-19
    corrupted positions out of 64 moved it by 10-20% (g=4 made 3.8 tokens per step where alpha 0.8
    predicts 3.4), which "the best static gamma", a maximum over four, then picks up."""
    for name, llm in llms.items():
        if name != "plain":
            with_oracle(llm, continuations, alpha)
    def run(seed: int) -> dict[str, float]:
        prompts = sets[seed]
        return lockstep_throughput(llms, prompts, new_tokens, [continuations[tuple(p)] for p in prompts], seed)
    run(0)
    choices = {name: ChoiceLog(llm.engine) for name, llm in llms.items() if is_adaptive(llm)}
    runs = [run(seed) for seed in range(1, len(sets))]
    rate = {name: len(runs) / sum(1 / run[name] for run in runs) for name in llms}   # tokens / total time
    oracle_cell.choices = {name: log.close() for name, log in choices.items()}
    return {name: tps / rate["plain"] for name, tps in rate.items() if name != "plain"}, rate["plain"]


def is_adaptive(llm: LLM) -> bool:
    """A speculative engine whose speculation adapts (the goodput policy, with proposers)."""
    return bool(llm.engine.spec.router.proposers) and isinstance(llm.engine.spec.policy, GoodputPolicy)


class ChoiceLog:
    """What an adaptive engine chose over a cell's timed runs: how many decode rows drafted and how
    deep, and its predicted step time against the measured one for drafting steps (the cost
    model's error is what turns drafting down). Measured as the engine times its passes (the
    work clock: without graph captures), as the prediction is of the passes alone."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.rows = self.drafting = self.drafted = self.steps = 0
        self.predicted = self.measured = 0.0
        engine.step = self._step

    def _step(self):
        out = self.step()
        stats = self.engine.last_stats
        if stats and stats.chosen_k:
            ks = stats.chosen_k
            self.rows += len(ks)
            self.drafting += sum(k > 0 for k in ks)
            self.drafted += sum(ks)
            if stats.predicted_time_s and any(ks):
                self.steps += 1
                self.predicted += stats.predicted_time_s
                self.measured += stats.draft_time_s + stats.verify_time_s
        return out

    def close(self) -> str:
        self.engine.step = self.step
        bias = f", predicted / measured time of drafting steps {self.predicted / self.measured:.2f}" if self.steps else ""
        return (f"drafted in {self.drafting / max(self.rows, 1):.0%} of decode rows, "
                f"{self.drafted / max(self.drafting, 1):.1f} deep on average{bias}")


def sweep(target, draft, dtype, prompts, continuations, new_tokens, alphas, batches, repeats,
          fresh: bool = False) -> list[dict]:
    print(f"\n2. oracle sweep: throughput as a ratio to plain decoding at the same batch; every cell runs "
          f"plain, each static gamma and adaptive in lock-step (one step of each in turn, in shuffled order), "
          f"{repeats} times after one untimed run, each run with its own prompts, "
          f"tokens over total time; adaptive / best static in the last column")
    if fresh:
        print("(adaptive: one engine carried through the row's cells in order; fresh: a new adaptive engine "
              "per cell, its untimed run its only history)")
    head = "".join(f"{'g=' + str(g):>7}" for g in STATIC_GAMMAS)
    print(f"{'alpha':>5} {'batch':>5} {'plain tok/s':>11}{head} {'adaptive':>8} {'ad/best':>8}"
          + (f" {'fresh':>7} {'fr/best':>8}" if fresh else ""))
    rows = []
    for batch in batches:
        llms = {"plain": LLM(target, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=max(batch, 16), **ENGINE_OPTIONS,
                             kv_cache_memory_bytes=KV_BYTES)}
        llms.update({g: speculative_llm(target, draft, dtype, g, False, batch) for g in STATIC_GAMMAS})
        llms["adaptive"] = speculative_llm(target, draft, dtype, max(STATIC_GAMMAS), True, batch)
        for alpha in alphas:
            if fresh:
                llms.pop("fresh", None)
                gc.collect()   # the last cell's engine holds weights and a KV cache: free them first
                llms["fresh"] = speculative_llm(target, draft, dtype, max(STATIC_GAMMAS), True, batch)
            ratios, plain_rate = oracle_cell(llms, continuations, prompt_sets(prompts, batch, repeats), alpha,
                                             new_tokens)
            best_static = max(ratios[g] for g in STATIC_GAMMAS)
            cells = "".join(f"{ratios[g]:6.2f}x" for g in STATIC_GAMMAS)
            fresh_cell = f" {ratios['fresh']:6.2f}x {ratios['fresh'] / best_static:8.2f}" if fresh else ""
            print(f"{alpha:5.2f} {batch:5d} {plain_rate:11.1f}{cells} {ratios['adaptive']:7.2f}x "
                  f"{ratios['adaptive'] / best_static:8.2f}{fresh_cell}", flush=True)
            for name, choices in oracle_cell.choices.items():
                print(f"      {name}: {choices}")
            rows.append({"alpha": alpha, "batch": batch, **{str(k): v for k, v in ratios.items()}})
        del llms
    worst_plain = min(r["adaptive"] for r in rows)
    worst_best = min(r["adaptive"] / max(r[str(g)] for g in STATIC_GAMMAS) for r in rows)
    wins = sum(r["adaptive"] > max(r[str(g)] for g in STATIC_GAMMAS) for r in rows)
    print(f"adaptive: worst cell {worst_plain:.2f}x plain, worst {worst_best:.2f}x the best static gamma, "
          f"faster than every static gamma in {wins} of {len(rows)} cells")
    return rows


def keep_rows_exact() -> None:
    """Layers built from now on never hand a pass to oneDNN (see --row-exact)."""
    from engine.models import streamed_linear
    streamed_linear.native_rows = lambda layer: None
    streamed_linear.NATIVE_BF16_ROWS = None


def workload_shift(target, draft, dtype, prompt, continuation, new_tokens: int) -> None:
    """Acceptance 0.9, then 0.1 from the middle third, then 0.9 again: the draft length per step."""
    llm = speculative_llm(target, draft, dtype, max(STATIC_GAMMAS), True, 1)
    oracle = with_oracle(llm, {tuple(prompt): continuation}, 0.9)
    engine = llm.engine
    engine.add_request("shift", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    ks, phases, output = [], [], []
    while engine.has_unfinished_requests():
        produced = engine.requests["shift"].num_output_tokens if "shift" in engine.requests else new_tokens
        oracle.alpha = 0.1 if new_tokens // 3 <= produced < 2 * new_tokens // 3 else 0.9
        for out in engine.step():
            output += out.new_token_ids
        if engine.last_stats and engine.last_stats.chosen_k:
            ks.append(engine.last_stats.chosen_k[0])
            phases.append(oracle.alpha)
    # Once the output leaves the replayed continuation, the oracle's drafts are for another prefix
    # and acceptance is ~0 whatever alpha says (dtype auto on a native-bf16 CPU did, ~25 tokens in).
    assert output == continuation, "the shift's output must equal plain greedy output: use --dtype float32"
    low_start = phases.index(0.1)
    high_again = next(i for i in range(low_start, len(phases)) if phases[i] == 0.9)
    down = next((i - low_start for i in range(low_start, high_again) if all(k <= 1 for k in ks[i:i + 5])), None)
    up = next((i - high_again for i in range(high_again, len(ks)) if ks[i] >= 3), None)
    print("\n3. workload shift (one stream, acceptance 0.9 -> 0.1 -> 0.9): draft length per step\n   "
          + " ".join(str(k) for k in ks))
    print(f"   turned down (k <= 1) {down} steps after acceptance fell; back to k >= 3 {up} steps after it returned")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--alphas", default="0,0.3,0.5,0.7,0.9")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3, help="lock-step runs per cell")
    parser.add_argument("--fresh", action="store_true",
                        help="also run a new adaptive engine per sweep cell beside the one carried through the row")
    parser.add_argument("--cuda-graphs", action="store_true", help="GPU: every engine replays decode and "
                        "verification passes as CUDA graphs")
    parser.add_argument("--row-exact", action="store_true", help="dtype auto on a CPU with AVX512-BF16: every "
                        "pass of up to 512 rows in the row-exact kernel, so batches 4 and 16 replay the oracle")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: theory,sweep,shift")
    root = os.path.join(tempfile.gettempdir(), "specserve-bench")
    parser.add_argument("--model-dir", default=os.path.join(root, "target"))
    parser.add_argument("--draft-dir", default=os.path.join(root, "draft"))
    args = parser.parse_args(argv)
    alphas = [float(a) for a in args.alphas.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(args.skip.split(","))

    if args.row_exact:
        keep_rows_exact()
    target = random_llama(args.model_dir)
    draft = random_llama(args.draft_dir, seed=1, **{k: v for k, v in SMALL_DRAFT.items()})
    ENGINE_OPTIONS.update(cuda_graphs=args.cuda_graphs)
    plain_llm = LLM(target, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(batches + [16]), **ENGINE_OPTIONS)
    prompts, continuations = oracle_prompts(plain_llm, max(batches) * (args.repeats + 1), args.new_tokens)
    shift_tokens = 3 * args.new_tokens
    shift_continuation = plain_llm.generate(prompts[:1], SamplingParams(
        max_tokens=shift_tokens, temperature=0.0, ignore_eos=True))[0].token_ids
    plain = {b: throughput(plain_llm, prompts[:b], args.new_tokens) for b in batches}
    print(f"plain decoding (ours), dtype {str(plain_llm.engine.dtype).replace('torch.', '')}: "
          + ", ".join(f"batch {b} {tps:.1f} tok/s" for b, tps in plain.items()))
    del plain_llm
    if "theory" not in skip:
        theory_table(target, draft, args.dtype, prompts, continuations, plain[batches[0]], args.new_tokens, 4, alphas)
    if "sweep" not in skip:
        sweep(target, draft, args.dtype, prompts, continuations, args.new_tokens, alphas, batches, args.repeats,
              args.fresh)
    if "shift" not in skip:
        workload_shift(target, draft, args.dtype, prompts[0], shift_continuation, shift_tokens)


if __name__ == "__main__":
    main()
