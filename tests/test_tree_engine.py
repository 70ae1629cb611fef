"""Draft trees in the engine's step (speculative.tree_nodes): n-gram and suffix drafts verified as
trees give plain decoding's greedy output, with every accepted path's KV where the next step reads
it (long outputs, preemption, the prefix cache's next turn); seeded requests keep their coupled
output; logprobs are the plain ones. The sampled walk's distribution is checked by the chi-square
tests in test_tree.py (the walk) and test_spec_decode.py (the engine)."""
import random

import pytest
from helpers import branching_prompts, make_scripted_checkpoint, make_tiny_checkpoint, run_requests

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tree") / "target", arch="qwen2", seed=0))


@pytest.fixture(scope="module")
def prompts():
    """Contexts in which the last tokens occurred before with different continuations: branching trees."""
    return branching_prompts(4, (5, 17))


def tree_config(target: str, method: str, tree_nodes: int = 8, **engine) -> EngineConfig:
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False, "tree_nodes": tree_nodes,
            "ngram": {"max": 3}, "suffix": {"min_score": 1}}
    return EngineConfig(model=target, dtype="float32", speculative=spec, **engine)


def generate(config: EngineConfig, prompts, params):
    """Outputs, finals and the number of passes that verified a tree."""
    engine = Engine(config)
    trees = []
    tokens, finals = run_requests(engine, prompts, params, lambda e: trees.append(e.last_stats.num_tree_drafts))
    return tokens, finals, sum(trees)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(target, prompts):
    return generate(EngineConfig(model=target, dtype="float32"), prompts, GREEDY)[0]


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_greedy_trees_are_lossless(target, prompts, plain, method):
    tokens, finals, trees = generate(tree_config(target, method), prompts, GREEDY)
    assert tokens == plain
    assert trees > 0
    assert sum(f.spec.accepted for f in finals) > 0


def test_greedy_trees_are_lossless_under_kv_pressure(target, prompts, plain):
    """Small blocks, a tight cache and token budget: trees across block edges, preemption and recomputation."""
    config = tree_config(target, "ngram", block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    tokens, _, trees = generate(config, prompts, GREEDY)
    assert tokens == plain and trees > 0


def test_seeded_output_does_not_depend_on_the_tree(target, prompts):
    """Coupled sampling: the tree walk accepts the target's own draw at each position."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    plain_seeded = generate(EngineConfig(model=target, dtype="float32"), prompts, params)[0]
    tokens, _, trees = generate(tree_config(target, "ngram"), prompts, params)
    assert tokens == plain_seeded and trees > 0


def logprobs_of(config: EngineConfig, prompts, params) -> tuple[list[list], int]:
    """Each request's logprobs as they streamed, and the passes that verified a tree."""
    engine = Engine(config)
    logprobs, trees = {str(i): [] for i in range(len(prompts))}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += out.new_logprobs or []
        trees += engine.last_stats.num_tree_drafts
    return [logprobs[str(i)] for i in range(len(prompts))], trees


def test_logprobs_of_a_tree_pass_are_the_plain_ones(target, prompts, plain):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    reference, _ = logprobs_of(EngineConfig(model=target, dtype="float32"), prompts, params)
    mine, trees = logprobs_of(tree_config(target, "ngram"), prompts, params)
    assert trees > 0
    for ours, theirs, tokens in zip(mine, reference, plain):
        assert [lp.token_id for lp in ours] == [lp.token_id for lp in theirs] == tokens
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in ours] == [[t for t, _ in lp.top] for lp in theirs]


def test_the_prefix_cache_never_holds_a_rejected_node(target, prompts):
    """The next turn of a conversation reuses the first turn's cached blocks: with trees they must hold
    the accepted path, not the nodes verified beside it."""
    first, params = prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = Engine(tree_config(target, "ngram", block_size=4))
    reply, _ = run_requests(engine, [first], GREEDY)
    follow_up = first + reply[0] + first[:6]
    assert len(engine.pool.match_prefix(follow_up)) * 4 >= len(first) + len(reply[0]) - 4   # the reply's blocks cached
    again, _ = run_requests(engine, [follow_up], params)
    reference, _, _ = generate(EngineConfig(model=target, dtype="float32", enable_prefix_caching=False), [follow_up],
                               params)
    assert again == reference


