"""Structured outputs (JSON schema) on the default target: speculation against plain decoding, both
constrained by the same grammar, side by side in one run and in lock-step (one engine step of each
in turn, each step timed: see conversations.py for why).

    HF_HUB_OFFLINE=1 python bench/structured_bench.py [--config configs/default.yaml] [--concurrency 1 16]
        [--rounds 2] [--requests-per-stream 4 | --requests N] [--max-tokens 192] [--seed 0] [--json out.json]

The traffic is what API clients send with `response_format: json_schema`: "extract this record from
the text as JSON". bench/data/structured/ holds the schemas (a contact card, an invoice with line
items, a calendar event, a product review, a support-ticket triage, a weather report, a recipe, a
flight booking: nested objects, arrays of objects, enums, patterns, bounded numbers, strings with
maxLength), the word lists and the text templates; the source texts are generated from them with a
seeded RNG, so every request of every round and concurrency has a prompt of its own (prefix and
suffix caches would replay a prompt seen before). Each prompt gives the instruction, the schema
(compact JSON) and the text, rendered with the model's chat template. Greedy decoding.

The two engines:
- spec: the config's speculation as served (configs/default.yaml: auto over the distilled draft,
  n-gram and suffix), plus the implicit grammar proposer, which drafts the tokens the grammar forces
  (keys, quotes, the rest of an enum value) for free;
- plain: no speculation (method none, k 0). It masks with the same grammar.

For each concurrency (requests in flight; the engine's max_num_seqs) and each round, both engines
are built fresh (in an order rotated by the round), warmed up on a short structured request, given
the same requests at once and stepped in lock-step until all are done. Printed per concurrency:
tokens/s of each (output tokens / timed step seconds; submitting is not timed, but the grammars
compile on the engine's worker threads meanwhile and steps that only wait for them count), spec/plain
per round and pooled with the rounds' min-max, acceptance per proposer (grammar, draft, ngram,
suffix), output tokens per decode pass ((tokens - first tokens) / target passes after the prefill:
1.00 for plain decoding), the grammar mask's share of a step (sum of mask_time_s / sum of draft +
verify time, from the engine's StepStats) and its cost per masked row, how many outputs parse and
validate against their schema (jsonschema) and end by the grammar finishing rather than max_tokens,
and how many greedy outputs are identical between the engines. The issue's targets are checked last:
spec >= 1.5x plain at one stream, and the mask under 10% of a plain step at 16 streams.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversations import step_in_turn, warm_engine  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.structured import StructuredOutput  # noqa: E402
from engine.tokenizer import load_tokenizer, render_chat  # noqa: E402

DATA = ROOT / "bench" / "data" / "structured"
SPEC, PLAIN = "spec", "plain"
PROPOSER_ORDER = ("grammar", "draft", "eagle", "ngram", "suffix")
TARGET_SPEEDUP_ONE_STREAM = 1.5   # the issue: spec >= 1.5x plain at one stream
TARGET_MASK_SHARE_16 = 0.10       # the issue: the mask under 10% of a plain step at 16 streams
MAX_INVALID_SAMPLES = 8           # invalid outputs written to --json per engine and concurrency, to read
# Warm-up: builds each engine's llguidance tokenizer (~1 s on first use) and runs the constrained
# path once, outside the timed steps; a schema and text of no request.
WARMUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}
WARMUP_MESSAGES = [{"role": "user", "content": "Answer as JSON: is water wet?"}]


# ---- the workload: schemas and source texts -------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One schema and how to write texts that hold a record of it."""
    name: str
    schema: dict
    instruction: str
    templates: tuple[str, ...]
    lists: dict        # placeholder -> {"template", "min", "max", "joiner"}: a list of sub-items
    choices: dict      # placeholder -> its own word list

    @property
    def structured(self) -> StructuredOutput:
        return StructuredOutput.json_schema(self.schema)


def load_kinds(data_dir: Path = DATA) -> list[Kind]:
    """Every schema in data_dir/schemas with its texts file (data_dir/texts, same name), by name."""
    kinds = []
    for schema_path in sorted((data_dir / "schemas").glob("*.json")):
        texts = json.loads((data_dir / "texts" / schema_path.name).read_text())
        kinds.append(Kind(schema_path.stem, json.loads(schema_path.read_text()), texts["instruction"],
                          tuple(texts["templates"]), texts.get("lists", {}), texts.get("choices", {})))
    return kinds


