"""The benchmarks' lock-step conversation driver (bench/conversations.py): every session answered
turn by turn with its own answers in the context of the next turn, engines stepped in turn, and the
per-category time adding up to the wall time."""
from __future__ import annotations

import sys

import pytest

from engine import LLM

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "bench"))
from conversations import Conversations, Session, chat_ids, run_lockstep  # noqa: E402

SESSIONS = [
    Session("chat", [{"role": "user", "content": "hello there"}], [[{"role": "user", "content": "and then?"}]]),
    Session("agent", [{"role": "user", "content": "call a tool"}],
            [[{"role": "user", "content": "result: 42"}], [{"role": "user", "content": "done?"}]]),
    Session("chat", [{"role": "user", "content": "one turn only"}]),
]


@pytest.fixture(scope="module")
def llms(tiny_pair):
    target, _ = tiny_pair
    return {"plain": LLM(str(target), dtype="float32", max_num_seqs=2),
            "ngram": LLM(str(target), dtype="float32", max_num_seqs=2,
                         speculative={"method": "ngram", "num_speculative_tokens": 4})}


def test_lockstep_runs_every_turn_with_its_history(llms):
    runs = run_lockstep(llms, SESSIONS, max_tokens=8)
    plain, ngram = runs["plain"], runs["ngram"]
    assert sorted(plain.answers) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert plain.answers == ngram.answers   # fp32 greedy: speculation changes nothing
    assert plain.pooled("tokens") == sum(len(a) for a in plain.answers.values())
    assert plain.pooled("seconds") == pytest.approx(plain.wall) and plain.wall > 0
    assert set(plain.tokens) == {"chat", "agent"}
    assert ngram.pooled("forwards") <= ngram.pooled("tokens")


def test_a_later_turn_sees_the_earlier_answer(llms):
    llm = llms["plain"]
    driver = Conversations(llm, SESSIONS[:1], max_tokens=8)
    submitted = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, ids, params: (submitted.append(ids), add(rid, ids, params))
    try:
        while not driver.done:
            driver.step()
    finally:
        llm.engine.add_request = add
    first = driver.run.answers[(0, 0)]
    history = [{"role": "user", "content": "hello there"},
               {"role": "assistant", "content": llm.tokenizer.decode(first, skip_special_tokens=True)},
               {"role": "user", "content": "and then?"}]
    assert submitted == [chat_ids(llm.tokenizer, history)]


def test_rounds_pool_into_one_run(llms):
    """spec_bench --rounds: each round's totals add up; the answers are the first round's."""
    first = run_lockstep(llms, SESSIONS, max_tokens=8)["plain"]
    second = run_lockstep(llms, SESSIONS, max_tokens=8)["plain"]
    tokens, wall, answers = first.pooled("tokens"), first.wall, dict(first.answers)
    first.merge(second)
    assert first.pooled("tokens") == tokens + second.pooled("tokens")
    assert first.wall == pytest.approx(wall + second.wall)
    assert first.pooled("seconds") == pytest.approx(first.wall)
    assert first.answers == answers


def test_auto_over_a_proposer_subset():
    from types import SimpleNamespace
    from conversations import auto_over, method_configs

    spec = SimpleNamespace(model="draft-dir", head="head-dir")
    methods = method_configs(spec, gamma=4)
    assert methods["auto"]["proposers"] == ["draft", "eagle", "ngram", "suffix"]
    subset = auto_over(methods, "auto:eagle+ngram")
    assert subset["proposers"] == ["eagle", "ngram"] and subset["head"] == "head-dir"
    no_head = method_configs(SimpleNamespace(model="draft-dir", head=None), gamma=4)
    with pytest.raises(ValueError, match="cannot build eagle"):
        auto_over(no_head, "auto:eagle+ngram")