def test_a_tree_accepts_the_continuation_a_chain_misses(tmp_path):
    """A scripted target writes "abcdefgh" after "Z". The prompt holds "Za" three times, followed by
    "bcdefgh", "1" and "2": a chain drafts the newest continuation ("2Za", rejected), a tree holds all
    three and accepts "bc" at once. Both give the target's output."""
    model = str(make_scripted_checkpoint(tmp_path / "scripted", "abcdefgh"))
    prompt, params = list(b"ZabcdefghZa1Za2Z"), SamplingParams(max_tokens=8, temperature=0.0)
    outputs = {}
    for nodes in (0, 8):
        tokens, finals, trees = generate(tree_config(model, "ngram", tree_nodes=nodes), [prompt], params)
        outputs[nodes] = (tokens[0], finals[0].spec, trees)
    (chain_tokens, chain, chain_trees), (tree_tokens, tree, trees) = outputs[0], outputs[8]
    assert chain_tokens == tree_tokens == list(b"abcdefgh")
    assert chain_trees == 0 and trees == 1
    # the chain: "2Za" rejected, then "cdef" and "h"; the tree: "bc" and "d", then "efg" and "h"
    assert (chain.accepted, chain.target_forwards) == (4, 3) and (tree.accepted, tree.target_forwards) == (5, 2)


def test_the_policy_hears_what_a_trees_alternatives_promised_and_won(tmp_path):
    """The scripted tree above: after "Za" the chain "2Za" and five alternatives ("1", "1Z", "b", "bc",
    "1Za"), each the path of one of the three continuations, at chance 1/3; the target takes "bc", two of
    them. The policy hears 5/3 promised and 2 won, and for its rates the accepted path up to the chain's
    length (Engine._judged)."""
    model = str(make_scripted_checkpoint(tmp_path / "scripted", "abcdefgh"))
    engine = Engine(tree_config(model, "ngram"))
    outcomes = []
    engine.spec.policy.observe = lambda plan, outcome: outcomes.append(outcome)
    run_requests(engine, [list(b"ZabcdefghZa1Za2Z")], SamplingParams(max_tokens=8, temperature=0.0))
    trees = [v for outcome in outcomes for v in outcome.verified if v.alternatives_chance > 0]
    assert len(trees) == 1
    assert (trees[0].alternatives_chance, trees[0].alternatives_accepted) == (pytest.approx(5 / 3), 2)
    assert (trees[0].num_drafted, trees[0].num_accepted) == (3, 2)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("tree_drafts")
    return {"copy": target, "random": str(make_tiny_checkpoint(root / "draft", arch="llama", seed=7, num_layers=1,
                                                               hidden_size=32, num_heads=2, num_kv_heads=1))}


def draft_tree_config(target: str, draft: str, tree_nodes: int = 8, **engine) -> EngineConfig:
    spec = {"method": "draft", "draft": {"model": draft}, "num_speculative_tokens": 4, "adaptive": False,
            "tree_nodes": tree_nodes}
    return EngineConfig(model=target, dtype="float32", speculative=spec, **engine)


