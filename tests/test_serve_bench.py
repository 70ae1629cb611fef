"""bench/serve_bench.py's pooling of rounds (the servers themselves are benchmarked, not tested, here)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from serve_bench import Result  # noqa: E402


def test_rounds_pool_tokens_time_and_latencies():
    first, second = Result(100, 2.0, [0.1], [0.01, 0.02]), Result(300, 2.0, [0.3], [0.03])
    pooled = Result().merge(first).merge(second)
    assert (pooled.tokens, pooled.seconds) == (400, 4.0)
    assert pooled.tok_s == 100.0   # tokens over total time, not the mean of the rounds' rates (125)
    assert pooled.ttft == [0.1, 0.3] and pooled.itl == [0.01, 0.02, 0.03]
    assert first.tokens == 100 and first.itl == [0.01, 0.02]   # merging leaves the rounds as they were


def test_each_round_gets_its_own_prompts():
    from serve_bench import level_prompts
    questions = [f"q{i}" for i in range(10)]
    assert level_prompts(questions, 1, 3) == ["q0", "q1", "q2"]
    assert level_prompts(questions, 1, 3, start=3) == ["q3", "q4", "q5"]
    assert level_prompts(questions, 1, 3, start=9) == ["q9", "q0", "q1"]   # past the end: they repeat
    assert level_prompts(questions, 4, 0) == [f"q{i}" for i in range(8)]   # default: max(8, 2 x concurrency)


def test_prompts_take_the_categories_in_turn():
    import json
    from serve_bench import QUESTIONS, questions
    rows = [json.loads(line) for line in open(QUESTIONS) if line.strip()]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    first_turn = {r["turns"][0]: r["category"] for r in rows}
    prompts = questions()
    assert sorted(prompts) == sorted(first_turn)   # every question once
    assert [first_turn[p] for p in prompts[:len(categories)]] == categories


def test_variants_name_flags_or_a_proposer_set():
    import json
    from serve_bench import main, variant
    flags, env = variant("spec:eagle+ngram")
    assert flags[0] == "--speculative-config" and env == {}
    assert json.loads(flags[1]) == {"method": "auto", "proposers": ["eagle", "ngram"]}
    assert variant("ours") == (["--speculative-config", json.dumps({"method": "none"})], {})
    with pytest.raises(SystemExit):
        main(["--variants", "ours,nonsense", "--peers", ""])
