"""Three workloads where drafting strategies part ways, on the default target: an agent loop, code
edits, and chat. For each, at one request at a time and at 8 in flight, the acceptance, tokens per
target forward and speedup over plain decoding of the draft model, n-gram, suffix and auto,
measured side by side in one run. Greedy decoding.

    python bench/workloads.py [--config configs/default.yaml] [--workloads agent,code,chat]
                              [--concurrency 1 8] [--gamma 8] [--json results.json]
                              [--methods none,ngram,ngram+tree,suffix,suffix+tree --tree-nodes 16]

A method named `<method>+tree` drafts trees of up to --tree-nodes nodes (speculative.tree_nodes); the
summary then also gives its tokens/s over the same method's chains, run by run.

The workloads are built here, deterministically (--seed), from what every install has:
- agent: multi-turn tool-calling sessions. A system prompt lists tools as JSON schemas; each turn
  the model answers with a tool call, which stays in the context, followed by the tool's JSON
  result; the next turn asks for the next call. Two worked turns open every session, so the
  answers have the repeated structure agent traffic has.
- agent-cold (not in the default set): the same without worked turns. A session's first call has
  no example in its own context, only in other sessions' outputs: what a cache shared across
  requests is for.
- code: "apply this change" prompts over functions taken from Python source shipped in installed
  packages (stdlib, httpx, pydantic, ...): rename an identifier, add a docstring, or add type
  hints; the answer rewrites the whole function, so it copies most of it.
- chat: the Spec-Bench development questions (bench/data/spec_bench/question_dev.jsonl), the
  first --chat-per-category of each category, turn by turn.

Sessions run turn by turn, each session's next turn submitted as soon as its answer is in, with
`concurrency` requests in flight. The methods run in lock-step, one engine step of each in turn
(conversations.py). Each method has its own engine, so the suffix proposer's shared cache starts
empty and fills only with this run's earlier outputs.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversations import (QUESTIONS, Run, Session, load_questions, method_configs,  # noqa: E402
                           question_sessions, run_lockstep, speedups, spread, warm_engine)
from spec_bench import ratio  # noqa: E402

from server.config import load_config  # noqa: E402


# ---- agent loop ------------------------------------------------------------------------------

TOOLS = [
    {"name": "search_flights", "description": "Find flights between two cities on a date.",
     "parameters": {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"}},
    {"name": "get_weather", "description": "Weather forecast for a city on a date.",
     "parameters": {"city": "string", "date": "YYYY-MM-DD"}},
    {"name": "book_hotel", "description": "Book a hotel room in a city.",
     "parameters": {"city": "string", "check_in": "YYYY-MM-DD", "nights": "integer"}},
    {"name": "convert_currency", "description": "Convert an amount between currencies.",
     "parameters": {"amount": "number", "from": "string", "to": "string"}},
]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo", "Dublin", "Warsaw",
          "Athens", "Zurich"]


def _call(rng: random.Random, tool: dict) -> dict:
    args = {}
    for name, kind in tool["parameters"].items():
        if kind == "YYYY-MM-DD":
            args[name] = f"2026-0{rng.randint(1, 9)}-{rng.randint(10, 28)}"
        elif kind == "integer":
            args[name] = rng.randint(1, 7)
        elif kind == "number":
            args[name] = rng.randint(50, 900)
        elif name in ("from", "to"):
            args[name] = rng.choice(["EUR", "USD", "GBP", "CHF", "NOK"])
        else:
            args[name] = rng.choice(CITIES)
    return {"tool": tool["name"], "arguments": args}


def _result(rng: random.Random, call: dict) -> dict:
    name, args = call["tool"], call["arguments"]
    if name == "search_flights":
        return {"status": "ok", "flights": [{"flight": f"{rng.choice('ABLUK')}{rng.randint(100, 999)}",
                                             "departure": f"{rng.randint(6, 21):02d}:{rng.choice(['05', '30', '45'])}",
                                             "price_eur": rng.randint(60, 400)} for _ in range(2)]}
    if name == "get_weather":
        return {"status": "ok", "city": args["city"], "forecast": rng.choice(["sunny", "cloudy", "rain"]),
                "high_c": rng.randint(5, 30), "low_c": rng.randint(-5, 15)}
    if name == "book_hotel":
        return {"status": "ok", "confirmation": f"H{rng.randint(10000, 99999)}", "city": args["city"],
                "nights": args["nights"], "total_eur": rng.randint(80, 1500)}
    return {"status": "ok", "amount": round(args["amount"] * rng.uniform(0.8, 1.2), 2), "currency": args["to"]}


def agent_sessions(num_sessions: int, turns: int, seed: int, worked_turns: int = 2) -> list[Session]:
    rng = random.Random(seed)
    system = ("You are a travel agent that acts only through tools. Reply to every message with exactly one "
              "tool call as a JSON object {\"tool\": <name>, \"arguments\": {...}} and nothing else. Tools:\n"
              + "\n".join(json.dumps(t) for t in TOOLS))
    sessions = []
    for _ in range(num_sessions):
        cities = rng.sample(CITIES, 3)
        task = (f"Plan a trip from {cities[0]} to {cities[1]} and then {cities[2]}: check the weather, find "
                f"flights, book hotels and convert the budget to EUR. One tool call per message.")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        for _ in range(worked_turns):   # worked turns: the structure the answers repeat
            call = _call(rng, rng.choice(TOOLS))
            messages += [{"role": "assistant", "content": json.dumps(call)},
                         {"role": "user", "content": "Tool result: " + json.dumps(_result(rng, call))
                          + "\nNext tool call."}]
        followups = [[{"role": "user", "content": "Tool result: " + json.dumps(_result(rng, _call(rng, rng.choice(TOOLS))))
                       + "\nNext tool call."}] for _ in range(turns - 1)]
        sessions.append(Session("agent", messages, followups))
    return sessions


# ---- code edits ------------------------------------------------------------------------------

CODE_MODULES = ["json.decoder", "json.encoder", "textwrap", "shlex", "string", "fractions", "difflib",
                "httpx._urlparse", "httpx._models", "pydantic.networks", "yaml.reader", "click.formatting"]


def _functions(module: str, min_lines: int, max_lines: int) -> list[tuple[str, str]]:
    """(name, source) of the top-level and method functions of an installed module, by size."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    source = Path(spec.origin).read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
            segment = ast.get_source_segment(source, node)
            if segment and "\t" not in segment:
                out.append((node.name, _dedent(segment, node.col_offset)))
    return out


