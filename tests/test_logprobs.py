"""Logprob VALUES against transformers (fp32, tiny random checkpoints), not just token ids.

What the engine promises (engine/sampler.py compute_logprobs, engine/verify.py): every logprob it
returns, prompt or output, chosen token or top-n, is log_softmax of the target's RAW logits at that
position: before penalties, temperature, top-k, top-p and min-p (vLLM's default "raw_logprobs"
mode). So a sampled token's logprob is what the model gave it, not the probability it was drawn
with, and a token outside the sampler's top-k still has a finite logprob. The reference here is
`torch.log_softmax(model(prompt + output).logits.float(), -1)` from transformers, row i scoring
token i + 1; the prompt's first token has no logprob.

Covered: prompt logprobs whole and in chunked prefill (beside a decoding request), with speculation,
and with a cached prefix (the scheduler recomputes the prompt of a request that wants prompt logprobs
rather than reuse cached blocks, which have no logits); output logprobs for greedy and sampled
decoding, plain and with draft-model and n-gram speculation, so that tokens from accepted drafts,
recovered tokens (after a rejection) and bonus tokens are all checked; and the HTTP server's
/v1/completions echo + logprobs, whose top_logprobs are keyed by token strings.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from conftest import InProcessServer
from helpers import make_noisy_copy, make_tiny_checkpoint

TOL = 1e-4
MODEL = "tiny"
ERRORS: list[float] = []   # every |ours - transformers'| compared; `pytest -s` prints the largest


@pytest.fixture(scope="module", autouse=True)
def report_max_error():
    yield
    if ERRORS:
        print(f"\ntest_logprobs: {len(ERRORS)} logprob comparisons, max abs error {max(ERRORS):.3g}")


# ---- checkpoints, reference, engine runs ---------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("logprobs")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=0)
    return target, make_noisy_copy(target, root / "draft", noise=0.1)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """prompt + output token ids -> [len, V] fp32 logprobs from transformers."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(token_ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), -1)
    return logprobs


def speculative(method: str, checkpoints) -> dict | None:
    if method == "none":
        return None
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    return {**spec, "draft": {"model": str(checkpoints[1])}} if method == "draft" else spec


def make_llm(checkpoints, method: str = "none", **engine_options):
    from engine import LLM
    return LLM(str(checkpoints[0]), dtype="float32", device="cpu", speculative=speculative(method, checkpoints),
               **engine_options)


def record_steps(engine) -> list[dict]:
    """Wraps engine.step: per step, tokens fed, draft tokens verified and new tokens per request."""
    steps, step = [], engine.step

    def recording_step():
        before = engine.last_stats
        outputs = step()
        if engine.last_stats is not before:   # a step that ran (an idle one leaves last_stats alone)
            steps.append({"batched": engine.last_stats.num_batched_tokens, "drafts": engine.last_stats.num_draft_tokens,
                          "new": {o.request_id: len(o.new_token_ids) for o in outputs}})
        return outputs
    engine.step = recording_step
    return steps


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(32, 127, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- comparison ------------------------------------------------------------------------------------

def check_entry(entry, token_id: int, row: torch.Tensor, num_top: int) -> None:
    """One TokenLogprob against the reference row that scores its position."""
    assert entry.token_id == token_id
    errors = [abs(entry.logprob - row[token_id].item())]
    assert len(entry.top) == num_top
    best = row.topk(num_top).values.tolist()
    for (top_id, top_lp), want in zip(entry.top, best):
        # by value, best first (robust to exact ties), and each id's own logprob is what it claims
        errors += [abs(top_lp - want), abs(top_lp - row[top_id].item())]
    ERRORS.extend(errors)
    assert max(errors) < TOL, f"token {token_id}: max abs logprob error {max(errors):.3g}"


def check_prompt_logprobs(out, reference, num_top: int) -> None:
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    rows = reference(prompt)
    for j in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[j], prompt[j], rows[j - 1], num_top)


def check_output_logprobs(out, reference, num_top: int) -> None:
    n = len(out.prompt_token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    rows = reference(out.prompt_token_ids + out.token_ids)
    for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_entry(entry, token, rows[n + k - 1], num_top)


# ---- prompt logprobs ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["whole", "chunked", "chunked_draft"])
def test_prompt_logprobs(checkpoints, reference, case):
    from engine import SamplingParams

    chunked = case != "whole"
    llm = make_llm(checkpoints, "draft" if case == "chunked_draft" else "none",
                   max_num_batched_tokens=8 if chunked else 2048)
    steps = record_steps(llm.engine)
    prompts = [prompt_of(2, 5), prompt_of(1, 37)]   # the short one first: it decodes beside the long one's chunks
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=5, logprobs=2)]
    short, long = llm.generate(prompts, params)
    check_prompt_logprobs(long, reference, 5)
    assert short.prompt_logprobs is None
    for out in (long, short):
        check_output_logprobs(out, reference, 2)
    first_token_step = next(i for i, s in enumerate(steps) if s["new"].get(long.request_id))
    if chunked:   # the 37-token prompt took 5+ passes of <= 8 tokens, the short request decoding meanwhile
        assert first_token_step >= 4 and all(s["batched"] <= 8 for s in steps)
        assert any(s["new"].get(short.request_id) for s in steps[:first_token_step])
    else:
        assert first_token_step == 0


