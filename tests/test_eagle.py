"""EAGLE heads served as a proposer: lossless (greedy token for token, sampling in distribution),
the target's features reach the head at the right positions (after prefill chunks, rollbacks,
preemption and prefix-cache hits), the head loads strictly, and bad configs fail at start-up."""
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from helpers import make_eagle_head, make_tiny_checkpoint, run_requests

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.spec_decode.eagle import EagleProposer

MAX_TOKENS = 14
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=0)
    one_layer = make_tiny_checkpoint(root / "target1", arch="llama", seed=5, num_layers=1)
    return {"target": str(target), "head": str(make_eagle_head(target, root / "head", seed=3)),
            "target1": str(one_layer), "copy_head": str(make_eagle_head(one_layer, root / "copy", copy_target=True)),
            "draft": str(make_tiny_checkpoint(root / "draft", arch="llama", seed=7, num_layers=1, hidden_size=32,
                                              num_heads=2, num_kv_heads=1))}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    motif = [rng.randrange(256) for _ in range(6)]
    out = [motif * 4 + [rng.randrange(256)], motif * 2, [5], [9, 9, 9, 9, 9, 9]]
    return out + [[rng.randrange(256) for _ in range(n)] for n in (2, 11, 30, 64)]


def run(config: EngineConfig, prompts, params=GREEDY, engine: Engine | None = None):
    engine = engine or Engine(config)
    return run_requests(engine, prompts, params)[0], engine


@pytest.fixture(scope="module")
def plain_greedy(paths, prompts):
    return run(EngineConfig(model=paths["target"], dtype="float32"), prompts)[0]


def eagle(paths, gamma: int = 3, head: str | None = None, **extra) -> dict:
    return {"method": "eagle", "draft": {"head": head or paths["head"]}, "num_speculative_tokens": gamma,
            "adaptive": False, **extra}


class TruthfulDrafts:
    """Swap the head's drafts for the plain greedy continuation, each token kept with probability
    alpha (else corrupted): a random head accepts almost nothing, and the rollback paths need
    partial acceptance. The head still runs every forward it would."""

    def __init__(self, proposer: EagleProposer, truth: dict[tuple, list[int]], alpha: float, seed: int = 0):
        self.proposer, self.truth, self.alpha = proposer, truth, alpha
        self.rng = random.Random(seed)
        self.original = proposer.propose
        proposer.propose = self.propose

    def propose(self, items):
        proposal = self.original(items)
        for item, tokens in zip(items, proposal.draft_token_ids):
            request = item.request
            truth = self.truth[tuple(request.token_ids[:request.num_prompt_tokens])]
            start = request.num_output_tokens
            tokens[:] = [t if self.rng.random() < self.alpha else (t + 1) % 256
                         for t in truth[start:start + len(tokens)]]
        return proposal


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_eagle_is_lossless(paths, prompts, plain_greedy, gamma):
    assert run(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, gamma)), prompts)[0] \
        == plain_greedy


@pytest.mark.parametrize("head", ["head", "copy_head"])
def test_greedy_eagle_trees_are_lossless(paths, prompts, head):
    """EAGLE trees (tree_nodes): grown from the head's top tokens, each node fed the head's output at
    its parent; plain decoding's tokens, with a random head (little accepted) and a head that copies
    its target (chains accepted whole), under KV pressure that preempts."""
    target = paths["target"] if head == "head" else paths["target1"]
    plain = run(EngineConfig(model=target, dtype="float32"), prompts)[0]
    config = EngineConfig(model=target, dtype="float32", block_size=4, num_kv_blocks=48,
                          speculative=eagle(paths, 4, head=paths[head], tree_nodes=8))
    engine = Engine(config)
    trees = []
    outputs = run_requests(engine, prompts, GREEDY, lambda e: trees.append(e.last_stats.num_tree_drafts))[0]
    assert outputs == plain and sum(trees) > 0


def test_an_eagle_trees_chain_is_the_chain_the_head_drafts(paths, prompts):
    """Each node's feature is the head's output at its parent: the tree's chain (the head's top token
    after its top token) is token for token what the head drafts as a chain, where every step
    feeds the previous step's output. A root feature reused down the tree would part from it."""
    config = EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, 4, tree_nodes=8))
    engine = Engine(config)
    proposer = engine.spec.router.proposers["eagle"]
    grow, compared = proposer._propose_trees, []

    def checking(items):
        chains = proposer._propose_chains(items).draft_token_ids
        grown = grow(items)
        for chain, tokens, tree in zip(chains, grown.draft_token_ids, grown.trees or [None] * len(items)):
            length = len(tokens) if tree is None else tree.chain
            compared.append(length)
            assert tokens[:length] == chain[:length] and length == len(chain)
        return grown
    proposer._propose_trees = checking
    run(config, prompts, engine=engine)
    assert len(compared) > 10 and max(compared) >= 3