def load_words(data_dir: Path = DATA) -> dict:
    return json.loads((data_dir / "words.json").read_text())


PLACEHOLDER = re.compile(r"\{([a-z_0-9]+)(?:\.([a-z0-9]+))?\}")


class SourceText:
    """Fills a template's placeholders: {name} or {name.tag}. A placeholder has one value wherever it
    recurs in a text; another tag draws another value (distinct where the word list allows). A name
    is a list of the kind (sub-items), a word list of the kind or of words.json, a field of a record
    list of words.json (city / country / airport share one record per tag), or generated: int_A_B
    (mA: -A), price_A_B, digits_N, code_N, date, time, phone, email (from the same tag's name and
    company domain)."""

    def __init__(self, rng: random.Random, words: dict, kind: Kind, parent: "SourceText | None" = None):
        self.rng, self.words, self.kind = rng, words, kind
        self.values: dict[tuple[str, str], str] = {}
        # sub-items share the text's records (an invoice's currency) and draw words distinct from it
        self.records = parent.records if parent else {}
        self.used = parent.used if parent else {}

    def render(self, template: str) -> str:
        return PLACEHOLDER.sub(lambda m: self.value(m[1], m[2] or ""), template)

    def value(self, name: str, tag: str = "") -> str:
        if (name, tag) not in self.values:
            self.values[(name, tag)] = self._draw(name, tag)
        return self.values[(name, tag)]

    def _draw(self, name: str, tag: str) -> str:
        if name in self.kind.lists:
            return self._sub_items(self.kind.lists[name])
        pool = self.kind.choices.get(name) or self.words.get(name)
        if isinstance(pool, list) and pool and isinstance(pool[0], str):
            return self._distinct(name, pool)
        for list_name, records in self.words.items():
            if isinstance(records, list) and records and isinstance(records[0], dict) and name in records[0]:
                return self._record(list_name, tag)[name]
        return self._generated(name, tag)

    def _distinct(self, name: str, pool: list[str]) -> str:
        used = self.used.setdefault(name, set())
        fresh = [w for w in pool if w not in used] or pool
        choice = self.rng.choice(fresh)
        used.add(choice)
        return choice

    def _record(self, list_name: str, tag: str) -> dict:
        if (list_name, tag) not in self.records:
            taken = [id(r) for (n, _), r in self.records.items() if n == list_name]
            pool = [r for r in self.words[list_name] if id(r) not in taken] or self.words[list_name]
            self.records[(list_name, tag)] = self.rng.choice(pool)
        return self.records[(list_name, tag)]

    def _sub_items(self, spec: dict) -> str:
        count = self.rng.randint(spec["min"], spec["max"])
        return spec["joiner"].join(SourceText(self.rng, self.words, self.kind, self).render(spec["template"])
                                   for _ in range(count))

    def _generated(self, name: str, tag: str) -> str:
        rng = self.rng
        generator, *args = name.split("_")
        if generator == "int":
            low, high = (-int(a[1:]) if a.startswith("m") else int(a) for a in args)
            return str(rng.randint(low, high))
        if generator == "price":
            return f"{rng.uniform(int(args[0]), int(args[1])):.2f}"
        if generator == "digits":
            return "".join(rng.choice("0123456789") for _ in range(int(args[0])))
        if generator == "code":
            return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(int(args[0])))
        if name == "date":
            return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if name == "time":
            return f"{rng.randint(6, 20):02d}:{rng.choice(['00', '15', '30', '45'])}"
        if name == "phone":
            return f"+{rng.randint(1, 49)} {rng.randint(20, 99)} {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"
        if name == "email":
            first, last = self.value("first_name", tag).lower(), self.value("last_name", tag).lower()
            return f"{first}.{last}@{self.value('domain', tag)}"
        raise KeyError(f"{self.kind.name}: no word list, record field or generator for placeholder {{{name}}}")


@dataclass(frozen=True)
class StructuredRequest:
    index: int       # unique over the whole run: its request id in every engine
    kind: Kind
    text: str

    @property
    def messages(self) -> list[dict]:
        schema = json.dumps(self.kind.schema, separators=(",", ":"))
        return [{"role": "user", "content": f"{self.kind.instruction} Reply with the JSON object only, following "
                                            f"this JSON schema:\n{schema}\n\nText:\n{self.text}"}]


