"""Speculative decoding under a grammar is lossless in distribution: sampled output follows the
target's distribution masked to the tokens the grammar allows at each step and renormalised there
(what plain decoding under the grammar samples), whichever proposer drafted: a draft model, n-gram
lookup or suffix matching, each verified by rejection sampling (unseeded requests) and by coupling
(seeded ones).

Why a sampled test: greedy equality (tests/test_structured.py) cannot see a wrong distribution, and
under a grammar the verifier sees other inputs than without one: every emitting row is masked
before the accept/reject test; n-gram and suffix drafts, guessed without the grammar, are cut at
their first token the grammar forbids (engine/structured.py constrain), so the row that would have
judged it emits a token of its own; a draft model drafts from its q masked by the grammar. Only
counts against exact probabilities show that the output is still the masked target's.

The setup:
- a tiny qwen2 target reworked to put most of its mass on the letters a-f, shared among them by the
  context, so that the regex [a-d]{3} has four likely tokens at each of its three steps and the
  forbidden e and f are likely too (10-50% of the mass, by the prefix): drafts are cut where the
  grammar branches, not only at its end;
- the exact joint P'(t1, t2, t3) from transformers' logits, masked by a matcher built as the engine
  builds one and warped by the engine's own sampler code (64 outputs; then the grammar admits only
  EOS, so every output is 3 tokens);
- thousands of requests per proposer through one Engine, compared by Pearson's chi-square
  (helpers.pooled_chisquare) on the joint and on each position's marginal;
- checks that a run is not vacuous: its proposer's drafts were verified, accepted and rejected
  (acceptance strictly between bounds), and for n-gram and suffix cut inside the language.

Negative controls, so that a pass means something:
- the same counts against the target conditioned on its output being in the language
  (P(t1 t2 t3) / P(language): the grammar applied to whole outputs instead of step by step, which
  differs because each step's share of allowed mass depends on the prefix) fail;
- a verifier that recovers a rejected draft from p' instead of the residual max(0, p' - q) fails;
- a draft model drafting from its unmasked q passes, its forbidden tokens judged by rejection
  sampling; cutting them before they are judged (what the engine did before) fails: cutting is exact
  only for one-hot and coupled drafts.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_noisy_copy, make_tiny_checkpoint, pooled_chisquare, recover_from_p

import engine.spec_decode.decoder as engine_loop
import engine.verify as verify_module
from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.spec_decode import draft_model
from engine.structured import GrammarCompiler, StructuredOutput

REGEX = "[a-d]{3}"
GRAMMAR = StructuredOutput("regex", REGEX)
ALLOWED = list(b"abcd")
LENGTH = 3
# Written by the target itself (sampled under [a-f]*): n-gram and suffix lookups match at every
# step and draft what the target is likely to write, the forbidden e and f among it (cut).
PROMPT = list(b"afdbecaaddddeeebeceecdbbeaafded")
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, structured=GRAMMAR)   # the grammar ends it at 3
GAMMA = 2            # drafts for positions 2 and 3
SAMPLES = 3000       # per case: 64 joint cells, ~50 expected counts a cell
CONTROL_SAMPLES = 1500   # the broken verifier's error is gross: fewer samples find it
BATCH = 3000         # requests in flight at once
P_MIN = 1e-3         # per comparison; 4 per case

# The letters' logit bias (along a steady direction of the final hidden state) and the scale of
# their own output rows (the context's say): a-d ~55-80% of the mass, e-f ~10-50% by the prefix.
LETTER_BIAS = dict(zip(b"abcdef", [7.0] * 4 + [5.5] * 2))
LETTER_SPREAD = dict(zip(b"abcdef", [5.0] * 4 + [14.0] * 2))


@dataclasses.dataclass(frozen=True)
class Models:
    target: str
    draft: str


def make_letter_target(path: Path) -> Path:
    """The tiny random qwen2 checkpoint, reworked so that its next token is mostly a letter a-f with
    their shares set by the context: a random model's distributions are nearly uniform over 272
    tokens, where a grammar over four of them leaves a draft model nothing to draft and the masked
    distribution little to tell apart from others.

    A constant added to every token embedding gives the final hidden state a steady direction; each
    letter's output row gets a component along it (a bias in its logit) on top of its own row scaled
    up (the context's say among the letters)."""
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(path, arch="qwen2", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        steady = torch.randn(embed.shape[1], generator=generator)
        embed += steady * embed.norm(dim=1).mean() / steady.norm()
        contexts = torch.randint(0, 256, (256, 6), generator=generator)
        mean_hidden = model(contexts, output_hidden_states=True).hidden_states[-1][:, -1].mean(0)
        letters = list(LETTER_BIAS)
        bias = torch.tensor(list(LETTER_BIAS.values())).unsqueeze(1)
        spread = torch.tensor(list(LETTER_SPREAD.values())).unsqueeze(1)
        rows = model.lm_head.weight
        rows[letters] = rows[letters] * spread + bias * mean_hidden / mean_hidden.norm() ** 2
    model.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("structured_sampling")
    target = make_letter_target(root / "target")
    # Noisier than the usual 0.1, so that the draft's masked q differs from p' enough for rejections
    # (~15% of its drafts) and for the unmasked-draft control to show.
    return Models(str(target), str(make_noisy_copy(target, root / "draft", noise=0.2)))


def speculative(models: Models, method: str) -> dict:
    spec = {"method": method, "num_speculative_tokens": GAMMA, "adaptive": False}
    if method == "draft":
        spec["draft"] = {"model": models.draft}
    if method == "ngram":
        spec["ngram"] = {"max": 3}
    return spec


def make_engine(models: Models, method: str, max_num_seqs: int = BATCH) -> Engine:
    return Engine(EngineConfig(model=models.target, dtype="float32", max_num_seqs=max_num_seqs,
                               num_kv_blocks=4 * max_num_seqs, max_num_batched_tokens=16384,
                               speculative=speculative(models, method)))


@dataclasses.dataclass(frozen=True)
class Exact:
    outputs: list[tuple[int, ...]]   # every output the grammar admits, in a fixed order
    masked: np.ndarray               # P'(output): step by step, the target masked to the grammar
    conditioned: np.ndarray          # P(output | output in the language): a wrong answer (the control)


@functools.lru_cache(maxsize=4)   # one per target and engine vocabulary: every case shares it
def exact_outputs(target: str, vocab_size: int, eos_token_ids: frozenset[int], params: SamplingParams = PARAMS
                  ) -> Exact:
    """The exact distribution of the output, enumerated over the grammar's 64 strings from
    transformers' logits, masked by a matcher built as the engine builds one and warped as verify.py
    warps."""
    from transformers import AutoModelForCausalLM

    from engine.sampler import SamplingTensors, warp_probs

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    state = GrammarCompiler(target, vocab_size, eos_token_ids).state(params.structured)   # masks() leaves it be
    masked, plain = {(): 1.0}, {(): 1.0}
    for _ in range(LENGTH):
        prefixes = list(masked)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        allowed = torch.stack([state.masks(list(p))[-1] for p in prefixes])
        assert all(row.nonzero().flatten().tolist() == ALLOWED for row in allowed)   # the regex is what we think
        tensors = SamplingTensors.from_params([params] * len(prefixes), "cpu")
        p_masked = warp_probs(logits.masked_fill(~allowed, float("-inf")), tensors).double()
        p_plain = warp_probs(logits, tensors).double()
        masked = {p + (t,): masked[p] * p_masked[i, t].item() for i, p in enumerate(prefixes) for t in ALLOWED}
        plain = {p + (t,): plain[p] * p_plain[i, t].item() for i, p in enumerate(prefixes) for t in ALLOWED}
    end = state.masks(list(next(iter(masked))))[-1]
    assert end.nonzero().flatten().tolist() == sorted(eos_token_ids)   # then only EOS: outputs end there
    outputs = sorted(masked)
    joint, conditioned = np.array([masked[o] for o in outputs]), np.array([plain[o] for o in outputs])
    return Exact(outputs, joint / joint.sum(), conditioned / conditioned.sum())


@dataclasses.dataclass
class Run:
    counts: Counter = dataclasses.field(default_factory=Counter)   # output (its tokens) -> requests that wrote it
    finish_reasons: Counter = dataclasses.field(default_factory=Counter)
    methods: set = dataclasses.field(default_factory=set)   # proposers whose drafts were verified
    proposed: int = 0      # draft tokens as proposed, before the grammar cut any
    verified: int = 0      # draft tokens verified (after the cut)
    accepted: int = 0      # of those, accepted by the verifier (the engine's own count stops at the grammar's end)
    rejections: int = 0    # verifications that stopped at a rejected draft
    cuts_inside: int = 0   # drafts cut inside the language (at a forbidden e or f), not at its end

    @property
    def acceptance(self) -> float:
        return self.accepted / self.verified


def sample_outputs(engine: Engine, num: int, params: SamplingParams | list[SamplingParams] = PARAMS) -> Run:
    """`num` requests of PROMPT (`params` for all, or one each), BATCH at a time: each output's tokens,
    and the drafts as proposed, as verified after the grammar's cut, accepted and rejected (counted
    around the engine's propose and verify calls, which run as they are)."""
    run = Run()
    propose, verify = engine.spec.router.propose, engine_loop.verify
    proposed_lengths: list[int] = []

    def counting_propose(scheduled, plan):   # constrain() cuts the proposal in place after this
        proposal = propose(scheduled, plan)
        proposed_lengths[:] = map(len, proposal.draft_token_ids)
        run.proposed += sum(proposed_lengths)
        return proposal

    def counting_verify(target, scheduled, proposal, *args, **kwargs):
        result = verify(target, scheduled, proposal, *args, **kwargs)
        for item, drafts, before, accepted in zip(scheduled, proposal.draft_token_ids, proposed_lengths,
                                                  result.num_accepted):
            run.verified += len(drafts)
            run.accepted += accepted
            run.rejections += accepted < len(drafts)
            run.cuts_inside += len(drafts) < before and item.request.num_output_tokens + len(drafts) < LENGTH
        return result

    engine.spec.router.propose, engine_loop.verify = counting_propose, counting_verify
    try:
        for start in range(0, num, BATCH):
            outputs = {}
            for i in range(start, min(num, start + BATCH)):
                engine.add_request(str(i), PROMPT, params[i] if isinstance(params, list) else params)
                outputs[str(i)] = []
            while engine.has_unfinished_requests():
                steps = engine.num_steps
                for out in engine.step():
                    outputs[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        run.finish_reasons[out.finish_reason] += 1
                if engine.num_steps > steps:   # a pass ran (none does while requests wait for a grammar)
                    run.methods.update(m for m, verified, _ in engine.last_stats.drafts_by_proposer if verified)
            run.counts.update(tuple(tokens) for tokens in outputs.values())
    finally:
        engine.spec.router.propose, engine_loop.verify = propose, verify
    return run


def chi_square_pvalues(counts: Counter, exact: Exact, probs: np.ndarray) -> dict[str, float]:
    """p-values of the joint of the three tokens and of each position's marginal (the joint pools its
    thin cells; the marginals see each position whole). An output outside the grammar's 64 is a 0."""
    if set(counts) - set(exact.outputs):
        return {"outside the grammar": 0.0}
    observed = np.array([counts[o] for o in exact.outputs])
    pvalues = {"joint": pooled_chisquare(observed, probs)}
    for position in range(LENGTH):
        index = np.array([ALLOWED.index(o[position]) for o in exact.outputs])
        pvalues[f"t{position + 1}"] = pooled_chisquare(np.bincount(index, observed, len(ALLOWED)),
                                                       np.bincount(index, probs, len(ALLOWED)))
    return pvalues


# Acceptance of the drafts verified, by proposer, measured: draft 0.85, n-gram 0.31, suffix 0.45.
# Bounds strictly inside (0, 1): drafts were accepted and rejected, so every branch of the verifier
# ran.
ACCEPTANCE = {"draft": (0.7, 0.95), "ngram": (0.15, 0.5), "suffix": (0.25, 0.65)}
# Unseeded requests verify by rejection sampling, seeded ones by coupling (the target's own draw at
# each row, whatever was drafted). The draft model's q matters to rejection sampling only, so its
# requests are all unseeded (full power there); n-gram and suffix runs seed every other request, so
# that coupled verification under the grammar runs too.
HALF_SEEDED = {"draft": False, "ngram": True, "suffix": True}
GUESSING = ("ngram", "suffix")   # they draft without the grammar: it cuts their drafts


def run_case(models: Models, method: str, num: int = SAMPLES, half_seeded: bool = False) -> tuple[Run, Exact]:
    """`num` requests through a fresh engine speculating with `method` (every other one seeded, or none)."""
    engine = make_engine(models, method)
    params = [dataclasses.replace(PARAMS, seed=i) if half_seeded and i % 2 else PARAMS for i in range(num)]
    return sample_outputs(engine, num, params), exact_outputs(models.target, engine.vocab_size, engine.eos_token_ids)


@pytest.mark.slow   # chi-square: thousands of samples
@pytest.mark.parametrize("method", list(ACCEPTANCE))
def test_sampling_under_a_grammar_follows_the_masked_target(models, method):
    run, exact = run_case(models, method, half_seeded=HALF_SEEDED[method])
    low, high = ACCEPTANCE[method]
    assert run.finish_reasons == {"stop": SAMPLES}   # the grammar ended every output after its 3 tokens
    assert run.methods == {method}, run   # no forced tokens in [a-d]{3}: the grammar proposer drafts none
    assert low < run.acceptance < high and run.rejections > 0, run
    if method in GUESSING:
        assert run.cuts_inside > 0, run   # drafts cut where the grammar branches: constrain()'s cut ran
    pvalues = chi_square_pvalues(run.counts, exact, exact.masked)
    assert min(pvalues.values()) > P_MIN, pvalues
    # The control: the same counts tell step-by-step masking from the language-conditioned target.
    control = chi_square_pvalues(run.counts, exact, exact.conditioned)
    assert control["joint"] < P_MIN, control


@pytest.mark.slow   # chi-square: thousands of samples
def test_the_chi_square_catches_a_sampler_that_recovers_from_p_not_the_residual(models, monkeypatch):
    """The test has power against a sampler that emits from p' where a rejected draft's residual is
    due: with it, n-gram runs fail the comparison with P'."""
    monkeypatch.setattr(verify_module, "rejection_sample", recover_from_p)
    run, exact = run_case(models, "ngram", num=CONTROL_SAMPLES)   # unseeded: rejection sampling
    assert run.rejections > 0, run
    pvalues = chi_square_pvalues(run.counts, exact, exact.masked)
    assert min(pvalues.values()) < P_MIN, pvalues


@pytest.mark.slow   # chi-square: thousands of samples
def test_forbidden_tokens_drawn_from_a_real_q_are_judged_not_cut(models, monkeypatch):
    """A proposer that drafts from a real q without the grammar (the draft model with its masking
    off) proposes tokens the grammar forbids. constrain() keeps such a token for rejection sampling,
    whose certain rejection resamples from the residual max(0, p' - q): the output stays the masked
    target's. Cutting before it instead (what the engine did before) lets the row emit from p' and
    the output leans to the draft's own masked distribution: the chi-square catches that (power
    ~0.999 at these samples, by the noncentral chi-square). Cutting is exact only for one-hot drafts,
    whose residual is p' itself, and for coupled ones."""
    import engine.structured as structured

    monkeypatch.setattr(draft_model, "_mask_by_grammar", lambda logits, requests, drafts: None)
    run, exact = run_case(models, "draft")   # as the draft case, but for the patch
    assert run.cuts_inside > 0, run   # it did draft forbidden tokens
    pvalues = chi_square_pvalues(run.counts, exact, exact.masked)
    assert min(pvalues.values()) > P_MIN, pvalues
    monkeypatch.setattr(structured, "_judged_against_q", lambda request, proposal, i, position: False)
    run, exact = run_case(models, "draft")
    pvalues = chi_square_pvalues(run.counts, exact, exact.masked)
    assert min(pvalues.values()) < P_MIN, pvalues


def test_every_sampled_output_matches_the_grammar_under_each_proposer(models):
    """Cheap, and a precondition of the chi-square tests: with every proposer, sampled outputs are in
    the language and end there (finish reason stop), the proposer's drafts were verified, n-gram and
    suffix drafts were cut by the grammar inside the language, and the draft model's never were: it
    drafts under the grammar, which keeps rejection sampling exact (see the control above)."""
    for method in ACCEPTANCE:
        engine = make_engine(models, method, max_num_seqs=64)
        run = sample_outputs(engine, 64)
        assert run.finish_reasons == {"stop": 64}, (method, run)
        assert all(re.fullmatch(REGEX, bytes(o).decode()) for o in run.counts), (method, run)
        assert run.methods == {method} and run.verified > 0, (method, run)
        assert run.cuts_inside > 0 if method in GUESSING else run.cuts_inside == 0, (method, run)