def test_greedy_eagle_with_partial_acceptance_preemption_and_chunked_prefill(paths, prompts, plain_greedy):
    """Few KV blocks (preemption), a small token budget (prefill chunks), accepted runs that end at
    every depth: the output is still the plain greedy output."""
    config = EngineConfig(model=paths["target"], dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=24,
                          speculative=eagle(paths, 4))
    engine = Engine(config)
    truth = {tuple(p): out + [0] * 16 for p, out in zip(prompts, plain_greedy)}
    TruthfulDrafts(engine.spec.router.proposers["eagle"], truth, alpha=0.7)
    outputs, engine = run(config, prompts, engine=engine)
    assert outputs == plain_greedy
    assert 0.2 < engine.totals.acceptance_rate < 0.95
    assert all(engine.totals.accepted_per_position)   # accepted runs reached every depth


def test_auto_routes_between_eagle_draft_and_ngram_losslessly(paths, prompts, plain_greedy):
    spec = {"method": "auto", "draft": {"head": paths["head"], "model": paths["draft"]}, "num_speculative_tokens": 4}
    outputs, engine = run(EngineConfig(model=paths["target"], dtype="float32", speculative=spec), prompts)
    assert outputs == plain_greedy
    assert engine.spec.router.names == ["grammar", "draft", "eagle", "ngram", "suffix"]   # grammar: forced tokens


def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(paths, prompts, tmp_path):
    """A head with a reduced vocabulary (EAGLE-3's) drafts only its tokens; where the target's
    choice lies outside it, the draft is rejected and the output is still plain greedy's."""
    plain = run(EngineConfig(model=paths["target1"], dtype="float32"), prompts)[0]
    vocab = [t for t in range(256) if t % 4]                      # a quarter of the tokens left out
    head = make_eagle_head(paths["target1"], tmp_path / "reduced", copy_target=True, draft_vocab=vocab)
    config = EngineConfig(model=paths["target1"], dtype="float32",
                          speculative=eagle(paths, 4, head=str(head)))
    engine = Engine(config)
    proposer = engine.spec.router.proposers["eagle"]
    drafted: list[int] = []
    original = proposer.propose

    def recording(items):
        proposal = original(items)
        for tokens in proposal.draft_token_ids:
            drafted.extend(tokens)
        return proposal
    proposer.propose = recording
    outputs, engine = run(config, prompts, engine=engine)
    assert outputs == plain
    assert drafted and set(drafted) <= set(vocab)
    assert engine.totals.acceptance_rate > 0.3, engine.totals   # the copy head still agrees, inside its vocabulary
    assert any(t % 4 == 0 for out in plain for t in out)        # the target did choose tokens the head cannot


def test_bad_draft_vocabularies_fail_at_start_up(paths, tmp_path):
    from safetensors.torch import load_file, save_file
    head = make_eagle_head(paths["target"], tmp_path / "head", draft_vocab=[1, 5, 9])
    config = json.loads((head / "config.json").read_text())
    config["eagle"]["draft_vocab_size"] = 4
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Engine(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, head=str(head))))
    config["eagle"]["draft_vocab_size"] = 3
    (head / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(head / "model.safetensors"))
    tensors["draft_vocab"] = torch.tensor([5, 1, 9])
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match="ascending token ids"):
        Engine(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, head=str(head))))


def record_features(engine: Engine, proposer: EagleProposer, tag=lambda: None) -> list:
    """Every feature span the head is fed from now on, as (tag(), request id, start, end, features)."""
    seen, batch_ids = [], []
    catch_up, read = proposer._catch_up, engine.target.read_features

    def recording_catch_up(items):
        batch_ids[:] = [item.request.request_id for item in items]
        return catch_up(items)

    def recording_read(spans):
        features = read(spans)
        offsets = np.cumsum([0] + [end - start for _, start, end in spans])
        seen.extend((tag(), rid, start, end, features[offset:offset + end - start].clone())
                    for rid, (_, start, end), offset in zip(batch_ids, spans, offsets))
        return features
    proposer._catch_up, engine.target.read_features = recording_catch_up, recording_read
    return seen


