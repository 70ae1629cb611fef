"""Spec-Bench on the default target: the draft model and n-gram (each at a static gamma), auto (the
adaptive policy routing between them) and no speculation, side by side in one run (in lock-step:
one engine step of each method in turn, see conversations.py), with transformers' assisted
generation and prompt lookup as the peers.

    python bench/spec_bench.py [--config configs/smollm2-draft.yaml] [--per-category 3] [--max-tokens 128]
                               [--concurrency 1 4 16] [--rounds 1] [--no-peers] [--json results.json]

Questions: bench/data/spec_bench/question_dev.jsonl (the development half; the first
--per-category of each category, by question id). Multi-turn questions run turn by turn, the
model's own answer in the context of the next turn, as Spec-Bench does. Greedy decoding.

For each concurrency (requests in flight at once) and each method it prints, per category and
pooled: acceptance (accepted / proposed draft tokens), tokens per target forward, and the speedup
over plain decoding (time per generated token, plain / method). Per-category speedups come from the
concurrency-1 run, where each step serves one conversation. The peers run at concurrency 1 on the
same prompts, dtype and token limit. The measured cost of verifying gamma + 1 tokens, in decode
steps, is printed first: on CPUs without native bf16 it is what limits the speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(__file__))
from common import timed  # noqa: E402
from conversations import (QUESTIONS, Run, auto_over, chat_ids, load_questions, method_configs,  # noqa: E402
                           question_sessions, run_lockstep, speedups, spread, warm_engine)

from engine import LLM  # noqa: E402
from engine.model_runner import ForwardItem  # noqa: E402
from server.config import load_config  # noqa: E402

def verification_cost(llm: LLM, gamma: int, context: int = 256) -> float:
    """Time of one target pass over gamma + 1 new tokens / one over a single token, batch 1, bf16 as served."""
    engine = llm.engine
    table: list[int] = []
    assert engine.pool.allocate(table, context + gamma + 1)
    try:
        tokens = [(100 + i) % engine.vocab_size for i in range(context + gamma + 1)]
        def step(n: int):
            return lambda: engine.target.forward([ForwardItem(tokens[context:context + n], context, table, n)])
        return timed(step(gamma + 1), 5) / timed(step(1), 5)
    finally:
        engine.pool.free(table)


def run_peer(target, tokenizer, questions: list[dict], max_tokens: int, **generate_kwargs) -> Run:
    """transformers' generate, one conversation at a time, greedy, same prompts and limits."""
    run = Run()
    for q in questions:
        history = []
        for turn, text in enumerate(q["turns"]):
            history.append({"role": "user", "content": text})
            ids = torch.tensor([chat_ids(tokenizer, history)])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.eos_token_id, **generate_kwargs)
            elapsed = time.perf_counter() - t0
            new = out[0, ids.shape[1]:].tolist()
            run.tokens[q["category"]] += len(new)
            run.seconds[q["category"]] += elapsed
            run.wall += elapsed
            history.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
    return run