@pytest.mark.parametrize("draft", ["copy", "random"])
def test_greedy_draft_model_trees_are_lossless(target, prompts, plain, drafts, draft):
    """Trees grown from the draft model's top tokens, a depth per draft forward: plain decoding's output;
    a copy of the target as the draft has every path's first node accepted."""
    tokens, finals, trees = generate(draft_tree_config(target, drafts[draft]), prompts, GREEDY)
    assert tokens == plain and trees > 0
    if draft == "copy":   # its best path is the target's: at least as many tokens per pass as a chain of 4
        assert all(f.spec.target_forwards <= -(-(MAX_TOKENS - 1) // 5) for f in finals)


def test_draft_model_trees_under_kv_pressure_and_seeded(target, prompts, plain, drafts):
    config = draft_tree_config(target, drafts["random"], block_size=4, num_kv_blocks=48, max_num_batched_tokens=32)
    tokens, _, trees = generate(config, prompts, GREEDY)
    assert tokens == plain and trees > 0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    plain_seeded = generate(EngineConfig(model=target, dtype="float32"), prompts, params)[0]
    tokens, _, trees = generate(draft_tree_config(target, drafts["random"]), prompts, params)
    assert tokens == plain_seeded and trees > 0


def test_one_requests_tree_pass_stays_on_row_independent_linears(target):
    """bf16 linears switch to oneDNN's GEMM from a row count timed at load (at least 16): the engine
    keeps every pass of up to one request's largest tree (1 + tree_nodes rows) below it, so a tree
    row's logits are the decode row's and greedy trees give plain decoding's tokens at one stream."""
    from engine.models.streamed_linear import StreamedLinear

    engine = Engine(tree_config(target, "ngram", tree_nodes=24, quantization="bf16"))
    linears = [m for m in engine.target.model.modules() if isinstance(m, StreamedLinear)]
    assert linears and all(m.native_rows is None or m.native_rows >= 25 for m in linears)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, prompts):
    """A Mistral target whose 72-position window the prompts (each over 80 tokens) and outputs cross,
    with its draft, and its plain greedy output."""
    root = tmp_path_factory.mktemp("tree_window")
    target = str(make_tiny_checkpoint(root / "target", arch="mistral", seed=4, sliding_window=72))
    draft = str(make_tiny_checkpoint(root / "draft", arch="mistral", seed=5, num_layers=1, hidden_size=32,
                                     num_heads=2, num_kv_heads=1, sliding_window=72))
    rng = random.Random(9)
    long_prompts = [[rng.randrange(256) for _ in range(60)] + prompt for prompt in prompts[:4]]
    return target, draft, long_prompts, generate(EngineConfig(model=target, dtype="float32"), long_prompts, GREEDY)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_trees_under_a_sliding_window_are_lossless(windowed, method):
    """A windowed target takes trees (its window is wider than any tree): n-gram and draft-model
    trees, the draft windowed too, give plain decoding's output."""
    target, draft, long_prompts, plain_out = windowed
    config = draft_tree_config(target, draft) if method == "draft" else tree_config(target, "ngram")
    tokens, _, trees = generate(config, long_prompts, GREEDY)
    assert tokens == plain_out and trees > 0


def test_a_narrow_window_keeps_chains(tmp_path, prompts, caplog):
    target = str(make_tiny_checkpoint(tmp_path / "narrow", arch="mistral", seed=4, sliding_window=32))
    engine = Engine(tree_config(target, "ngram"))
    assert engine.spec.tree_nodes == 0 and "sliding window (32 positions) could cut a draft tree" in caplog.text


def test_a_mixed_batch_drafts_its_chains_and_trees_in_the_same_forwards(target, prompts, drafts):
    """A request with a repetition penalty drafts a chain (its penalties judge one history) beside
    requests that draft trees: the draft model serves both in one catch-up forward and then one
    forward per depth, never more forwards than the longest chain has tokens; greedy output is plain
    decoding's."""
    params = [GREEDY] + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                        repetition_penalty=1.3)] + [GREEDY] * (len(prompts) - 2)
    plain_out = generate(EngineConfig(model=target, dtype="float32"), prompts, params)[0]
    engine = Engine(draft_tree_config(target, drafts["random"]))
    proposer = engine.spec.router.proposers["draft"]
    calls, mixed = [0], []
    forward, draft = proposer.runner.forward, proposer._draft
    proposer.runner.forward = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or forward(*a, **k)

    def counted(items, growing):
        before = calls[0]
        proposal = draft(items, growing)
        if 0 < len(growing) < len(items):
            mixed.append((calls[0] - before, len(proposal.forwards), max(item.k for item in items)))
        return proposal
    proposer._draft = counted
    tokens, _ = run_requests(engine, prompts, params)
    assert tokens == plain_out
    assert mixed and all(made == timed <= longest for made, timed, longest in mixed), mixed