def test_prompt_logprobs_with_a_cached_prefix(checkpoints, reference):
    """A request that wants prompt logprobs recomputes its whole prompt (cached blocks hold KV, not
    logits), so every position has its logprob; one that does not reuses the cached prefix."""
    from engine import SamplingParams

    llm = make_llm(checkpoints, block_size=4)
    steps = record_steps(llm.engine)
    prefix = prompt_of(3, 24)
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prefix + prompt_of(4, 6)], plain)   # fills the prefix cache
    steps.clear()
    scored = llm.generate([prefix + prompt_of(5, 7)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                     prompt_logprobs=3))[0]
    assert steps[0]["batched"] == 31   # the whole prompt was fed, cached prefix or not
    check_prompt_logprobs(scored, reference, 3)
    steps.clear()
    llm.generate([prefix + prompt_of(6, 7)], plain)
    assert steps[0]["batched"] == 31 - 24   # without prompt logprobs the 24 cached tokens are skipped


# ---- output logprobs ---------------------------------------------------------------------------

SAMPLED = dict(temperature=0.7, top_k=20, top_p=0.9, seed=3, frequency_penalty=0.5)


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_output_logprobs(checkpoints, reference, method):
    """Greedy and sampled (with a penalty, which must not show in the logprobs either)."""
    from engine import SamplingParams

    llm = make_llm(checkpoints, method)
    steps = record_steps(llm.engine)
    prompt = list(b"The quick brown fox jumps over the lazy dog. The quick brown fox")
    for settings in (dict(temperature=0), SAMPLED):
        out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5, **settings))[0]
        check_output_logprobs(out, reference, 5)
        if settings is SAMPLED:   # raw logprobs: the sampled token need not be the model's best
            assert any(entry.top[0][0] != entry.token_id for entry in out.logprobs)
    if method != "none":   # single request: a step's drafts and new tokens are all its own
        verified = [(s["drafts"], sum(s["new"].values())) for s in steps if s["drafts"]]
        assert any(new > 1 for _, new in verified), "no accepted draft token was checked"
        assert any(new == drafts + 1 for drafts, new in verified), "no bonus token was checked"
        assert any(new <= drafts for drafts, new in verified), "no recovered token (after a rejection) was checked"


# ---- the HTTP server ---------------------------------------------------------------------------

def test_completions_echo_logprobs_over_http(checkpoints, reference):
    """/v1/completions, echo + logprobs=3, greedy: every value equals transformers' over prompt +
    completion, for a prompt fed whole and one chunked over several passes (budget 16 tokens).

    The prompt goes as token ids, so the ids are exact. top_logprobs is keyed by token text, and the
    tiny byte-level tokens >= 0x80 all decode to "\\ufffd": the keys must be the texts of transformers'
    top-3 ids plus the chosen one; a key several of those ids share must hold one of their values,
    every other key its own. (Chat's list form has no such collisions, but no echo or prompt scoring.)"""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from engine.tokenizer import TokenStrings, load_tokenizer

    engine = Engine(EngineConfig(model=str(checkpoints[0]), dtype="float32", device="cpu",
                                 max_num_batched_tokens=16))
    steps = record_steps(engine)
    tokenizer = load_tokenizer(str(checkpoints[0]))
    token_str = TokenStrings(tokenizer)
    with InProcessServer(create_app(engine, tokenizer, MODEL)) as server:
        for prompt in (prompt_of(7, 9), prompt_of(8, 40)):
            steps.clear()
            response = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            lp = response.json()["choices"][0]["logprobs"]
            assert len(steps) == (1 if len(prompt) <= 16 else 3) + 3   # prefill passes, then 3 decodes
            # the completion is transformers' greedy continuation
            tokens = list(prompt)
            for _ in range(4):
                tokens.append(int(reference(tokens)[-1].argmax()))
            rows = reference(tokens)
            assert lp["tokens"] == [token_str(t) for t in tokens]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for i in range(1, len(tokens)):
                row = rows[i - 1]
                got = lp["token_logprobs"][i]
                ERRORS.append(abs(got - row[tokens[i]].item()))
                assert got == pytest.approx(row[tokens[i]].item(), abs=TOL)
                expected_ids = set(row.topk(3).indices.tolist()) | {tokens[i]}
                by_text: dict[str, list[int]] = {}
                for t in expected_ids:
                    by_text.setdefault(token_str(t), []).append(t)
                top = lp["top_logprobs"][i]
                assert set(top) == set(by_text)
                for text, ids in by_text.items():
                    err = min(abs(top[text] - row[t].item()) for t in ids)
                    ERRORS.append(err)
                    assert err < TOL, f"position {i}, {text!r}: {top[text]} vs {[row[t].item() for t in ids]}"