def test_the_head_reads_the_targets_features_at_the_right_positions(paths, prompts, plain_greedy):
    """Every feature the head is fed equals transformers' final (normed) hidden state of the target at
    that position of the request's final token sequence: after prefill chunks, rollbacks (partial
    acceptance), preemption (few blocks) and a prefix-cache hit (a prompt run again)."""
    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=paths["target"], dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=20,
                          speculative=eagle(paths, 4))
    engine = Engine(config)
    proposer = engine.spec.router.proposers["eagle"]
    truth = {tuple(p): out + [0] * 16 for p, out in zip(prompts, plain_greedy)}
    TruthfulDrafts(proposer, truth, alpha=0.6)
    runs = []
    seen = record_features(engine, proposer, lambda: len(runs))
    preempt, match = engine.scheduler._preempt, engine.pool.match_prefix
    preempted, hits = [], []
    engine.scheduler._preempt = lambda request, out: (preempted.append(request.request_id), preempt(request, out))
    engine.pool.match_prefix = lambda ids, tenant=None: (lambda blocks: (hits.append(len(blocks)), blocks)[1])(
        match(ids, tenant))

    for batch in (prompts, prompts[-1:], prompts[-1:]):   # the last prompt alone twice: a prefix-cache hit
        outputs = run(config, batch, engine=engine)[0]
        runs.append((batch, outputs))
    assert runs[0][1] == plain_greedy and runs[2][1] == runs[1][1] == plain_greedy[-1:]
    assert preempted and hits[-1] >= 12   # the repeated 64-token prompt found its first blocks cached

    model = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    with torch.no_grad():
        hidden = [{str(i): model.model(torch.tensor([p + o])).last_hidden_state[0] for i, (p, o) in
                   enumerate(zip(batch, outputs))} for batch, outputs in runs]
    assert len(seen) > 50
    for index, rid, start, end, features in seen:
        torch.testing.assert_close(features, hidden[index][rid][start:end], atol=2e-4, rtol=1e-4)
    assert sum(start > 0 for _, _, start, _, _ in seen) > 20   # caught up step by step, not from scratch


def exact_three_tokens(path: str, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """P(t1, t2, t3 | prompt) under the request's warping, over the (top-k) support."""
    from transformers import AutoModelForCausalLM

    from engine.sampler import SamplingTensors, warp_probs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        return warp_probs(logits, SamplingTensors.from_params([params] * len(prefixes), "cpu")).double()
    joint = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        probs = next_probs([list(p) for p in prefixes])
        joint = {p + (t,): joint[p] * probs[i, t].item() for i, p in enumerate(prefixes)
                 for t in probs[i].nonzero().flatten().tolist()}
    return joint


@pytest.mark.slow   # chi-square: thousands of samples
def test_eagle_sampling_matches_the_target_distribution(paths):
    """Sampled tokens through the head's drafts (rejection sampling against its q) follow the
    target's distribution: chi-square of the first three tokens (t2, t3 drafted and judged), with
    head and n-gram drafts verified in the same passes. The head copies the target, so its drafts
    are accepted often and rejected often enough that every branch of the sampler runs."""
    from helpers import pooled_chisquare

    rng = random.Random(4)
    prompt = [rng.randrange(256) for _ in range(12)] + [3, 17, 42, 3, 17]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)
    exact = exact_three_tokens(paths["target1"], prompt, params)
    spec = {"method": "auto", "draft": {"head": paths["copy_head"]}, "num_speculative_tokens": 2, "adaptive": False,
            "proposers": ["eagle", "ngram"], "ngram": {"max": 2}}
    engine = Engine(EngineConfig(model=paths["target1"], dtype="float32", max_num_seqs=1024, num_kv_blocks=4096,
                                 max_num_batched_tokens=16384, speculative=spec))
    counts = dict.fromkeys(exact, 0)
    mixed = 0
    for start in range(0, 8000, 2000):
        seqs = {}
        for i in range(start, start + 2000):
            method = ("eagle", "eagle", "ngram")[i % 3]
            engine.add_request(str(i), prompt, dataclasses.replace(params, speculative_method=method))
            seqs[str(i)] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                seqs[out.request_id].extend(out.new_token_ids)
            mixed += {m for m, _, _ in engine.last_stats.drafts_by_proposer} >= {"eagle", "ngram"}
        for tokens in seqs.values():
            counts[tuple(tokens[:3])] += 1
    assert mixed > 0 and 0.4 < engine.totals.acceptance_rate < 0.95, engine.totals
    keys = sorted(exact)
    observed, expected = np.array([counts[k] for k in keys]), np.array([exact[k] for k in keys])
    assert pooled_chisquare(observed, expected / expected.sum()) > 1e-3
    for position in range(3):   # each token's marginal too (the joint pools thin cells)
        marginal = {}
        for k, o, e in zip(keys, observed, expected):
            mo, me = marginal.get(k[position], (0, 0.0))
            marginal[k[position]] = (mo + o, me + e)
        o, e = np.array([v[0] for v in marginal.values()]), np.array([v[1] for v in marginal.values()])
        assert pooled_chisquare(o, e / e.sum()) > 1e-3, position