def _dedent(segment: str, indent: int) -> str:
    lines = segment.splitlines()
    return "\n".join([lines[0]] + [line[indent:] if line[:indent].isspace() else line for line in lines[1:]])


def code_sessions(num_prompts: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    pool = [(m, name, src) for m in CODE_MODULES for name, src in _functions(m, 12, 40)]
    rng.shuffle(pool)
    sessions = []
    for module, name, src in pool[:num_prompts]:
        args = [a for a in ast.walk(ast.parse(src)) if isinstance(a, ast.arg) and a.arg not in ("self", "cls")]
        change = rng.choice(["rename", "docstring", "hints"] if args else ["docstring"])
        if change == "rename":
            arg = rng.choice(args).arg
            request = f"Rename the parameter `{arg}` to `{arg}_value` everywhere in this function."
        elif change == "docstring":
            request = "Add a one-line docstring to this function. Change nothing else."
        else:
            request = "Add type hints to the parameters of this function. Change nothing else."
        prompt = (f"Apply this change to the function `{name}` from `{module}` and reply with the complete "
                  f"updated function only.\nChange: {request}\n\n```python\n{src}\n```")
        sessions.append(Session("code", [{"role": "user", "content": prompt}]))
    return sessions


# ---- chat ------------------------------------------------------------------------------------

def chat_sessions(per_category: int, offset: int = 0) -> list[Session]:
    return question_sessions(load_questions(QUESTIONS, per_category, offset))


# ---- running ---------------------------------------------------------------------------------

def table(name: str, concurrency: int, runs: dict[str, Run]) -> tuple[list[str], dict]:
    plain = runs["none"]
    plain_rate = plain.pooled("tokens") / plain.wall
    lines = [f"\n### {name}, concurrency {concurrency}\n",
             "| method | acceptance | tokens / forward | tokens/s | speedup over plain |", "|---|---|---|---|---|",
             f"| none | - | 1.00 | {plain_rate:.1f} | 1.00x |"]
    figures = {"none": {"tokens_per_s": plain_rate}}
    for method, run in runs.items():
        if method == "none":
            continue
        rate = run.pooled("tokens") / run.wall
        accept = ratio(run.pooled("accepted"), run.pooled("proposed"))
        per_forward = ratio(run.pooled("tokens"), run.pooled("forwards"))
        lines.append(f"| {method} | {accept:.2f} | {per_forward:.2f} | {rate:.1f} | {rate / plain_rate:.2f}x |")
        figures[method] = {"acceptance": accept, "tokens_per_forward": per_forward, "tokens_per_s": rate,
                           "speedup": rate / plain_rate}
    same = {m: sum(r.answers[k] == plain.answers[k] for k in plain.answers) for m, r in runs.items() if m != "none"}
    lines.append("\ngreedy answers identical to plain decoding: "
                 + ", ".join(f"{m} {n}/{len(plain.answers)}" for m, n in same.items())
                 + " (bf16 numerics depend on the batch shape, so some diverge after a near tie)")
    return lines, figures


def trees_over_chains(rounds: list[dict[str, Run]]) -> dict[str, str]:
    """Each +tree method's tokens/s over its chain twin's, run by run (both in lock-step)."""
    return {m: spread([r[m].rate / r[m.removesuffix("+tree")].rate for r in rounds])
            for m in rounds[0] if m.endswith("+tree") and m.removesuffix("+tree") in rounds[0]}


def versus_best_static(per_run: dict[str, list[float]]) -> str:
    """auto's tokens/s over the best single method's, run by run (every method but auto is static)."""
    statics = [m for m in per_run if not m.startswith("auto")]
    if "auto" not in per_run or not statics:
        return "-"
    return spread([auto / max(per_run[m][r] for m in statics) for r, auto in enumerate(per_run["auto"])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--workloads", default="agent,code,chat")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--gamma", type=int, default=8, help="the most drafts per step (static methods draft this many)")
    p.add_argument("--agent-sessions", type=int, default=6)
    p.add_argument("--agent-turns", type=int, default=4)
    p.add_argument("--code-prompts", type=int, default=8)
    p.add_argument("--chat-per-category", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per workload and concurrency, each on sessions of its own (seed + r; chat: the "
                        "next questions), fresh engines each; the speedups' spread is printed")
    p.add_argument("--methods", default="none,draft,ngram,suffix,auto",
                   help="comma-separated; method@gamma runs a method at its own gamma (e.g. ngram@8); "
                        "method+tree drafts trees (n-gram, suffix, auto)")
    p.add_argument("--tree-nodes", type=int, default=16, help="speculative.tree_nodes of the +tree methods")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    config = load_config(args.config, environ={}).engine
    builders = {"agent": lambda r: agent_sessions(args.agent_sessions, args.agent_turns, args.seed + r),
                "code": lambda r: code_sessions(args.code_prompts, args.seed + r),
                "agent-cold": lambda r: agent_sessions(args.agent_sessions, args.agent_turns, args.seed + 1 + r, 0),
                "chat": lambda r: chat_sessions(args.chat_per_category, r)}
    wanted = {}
    for name in args.methods.split(","):   # "ngram@8": n-gram at gamma 8, beside the others at --gamma
        base, tree = name.removesuffix("+tree"), name.endswith("+tree")
        method, _, gamma = base.partition("@")
        wanted[name] = method_configs(config.speculative, int(gamma) if gamma else args.gamma)[method]
        if tree:
            wanted[name] = {**wanted[name], "tree_nodes": args.tree_nodes}
    lines = [f"# Workloads on {config.model} (draft {config.speculative.draft.model}), greedy, max_tokens "
             f"{args.max_tokens}, gamma {args.gamma}"]
    results: dict = {}
    tree_lines: list[str] = []
    summary = ["\n## Speedup over plain decoding per run, mean (min-max)\n",
               "| workload | streams | " + " | ".join(m for m in wanted if m != "none") + " | auto / best static |",
               "|---|---|" + "---|" * len(wanted)]
    for workload in args.workloads.split(","):
        for concurrency in args.concurrency:
            runs, rounds = {}, []
            for r in range(args.repeats):
                sessions = builders[workload](r)
                llms = {m: warm_engine(config, concurrency, speculative) for m, speculative in wanted.items()}
                rounds.append(run_lockstep(llms, sessions, args.max_tokens))
                del llms
                for method, run in rounds[-1].items():
                    runs.setdefault(method, Run()).merge(run, r)
                    print(f"{workload} c{concurrency} run {r} {method}: {run.pooled('tokens')} tokens in "
                          f"{run.wall:.1f} s", file=sys.stderr, flush=True)
            block, figures = table(f"{workload} ({len(sessions)} sessions, {sum(s.num_turns for s in sessions)} "
                                   f"requests, x {args.repeats} runs)", concurrency, runs)
            per_run = speedups(rounds)
            summary.append(f"| {workload} | {concurrency} | " + " | ".join(spread(v) for v in per_run.values())
                           + f" | {versus_best_static(per_run)} |")
            trees = trees_over_chains(rounds)
            if trees:
                tree_lines.append(f"| {workload} | {concurrency} | "
                                  + " | ".join(f"{m}: {v}" for m, v in trees.items()) + " |")
                figures["trees_over_chains_per_run"] = trees
            figures["speedup_per_run"] = per_run
            lines += block
            results[f"{workload}/c{concurrency}"] = figures
            print("\n".join(block + summary[-1:]), flush=True)
    lines += summary
    if tree_lines:
        lines += ["\n## Trees over chains (tokens/s, same method, per run), mean (min-max)\n",
                  "| workload | streams | ratios |", "|---|---|---|", *tree_lines]
    if "draft" in wanted:
        draft = {key: f["draft"]["acceptance"] for key, f in results.items() if "draft" in f}
        lines.append("\ndraft model acceptance by workload: "
                     + ", ".join(f"{key} {value:.2f}" for key, value in draft.items()))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
