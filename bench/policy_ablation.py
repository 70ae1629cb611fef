"""Does each of the goodput policy's mechanisms earn its place? The policy with one mechanism switched
off at a time, beside the whole policy and plain decoding, in lock-step (conversations.py), on the
Spec-Bench development questions and the agent workload, at 1 and 16 streams, repeated.

    python bench/policy_ablation.py [--config configs/default.yaml] [--concurrency 1 16] [--repeats 3]
                                    [--variants no-hurdle,no-probes,...] [--group 4] [--json out.json]

Each variant is a subclass of GoodputPolicy defined here (or, for the cost tables' feedback, the
engine's costs with observe() a no-op), put in the engine's place through SpecDecoder.policy: the
production class has no switches. A round runs plain decoding, the whole policy and --group variants
on the same sessions (engines of their own, so every suffix cache starts empty); each repeat takes
sessions of its own (the next Spec-Bench questions, the next agent seed). Results are saved after
every round (--json), and a rerun with the same file skips the rounds it holds.

The table gives, per workload and streams, each variant's tokens/s over the whole policy's in the
same round: mean (min-max) over the repeats. A mechanism whose removal costs less than the spread of
those ratios does not earn its place.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(__file__))
from conversations import chat_ids, run_lockstep, spread  # noqa: E402
from workloads import agent_sessions, chat_sessions  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.spec_decode.estimates import FORGET, POOL_FORGET, AcceptanceRate, DraftRates  # noqa: E402
from engine.spec_decode.policy import GoodputPolicy, StepView  # noqa: E402
from server.config import load_config  # noqa: E402


# ---- the variants: GoodputPolicy less one mechanism -------------------------------------------

class NoHurdle(GoodputPolicy):
    """Plans that promise any gain over plain decoding are taken (HURDLE)."""
    hurdle = 0.0


class NoProbes(GoodputPolicy):
    """Requests planned at k = 0 never probe (EXPLORE, the optimistic bound UPPER_Z, refunds)."""
    def _probes(self, view, drafts, shadow, plain_time, rows):
        return {}


class NoConfidenceStop(GoodputPolicy):
    """Drafts run to the plan's k whatever the draft's own confidence (p_min from the shadow price)."""
    def _p_min(self, shadow, row):
        return 0.0


class OnePricingRound(GoodputPolicy):
    """Drafts priced once, at plain decoding's goodput (no second round at the goodput found)."""
    pricing_rounds = 1


class NoDepthCut(GoodputPolicy):
    """Every request drafts its own best k: no common depth cap priced against the step's exact time."""
    def _best_depth(self, view, choices, sunk):
        if not choices:
            return {}, 0.0
        return self._at_depth(view, choices, sunk, max(c.k for c in choices.values()))


class CatchUpWhole(GoodputPolicy):
    """A draft model's catch-up is charged whole to the step that pays it, not spread over the request."""
    def _catch_up_share(self, c, proposer, tokens):
        return self._catch_up(c, proposer)


class PromptsCounted(GoodputPolicy):
    """The prompt chunks sharing a pass count in the price of its drafts (no sunk share)."""
    def _decode_time(self, view: StepView, plain_time: float) -> float:
        return plain_time


class NoPooling(GoodputPolicy):
    """A request's rates stand alone: no shrinking toward the engine-wide rates (PRIOR_WEIGHT, POOL_FORGET)."""
    def acceptance(self, rid, proposer):
        return self._own(rid, proposer).mean()

    def optimistic(self, rid, proposer):
        rates = self._own(rid, proposer)
        return rates.first.upper(), rates.mean()[1]


class _OneRate:
    """DraftRates' interface over one rate for every draft position."""
    def __init__(self, forget: float = FORGET):
        self.rate = AcceptanceRate(forget)

    first = rest = property(lambda self: self.rate)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.rate.observe(num_drafted, num_accepted)

    def age(self) -> None:
        self.rate.age()

    def mean(self, prior=None, weight: float = 0.0):
        m = self.rate.mean() if prior is None else self.rate.mean(prior[0], weight)
        return m, m


class _RatesVariant(GoodputPolicy):
    """A GoodputPolicy whose rates (the request's and the engine-wide ones) come from make_rates."""
    def make_rates(self, forget: float):
        raise NotImplementedError

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = {m: self.make_rates(POOL_FORGET) for m in self.proposers}

    def _own(self, rid, proposer):
        rates = self.rates.setdefault(rid, {})
        if proposer not in rates:
            rates[proposer] = self.make_rates(FORGET)
        return rates[proposer]


class OneRate(_RatesVariant):
    """One acceptance rate for every draft position (no first / later split)."""
    def make_rates(self, forget):
        return _OneRate(forget)


class _Undetected(AcceptanceRate):
    def _detect(self, judged, accepted):
        pass


