"""Speculative decoding benchmark: measured speedup against the theory, at controlled acceptance.

For the random ~270M target, an "oracle" proposer replays the target's own greedy
continuation, each token corrupted with probability 1 - alpha, so the acceptance rate is
alpha by construction; a small random draft model runs alongside it so drafting costs
what a real draft costs. For alpha in {0.5, 0.7, 0.9} it prints, side by side in one run:
measured speedup over our own autoregressive decoding, tokens per target forward, the
theoretical speedup S = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma*c + 1)) with c the
measured draft/target step cost ratio, and measured / theoretical; also theory_v, the same
formula with the measured cost v of a verification pass in place of 1 (on CPUs whose small-batch
matmuls are compute-bound, verifying gamma + 1 tokens costs several decode steps). Then the same for
transformers' assisted generation (assistant_model= and prompt_lookup_num_tokens=).

    python bench/bench_spec.py [--gamma 4] [--new-tokens 64] [--dtype auto]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SMALL_DRAFT, random_llama, timed  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_runner import ForwardItem  # noqa: E402
from engine.spec_decode.base import Proposal  # noqa: E402


class OracleProposer:
    """Runs the real draft model (for its cost), then swaps in the target's own continuation,
    each token corrupted with probability 1 - alpha."""
    method = "draft"

    def __init__(self, draft, continuation: list[int], prompt_len: int, alpha: float, vocab: int, seed: int = 0):
        self.draft, self.continuation, self.prompt_len, self.vocab = draft, continuation, prompt_len, vocab
        self.alpha, self.rng = alpha, random.Random(seed)

    def propose(self, scheduled) -> Proposal:
        real = self.draft.propose(scheduled)
        drafts = []
        for item, tokens in zip(scheduled, real.draft_token_ids):
            start = item.request.num_tokens - self.prompt_len
            truth = self.continuation[start:start + len(tokens)]
            drafts.append([t if self.rng.random() < self.alpha else (t + 1) % self.vocab for t in truth])
        return Proposal(drafts, None)


def step_costs(llm: LLM, gamma: int, repeats: int = 20) -> tuple[float, float]:
    """Batch 1, short context, relative to one target decode forward:
    c = one draft decode forward; v = one target forward verifying gamma drafts (gamma + 1 tokens)."""
    engine = llm.engine
    table = []
    engine.pool.allocate(table, 64)

    def run(runner, num_tokens: int):
        item = ForwardItem([5] * num_tokens, 40, table, num_tokens)
        return timed(lambda: [runner.forward([item]) for _ in range(repeats)])
    target = run(engine.target, 1)
    draft = run(engine.proposer.runner, 1)
    verify = run(engine.target, gamma + 1)
    engine.pool.free(table)
    return draft / target, verify / target


def run_ours(llm: LLM, prompt: list[int], new_tokens: int):
    """Seconds, tokens, and speculation stats of one greedy request."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - start, out.token_ids, out.spec


def hf_assisted(target_path: str, draft_path: str, dtype, prompt: list[int], new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def gen(**kw):
        with torch.inference_mode():
            return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **kw)
    plain = timed(gen)
    assisted = timed(lambda: gen(assistant_model=draft))
    lookup = timed(lambda: gen(prompt_lookup_num_tokens=4))
    print(f"transformers: plain {new_tokens / plain:.2f} tok/s; assistant_model (random draft, acceptance ~0) "
          f"{plain / assisted:.2f}x; prompt_lookup_num_tokens=4 {plain / lookup:.2f}x "
          f"(no oracle hook there: these show its overhead at near-zero acceptance)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--skip-hf", action="store_true")
    root = os.path.join(tempfile.gettempdir(), "specserve-bench")
    parser.add_argument("--model-dir", default=os.path.join(root, "target"))
    parser.add_argument("--draft-dir", default=os.path.join(root, "draft"))
    args = parser.parse_args(argv)

    target_path = random_llama(args.model_dir)
    draft_path = random_llama(args.draft_dir, seed=1, **{k: v for k, v in SMALL_DRAFT.items()})
    plain = LLM(target_path, dtype=args.dtype, skip_tokenizer_init=True)
    vocab = plain.engine.vocab_size
    prompt = torch.randint(3, vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    run_ours(plain, prompt, args.new_tokens)   # warm-up
    plain_s, continuation, _ = run_ours(plain, prompt, args.new_tokens)
    print(f"plain decoding (ours): {args.new_tokens / plain_s:.2f} tok/s, "
          f"dtype {str(plain.engine.dtype).replace('torch.', '')}")
    del plain

    spec = LLM(target_path, dtype=args.dtype, skip_tokenizer_init=True,
               speculative={"method": "draft", "model": draft_path, "num_speculative_tokens": args.gamma})
    real_draft = spec.engine.proposer
    g = args.gamma
    c, v = step_costs(spec, g)
    print(f"gamma = {g}; draft/target step cost c = {c:.3f}; verifying {g + 1} tokens costs v = {v:.2f} "
          f"plain decode steps (the theory assumes 1)")
    print("alpha: the oracle's per-token accuracy = the i.i.d. acceptance the theory assumes; "
          "tok/fwd: measured (expected 1 + alpha + ... + alpha^gamma)")
    print(f"{'alpha':>5} {'tok/fwd':>14} {'measured':>9} {'theory':>7} {'ratio':>6} {'theory_v':>9} {'ratio_v':>8}")
    for alpha in (float(a) for a in args.alphas.split(",")):
        spec.engine.proposer = OracleProposer(real_draft, continuation, len(prompt), alpha, vocab)
        run_ours(spec, prompt, args.new_tokens)   # warm-up
        seconds, tokens, stats = run_ours(spec, prompt, args.new_tokens)
        assert tokens == continuation, "speculative output must equal plain greedy output"
        measured = plain_s / seconds
        expected_tokens = (1 - alpha ** (g + 1)) / (1 - alpha)
        theory = expected_tokens / (g * c + 1)
        theory_v = expected_tokens / (g * c + v)   # with the measured cost of a verification pass
        tokens_per_forward = (len(tokens) - 1) / stats.target_forwards
        print(f"{alpha:5.2f} {tokens_per_forward:5.2f} ({expected_tokens:4.2f}) {measured:8.2f}x "
              f"{theory:6.2f}x {measured / theory:6.2f} {theory_v:8.2f}x {measured / theory_v:8.2f}")
    if not args.skip_hf:
        hf_assisted(target_path, draft_path, spec.engine.dtype, prompt, args.new_tokens)


if __name__ == "__main__":
    main()
