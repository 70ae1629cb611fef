"""Speculative decoding: lossless (greedy token-for-token, sampling in distribution),
acceptance counted right, bad configs rejected at start-up."""
import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import make_tiny_checkpoint
from scipy.stats import chisquare

import engine.verify
from engine import SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.spec.rejection import rejection_sample

MAX_TOKENS = 14


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": str(make_tiny_checkpoint(root / "target", arch="qwen2", seed=0)),
        "random_draft": str(make_tiny_checkpoint(root / "draft", arch="llama", seed=7, num_layers=1,
                                                 hidden_size=32, num_heads=2, num_kv_heads=1)),
    }


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    motif = [rng.randrange(256) for _ in range(6)]
    out = [motif * 4 + [rng.randrange(256)], motif * 2, [5], [9, 9, 9, 9, 9, 9]]   # repetitive: n-gram hits
    out += [[rng.randrange(256) for _ in range(n)] for n in (2, 11, 30, 64)]
    return out


def generate(config: EngineConfig, prompts, params):
    engine = Engine(config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    tokens = {str(i): [] for i in range(len(prompts))}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    generate.last_engine = engine
    return [tokens[str(i)] for i in range(len(prompts))], [finals[str(i)] for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(paths, prompts):
    return generate(EngineConfig(model=paths["target"], dtype="float32"), prompts, GREEDY)[0]


def spec_config(paths, kind: str, gamma: int) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": gamma, "ngram_max": 3}
    draft = paths["target"] if kind == "copy_draft" else paths["random_draft"]
    return {"method": "draft", "model": draft, "num_speculative_tokens": gamma}


@pytest.mark.parametrize("kind", ["copy_draft", "random_draft", "ngram"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_speculation_is_lossless(paths, prompts, plain_greedy, kind, gamma):
    config = EngineConfig(model=paths["target"], dtype="float32", speculative=spec_config(paths, kind, gamma))
    tokens, finals = generate(config, prompts, GREEDY)
    assert tokens == plain_greedy
    proposed = sum(f.spec.proposed for f in finals)
    accepted = sum(f.spec.accepted for f in finals)
    assert proposed > 0
    if kind == "copy_draft":
        assert accepted == proposed
    if kind == "random_draft":
        assert accepted / proposed < 0.3


@pytest.mark.parametrize("kind", ["copy_draft", "random_draft", "ngram"])
def test_greedy_speculation_is_lossless_under_kv_pressure(paths, prompts, plain_greedy, kind):
    config = EngineConfig(model=paths["target"], dtype="float32", block_size=4, num_kv_blocks=24,
                          max_num_batched_tokens=24, speculative=spec_config(paths, kind, 4))
    engine_preemptions = []
    original = Engine.step

    def counting_step(self):
        outputs = original(self)
        if self.last_stats is not None:
            engine_preemptions.append(self.last_stats.num_preemptions)
        return outputs

    Engine.step = counting_step
    try:
        tokens, finals = generate(config, prompts, GREEDY)
    finally:
        Engine.step = original
    assert tokens == plain_greedy
    assert sum(engine_preemptions) > 0
    if kind == "copy_draft":   # recomputation after preemption must not count as drafting
        assert all(f.spec.accepted == f.spec.proposed for f in finals)


@pytest.mark.parametrize("gamma", [1, 4])
def test_acceptance_counts_with_copy_draft(paths, prompts, gamma):
    rounds = 3
    params = SamplingParams(max_tokens=1 + rounds * (gamma + 1), temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=paths["target"], dtype="float32",
                          speculative={"method": "draft", "model": paths["target"], "num_speculative_tokens": gamma})
    tokens, finals = generate(config, prompts, params)
    for t, f in zip(tokens, finals):
        assert f.spec.proposed == f.spec.accepted == rounds * gamma
        assert f.spec.target_forwards == rounds
        assert (len(t) - 1) / f.spec.target_forwards == gamma + 1   # the first token comes from prefill
    totals = generate.last_engine.totals
    assert totals.acceptance_rate == 1.0
    assert totals.num_draft_tokens == sum(f.spec.proposed for f in finals)
    assert totals.num_target_forwards == sum(f.spec.target_forwards for f in finals)
    assert totals.accepted_per_position == [rounds * len(prompts)] * gamma


def test_bad_speculative_configs_fail_at_start_up(paths, tmp_path):
    for gamma in (0, 17):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..16"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=gamma)
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpeculativeConfig(method="medusa-ish")
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        SpeculativeConfig(method="draft", model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown speculative config keys: \\['gama'\\]"):
        EngineConfig(model=paths["target"], speculative={"method": "ngram", "gama": 3})
    other_vocab = make_tiny_checkpoint(tmp_path / "v300", arch="llama", vocab_size=300, seed=3)
    with pytest.raises(ValueError, match=r"the tokenizer has 300 tokens but the target has only 272 embedding rows"):
        Engine(EngineConfig(model=paths["target"], speculative={"method": "draft", "model": str(other_vocab)}))
    other_tokens = make_tiny_checkpoint(tmp_path / "renamed", arch="llama", seed=3)
    tokenizer_json = other_tokens / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"<extra_3>"', '"<other_3>"'))
    with pytest.raises(ValueError, match=r"the draft's tokenizer differs from the target's \(token 264: '<other_3>' vs '<extra_3>'"):
        Engine(EngineConfig(model=paths["target"], speculative={"method": "draft", "model": str(other_tokens)}))


def test_draft_with_a_differently_padded_embedding_table(paths, prompts, plain_greedy, tmp_path):
    """Same tokenizer, more embedding rows (Qwen2.5-0.5B vs 7B): accepted, q gives the padding rows no mass,
    and greedy output stays the target's."""
    import shutil

    padded = make_tiny_checkpoint(tmp_path / "padded", arch="llama", vocab_size=300, seed=7, num_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{paths['target']}/{name}", padded / name)
    config = EngineConfig(model=paths["target"], dtype="float32",
                          speculative={"method": "draft", "model": str(padded), "num_speculative_tokens": 3})
    tokens, finals = generate(config, prompts, GREEDY)
    assert tokens == plain_greedy
    assert sum(f.spec.proposed for f in finals) > 0
    sampled, _ = generate(config, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                                          ignore_eos=True))
    assert all(t < 272 for seq in sampled for t in seq)


# ---- sampling: the output distribution is the target's -------------------------------------

VOCAB = 16
NUM_SAMPLES = 20_000


def tiny_vocab_model(path, seed: int, sharpness: float) -> str:
    """A random 16-token Llama whose next-token distributions are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.save_pretrained(path)
    return str(path)


def exact_distribution(path: str, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | prompt) by enumeration, with the request's temperature / top-k warping."""
    from engine.sampler import SamplingTensors, warp_probs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = lambda n: SamplingTensors.from_params([params] * n, "cpu")
    probs = np.zeros((VOCAB,) * 3)
    with torch.no_grad():
        p1 = warp_probs(model(torch.tensor([prompt])).logits[0, -1:], tensors(1))[0]
        for t1 in range(VOCAB):
            ctx = torch.tensor([prompt + [t1, t2] for t2 in range(VOCAB)])
            logits = model(ctx).logits
            p2 = warp_probs(logits[0, -2:-1], tensors(1))[0]
            p3 = warp_probs(logits[:, -1], tensors(VOCAB))
            probs[t1] = (p1[t1] * p2[:, None] * p3).numpy()
    return probs / probs.sum()


def sample_first_three(target: str, draft: str, prompt, params, num: int) -> np.ndarray:
    config = EngineConfig(model=target, dtype="float32", max_num_seqs=1024, max_num_batched_tokens=8192,
                          num_kv_blocks=4096, speculative={"method": "draft", "model": draft,
                                                           "num_speculative_tokens": 3})
    engine = Engine(config)
    counts = np.zeros((VOCAB,) * 3)
    for start in range(0, num, 2000):
        seqs = {}
        for seed in range(start, min(num, start + 2000)):
            engine.add_request(str(seed), prompt, dataclasses.replace(params, seed=seed))
            seqs[str(seed)] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                seqs[out.request_id].extend(out.new_token_ids)
        for tokens in seqs.values():
            counts[tuple(tokens[:3])] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test with cells of expected count < 5 pooled into one."""
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    small = expected < 5
    exp = np.append(expected[~small], expected[small].sum())
    obs = np.append(observed[~small], observed[small].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab16")
    return tiny_vocab_model(root / "target", seed=0, sharpness=25.0), tiny_vocab_model(root / "draft", seed=1,
                                                                                        sharpness=25.0)


# max_tokens 5: the first token comes from prefill, then 3 drafts are verified (positions 1..3 + bonus).
SAMPLED = SamplingParams(max_tokens=5, temperature=0.8, top_k=12, ignore_eos=True)
PROMPT = [0, 3, 7, 2]


def test_speculative_sampling_matches_target_distribution(small_vocab_pair):
    target, draft = small_vocab_pair
    probs = exact_distribution(target, PROMPT, SAMPLED)
    counts = sample_first_three(target, draft, PROMPT, SAMPLED, NUM_SAMPLES)
    assert chi_square_pvalue(counts, probs) > 0.001


def test_chi_square_catches_a_broken_sampler(small_vocab_pair, monkeypatch):
    """The same test must reject a sampler that always accepts the drafts."""
    def always_accept(target_probs, draft_ids, num_drafts, draft_probs, is_greedy, generators):
        out, _ = rejection_sample(target_probs, draft_ids, num_drafts, draft_probs, is_greedy, generators)
        out[:, :draft_ids.shape[1]] = draft_ids
        return out, num_drafts.clone()

    monkeypatch.setattr(engine.verify, "rejection_sample", always_accept)
    target, draft = small_vocab_pair
    probs = exact_distribution(target, PROMPT, SAMPLED)
    counts = sample_first_three(target, draft, PROMPT, SAMPLED, 4000)
    assert chi_square_pvalue(counts, probs) < 0.001
