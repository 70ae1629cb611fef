"""Speculative decoding: lossless (greedy token-for-token, sampling in distribution),
acceptance counted right, bad configs rejected at start-up."""
import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import make_tiny_checkpoint, pooled_chisquare, recover_from_p, run_requests

import engine.verify
from engine import SamplingParams
from engine.config import MAX_SPEC_TOKENS, EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.spec_decode.rejection import rejection_sample

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
    generate.last_engine = engine
    return run_requests(engine, prompts, params)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(paths, prompts):
    return generate(EngineConfig(model=paths["target"], dtype="float32"), prompts, GREEDY)[0]


def spec_config(paths, kind: str, gamma: int) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": gamma, "adaptive": False, "ngram": {"max": 3}}
    draft = paths["target"] if kind == "copy_draft" else paths["random_draft"]
    return {"method": "draft", "draft": {"model": draft}, "num_speculative_tokens": gamma, "adaptive": False}


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
    for t, f in zip(tokens, finals):   # the recomputation pass emits a token of its own: it counts as a forward
        assert_accounting(t, f.spec)


@pytest.mark.parametrize("gamma", [1, 4])
def test_acceptance_counts_with_copy_draft(paths, prompts, gamma):
    rounds = 3
    params = SamplingParams(max_tokens=1 + rounds * (gamma + 1), temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=paths["target"], dtype="float32",
                          speculative={"method": "draft", "draft": {"model": paths["target"]}, "num_speculative_tokens": gamma, "adaptive": False})
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


def assert_accounting(tokens: list[int], spec) -> None:
    """Each pass emits its accepted drafts plus one token of its own; the prefill emits the first."""
    assert len(tokens) == 1 + spec.accepted + spec.target_forwards, (len(tokens), spec)
    assert spec.accepted <= spec.proposed