def test_bad_eagle_configs_fail_at_start_up(paths, tmp_path):
    with pytest.raises(ValueError, match="speculative.draft.head"):
        EngineConfig(model=paths["target"], speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="not an EAGLE head"):
        EngineConfig(model=paths["target"], speculative={"method": "eagle", "draft": {"head": paths["draft"]}})
    other = make_tiny_checkpoint(tmp_path / "wide", arch="llama", hidden_size=96, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="hidden size"):
        Engine(EngineConfig(model=str(other), dtype="float32", speculative=eagle(paths)))
    broken = make_eagle_head(paths["target"], tmp_path / "broken")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: norm.weight"):
        Engine(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, head=str(broken))))
    config = json.loads((broken / "config.json").read_text())
    config["eagle"]["format"] = 99
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format 1"):
        Engine(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, head=str(broken))))


def test_the_served_head_computes_what_training_computed(paths, tmp_path):
    """The contract between train/eagle_head.py and engine/models/eagle.py: a head exported by the
    trainer, loaded by the engine, gives the trainer's teacher-forced logits (position p from the
    target's feature at p and the token at p + 1)."""
    from transformers import AutoModelForCausalLM

    from train.eagle_head import EagleHeadTrainer, head_logits_teacher_forced
    target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    head = EagleHeadTrainer.from_target(target)
    with torch.no_grad():   # away from the initialisation (which copies the target's last layer)
        for parameter in head.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    head.save_pretrained(tmp_path / "head", dtype=torch.float32)
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    expected = head_logits_teacher_forced(head, target, ids)[0]          # [19, V]

    assert_served_logits(paths, tmp_path / "head", ids, expected)

    # With a draft vocabulary: the trainer's logits over it, and no mass anywhere else.
    vocab = list(range(0, 256, 3))
    head.set_draft_vocab(vocab)
    head.save_pretrained(tmp_path / "reduced", dtype=torch.float32)
    reduced = head_logits_teacher_forced(head, target, ids)[0]          # [19, len(vocab)]
    expected = torch.full((19, target.config.vocab_size), float("-inf"))
    expected[:, vocab] = reduced
    assert_served_logits(paths, tmp_path / "reduced", ids, expected)


def assert_served_logits(paths, head_dir, ids, expected):
    """The engine's head logits, teacher-forced over ids (features from the engine's target)."""
    from engine.model_runner import ForwardItem
    engine = Engine(EngineConfig(model=paths["target"], dtype="float32", speculative=eagle(paths, head=str(head_dir))))
    table: list[int] = []
    engine.pool.allocate(table, 32)
    engine.target.forward([ForwardItem(ids[0].tolist(), 0, table, 0)])   # the target keeps its features
    features = engine.target.read_features([(table, 0, 19)])
    served = engine.spec.router.proposers["eagle"].runner.forward([ForwardItem(ids[0, 1:].tolist(), 0, table, 19)], features)
    torch.testing.assert_close(served, expected, atol=1e-4, rtol=1e-4)


def test_only_rows_verified_by_rejection_sampling_carry_draft_distributions(paths, prompts):
    """Greedy and seeded rows accept by the target's own choice, so their steps build no
    [batch x k x vocab] buffer of draft distributions; unseeded sampled rows get theirs."""
    config = EngineConfig(model=paths["target1"], dtype="float32",
                          speculative=eagle(paths, 3, head=paths["copy_head"]))
    engine = Engine(config)
    buffers = []
    original = engine.spec.router.propose

    def recording(scheduled, plan):
        proposal = original(scheduled, plan)
        if any(proposal.draft_token_ids):
            buffers.append(proposal.draft_probs is not None)
        return proposal
    engine.spec.router.propose = recording
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    for params, expected in ((GREEDY, False), (dataclasses.replace(sampled, seed=7), False), (sampled, True)):
        buffers.clear()
        run(config, prompts[:3], params, engine=engine)
        assert buffers and set(buffers) == {expected}, params


