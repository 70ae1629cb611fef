"""Greedy outputs of one config, one stream, written to a file or compared with one: the check that a
refactor changed no token. It holds only where the engine's numbers repeat from process to process:
on the default config they do not yet (a rerun of one commit agreed on 53 of 74 answers, another
on 74; see docs/benchmarks.md), so a differing answer means something only where a rerun of the base agrees.

    python bench/greedy_outputs.py --write before.json [--config configs/default.yaml]
    python bench/greedy_outputs.py --compare before.json      # exit 1 at the first differing answer

The conversations: the Spec-Bench development questions (--per-category of each category, turn by
turn), the agent sessions and the code edits of bench/workloads.py, --max-tokens each answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (before torch: it sets torch's CPU allocator up)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(__file__))
from conversations import Conversations, warm_engine  # noqa: E402
from workloads import agent_sessions, chat_sessions, code_sessions  # noqa: E402

from server.config import load_config  # noqa: E402


def answers(config_path: str, per_category: int, max_tokens: int) -> dict[str, list[int]]:
    """Every answer's token ids, keyed workload/session/turn."""
    config = load_config(config_path, {}, environ={}).engine
    llm = warm_engine(config, 1, config.speculative)
    outputs = {}
    for workload, sessions in (("chat", chat_sessions(per_category)), ("agent", agent_sessions(6, 4, seed=0)),
                               ("code", code_sessions(8, seed=0))):
        driver = Conversations(llm, sessions, max_tokens)
        while not driver.done:
            driver.step()
        outputs |= {f"{workload}/{s}/{t}": tokens for (s, t), tokens in sorted(driver.run.answers.items())}
    return outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--write", help="write the answers here")
    where.add_argument("--compare", help="compare the answers with this file's")
    args = p.parse_args(argv)
    start = time.perf_counter()
    got = answers(args.config, args.per_category, args.max_tokens)
    print(f"{len(got)} answers, {sum(map(len, got.values()))} tokens in {time.perf_counter() - start:.0f} s")
    if args.write:
        Path(args.write).write_text(json.dumps(got))
        return 0
    expected = json.loads(Path(args.compare).read_text())
    differing = [key for key in expected if got.get(key) != expected[key]] + sorted(set(got) - set(expected))
    for key in differing[:5]:
        a, b = expected.get(key, []), got.get(key, [])
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"{key}: differs at token {at} ({len(a)} expected, {len(b)} now)")
    print(f"{len(expected) - len(differing)} of {len(expected)} answers identical")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