@pytest.mark.parametrize("kind", ["random_draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_accounting_identity_with_rejections(paths, prompts, kind, temperature):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=1, ignore_eos=True)
    tokens, finals = generate(EngineConfig(model=paths["target"], dtype="float32",
                                           speculative=spec_config(paths, kind, 4)), prompts, params)
    for t, f in zip(tokens, finals):
        assert_accounting(t, f.spec)
    totals = generate.last_engine.totals
    assert totals.num_generation_tokens == len(prompts) + totals.num_accepted_tokens + totals.num_target_forwards
    assert sum(totals.accepted_per_position) == totals.num_accepted_tokens


SCRIPT = "x€yé😀z"   # 12 distinct bytes, then EOS: 13 tokens in all


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> str:
    from helpers import make_scripted_checkpoint
    return str(make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model", SCRIPT))


@pytest.mark.parametrize("end, expected_tokens, accepted", [
    # Passes emit tokens 2-6 and 7-11, then drafts 12-15: EOS (token 13) is draft 2 of that run;
    # the target accepts all four drafts (the copy goes on after EOS), only token 12 is counted.
    ("eos", list(SCRIPT.encode()) + [257], 4 + 4 + 1),
    # stop token "y" (0x79) is token 5, draft 4 of the first run.
    ("stop_token", list("x€y".encode()), 3),
    # max_tokens 8: the second pass gets one draft, as the scheduler drafts only what can be emitted.
    ("length", list(SCRIPT.encode())[:8], 4 + 1),
])
def test_output_ending_inside_an_accepted_run(scripted, end, expected_tokens, accepted):
    """EOS, a stop token or max_tokens inside a run of accepted drafts: the output stops there and the
    drafts after it are not counted as accepted (the issue's probe: 2 tokens emitted, accepted 4)."""
    params = SamplingParams(max_tokens=8 if end == "length" else 30, temperature=0.0,
                            stop_token_ids=[ord("y")] if end == "stop_token" else ())
    config = EngineConfig(model=scripted, dtype="float32",
                          speculative={"method": "draft", "draft": {"model": scripted}, "num_speculative_tokens": 4, "adaptive": False})
    tokens, finals = generate(config, [list(b"Q: ")], params)
    assert tokens[0] == expected_tokens
    assert finals[0].finish_reason == ("length" if end == "length" else "stop")
    assert finals[0].spec.accepted == accepted
    assert_accounting(tokens[0], finals[0].spec)
    totals = generate.last_engine.totals
    assert totals.num_accepted_tokens == accepted and totals.num_generation_tokens == len(expected_tokens)


# ---- seeded sampling does not depend on the batch --------------------------------------------

@pytest.mark.parametrize("pressure", ["token_budget", "kv_cache"])
def test_seeded_speculative_output_is_independent_of_the_batch(paths, prompts, pressure):
    """The draft count a request gets follows the budget older requests leave, and a preemption turns
    a verify pass into a recomputation; seeded requests sample through PositionalNoise, so neither
    changes their output."""
    limits = {"token_budget": dict(max_num_batched_tokens=12),
              "kv_cache": dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=24)}[pressure]
    config = EngineConfig(model=paths["target"], dtype="float32", **limits,
                          speculative={"method": "draft", "draft": {"model": paths["random_draft"]}, "num_speculative_tokens": 4, "adaptive": False})
    mine = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _ = generate(config, [prompts[2]], mine)
    # Older requests are scheduled first: with a tight budget, the two ahead of this one (short
    # prompts, long outputs) decode beside it and leave it room for fewer drafts; with a small
    # cache, the newest request is the one preempted and recomputed.
    others = [SamplingParams(max_tokens=40, temperature=t, ignore_eos=True) for t in (0.0, 0.7, 1.0, 0.0, 1.3, 0.0, 0.9)]
    order = [prompts[1], prompts[3], prompts[0]] + prompts[4:]
    mine_at = 2 if pressure == "token_budget" else len(order)
    mixed, _ = generate(config, order[:mine_at] + [prompts[2]] + order[mine_at:],
                        others[:mine_at] + [mine] + others[mine_at:])
    assert mixed[mine_at] == alone[0]


def test_bad_speculative_configs_fail_at_start_up(paths, tmp_path):
    for gamma in (0, MAX_SPEC_TOKENS + 1):
        with pytest.raises(ValueError, match=f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=gamma)
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpeculativeConfig(method="medusa-ish")
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        SpeculativeConfig(method="draft", draft={"model": str(tmp_path)})
    with pytest.raises(ValueError, match="unknown speculative config keys: \\['gama'\\]"):
        EngineConfig(model=paths["target"], speculative={"method": "ngram", "gama": 3})
    other_vocab = make_tiny_checkpoint(tmp_path / "v300", arch="llama", vocab_size=300, seed=3)
    with pytest.raises(ValueError, match=r"the tokenizer has 300 tokens but the target has only 272 embedding rows"):
        Engine(EngineConfig(model=paths["target"], speculative={"method": "draft", "draft": {"model": str(other_vocab)}}))
    other_tokens = make_tiny_checkpoint(tmp_path / "renamed", arch="llama", seed=3)
    tokenizer_json = other_tokens / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"<extra_3>"', '"<other_3>"'))
    with pytest.raises(ValueError, match=r"the draft's tokenizer differs from the target's \(token 264: '<other_3>' vs '<extra_3>'"):
        Engine(EngineConfig(model=paths["target"], speculative={"method": "draft", "draft": {"model": str(other_tokens)}}))


def test_draft_with_a_differently_padded_embedding_table(paths, prompts, plain_greedy, tmp_path):
    """Same tokenizer, more embedding rows (Qwen2.5-0.5B vs 7B): accepted, q gives the padding rows no mass,
    and greedy output stays the target's."""
    import shutil

    padded = make_tiny_checkpoint(tmp_path / "padded", arch="llama", vocab_size=300, seed=7, num_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{paths['target']}/{name}", padded / name)
    config = EngineConfig(model=paths["target"], dtype="float32",
                          speculative={"method": "draft", "draft": {"model": str(padded)}, "num_speculative_tokens": 3, "adaptive": False})
    tokens, finals = generate(config, prompts, GREEDY)
    assert tokens == plain_greedy
    assert sum(f.spec.proposed for f in finals) > 0
    sampled, _ = generate(config, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                                          ignore_eos=True))
    assert all(t < 272 for seq in sampled for t in seq)


# ---- sampling: the output distribution is the target's -------------------------------------
#
# A 16-token target and a noisy copy of it as the draft (acceptance 0.4-0.8 at these settings).
# max_tokens 5 with gamma 3: token 1 comes from the prefill, then one verification pass judges
# drafts at positions 2, 3, 4 and emits the bonus at position 5 when all three are accepted (or a
# recovered token at the first rejection, and more passes after it). The exact distribution of
# all five tokens is enumerated from transformers' logits; the test compares every position's
# marginal and every consecutive pair's joint with it, so the bonus and the later draft positions
# are observed, not only the first.

VOCAB = 16
SAMPLES = 12_000
PROMPT = [0, 3, 7, 2]
P_MIN = 1e-4   # per comparison; 9 comparisons per case: a false failure about 1 time in 1000


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


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    from helpers import make_noisy_copy

    root = tmp_path_factory.mktemp("vocab16")
    target = tiny_vocab_model(root / "target", seed=0, sharpness=25.0)
    return target, str(make_noisy_copy(target, root / "draft", noise=0.15))


def ngram_prompt(target: str) -> list[int]:
    """PROMPT, the target's greedy continuation, then that continuation's start again: the n-gram
    proposer matches the repeated start and drafts what the target wrote after it before."""
    from engine import LLM
    greedy = LLM(target, skip_tokenizer_init=True, dtype="float32").generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    return PROMPT + greedy + greedy[:3]


def tree_prompt(target: str) -> list[int]:
    """PROMPT, the target's greedy continuation g, then PROMPT's last two tokens twice more, followed
    by other tokens: the end of the context occurred three times with different continuations, so
    n-gram drafts are branching trees."""
    from engine import LLM
    greedy = LLM(target, skip_tokenizer_init=True, dtype="float32").generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    others = [t for t in range(2, VOCAB) if t != greedy[0]]
    return PROMPT + greedy + PROMPT[-2:] + others[:2] + PROMPT[-2:] + others[2:4] + PROMPT[-2:]


def exact_distribution(path: str, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1..t5 | prompt) [16]*5 by enumerating every 4-token prefix, with the request's warping."""
    from engine.sampler import SamplingTensors, warp_probs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prefixes = torch.stack(torch.meshgrid(*[torch.arange(VOCAB)] * 4, indexing="ij"), -1).reshape(-1, 4)
    sequences = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = torch.cat([model(chunk).logits[:, -5:] for chunk in sequences.split(8192)])
    flat = logits.reshape(-1, VOCAB)
    probs = warp_probs(flat, SamplingTensors.from_params([params] * len(flat), "cpu"))
    p = probs.double().reshape(VOCAB, VOCAB, VOCAB, VOCAB, 5, VOCAB).numpy()     # [t1..t4, position, next]
    joint = (p[0, 0, 0, 0, 0][:, None, None, None, None] * p[:, 0, 0, 0, 1][:, :, None, None, None]
             * p[:, :, 0, 0, 2][:, :, :, None, None] * p[:, :, :, 0, 3][:, :, :, :, None] * p[:, :, :, :, 4])
    return joint / joint.sum()


def sample_sequences(target: str, spec: dict, prompt, params, num: int, seeded: bool) -> tuple[np.ndarray, float]:
    """Counts [16]*5 of the first five tokens of `num` requests, and the acceptance rate. Seeded requests
    sample through PositionalNoise (coupled verification); unseeded ones own a generator each (rejection
    sampling)."""
    config = EngineConfig(model=target, dtype="float32", max_num_seqs=2048, max_num_batched_tokens=16384,
                          num_kv_blocks=8192, speculative=spec)
    engine = Engine(config)
    counts = np.zeros((VOCAB,) * 5)
    sample_sequences.mixed_passes = 0   # passes that verified draft-model and n-gram drafts together
    sample_sequences.tree_drafts = 0    # requests' passes that verified a draft tree
    for start in range(0, num, 3000):
        seqs = {}
        for seed in range(start, min(num, start + 3000)):
            mine = dataclasses.replace(params, seed=seed) if seeded else params
            if spec["method"] == "auto":   # alternate requests between the proposers: both in every pass
                mine = dataclasses.replace(mine, speculative_method=("draft", "ngram")[seed % 2])
            engine.add_request(str(seed), prompt, mine)
            seqs[str(seed)] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                seqs[out.request_id].extend(out.new_token_ids)
            methods = {m for m, _, _ in engine.last_stats.drafts_by_proposer} if engine.last_stats else set()
            sample_sequences.mixed_passes += methods >= {"draft", "ngram"}
            sample_sequences.tree_drafts += engine.last_stats.num_tree_drafts if engine.last_stats else 0
        for tokens in seqs.values():
            counts[tuple(tokens[:5])] += 1
    return counts, engine.totals.acceptance_rate


def position_pvalues(counts: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """p-values of each position's marginal and of each consecutive pair's joint."""
    out = {}
    for j in range(5):
        others = tuple(a for a in range(5) if a != j)
        out[f"t{j + 1}"] = pooled_chisquare(counts.sum(others), probs.sum(others))
    for j in range(4):
        others = tuple(a for a in range(5) if a not in (j, j + 1))
        out[f"t{j + 1}t{j + 2}"] = pooled_chisquare(counts.sum(others), probs.sum(others))
    return out


def draft_spec(draft: str, temperature: float | None = None, **extra) -> dict:
    return {"method": "draft", "draft": {"model": draft, "temperature": temperature}, "num_speculative_tokens": 3,
            "adaptive": False, **extra}


SAMPLING_CASES = {   # (sampling fields, draft config extras or None for n-gram, seeded)
    "draft-temperature-top_k": (dict(temperature=0.8, top_k=12), {}, False),
    "draft-top_p-min_p": (dict(temperature=1.0, top_p=0.85, min_p=0.05), {}, False),
    "draft_temperature": (dict(temperature=0.8), {"temperature": 1.3}, False),
    "ngram": (dict(temperature=0.9, top_k=10), None, False),
    "seeded-draft-top_p": (dict(temperature=0.9, top_p=0.9), {}, True),
    "seeded-ngram": (dict(temperature=0.9, top_k=10), None, True),
    "mixed-draft-and-ngram": (dict(temperature=0.9, top_k=10), "mixed", False),
    "ngram-tree": (dict(temperature=0.9, top_k=10), "tree", False),
    "draft-tree": (dict(temperature=0.8, top_k=12), {"tree_nodes": 6}, False),
    "seeded-draft-tree": (dict(temperature=0.9, top_p=0.9), {"tree_nodes": 6}, True),
    "seeded-ngram-tree": (dict(temperature=0.9, top_p=0.9), "tree", True),
}


def run_case(target: str, draft: str, case: str, num: int = SAMPLES) -> tuple[np.ndarray, float, np.ndarray]:
    """(counts, acceptance, exact distribution) of one sampling case."""
    fields, extra, seeded = SAMPLING_CASES[case]
    params = SamplingParams(max_tokens=5, ignore_eos=True, **fields)
    if extra is None:   # deterministic drafts (q one-hot) from the prompt
        spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "ngram": {"max": 3}}
        prompt = ngram_prompt(target)
    elif extra == "tree":   # n-gram drafts as branching trees (several deterministic children per node)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "ngram": {"max": 3}, "tree_nodes": 6}
        prompt = tree_prompt(target)
    elif extra == "mixed":   # model drafts and n-gram guesses verified in the same passes
        spec = {"method": "auto", "draft": {"model": draft}, "num_speculative_tokens": 3, "adaptive": False,
                "ngram": {"max": 3}}
        prompt = ngram_prompt(target)
    else:
        spec, prompt = draft_spec(draft, **extra), PROMPT
    counts, acceptance = sample_sequences(target, spec, prompt, params, num, seeded)
    return counts, acceptance, exact_distribution(target, prompt, params)


@pytest.mark.slow   # chi-square: thousands of samples
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, case):
    counts, acceptance, probs = run_case(*small_vocab_pair, case)
    # acceptance where every branch of the sampler runs often (measured: draft 0.54-0.64, rejection
    # sampling and coupled alike; n-gram 0.32; trees, per node: n-gram 0.24, draft model 0.21)
    kind = SAMPLING_CASES[case][1]
    lowest = 0.15 if kind == "tree" or isinstance(kind, dict) and kind.get("tree_nodes") else \
        0.4 if isinstance(kind, dict) else 0.25
    assert lowest <= acceptance <= 0.8, acceptance
    if case.startswith("mixed"):
        assert sample_sequences.mixed_passes > 0
    if kind == "tree" or isinstance(kind, dict) and kind.get("tree_nodes"):
        assert sample_sequences.tree_drafts > 0
    pvalues = position_pvalues(counts, probs)
    assert min(pvalues.values()) > P_MIN, pvalues


def bonus_from_last_draft_row(target_probs, draft_ids, num_drafts, draft_probs, is_greedy, generators,
                              coupled_choice=None):
    """Subtly broken: off by one row for the bonus token (sampled from the row that judged the last
    draft, not from the row after it)."""
    shifted = target_probs.clone()
    rows = torch.arange(len(num_drafts))
    last = (num_drafts - 1).clamp(min=0)
    shifted[rows, num_drafts] = torch.where((num_drafts > 0)[:, None], target_probs[rows, last],
                                            target_probs[rows, num_drafts])
    return rejection_sample(shifted, draft_ids, num_drafts, draft_probs, is_greedy, generators, coupled_choice)


@pytest.mark.slow   # chi-square: thousands of samples
@pytest.mark.parametrize("broken", [recover_from_p, bonus_from_last_draft_row])
def test_chi_square_catches_a_subtly_broken_sampler(small_vocab_pair, monkeypatch, broken):
    monkeypatch.setattr(engine.verify, "rejection_sample", broken)
    counts, _, probs = run_case(*small_vocab_pair, "draft-temperature-top_k")
    pvalues = position_pvalues(counts, probs)
    assert min(pvalues.values()) < P_MIN, pvalues


@pytest.mark.slow   # chi-square: thousands of samples
def test_chi_square_catches_a_tree_walk_without_residuals(small_vocab_pair, monkeypatch):
    """A rejected tree child must leave the target's distribution without it: drawing from p as it was
    makes the rejected token too likely."""
    import engine.spec_decode.tree as tree_module

    monkeypatch.setattr(tree_module, "_residual", lambda p, token, q: p)
    counts, _, probs = run_case(*small_vocab_pair, "ngram-tree")
    pvalues = position_pvalues(counts, probs)
    assert min(pvalues.values()) < P_MIN, pvalues


@pytest.mark.slow   # chi-square: thousands of samples
def test_chi_square_catches_noise_reused_across_positions(small_vocab_pair, monkeypatch):
    """Coupled sampling is exact only if every output position has its own noise."""
    from engine.sampler import PositionalNoise

    at = PositionalNoise.at
    monkeypatch.setattr(PositionalNoise, "at", lambda self, position: at(self, position // 2))
    counts, _, probs = run_case(*small_vocab_pair, "seeded-draft-top_p")
    pvalues = position_pvalues(counts, probs)
    assert min(pvalues.values()) < P_MIN, pvalues


@pytest.mark.parametrize("ngram_min, ngram_max", [(1, 4), (2, 3), (3, 3)])
def test_ngram_index_answers_as_a_scan_of_the_context(ngram_min, ngram_max):
    """The proposer's incremental index finds the same continuation as scanning the whole context
    (longest suffix first, its latest earlier occurrence with a token after it), as tokens arrive
    one at a time or several at once."""
    from engine.spec_decode.ngram import NgramIndex, ngram_lookup

    rng = random.Random(ngram_min * 10 + ngram_max)
    tokens = [rng.randrange(6) for _ in range(3)]
    index = NgramIndex(ngram_min, ngram_max)
    checked = 0
    while len(tokens) < 400:
        tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3, 8]))]
        index.extend(tokens)
        for k in (1, 4, 9):
            assert index.lookup(k) == ngram_lookup(np.asarray(tokens), ngram_min, ngram_max, k), (len(tokens), k)
            checked += bool(index.lookup(k))
    assert checked > 100   # most contexts of 6 symbols have a match