FUSED_LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """A 4-layer target and an EAGLE-3-style head over its layers 0, 1 and 2 (random weights)."""
    root = tmp_path_factory.mktemp("fused")
    target = make_tiny_checkpoint(root / "target", arch="llama", seed=11, num_layers=4)
    head = make_eagle_head(target, root / "head", seed=4, feature_layers=FUSED_LAYERS)
    return {"target": str(target), "head": str(head)}


def test_a_fused_feature_head_reads_its_layers_and_stays_lossless(fused, prompts):
    """With fused features the target keeps, per position, the outputs of the head's layers side by
    side (transformers' hidden_states of those layers), through prefill chunks, partial acceptance
    and preemption, and the output is still plain greedy."""
    from transformers import AutoModelForCausalLM

    plain = run(EngineConfig(model=fused["target"], dtype="float32"), prompts)[0]
    config = EngineConfig(model=fused["target"], dtype="float32", block_size=4, num_kv_blocks=24,
                          max_num_batched_tokens=20, speculative=eagle(fused, 4))
    engine = Engine(config)
    assert engine.target.features.shape[1] == 3 * engine.target.model.hidden_size
    proposer = engine.spec.router.proposers["eagle"]
    TruthfulDrafts(proposer, {tuple(p): out + [0] * 16 for p, out in zip(prompts, plain)}, alpha=0.6)
    seen = record_features(engine, proposer)
    outputs, engine = run(config, prompts, engine=engine)
    assert outputs == plain and 0.2 < engine.totals.acceptance_rate < 0.95

    model = AutoModelForCausalLM.from_pretrained(fused["target"], dtype=torch.float32)
    with torch.no_grad():
        states = {str(i): model.model(torch.tensor([p + o]), output_hidden_states=True).hidden_states
                  for i, (p, o) in enumerate(zip(prompts, outputs))}
    expected = {rid: torch.cat([hs[layer + 1][0] for layer in FUSED_LAYERS], dim=-1) for rid, hs in states.items()}
    assert len(seen) > 30
    for _, rid, start, end, features in seen:
        torch.testing.assert_close(features, expected[rid][start:end], atol=2e-4, rtol=1e-4)


def test_a_fused_head_trained_is_the_fused_head_served(fused, tmp_path):
    """The train/serve contract with fused features: a head made by the trainer with feature layers,
    exported and loaded by the engine, gives the trainer's teacher-forced logits."""
    from transformers import AutoModelForCausalLM

    from train.eagle_head import EagleHeadTrainer, head_logits_teacher_forced
    target = AutoModelForCausalLM.from_pretrained(fused["target"], dtype=torch.float32)
    head = EagleHeadTrainer.from_target(target, feature_layers=[2, 0, 1])
    assert head.feature_layers == FUSED_LAYERS and "fuse.weight" in head.state_dict()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    head.save_pretrained(tmp_path / "head", dtype=torch.float32)
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    assert_served_logits(fused, tmp_path / "head", ids, head_logits_teacher_forced(head, target, ids)[0])


def test_fused_feature_layers_must_be_layers_below_the_last(fused, tmp_path):
    for layers in ([3], [0, 0], [-1]):
        head = make_eagle_head(fused["target"], tmp_path / f"bad{len(layers)}{layers[0]}", feature_layers=layers)
        with pytest.raises(ValueError, match="feature layers must be distinct decoder layers"):
            Engine(EngineConfig(model=fused["target"], dtype="float32", speculative=eagle({"head": str(head)})))


def test_a_fused_feature_head_drafts_lossless_trees(fused, prompts):
    """An EAGLE-3-style head (fused target features at the root, its own outputs below) grows trees too."""
    plain = run(EngineConfig(model=fused["target"], dtype="float32"), prompts)[0]
    engine = Engine(EngineConfig(model=fused["target"], dtype="float32", speculative=eagle(fused, 4, tree_nodes=8)))
    trees = []
    assert run_requests(engine, prompts, GREEDY, lambda e: trees.append(e.last_stats.num_tree_drafts))[0] == plain
    assert sum(trees) > 0
