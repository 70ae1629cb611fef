"""Multi-turn conversations driven through engines in lock-step, for the benchmarks that compare
methods on real prompts (spec_bench.py, workloads.py).

Each method has its own engine. Run one after the other, their figures swing by 10-15% on a shared
machine (other tenants, frequency changes) and a 5% difference means nothing; run in lock-step, one
engine step of each in turn, each step timed, whatever slows the machine for a while slows them all
alike.

A conversation is a Session: its opening messages, then after each answer but the last the messages
that follow it (a tool result, the next user turn). Each answer joins its session's context, and
the session's next turn is submitted as soon as it is done; the engine's max_num_seqs sets how many
requests are in flight.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# Spec-Bench's development questions (bench/data/spec_bench: Apache 2.0, see its README and LICENSE)
QUESTIONS = ROOT / "bench" / "data" / "spec_bench" / "question_dev.jsonl"


@dataclass
class Session:
    category: str
    messages: list[dict]
    followups: list[list[dict]] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.followups) + 1


def load_questions(path: Path, per_category: int, offset: int = 0) -> list[dict]:
    """per_category questions of each category, by question id, after its first offset * per_category
    (offset r gives round r questions of its own: a server never sees a question twice)."""
    rows = sorted((json.loads(line) for line in open(path) if line.strip()), key=lambda r: r["question_id"])
    seen: dict[str, int] = defaultdict(int)
    selected = []
    for row in rows:
        index = seen[row["category"]]
        seen[row["category"]] += 1
        if offset * per_category <= index < (offset + 1) * per_category:
            selected.append(row)
    if not selected:
        raise ValueError(f"{path}: no questions left at offset {offset} x {per_category} per category")
    return selected


def question_sessions(questions: list[dict]) -> list[Session]:
    """Spec-Bench questions as sessions: the model's own answer stays in the context of the next turn."""
    return [Session(q["category"], [{"role": "user", "content": q["turns"][0]}],
                    [[{"role": "user", "content": turn}] for turn in q["turns"][1:]]) for q in questions]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class Run:
    """Totals of one method, per category."""

    def __init__(self):
        self.tokens = defaultdict(int)
        self.seconds = defaultdict(float)
        self.proposed = defaultdict(int)
        self.accepted = defaultdict(int)
        self.forwards = defaultdict(int)
        self.answers: dict[tuple[int, int], list[int]] = {}   # (session, turn) -> output tokens
        self.wall = 0.0

    def add(self, category: str, token_ids: list[int], spec) -> None:
        self.tokens[category] += len(token_ids)
        self.proposed[category] += spec.proposed
        self.accepted[category] += spec.accepted
        self.forwards[category] += spec.target_forwards

    def pooled(self, field: str) -> float:
        return sum(getattr(self, field).values())

    @property
    def rate(self) -> float:
        """Tokens per second of wall time."""
        return self.pooled("tokens") / self.wall if self.wall else 0.0

    def merge(self, other: "Run", round_index: int) -> None:
        """Add another round (its answers keyed by the round too: each round has sessions of its own)."""
        for field in ("tokens", "seconds", "proposed", "accepted", "forwards"):
            for category, value in getattr(other, field).items():
                getattr(self, field)[category] += value
        for key, answer in other.answers.items():
            self.answers[(round_index, *key)] = answer
        self.wall += other.wall


def speedups(rounds: list[dict[str, "Run"]]) -> dict[str, list[float]]:
    """Per method, its tokens/s over plain decoding's ("none") in each round run in lock-step."""
    return {m: [r[m].rate / r["none"].rate for r in rounds] for m in rounds[0] if m != "none"}


def spread(values: list[float]) -> str:
    """mean (min-max over n runs): the figure and how far repeats of it moved."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.3f} (1 run)"
    return f"{mean:.3f} ({min(values):.3f}-{max(values):.3f}, {len(values)} runs)"


def method_configs(spec, gamma: int) -> dict[str, dict | None]:
    """`speculative` settings per method compared: none, each single proposer at a static gamma (the
    draft model and the EAGLE head when the config names them), and auto (the policy routing
    between all of them); spec is the config's speculative section."""
    static = {"adaptive": False, "num_speculative_tokens": gamma}
    methods = {"none": None, "ngram": {"method": "ngram", **static}}
    if spec.draft.model:
        methods["draft"] = {"method": "draft", "draft": {"model": spec.draft.model}, **static}
    if spec.draft.head:
        methods["eagle"] = {"method": "eagle", "draft": {"head": spec.draft.head}, **static}
    methods["suffix"] = {"method": "suffix", **static}
    proposers = [m for m in ("draft", "eagle", "ngram", "suffix") if m in methods]
    methods["auto"] = {"method": "auto", "draft": {"model": spec.draft.model, "head": spec.draft.head},
                       "proposers": proposers, "num_speculative_tokens": gamma}
    return methods


