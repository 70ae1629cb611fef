"""Phi-3 through the engine and the server: greedy generation equal to transformers' generate (with a
sliding window shorter than the sequences, with LongRoPE, and with Phi-4-mini's partial RoPE), speculative decoding lossless with a
draft model, n-gram and suffix drafts, one server round trip. Logit parity and the LongRoPE table
are in test_models.py."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from helpers import make_tiny_checkpoint, run_requests
from test_models import PHI3_LONGROPE

# Phi-4-mini rotates 3/4 of each head (partial_rotary_factor 0.75) with LongRoPE over those dimensions.
PHI4_LONGROPE = {**PHI3_LONGROPE, "short_factor": PHI3_LONGROPE["short_factor"][:6],
                 "long_factor": PHI3_LONGROPE["long_factor"][:6]}
CASES = {"window": dict(sliding_window=8), "longrope": dict(max_position_embeddings=256, rope_parameters=PHI3_LONGROPE),
         "partial": dict(partial_rotary_factor=0.5),
         "partial_longrope": dict(partial_rotary_factor=0.75, max_position_embeddings=256, rope_parameters=PHI4_LONGROPE)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {name: make_tiny_checkpoint(root / name, arch="phi3", seed=5, **kwargs) for name, kwargs in CASES.items()}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(2)
    motif = [rng.randrange(256) for _ in range(5)]
    return [motif * 4, [7], [rng.randrange(256) for _ in range(19)]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_equals_transformers_generate(case, paths, prompts):
    outs = LLM(str(paths[case]), dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=4).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0))
    ref = AutoModelForCausalLM.from_pretrained(paths[case], dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist()


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_greedy_speculation_is_lossless(method, paths, prompts, tmp_path):
    target = str(paths["longrope"])
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft":   # a one-layer random Llama with the same tokenizer: drafts rejected and rolled back
        draft = make_tiny_checkpoint(tmp_path / "draft", arch="llama", seed=3, num_layers=1)
        spec["draft"] = {"model": str(draft)}
    plain = run_requests(Engine(EngineConfig(model=target, dtype="float32")), prompts, GREEDY)[0]
    config = EngineConfig(model=target, dtype="float32", block_size=4, max_num_batched_tokens=32, speculative=spec)
    tokens, finals = run_requests(Engine(config), prompts, GREEDY)
    assert tokens == plain
    assert sum(f.spec.proposed for f in finals) > 0


def test_server_answers_on_phi3(paths):
    """A chat completion over HTTP from an in-process server: the offline engine's greedy text."""
    import httpx

    from conftest import InProcessServer
    from engine.tokenizer import load_tokenizer, render_chat
    from server.api import create_app
    from server.metrics import Metrics

    path = str(paths["window"])
    engine = Engine(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                                 speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}))
    tokenizer = load_tokenizer(path)
    messages = [{"role": "user", "content": "xyzxyzxyz"}]
    body = {"model": "phi3", "messages": messages, "max_tokens": 16, "temperature": 0}
    with InProcessServer(create_app(engine, tokenizer, "phi3", None, Metrics("phi3", engine.method))) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    expected = LLM(path, dtype="float32", device="cpu").generate(
        [render_chat(tokenizer, messages)], SamplingParams(max_tokens=16, temperature=0))[0]
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected.token_ids,
                                                                            skip_special_tokens=True)



def test_partial_rope_on_the_torch_path_and_with_speculation(paths, prompts):
    """Phi-4-mini's shape (3/4 of each head rotated by LongRoPE, the rest passing, served by the
    full-head kernels after the q/k dimensions are reordered at load): transformers' greedy output
    on the padded torch reference too, and n-gram speculation gives plain decoding's output."""
    from engine.attention_backends import TorchBackend

    path = str(paths["partial_longrope"])
    params = SamplingParams(max_tokens=16, temperature=0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu")
    llm.engine.target.attention = TorchBackend(llm.engine.target.block_size, llm.engine.target.device,
                                               group_sequences=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    plain = run_requests(Engine(EngineConfig(model=path, dtype="float32")), prompts, GREEDY)[0]
    tokens, finals = run_requests(Engine(EngineConfig(model=path, dtype="float32", speculative=spec)), prompts, GREEDY)
    assert tokens == plain and sum(f.spec.proposed for f in finals) > 0