def source_text(kind: Kind, words: dict, seed: int, index: int, seen: set[str]) -> str:
    """The text of request `index`: a template of its kind filled from an RNG seeded by (seed, index),
    redrawn in the rare case it repeats an earlier text."""
    for attempt in range(100):
        rng = random.Random(f"{seed}:{index}:{attempt}")
        text = SourceText(rng, words, kind).render(rng.choice(kind.templates))
        if text not in seen:
            seen.add(text)
            return text
    raise RuntimeError(f"{kind.name}: 100 draws in a row repeated earlier texts; add words or templates")


def requests_per_round(concurrency: int, per_stream: int, fixed: int | None, num_kinds: int) -> int:
    """--requests as given; else per_stream per stream rounded up to a multiple of the schema count,
    so that every round has the same mix of schemas."""
    if fixed:
        return fixed
    return math.ceil(per_stream * concurrency / num_kinds) * num_kinds


def plan_requests(kinds: list[Kind], words: dict, concurrencies: list[int], rounds: int, round_size,
                  seed: int = 0) -> dict[tuple[int, int], list[StructuredRequest]]:
    """(concurrency, round) -> its requests, the schemas in turn; round_size(concurrency) requests
    each, every text distinct from every other of the run."""
    seen: set[str] = set()
    plan, index = {}, 0
    for concurrency in concurrencies:
        for round_index in range(rounds):
            batch = []
            for j in range(round_size(concurrency)):
                kind = kinds[j % len(kinds)]
                batch.append(StructuredRequest(index, kind, source_text(kind, words, seed, index, seen)))
                index += 1
            plan[(concurrency, round_index)] = batch
    return plan


# ---- measuring ------------------------------------------------------------------------------

@dataclass
class Tally:
    """What one engine did over one round (or, merged, over every round of a concurrency)."""
    seconds: float = 0.0            # timed engine steps
    steps: int = 0                  # steps that ran a pass
    idle_s: float = 0.0             # of `seconds`, steps that ran none: only grammars compiling
    compile_s: float = 0.0          # grammar compiles (on the engine's worker threads, off its loop)
    draft_s: float = 0.0
    verify_s: float = 0.0
    mask_s: float = 0.0
    masked_rows: int = 0
    mask_reported: bool = False     # the engine's StepStats has mask_time_s
    proposers: dict[str, list[int]] = field(default_factory=dict)   # proposer -> [proposed, accepted]
    outputs: dict[int, list[int]] = field(default_factory=dict)     # request index -> output tokens
    finish_reasons: dict[int, str] = field(default_factory=dict)
    target_passes: int = 0          # decode / verify passes that emitted tokens (SpecStats.target_forwards)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs.values()))

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add_step(self, stats) -> None:
        self.steps += 1
        self.draft_s += stats.draft_time_s
        self.verify_s += stats.verify_time_s
        self.mask_reported |= hasattr(stats, "mask_time_s")
        self.mask_s += getattr(stats, "mask_time_s", 0.0)
        self.masked_rows += getattr(stats, "num_masked_rows", 0)
        self.compile_s += sum(getattr(stats, "grammar_compile_s", ()))
        for proposer, proposed, accepted in stats.drafts_by_proposer:
            counts = self.proposers.setdefault(proposer, [0, 0])
            counts[0] += proposed
            counts[1] += accepted

    def merge(self, other: "Tally") -> None:
        for name in ("seconds", "steps", "idle_s", "compile_s", "draft_s", "verify_s", "mask_s", "masked_rows",
                     "target_passes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.mask_reported |= other.mask_reported
        for proposer, (proposed, accepted) in other.proposers.items():
            counts = self.proposers.setdefault(proposer, [0, 0])
            counts[0] += proposed
            counts[1] += accepted
        self.outputs.update(other.outputs)
        self.finish_reasons.update(other.finish_reasons)


class StructuredDriver:
    """One engine working through a round's requests, all submitted at once (max_num_seqs keeps
    `concurrency` in flight), advanced one timed engine step at a time. Submitting is not timed; the
    engine compiles each request's grammar on its worker threads meanwhile, and a step with nothing
    ready to run waits for them: that time is counted (it is the engine as served) and reported."""

    def __init__(self, llm: LLM, requests: list[StructuredRequest], prompts: dict[int, list[int]], max_tokens: int):
        self.engine = llm.engine
        self.tally = Tally()
        self.in_flight: dict[str, tuple[int, list[int]]] = {}
        for request in requests:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=request.kind.structured)
            request_id = f"r{request.index}"
            self.engine.add_request(request_id, prompts[request.index], params)
            self.in_flight[request_id] = (request.index, [])

    @property
    def done(self) -> bool:
        return not self.in_flight

    def step(self) -> None:
        steps_before = self.engine.num_steps
        start = time.perf_counter()
        deltas = self.engine.step()
        elapsed = time.perf_counter() - start
        self.tally.seconds += elapsed
        if self.engine.num_steps > steps_before:   # else last_stats is an earlier step's
            self.tally.add_step(self.engine.last_stats)
        else:   # nothing schedulable: the step waited for grammars compiling (counted: as served)
            self.tally.idle_s += elapsed
        for delta in deltas:
            index, tokens = self.in_flight[delta.request_id]
            tokens.extend(delta.new_token_ids)
            if delta.finished:
                if delta.finish_reason == "error":
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                del self.in_flight[delta.request_id]
                self.tally.outputs[index] = tokens
                self.tally.finish_reasons[index] = delta.finish_reason
                self.tally.target_passes += delta.spec.target_forwards


