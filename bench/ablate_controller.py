"""One oracle-sweep cell with the controller's mechanisms switched off one at a time, in lock-step:
plain, static gamma 2 and 4, the controller as shipped, without its 5% plan hurdle, and without
its exploration draws. Throughput as a ratio to plain decoding, over --repeats lock-step runs.

    python bench/ablate_controller.py --alpha 0.9 --batch 16 [--repeats 2] [--dtype float32]

The setup is bench_spec.py's: the random 271M target, a 1-layer draft whose tokens an oracle replaces
by the target's own continuation, each kept with probability alpha, 64 greedy tokens per request.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import lockstep_throughput, speculative_llm, with_oracle  # noqa: E402
from common import SMALL_DRAFT, random_llama  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--root", default="/tmp/specserve-bench")
    args = p.parse_args(argv)

    target = random_llama(os.path.join(args.root, "target"))
    draft = random_llama(os.path.join(args.root, "draft"), seed=1, **SMALL_DRAFT)
    plain = LLM(target, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(args.batch, 16))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, plain.engine.vocab_size, (32,), generator=generator).tolist()
               for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    continuations = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, params))}

    llms = {"plain": plain}
    llms.update({f"g={g}": speculative_llm(target, draft, args.dtype, g, False, args.batch) for g in (2, 4)})
    for name in ("adaptive", "no hurdle", "no exploration"):
        llms[name] = speculative_llm(target, draft, args.dtype, 8, True, args.batch)
    llms["no hurdle"].engine.controller.hurdle = 0.0
    llms["no exploration"].engine.controller.explore = False
    for name, llm in llms.items():
        if name != "plain":
            with_oracle(llm, continuations, args.alpha)
    expected = [continuations[tuple(p)] for p in prompts]
    runs = [lockstep_throughput(llms, prompts, args.new_tokens, expected) for _ in range(args.repeats)]
    rate = {name: len(runs) / sum(1 / run[name] for run in runs) for name in llms}
    print(f"alpha {args.alpha}, batch {args.batch}, {args.repeats} lock-step runs: "
          + ", ".join(f"{name} {rate[name] / rate['plain']:.2f}x" for name in llms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
