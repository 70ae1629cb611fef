"""One oracle-sweep cell with the controller's mechanisms switched off one at a time, in lock-step:
plain, static gammas (--gammas, default 2 and 4), the controller as shipped, and the controller with
one mechanism off (--without): its 5% plan hurdle, its exploration draws, a new request's free first
probe, its steady acceptance memory (the short one alone, no shift detector), the scaling of
predicted drafting-step times by what whole steps measured, or the pooled prior (the engine-wide
rate always worth 4 judged tokens, however alike finished requests were), long exploration
(idle requests draw optimistic rates only until they judged 4 tokens, not 16), or shared probes
(every probe priced and charged as if alone in its pass, at most one per eight requests a step), or
sampled looks (every new request takes its free first look, even where the traffic's acceptance
rules drafting out).
Throughput as a ratio to plain decoding, over --repeats lock-step runs (each with its own prompts)
after an untimed one; under it, what each adaptive engine chose (bench_spec.ChoiceLog).

    python bench/ablate_controller.py --alpha 0.9 --batch 16 [--repeats 2] [--gammas 2,4] [--without "no hurdle"]

The setup is bench_spec.py's: the random 271M target, a 1-layer draft whose tokens an oracle replaces
by the target's own continuation, each kept with probability alpha, 64 greedy tokens per request.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import ENGINE_OPTIONS, oracle_cell, oracle_prompts, prompt_sets, speculative_llm  # noqa: E402
from common import SMALL_DRAFT, random_llama  # noqa: E402

from engine import LLM  # noqa: E402


VARIANTS = ("no hurdle", "no exploration", "no first look", "short memory", "no step bias", "fixed prior",
            "short exploration", "lone probes", "every look")


def switch_off(engine, variant: str) -> None:
    """The controller as shipped ("adaptive"), or with one mechanism switched off."""
    if variant == "no hurdle":
        engine.controller.hurdle = 0.0
    elif variant == "no exploration":
        engine.controller.explore = False
    elif variant == "no first look":   # a new request's first probe is paid from its credit like any other
        engine.controller.first_look = False
    elif variant == "short memory":   # acceptance from the ~14-token memory alone
        engine.controller.steady_decay = None
    elif variant == "no step bias":   # step times from the parts alone, never scaled by whole steps
        engine.costs.observe_drafting_step = lambda predicted, measured, depth=None: None
    elif variant == "short exploration":
        engine.controller.explore_judged = 4.0
    elif variant == "fixed prior":
        engine.controller.pool_evidence = False
    elif variant == "lone probes":   # every probe priced and charged as if alone in its pass, one per 8 requests
        engine.controller.share_probes = False
    elif variant == "every look":   # every new request looks, even where its proposers are ruled out
        engine.controller.sample_looks = False
    elif variant != "adaptive":
        raise SystemExit(f"unknown variant {variant!r}: adaptive or one of {', '.join(VARIANTS)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gammas", default="2,4", help="static gammas compared")
    p.add_argument("--without", default=",".join(VARIANTS), help="variants with one mechanism off, comma-separated")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--root", default="/tmp/specserve-bench")
    args = p.parse_args(argv)

    target = random_llama(os.path.join(args.root, "target"))
    draft = random_llama(os.path.join(args.root, "draft"), seed=1, **SMALL_DRAFT)
    plain = LLM(target, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=max(args.batch, 16), **ENGINE_OPTIONS)
    prompts, continuations = oracle_prompts(plain, args.batch * (args.repeats + 1), args.new_tokens)
    llms = {"plain": plain}
    gammas = [int(g) for g in args.gammas.split(",")]
    llms.update({f"g={g}": speculative_llm(target, draft, args.dtype, g, False, args.batch) for g in gammas})
    variants = ["adaptive"] + [v for v in args.without.split(",") if v]
    for name in variants:
        llms[name] = speculative_llm(target, draft, args.dtype, 8, True, args.batch)
        switch_off(llms[name].engine, name)
    ratios, _ = oracle_cell(llms, continuations, prompt_sets(prompts, args.batch, args.repeats), args.alpha,
                            args.new_tokens)
    print(f"alpha {args.alpha}, batch {args.batch}, {args.repeats} lock-step runs: "
          + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in {"plain": 1.0, **ratios}.items()))
    for name, choices in oracle_cell.choices.items():
        print(f"  {name}: {choices}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