def auto_over(methods: dict[str, dict | None], name: str) -> dict:
    """The settings of a method named `auto:<proposer>+<proposer>...` (say auto:eagle+ngram+suffix):
    auto routing between only those proposers, to compare proposer sets in one run; methods comes
    from method_configs. A proposer the config cannot build is a ValueError that names it."""
    proposers = name.removeprefix("auto:").split("+")
    unknown = [p for p in proposers if p not in methods["auto"]["proposers"]]
    if unknown or not name.startswith("auto:"):
        raise ValueError(f"{name}: auto:<proposers joined by +> over {'+'.join(methods['auto']['proposers'])}; "
                         f"this config cannot build {', '.join(unknown) or 'it'}")
    return {**methods["auto"], "proposers": proposers}


def warm_engine(config, concurrency: int, speculative: dict | None) -> LLM:
    """The engine for one method (speculative None: plain decoding), warmed up by one short chat."""
    llm = LLM(config.model, dtype=config.dtype, max_num_seqs=max(concurrency, 1),
              **({"speculative": speculative} if speculative else {}))
    llm.generate([chat_ids(llm.tokenizer, [{"role": "user", "content": "Hello!"}])],
                 SamplingParams(max_tokens=8, temperature=0.0))
    return llm


class Conversations:
    """One engine working through sessions, advanced one engine step at a time. Each step's time
    goes to the wall clock and, split evenly, to the categories of the requests it ran."""

    def __init__(self, llm: LLM, sessions: list[Session], max_tokens: int):
        self.llm, self.sessions = llm, sessions
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.histories = [list(s.messages) for s in sessions]
        self.turns = [0] * len(sessions)
        self.in_flight: dict[str, tuple[int, list[int]]] = {}   # request id -> (session, tokens so far)
        self.run = Run()
        for i in range(len(sessions)):
            self._submit(i)

    @property
    def done(self) -> bool:
        return not self.in_flight

    def step(self) -> None:
        start = time.perf_counter()
        categories = [self.sessions[i].category for i, _ in self.in_flight.values()]
        for delta in self.llm.engine.step():
            i, tokens = self.in_flight[delta.request_id]
            tokens.extend(delta.new_token_ids)
            if delta.finished:
                if delta.finish_reason == "error":
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                del self.in_flight[delta.request_id]
                self._answer(i, tokens, delta.spec)
        elapsed = time.perf_counter() - start
        self.run.wall += elapsed
        for category in categories:
            self.run.seconds[category] += elapsed / len(categories)

    def _submit(self, i: int) -> None:
        request_id = f"s{i}-t{self.turns[i]}"
        self.llm.engine.add_request(request_id, chat_ids(self.llm.tokenizer, self.histories[i]), self.params)
        self.in_flight[request_id] = (i, [])

    def _answer(self, i: int, tokens: list[int], spec) -> None:
        session, turn = self.sessions[i], self.turns[i]
        self.run.add(session.category, tokens, spec)
        self.run.answers[(i, turn)] = tokens
        self.histories[i].append({"role": "assistant",
                                  "content": self.llm.tokenizer.decode(tokens, skip_special_tokens=True)})
        if turn < len(session.followups):
            self.histories[i] += session.followups[turn]
            self.turns[i] += 1
            self._submit(i)


def run_lockstep(llms: dict[str, LLM], sessions: list[Session], max_tokens: int) -> dict[str, Run]:
    """Every engine through the same sessions, one step of each in turn."""
    drivers = {name: Conversations(llm, sessions, max_tokens) for name, llm in llms.items()}
    step_in_turn(drivers.values())
    return {name: d.run for name, d in drivers.items()}


def step_in_turn(drivers) -> None:
    """Step each driver (step(), done) in turn until all are done, the order rotating by one each
    round (identical engines stepped in a fixed order measured 2-4% apart by their place)."""
    order = list(drivers)
    while not all(d.done for d in order):
        for driver in order:
            if not driver.done:
                driver.step()
        order = order[1:] + order[:1]