def test_greedy_draft_choice_matches_the_sampler():
    """The draft loop's greedy shortcut picks what the sampler picks (argmax, lowest index on ties)
    and reports the draft's softmax probability of it, as the sampled path does for greedy rows."""
    from engine.sampler import SamplingTensors, sample, warp_probs
    from engine.spec_decode.draft_model import greedy_choice

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 4
    logits[2, 7] = logits[2, 300] = logits[2].max() + 1.0   # a tie: the lower index wins
    logits = logits.to(torch.bfloat16)
    tensors = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 6, logits.device)
    expected = sample(warp_probs(logits, tensors), tensors.is_greedy, [None] * 6)
    tokens, own = greedy_choice(logits)
    assert tokens == expected.tolist() and tokens[2] == 7
    softmax = logits.float().softmax(dim=-1)
    assert own == pytest.approx(softmax[torch.arange(6), expected].tolist(), rel=1e-5)


def test_ngram_tree_holds_the_distinct_continuations_of_several_matches():
    """ngram_tree: the matches of the longest suffix, their continuations merged where they agree,
    best first by the share of matches behind each node (ties: the newer match); max_nodes keeps the
    best nodes, so one node's worth of budget per depth is the chain ngram_lookup drafts."""
    from engine.spec_decode.ngram import ngram_lookup, ngram_tree

    tokens = np.asarray([5, 6, 1, 2, 9, 5, 6, 1, 3, 9, 5, 6, 1, 2, 8, 5, 6])
    tree, probs = ngram_tree(tokens, 1, 3, max_nodes=16, max_depth=3)
    paths = {tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree)) if not tree.children(i)}
    assert paths == {(1, 2, 8), (1, 3, 9), (1, 2, 9)}
    assert len(tree) == 6 and probs == pytest.approx([1, 2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    node, first = -1, []   # the first child all the way down: the newest match among equals
    while tree.children(node):
        node = tree.children(node)[0]
        first.append(tree.tokens[node])
    assert first == ngram_lookup(tokens, 1, 3, 3) == [1, 2, 8]
    small, _ = ngram_tree(tokens, 1, 3, max_nodes=3, max_depth=3)
    assert small.tokens == [1, 2, 3]   # the best three: both second tokens before any third
    assert len(ngram_tree(np.asarray([1, 2, 3]), 1, 3, max_nodes=8, max_depth=3)[0]) == 0

