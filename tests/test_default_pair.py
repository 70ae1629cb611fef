"""The committed default pair (models/): loads in the engine, its draft agrees with the target on
held-out code, and speculative greedy output equals plain greedy output (fp32)."""
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_runner import ForwardItem

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT = ROOT / "models" / "default-target", ROOT / "models" / "default-draft"
GAMMA = 4
WINDOW = 256

pytestmark = pytest.mark.skipif(not ((TARGET / "config.json").exists() and (DRAFT / "config.json").exists()),
                                reason="the default pair is not in models/ (specserve train-default makes it)")


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=str(TARGET), dtype="float32", speculative={
        "method": "draft", "model": str(DRAFT), "num_speculative_tokens": GAMMA}))


@pytest.fixture(scope="module")
def held_out_windows():
    """Token windows from the standard-library files the pair was not trained on."""
    from transformers import AutoTokenizer

    from train.common import split_files, stdlib_files

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    _, held_out = split_files(stdlib_files())
    windows = []
    for path in held_out[:40]:
        ids = tokenizer.encode(path.read_text(errors="replace"))
        windows += [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW, 4 * WINDOW)][:2]
    return windows[:24]


def argmax_all_positions(engine: Engine, runner, tokens: list[int]) -> torch.Tensor:
    table = []
    assert engine.pool.allocate(table, len(tokens))
    try:
        return runner.forward([ForwardItem(tokens, 0, table, len(tokens))]).argmax(dim=-1)
    finally:
        engine.pool.free(table)


def test_draft_agrees_with_target_on_held_out_code(engine, held_out_windows):
    """Greedy acceptance: the fraction of positions where the draft's argmax is the target's."""
    agree = total = 0
    for tokens in held_out_windows:
        target = argmax_all_positions(engine, engine.target, tokens)
        draft = argmax_all_positions(engine, engine.proposer.runner, tokens)
        agree += int((target == draft).sum())
        total += len(tokens)
    acceptance = agree / total
    print(f"held-out greedy acceptance {acceptance:.3f} over {total} positions")
    assert acceptance >= 0.6


def test_speculative_greedy_equals_plain_greedy(engine, held_out_windows):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(TARGET), dtype="float32"))
    prompts = [w[:48] for w in held_out_windows[:6]]
    outputs = {}
    for name, eng in (("plain", plain), ("spec", engine)):
        for i, prompt in enumerate(prompts):
            eng.add_request(f"{name}-{i}", prompt, params)
        tokens = {f"{name}-{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id].extend(out.new_token_ids)
        outputs[name] = [tokens[f"{name}-{i}"] for i in range(len(prompts))]
    assert outputs["spec"] == outputs["plain"]
    assert engine.totals.num_accepted_tokens > 0