def per_token(run: Run, category: str | None = None) -> float:
    if category is None:
        return (run.pooled("seconds") or run.wall) / max(run.pooled("tokens"), 1)
    return run.seconds[category] / max(run.tokens[category], 1)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def report(runs: dict[str, Run], concurrency: int, categories: list[str]) -> list[str]:
    speculative = [m for m in runs if m != "none"]
    lines = [f"\n## concurrency {concurrency}\n",
             "| category | " + " | ".join(f"{m} accept | {m} tok/fwd | {m} speedup" for m in speculative) + " |",
             "|---|" + "---|---|---|" * len(speculative)]
    plain = runs["none"]
    rows = categories + ["pooled"] if concurrency == 1 else ["pooled"]
    for category in rows:
        cells = [category]
        for method in speculative:
            run = runs[method]
            if category == "pooled":
                accept = ratio(run.pooled("accepted"), run.pooled("proposed"))
                per_forward = ratio(run.pooled("tokens"), run.pooled("forwards"))
                speedup = ratio(plain.wall / max(plain.pooled("tokens"), 1), run.wall / max(run.pooled("tokens"), 1))
            else:
                accept = ratio(run.accepted[category], run.proposed[category])
                per_forward = ratio(run.tokens[category], run.forwards[category])
                speedup = ratio(per_token(plain, category), per_token(run, category))
            cells += [f"{accept:.2f}", f"{per_forward:.2f}", f"{speedup:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    tokens_per_s = {m: run.pooled("tokens") / run.wall for m, run in runs.items()}
    lines.append("\nthroughput (tokens/s): " + ", ".join(f"{m} {v:.1f}" for m, v in tokens_per_s.items()))
    singles = [m for m in runs if not m.startswith("auto")]
    pools = [[m for m in singles if m in ("none", "draft", "ngram")], singles]
    for auto in [m for m in runs if m.startswith("auto")]:
        for pool in pools[:1] if pools[0] == pools[1] else pools:
            best = max(pool, key=lambda m: tokens_per_s[m])
            lines.append(f"{auto} / best of {', '.join(pool)} ({best}): {tokens_per_s[auto] / tokens_per_s[best]:.3f}")
    same = {m: sum(runs[m].answers[k] == plain.answers[k] for k in plain.answers) for m in speculative}
    lines.append("greedy answers identical to plain decoding: "
                 + ", ".join(f"{m} {n}/{len(plain.answers)}" for m, n in same.items())
                 + " (bf16 results depend on the batch shape, so a few may diverge)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2-draft.yaml"), help="a draft-model pair config")
    p.add_argument("--questions", default=str(QUESTIONS))
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--peer-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--rounds", type=int, default=1,
                   help="lock-step rounds per concurrency, each on questions of its own (the next --per-category "
                        "of each category) and fresh engines, pooled; each round's speedups are printed, and "
                        "their spread")
    p.add_argument("--no-peers", dest="peers", action="store_false")
    p.add_argument("--methods", nargs="+", default=None,
                   help="compare only these (none, ngram, draft, eagle, suffix, auto; none always); auto:<p>+<p>... "
                        "is auto over only those proposers, e.g. auto:eagle+ngram+suffix")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    config = load_config(args.config, environ={}).engine
    spec = config.speculative
    questions = load_questions(Path(args.questions), args.per_category)
    categories = sorted({q["category"] for q in questions})
    # the single methods at a static gamma, and auto: the adaptive policy routing each request and
    # step between all of them
    methods = method_configs(spec, spec.gamma)
    for name in [m for m in args.methods or [] if m.startswith("auto:")]:
        try:
            methods[name] = auto_over(methods, name)
        except ValueError as e:
            p.error(f"--methods: {e}")
    if args.methods:
        unknown = set(args.methods) - set(methods)
        if unknown:
            p.error(f"--methods: choose among {', '.join(methods)}; got {', '.join(sorted(unknown))}")
        methods = {m: methods[m] for m in methods if m in {"none", *args.methods}}   # plain decoding: the baseline
    lines = [f"# Spec-Bench dev: {len(questions)} questions ({args.per_category} per category), greedy, "
             f"max_tokens {args.max_tokens}, gamma {spec.gamma}, target {config.model}, draft {spec.draft.model}"]
    results: dict = {"questions": len(questions), "max_tokens": args.max_tokens, "gamma": spec.gamma}
    rounds_sessions = [question_sessions(load_questions(Path(args.questions), args.per_category, offset=r))
                       for r in range(args.rounds)]
    for concurrency in args.concurrency:
        runs: dict[str, Run] = {}
        rounds: list[dict[str, Run]] = []
        for round_index, sessions in enumerate(rounds_sessions):   # fresh engines, questions of its own
            llms = build_engines(config, concurrency, methods, round_index)
            if concurrency == args.concurrency[0] and round_index == 0:
                cost = verification_cost(llms["none"], spec.gamma)
                lines.append(f"dtype {str(llms['none'].engine.dtype).replace('torch.', '')}: verifying "
                             f"{spec.gamma + 1} tokens costs {cost:.2f} decode steps (batch 1)")
                results["verify_cost"] = cost
            rounds.append(run_lockstep(llms, sessions, args.max_tokens))
            for name, run in rounds[-1].items():
                runs.setdefault(name, Run()).merge(run, round_index)
            del llms
        for name, run in runs.items():
            print(f"{name} at concurrency {concurrency}: {run.pooled('tokens')} tokens in {run.wall:.1f} s",
                  file=sys.stderr, flush=True)
        lines += report(runs, concurrency, categories)
        per_round = speedups(rounds)
        lines.append("speedup over plain per round, mean (min-max): "
                     + "; ".join(f"{m} {spread(v)}" for m, v in per_round.items()))
        results[f"c{concurrency}"] = {m: {"tokens": r.pooled("tokens"), "seconds": r.wall,
                                          "proposed": r.pooled("proposed"), "accepted": r.pooled("accepted"),
                                          "target_forwards": r.pooled("forwards"),
                                          "speedup_per_round": per_round.get(m)} for m, r in runs.items()}
        print("\n".join(lines[-2:]), file=sys.stderr, flush=True)
        if concurrency == 1:
            ours = runs
    if args.peers and 1 in args.concurrency:
        lines += peers(config, spec, questions, args, ours, results)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def build_engines(config, concurrency: int, methods: dict, round_index: int) -> dict[str, LLM]:
    """One engine per method, created in an order rotated by the round: two identical engines
    measured up to 2.6% apart at 16 streams by which was created first (placement in memory)."""
    names = list(methods)
    shift = round_index % len(names)
    llms = {name: warm_engine(config, concurrency, methods[name]) for name in names[shift:] + names[:shift]}
    return {name: llms[name] for name in names}