class NoChangeDetector(_RatesVariant):
    """Rates follow acceptance by forgetting alone (no CUSUM restart, SHIFT_LLR)."""
    def make_rates(self, forget):
        rates = DraftRates(forget)
        rates.first, rates.rest = _Undetected(forget), _Undetected(forget)
        return rates


class _Unaged(DraftRates):
    def age(self):
        pass


class NoIdleAging(_RatesVariant):
    """An idle request's evidence does not age, so its bound never widens back."""
    def make_rates(self, forget):
        return _Unaged(forget)


POLICY_VARIANTS = {
    "no-hurdle": NoHurdle, "no-probes": NoProbes, "no-confidence-stop": NoConfidenceStop,
    "one-pricing-round": OnePricingRound, "no-depth-cut": NoDepthCut, "catch-up-whole": CatchUpWhole,
    "prompts-counted": PromptsCounted, "no-pooling": NoPooling, "one-rate": OneRate,
    "no-change-detector": NoChangeDetector, "no-idle-aging": NoIdleAging,
}
VARIANTS = [*POLICY_VARIANTS, "no-cost-feedback"]


def engine_for(config, concurrency: int, variant: str | None) -> LLM:
    """An engine on the config's speculative settings (None: plain decoding), the policy swapped for
    the variant's ("full": as shipped), warmed up by one short chat."""
    llm = LLM(config.model, dtype=config.dtype, max_num_seqs=max(concurrency, 1),
              **({"speculative": config.speculative} if variant else {}))
    spec = llm.engine.spec
    if variant in POLICY_VARIANTS:
        spec.policy = POLICY_VARIANTS[variant](spec.policy.proposers, spec.costs, spec.policy.fixed_p_min)
    elif variant == "no-cost-feedback":   # the tables stay as measured at start-up
        spec.costs.observe = lambda timing: None
    llm.generate([chat_ids(llm.tokenizer, [{"role": "user", "content": "Hello!"}])],
                 SamplingParams(max_tokens=8, temperature=0.0))
    return llm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--workloads", default="chat,agent")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--group", type=int, default=4, help="variants per lock-step round (each round also runs "
                                                        "plain decoding and the whole policy)")
    p.add_argument("--chat-per-category", type=int, default=1)
    p.add_argument("--agent-sessions", type=int, default=6)
    p.add_argument("--agent-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="results, saved after every round; a rerun skips the rounds it holds")
    args = p.parse_args(argv)

    config = load_config(args.config, environ={}).engine
    if config.speculative.method != "auto" or not config.speculative.adaptive:
        raise SystemExit(f"{args.config}: the ablation needs the adaptive policy (speculative.method auto)")
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    builders = {"chat": lambda r: chat_sessions(args.chat_per_category, r),
                "agent": lambda r: agent_sessions(args.agent_sessions, args.agent_turns, seed=r)}
    saved = Path(args.json) if args.json else None
    results = json.loads(saved.read_text()) if saved and saved.exists() else {}
    groups = [variants[i:i + args.group] for i in range(0, len(variants), args.group)]
    for workload in args.workloads.split(","):
        for concurrency in args.concurrency:
            for r in range(args.repeats):
                for g, group in enumerate(groups):
                    key = f"{workload}/c{concurrency}/r{r}/g{g}"
                    if key in results:
                        continue
                    names = ["none", "full", *group]
                    llms = {n: engine_for(config, concurrency, None if n == "none" else n) for n in names}
                    runs = run_lockstep(llms, builders[workload](r), args.max_tokens)
                    del llms
                    results[key] = {n: {"rate": run.rate, "tokens": run.pooled("tokens")} for n, run in runs.items()}
                    print(f"{key}: " + ", ".join(f"{n} {v['rate']:.1f} tok/s" for n, v in results[key].items()),
                          file=sys.stderr, flush=True)
                    if saved:
                        saved.write_text(json.dumps(results, indent=2))
    print("\n".join(table(results, args.workloads.split(","), args.concurrency, variants)))
    return 0


def table(results: dict, workloads: list[str], concurrency: list[int], variants: list[str]) -> list[str]:
    """Per variant and cell: its tokens/s over the whole policy's in the same round, mean (min-max);
    the first row: the whole policy over plain decoding."""
    cells = [(w, c) for w in workloads for c in concurrency]
    lines = ["| variant | " + " | ".join(f"{w} c{c}" for w, c in cells) + " |", "|---|" + "---|" * len(cells)]

    def ratios(cell, over, name):
        w, c = cell
        return [round_[name]["rate"] / round_[over]["rate"] for key, round_ in results.items()
                if key.startswith(f"{w}/c{c}/") and name in round_]
    lines.append("| whole policy / plain | " + " | ".join(spread(ratios(cell, "none", "full")) if ratios(cell, "none", "full")
                                                           else "-" for cell in cells) + " |")
    for name in variants:
        lines.append(f"| {name} / whole | " + " | ".join(spread(ratios(cell, "full", name)) if ratios(cell, "full", name)
                                                         else "-" for cell in cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
