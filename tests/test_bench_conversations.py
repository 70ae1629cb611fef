"""The benchmarks' lock-step conversation driver (bench/conversations.py): every session answered
turn by turn with its own answers in the context of the next turn, engines stepped in turn, and the
per-category time adding up to the wall time."""
from __future__ import annotations

import sys

import pytest

from engine import LLM

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "bench"))
from conversations import (QUESTIONS, Conversations, Run, Session, chat_ids, load_questions,  # noqa: E402
                           run_lockstep, speedups, spread)

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
    """spec_bench --rounds: each round's totals add up, and each round keeps its own answers."""
    first = run_lockstep(llms, SESSIONS, max_tokens=8)
    second = run_lockstep(llms, SESSIONS[:1], max_tokens=8)
    pooled = Run()
    pooled.merge(first["plain"], 0)
    pooled.merge(second["plain"], 1)
    assert pooled.pooled("tokens") == first["plain"].pooled("tokens") + second["plain"].pooled("tokens")
    assert pooled.wall == pytest.approx(first["plain"].wall + second["plain"].wall)
    assert pooled.pooled("seconds") == pytest.approx(pooled.wall)
    assert pooled.answers[(1, 0, 0)] == second["plain"].answers[(0, 0)] and len(pooled.answers) == 6 + 2
    ratios = speedups([{"none": first["plain"], "ngram": first["ngram"]},
                       {"none": second["plain"], "ngram": second["ngram"]}])
    assert ratios["ngram"] == pytest.approx([first["ngram"].rate / first["plain"].rate,
                                             second["ngram"].rate / second["plain"].rate])


def test_each_round_asks_questions_of_its_own():
    rounds = [load_questions(QUESTIONS, 2, offset=r) for r in range(2)]
    ids = [{q["question_id"] for q in questions} for questions in rounds]
    assert not ids[0] & ids[1]
    categories = {q["category"] for q in rounds[0]}
    assert all(sum(q["category"] == c for q in rounds[1]) == 2 for c in categories)
    with pytest.raises(ValueError, match="no questions left"):
        load_questions(QUESTIONS, 40, offset=1000)


def test_spread_names_the_mean_and_the_range():
    assert spread([1.0, 1.2, 1.1]) == "1.100 (1.000-1.200, 3 runs)"
    assert spread([0.98]) == "0.980 (1 run)"


def test_auto_over_a_proposer_subset():
    from conversations import auto_over, method_configs
    from engine.config import SpeculativeConfig

    spec = SpeculativeConfig(draft={"model": "draft-dir", "head": "head-dir"})
    methods = method_configs(spec, gamma=4)
    assert methods["auto"]["proposers"] == ["draft", "eagle", "ngram", "suffix"]
    subset = auto_over(methods, "auto:eagle+ngram")
    assert subset["proposers"] == ["eagle", "ngram"] and subset["draft"]["head"] == "head-dir"
    no_head = method_configs(SpeculativeConfig(draft={"model": "draft-dir"}), gamma=4)
    with pytest.raises(ValueError, match="cannot build eagle"):
        auto_over(no_head, "auto:eagle+ngram")