def peers(config, spec, questions, args, ours: dict[str, Run], results: dict) -> list[str]:
    from engine.models.loader import load_hf_config
    from engine.setup import resolve_dtype
    from engine.tokenizer import load_tokenizer
    from train.draft_models import hf_model

    # transformers in the dtype we serve, or where we compute in fp32 over bf16 weights, its fastest
    torch_dtype = resolve_dtype(config.dtype, load_hf_config(config.model), torch.device("cpu"), "none")
    tokenizer = load_tokenizer(config.model)
    target = hf_model(config.model, torch_dtype).eval()
    draft = hf_model(spec.draft.model, torch_dtype).eval()
    draft.generation_config.num_assistant_tokens = spec.gamma
    peer_runs = {
        "transformers plain": run_peer(target, tokenizer, questions, args.max_tokens),
        "transformers assisted (our draft)": run_peer(target, tokenizer, questions, args.max_tokens,
                                                      assistant_model=draft),
        f"transformers prompt lookup ({args.peer_lookup_tokens})": run_peer(
            target, tokenizer, questions, args.max_tokens, prompt_lookup_num_tokens=args.peer_lookup_tokens),
    }
    ours_draft = per_token(ours["draft"])
    lines = ["\n## peers, concurrency 1 (same prompts, greedy, same dtype)\n",
             "| run | tokens/s | speedup over transformers plain | specserve draft is faster by |",
             "|---|---|---|---|"]
    hf_plain = per_token(peer_runs["transformers plain"])
    for name, run in {**{f"specserve {m}": r for m, r in ours.items()}, **peer_runs}.items():
        lines.append(f"| {name} | {1 / per_token(run):.1f} | {ratio(hf_plain, per_token(run)):.2f}x | "
                     f"{ratio(per_token(run), ours_draft):.2f}x |")
        results.setdefault("peers", {})[name] = {"tokens": run.pooled("tokens"), "seconds": run.pooled("seconds")}
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