def run_lockstep(llms: dict[str, LLM], requests: list[StructuredRequest], prompts: dict[int, list[int]],
                 max_tokens: int) -> dict[str, Tally]:
    """Both engines through the same requests, one step of each in turn (conversations.step_in_turn)."""
    drivers = {name: StructuredDriver(llm, requests, prompts, max_tokens) for name, llm in llms.items()}
    step_in_turn(drivers.values())
    return {name: d.tally for name, d in drivers.items()}


def build_engines(config, concurrency: int, round_index: int) -> dict[str, LLM]:
    """The spec and plain engines, created in an order rotated by the round (creation order moved
    identical engines' speed by a few percent: placement in memory), each warmed up."""
    settings = {SPEC: config.speculative, PLAIN: None}
    names = [SPEC, PLAIN][round_index % 2:] + [SPEC, PLAIN][:round_index % 2]
    llms = {name: warm_engine(config, concurrency, settings[name]) for name in names}
    warmup = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput.json_schema(WARMUP_SCHEMA))
    for llm in llms.values():
        llm.generate([render_chat(llm.tokenizer, WARMUP_MESSAGES)], warmup)
    return {SPEC: llms[SPEC], PLAIN: llms[PLAIN]}


# ---- figures --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ratio:
    """spec/plain tokens per second: over the pooled rounds, and per round with its spread."""
    pooled: float
    per_round: tuple[float, ...]

    @property
    def low(self) -> float:
        return min(self.per_round)

    @property
    def high(self) -> float:
        return max(self.per_round)

    def __str__(self) -> str:
        rounds = ", ".join(f"{r:.2f}x" for r in self.per_round)
        return (f"{self.pooled:.2f}x pooled; per round {rounds} (min-max {self.low:.2f}-{self.high:.2f}, "
                f"{len(self.per_round)} round{'s' * (len(self.per_round) > 1)})")


def speed_ratio(spec_rounds: list[tuple[int, float]], plain_rounds: list[tuple[int, float]]) -> Ratio:
    """From each round's (tokens, seconds) of each engine: the pooled ratio (all tokens over all
    seconds, each engine) and every round's own."""
    def rate(pairs):
        seconds = sum(s for _, s in pairs)
        return sum(t for t, _ in pairs) / seconds if seconds else float("nan")
    per_round = tuple(rate([s]) / rate([p]) for s, p in zip(spec_rounds, plain_rounds, strict=True))
    return Ratio(rate(spec_rounds) / rate(plain_rounds), per_round)


def safe_div(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def mask_share(tally: Tally) -> float | None:
    """Seconds computing grammar masks over draft + verify seconds (StepStats' own definition); None
    when the engine reports none."""
    if not tally.mask_reported or not tally.masked_rows:
        return None
    return safe_div(tally.mask_s, tally.draft_s + tally.verify_s)


def validity(tally: Tally, requests: list[StructuredRequest], tokenizer) -> tuple[int, int, list[dict]]:
    """(outputs that parse as JSON and validate against their schema, outputs that ended by the grammar
    finishing rather than by max_tokens, the invalid ones: index, schema, finish reason, text, why)."""
    import jsonschema

    invalid = []
    for request in requests:
        text = tokenizer.decode(tally.outputs[request.index], skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), request.kind.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            invalid.append({"index": request.index, "schema": request.kind.name, "text": text,
                            "finish_reason": tally.finish_reasons[request.index],
                            "why": str(exc).splitlines()[0]})
    ended = sum(tally.finish_reasons[r.index] == "stop" for r in requests)
    return len(requests) - len(invalid), ended, invalid


def mismatches(spec: Tally, plain: Tally, requests: list[StructuredRequest]) -> list[str]:
    return [f"#{r.index} ({r.kind.name})" for r in requests if spec.outputs[r.index] != plain.outputs[r.index]]


def proposer_line(tally: Tally) -> str:
    names = sorted(tally.proposers, key=lambda p: PROPOSER_ORDER.index(p) if p in PROPOSER_ORDER else 99)
    cells = [f"{p} {a}/{n} ({safe_div(a, n):.2f})" for p in names for n, a in [tally.proposers[p]]]
    return ", ".join(cells) or "no drafts"


def engine_row(name: str, tally: Tally, requests: list[StructuredRequest], tokenizer) -> tuple[str, dict]:
    valid, ended, invalid = validity(tally, requests, tokenizer)
    share = mask_share(tally)
    per_pass = safe_div(tally.tokens - len(requests), tally.target_passes)
    per_row_ms = safe_div(tally.mask_s * 1e3, tally.masked_rows)
    share_text = "n/a" if share is None else f"{share:.1%} ({per_row_ms:.3f} ms/row)"
    row = (f"| {name} | {tally.tokens} | {tally.seconds:.1f} | {tally.rate:.1f} | {per_pass:.2f} | "
           f"{valid}/{len(requests)} | {ended}/{len(requests)} | {share_text} |")
    figures = {"tokens": tally.tokens, "seconds": tally.seconds, "tokens_per_s": tally.rate, "steps": tally.steps,
               "idle_s": tally.idle_s, "grammar_compile_s": tally.compile_s,
               "tokens_per_decode_pass": per_pass, "valid": valid, "ended_by_grammar": ended,
               "draft_s": tally.draft_s, "verify_s": tally.verify_s, "mask_s": tally.mask_s,
               "masked_rows": tally.masked_rows, "mask_share": share,
               # the masks are timed inside the draft time; their share of the whole timed step too
               "mask_share_of_step_wall": safe_div(tally.mask_s, tally.seconds),
               "proposers": {p: {"proposed": n, "accepted": a} for p, (n, a) in tally.proposers.items()},
               "invalid_outputs": invalid[:MAX_INVALID_SAMPLES]}
    return row, figures


def report(concurrency: int, rounds: list[dict[str, Tally]], requests: list[StructuredRequest],
           tokenizer, spec_label: str) -> tuple[list[str], dict]:
    pooled = {name: Tally() for name in (SPEC, PLAIN)}
    for tallies in rounds:
        for name, tally in tallies.items():
            pooled[name].merge(tally)
    ratio = speed_ratio(*[[(t[name].tokens, t[name].seconds) for t in rounds] for name in (SPEC, PLAIN)])
    lines = [f"\n## {concurrency} stream{'s' * (concurrency > 1)}: {len(requests) // len(rounds)} requests per round "
             f"x {len(rounds)} round{'s' * (len(rounds) > 1)}\n",
             "| engine | tokens | step s | tok/s | tokens / decode pass | valid JSON | ended by grammar "
             "| mask share of draft+verify |", "|---|---|---|---|---|---|---|---|"]
    figures: dict = {"requests": len(requests)}
    for name, label in ((SPEC, spec_label), (PLAIN, "plain (none)")):
        row, figures[name] = engine_row(label, pooled[name], requests, tokenizer)
        lines.append(row)
    different = mismatches(pooled[SPEC], pooled[PLAIN], requests)
    lines += [f"\nspec / plain tok/s: {ratio}"] + notes(pooled, requests, different)
    figures.update(ratio_pooled=ratio.pooled, ratio_per_round=list(ratio.per_round), ratio_min=ratio.low,
                   ratio_max=ratio.high, identical=len(requests) - len(different), differ=different)
    return lines, figures


def notes(pooled: dict[str, Tally], requests: list[StructuredRequest], different: list[str]) -> list[str]:
    """The lines under a concurrency's table: drafts, identical outputs, grammar compiles, mask."""
    lines = [f"spec drafts accepted/proposed: {proposer_line(pooled[SPEC])}",
             f"greedy outputs identical spec vs plain: {len(requests) - len(different)}/{len(requests)}"
             + (f"; differ: {', '.join(different[:12])}{' ...' if len(different) > 12 else ''}" if different else ""),
             "grammar compiles (worker threads) / steps idle waiting for them: " + "; ".join(
                 f"{name} {pooled[name].compile_s:.2f} s / {pooled[name].idle_s:.2f} s" for name in (SPEC, PLAIN))]
    if mask_share(pooled[PLAIN]) is None:
        lines.append("grammar mask share: not measured (the engine's StepStats reports no mask_time_s / masked "
                     "rows: counted as 0)")
    return lines


def targets(results: dict) -> list[str]:
    """The issue's two targets, where this run measured them."""
    lines = ["\n## the issue's targets\n"]
    one = results.get("c1")
    if one:
        verdict = "met" if one["ratio_pooled"] >= TARGET_SPEEDUP_ONE_STREAM else "NOT met"
        lines.append(f"- spec >= {TARGET_SPEEDUP_ONE_STREAM}x plain at 1 stream: {verdict} "
                     f"({one['ratio_pooled']:.2f}x pooled, rounds {one['ratio_min']:.2f}-{one['ratio_max']:.2f})")
    sixteen = results.get("c16")
    if sixteen:
        share = sixteen[PLAIN]["mask_share"]
        if share is None:
            lines.append("- mask < 10% of a plain step at 16 streams: not measured (no mask time in StepStats)")
        else:
            verdict = "met" if share < TARGET_MASK_SHARE_16 else "NOT met"
            lines.append(f"- mask < {TARGET_MASK_SHARE_16:.0%} of a plain step at 16 streams: {verdict} ({share:.1%})")
    return lines if len(lines) > 1 else []


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        import platform
        return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="requests in flight")
    p.add_argument("--rounds", type=int, default=2, help="lock-step rounds per concurrency, fresh engines and "
                   "prompts of their own each; the per-round ratios' min-max is printed")
    p.add_argument("--requests-per-stream", type=int, default=4,
                   help="requests per round = this x concurrency, rounded up to a multiple of the schema count")
    p.add_argument("--requests", type=int, default=None, help="requests per round, whatever the concurrency")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=0, help="the source texts' RNG")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    from server.config import load_config

    config = load_config(args.config, environ={}).engine
    spec = config.speculative
    kinds = load_kinds()
    concurrencies = list(dict.fromkeys(args.concurrency))
    plan = plan_requests(kinds, load_words(), concurrencies, args.rounds, lambda c: requests_per_round(
        c, args.requests_per_stream, args.requests, len(kinds)), args.seed)
    tokenizer = load_tokenizer(config.model)
    prompts = {r.index: render_chat(tokenizer, r.messages) for batch in plan.values() for r in batch}
    for kind in kinds:   # compiled once per process, for both engines alike: not in any timed step
        kind.structured.grammar()
    spec_label = f"spec ({spec.method}: {'+'.join(spec.proposers or ())} + grammar)"
    lines = [f"# Structured outputs (JSON schema) on {config.model}: {spec_label} vs plain decoding, greedy, "
             f"max_tokens {args.max_tokens}, gamma {spec.gamma}, draft {spec.draft.model}",
             f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}",
             f"{len(kinds)} schemas ({', '.join(k.name for k in kinds)}); {len(prompts)} distinct prompts, "
             f"{min(map(len, prompts.values()))}-{max(map(len, prompts.values()))} tokens"]
    results: dict = {"cpu": cpu_name(), "max_tokens": args.max_tokens, "rounds": args.rounds, "schemas": len(kinds)}
    for concurrency in concurrencies:
        rounds = []
        for round_index in range(args.rounds):
            llms = build_engines(config, concurrency, round_index)
            rounds.append(run_lockstep(llms, plan[(concurrency, round_index)], prompts, args.max_tokens))
            del llms
            gc.collect()
            progress = ", ".join(f"{n} {t.tokens} tokens in {t.seconds:.1f} s" for n, t in rounds[-1].items())
            print(f"c{concurrency} round {round_index}: {progress}", file=sys.stderr, flush=True)
        requests = [r for i in range(args.rounds) for r in plan[(concurrency, i)]]
        block, results[f"c{concurrency}"] = report(concurrency, rounds, requests, tokenizer, spec_label)
        lines += block
        print("\n".join(block), file=sys.stderr, flush=True)
    lines += targets(results)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
