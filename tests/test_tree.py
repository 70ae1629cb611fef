"""Draft trees (engine/spec_decode/tree.py): their shape (depths, paths, the ancestor mask tree
attention needs), and lossless verification: greedy and coupled walks give plain decoding's tokens
whatever the tree, and sampled walks follow the target's distribution (chi-square of the first two
tokens over branching trees of deterministic and sampled children, duplicates included), with
negative controls that must fail. A synthetic target over a small vocabulary: no model."""
import itertools
import random

import numpy as np
import pytest
import torch
from helpers import pooled_chisquare

import engine.spec_decode.tree as tree_module
from engine.spec_decode.tree import DraftTree, chain_first, cut, target_choices, verify_tree

VOCAB = 6


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    """The synthetic target's p after a prefix: a fixed random distribution per prefix."""
    generator = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, dim=0)


def draft(prefix: tuple[int, ...]) -> torch.Tensor:
    """A draft close to the target but not equal: acceptance high, rejections frequent enough."""
    generator = torch.Generator().manual_seed((hash(prefix) + 7) % (2**31))
    return torch.softmax(torch.log(target(prefix)) + torch.randn(VOCAB, generator=generator) * 0.8, dim=0)


def rows(tree: DraftTree, context: tuple[int, ...]) -> torch.Tensor:
    """What the target pass gives: p after the root, then after each node (its path as the prefix)."""
    prefixes = [context] + [context + tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree))]
    return torch.stack([target(prefix) for prefix in prefixes])


def test_tree_shape():
    tree = DraftTree()
    a, b = tree.add(3), tree.add(1)
    a1, a2, b1 = tree.add(4, a), tree.add(0, a), tree.add(2, b)
    a11 = tree.add(5, a1)
    assert tree.children(-1) == [a, b] and tree.children(a) == [a1, a2] and tree.children(a11) == []
    assert tree.depths() == [1, 1, 2, 2, 2, 3] and tree.path(a11) == [a, a1, a11]
    mask = tree.ancestor_mask()
    assert mask[a11].tolist() == [True, False, True, False, False, True]
    assert mask[b1].tolist() == [False, True, False, False, True, False]
    with pytest.raises(ValueError, match="not a node"):
        tree.add(1, parent=9)
    with pytest.raises(ValueError, match="already a deterministic child"):
        tree.add(4, parent=a)
    tree.add(4, parent=a, q=torch.full((VOCAB,), 1 / VOCAB))   # a sampled repeat is kept


def random_tree(rng: random.Random, context, generator, sampled: bool) -> DraftTree:
    """Up to 3 children a node, depth up to 3: deterministic top tokens of the draft and (sampled)
    children drawn from the draft's q, duplicates and all."""
    tree = DraftTree()
    frontier = [-1]
    for _ in range(3):
        nxt = []
        for node in frontier:
            prefix = context + (tuple(tree.tokens[n] for n in tree.path(node)) if node >= 0 else ())
            q = draft(prefix)
            for token in q.argsort(descending=True)[:rng.randint(0, 2)].tolist():
                nxt.append(tree.add(token, node))
            for _ in range(rng.randint(0, 2) if sampled else 0):
                nxt.append(tree.add(int(torch.multinomial(q, 1, generator=generator)), node, q))
        frontier = nxt
    return tree


@pytest.mark.parametrize("coupled", [False, True])
def test_greedy_and_coupled_walks_give_plain_decodings_tokens(coupled):
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    for trial in range(200):
        context = (trial % 5, trial % 3)
        tree = random_tree(rng, context, generator, sampled=False)
        noise = [torch.empty(VOCAB).exponential_(generator=generator) for _ in range(5)] if coupled else None
        emitted, accepted = verify_tree(tree, choices=target_choices(rows(tree, context), tree.depths(), noise))
        plain, prefix = [], context
        for position in range(len(emitted)):   # plain decoding, token by token
            p = target(prefix)
            token = int(p.argmax()) if not coupled else int((p / noise[position]).argmax())
            plain.append(token)
            prefix += (token,)
        assert emitted == plain and [tree.tokens[n] for n in accepted] == emitted[:-1]
        assert accepted == tree.path(accepted[-1]) if accepted else True


def two_token_counts(trials: int, seed: int) -> np.ndarray:
    """Counts of the first two output tokens: a tree step, then plain sampling where it emitted one."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB, VOCAB))
    context = (1, 2)
    for _ in range(trials):
        tree = random_tree(rng, context, generator, sampled=True)
        emitted, _ = verify_tree(tree, rows(tree, context), generator)
        if len(emitted) < 2:
            emitted.append(int(torch.multinomial(target(context + (emitted[0],)), 1, generator=generator)))
        counts[emitted[0], emitted[1]] += 1
    return counts


def exact_two_tokens() -> np.ndarray:
    context = (1, 2)
    first = target(context)
    return np.array([[float(first[a] * target(context + (a,))[b]) for b in range(VOCAB)] for a in range(VOCAB)])


@pytest.mark.slow   # chi-square: thousands of samples
def test_sampled_walks_follow_the_target():
    counts, exact = two_token_counts(12000, seed=1), exact_two_tokens()
    assert pooled_chisquare(counts, exact) > 1e-3
    assert pooled_chisquare(counts.sum(axis=1), exact.sum(axis=1)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["no_residual", "drop_repeats"])
def test_the_chi_square_catches_a_wrong_walk(monkeypatch, broken):
    """Controls: a rejected candidate that leaves p as it was (the residual skipped), and sampled
    children whose repeats are dropped (a repeat's residual step skipped): both must fail."""
    if broken == "no_residual":
        monkeypatch.setattr(tree_module, "_residual", lambda p, token, q: p)
    else:
        real_add = DraftTree.add

        def add(self, token, parent=-1, q=None):
            for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
                if t == token and p == parent:
                    return i   # the repeat is not added
            return real_add(self, token, parent, q)

        monkeypatch.setattr(DraftTree, "add", add)
    counts, exact = two_token_counts(12000, seed=2), exact_two_tokens()
    assert pooled_chisquare(counts, exact) < 1e-3


def _attend_on(runner, path: str) -> None:
    """The runner's attention on `path`: the kernel (what start-up chose here), or the torch reference
    padded with one mask."""
    from engine.attention_backends import TorchBackend

    if path != "kernel":
        runner.attention = TorchBackend(runner.block_size, runner.device, group_sequences=path == "sequences")


@pytest.mark.parametrize("arch, path", [("llama", "kernel"), ("llama", "padded"), ("qwen3", "kernel")])
def test_a_tree_pass_gives_each_node_its_paths_logits(tmp_path, arch, path):
    """Tree attention (ForwardItem.tree_mask; fp32 on this CPU: the attention kernel's tree bits, or the
    padded torch reference's mask): one pass over a branching tree gives every node the logits of a plain
    pass over the context and that node's path, beside a chain in the same pass."""
    from helpers import make_tiny_checkpoint

    from engine import LLM
    from engine.model_runner import ForwardItem

    checkpoint = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=5)
    runner = LLM(str(checkpoint), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8,
                 skip_tokenizer_init=True).engine.target
    assert runner.fused_ops and runner.attention.name == "kernel"   # fp32 on an AVX2 CPU: auto picks the kernel
    _attend_on(runner, path)
    context, table = list(range(20, 39)), [3, 4, 5, 6]
    runner.forward([ForwardItem(context[:-1], 0, table, 1)])
    tree = DraftTree()
    a, b = tree.add(7), tree.add(9)
    a1, a2, b1 = tree.add(11, a), tree.add(12, a), tree.add(13, b)
    tree.add(14, a1)
    fed = [context[-1]] + tree.tokens
    mask = np.zeros((len(fed), len(fed)), dtype=bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.ancestor_mask().numpy()
    chain = ForwardItem([5, 6, 7], 4, [9], 3)   # another sequence in the same pass, causal
    runner.forward([ForwardItem([1, 2, 3, 4], 0, [9], 0)])
    logits = runner.forward([ForwardItem(fed, len(context) - 1, table, len(fed), mask), chain])
    expected_chain = logits[len(fed):]
    for row, node in enumerate([-1] + list(range(len(tree)))):
        tokens = context + ([tree.tokens[n] for n in tree.path(node)] if node >= 0 else [])
        reference = runner.forward([ForwardItem(tokens, 0, [20, 21, 22, 23, 24], 1)])[0]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)
    runner.forward([ForwardItem([1, 2, 3, 4], 0, [10], 0)])
    torch.testing.assert_close(runner.forward([ForwardItem([5, 6, 7], 4, [10], 3)]), expected_chain,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["kernel", "padded", "grid"])
def test_a_tree_pass_under_a_sliding_window(tmp_path, path):
    """A windowed target (Mistral, window 72) over a 90-token context, so the window cuts it: every
    node of a branching tree, fed at once and beside a chain, gets the logits of a plain pass over the
    context and its path (a node's window starts from its depth's position, not its slot's), on the
    kernel, the padded torch path and the decode grid that CUDA graphs capture (run eagerly here)."""
    from helpers import make_tiny_checkpoint

    from engine import LLM
    from engine.model_runner import ForwardItem

    checkpoint = make_tiny_checkpoint(tmp_path / "m", arch="mistral", seed=12, sliding_window=72)
    runner = LLM(str(checkpoint), dtype="float32", device="cpu", num_kv_blocks=128, block_size=8,
                 skip_tokenizer_init=True).engine.target
    _attend_on(runner, "padded" if path == "padded" else "kernel")
    if path == "grid":
        runner.enable_decode_grid(max_seqs=4, max_query_len=16, max_blocks=16, pad=True, capture=False)
    context = [(7 * i) % 250 + 3 for i in range(90)]
    table = list(range(1, 14))
    runner.forward([ForwardItem(context[:-1], 0, table, 1)])
    tree = DraftTree()
    a, b = tree.add(7), tree.add(9)
    a1, b1 = tree.add(11, a), tree.add(13, b)
    tree.add(12, a), tree.add(14, a1), tree.add(15, b1)
    fed = [context[-1]] + tree.tokens
    runner.forward([ForwardItem([1, 2, 3, 4], 0, [20], 0)])
    passes = []
    if path == "grid":
        run = runner.decode_grid.run
        runner.decode_grid.run = lambda items: passes.append(len(items)) or run(items)
    logits = runner.forward([ForwardItem(fed, len(context) - 1, table, len(fed), tree.fed_mask()),
                             ForwardItem([5, 6, 7], 4, [20], 3)])
    assert passes == ([2] if path == "grid" else [])
    for row, node in enumerate([-1] + list(range(len(tree)))):
        tokens = context + ([tree.tokens[n] for n in tree.path(node)] if node >= 0 else [])
        reference = runner.forward([ForwardItem(tokens, 0, list(range(30, 43)), 1)])[0]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)
    runner.forward([ForwardItem([1, 2, 3, 4], 0, [21], 0)])
    torch.testing.assert_close(runner.forward([ForwardItem([5, 6, 7], 4, [21], 3)]), logits[len(fed):],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_a_narrow_window_refuses_trees(backend):
    from engine.attention_backends import KernelBackend, TorchBackend
    from engine.attention_metadata import PassLayout

    tree = np.array([[1, 0], [1, 1]], dtype=bool)
    chosen = {"kernel": KernelBackend, "torch": TorchBackend}[backend](16, torch.device("cpu"))
    with pytest.raises(ValueError, match="sliding window over 64 positions, not 32"):
        chosen.build(PassLayout([2], [40], [[0, 1, 2]], [tree]), sliding_window=32)


def test_the_accepted_paths_kv_moves_where_the_next_step_reads_it(tmp_path):
    """After a tree pass, the accepted path's keys and values are copied to consecutive positions
    (ModelRunner.move_kv): the next decode step then gives the logits of a plain pass over the
    context, the path and the next token."""
    from helpers import make_tiny_checkpoint

    from engine import LLM
    from engine.model_runner import ForwardItem

    runner = LLM(str(make_tiny_checkpoint(tmp_path / "t", arch="llama", seed=6)), dtype="float32", device="cpu",
                 num_kv_blocks=64, block_size=4, skip_tokenizer_init=True).engine.target
    context, table = list(range(30, 43)), [3, 4, 5, 6, 7, 8]
    runner.forward([ForwardItem(context[:-1], 0, table, 1)])
    tree = DraftTree()
    a, b = tree.add(7), tree.add(9)
    a1, b1 = tree.add(11, a), tree.add(13, b)
    b11 = tree.add(15, b1)
    fed = [context[-1]] + tree.tokens
    mask = np.zeros((len(fed), len(fed)), dtype=bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.ancestor_mask().numpy()
    start = len(context) - 1
    runner.forward([ForwardItem(fed, start, table, len(fed), mask)])
    accepted = tree.path(b11)   # the second branch: its nodes sit at fed indices 2, 4, 5
    runner.move_kv(table, [start + 1 + n for n in accepted], [start + 1 + d for d in range(len(accepted))])
    path = [tree.tokens[n] for n in accepted]
    following = runner.forward([ForwardItem([21], len(context) + len(path), table, 1)])[0]
    reference = runner.forward([ForwardItem(context + path + [21], 0, [20, 21, 22, 23, 24, 25], 1)])[0]
    torch.testing.assert_close(following, reference, rtol=1e-4, atol=1e-4)
    other = [30, 31, 32, 33, 34, 35]   # the same without the move: the next step reads the wrong nodes
    runner.forward([ForwardItem(context[:-1], 0, other, 1)])
    runner.forward([ForwardItem(fed, start, other, len(fed), mask)])
    unmoved = runner.forward([ForwardItem([21], len(context) + len(path), other, 1)])[0]
    assert not torch.allclose(unmoved, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["kernel", "padded"])
def test_a_tree_fed_level_by_level_gives_each_node_its_paths_logits(tmp_path, path):
    """As a draft model grows a tree: each pass feeds one depth's nodes after the ones fed before, its
    mask over all the tree's positions so far (ForwardItem.tree_mask [fed, cols]); every node gets
    the logits of a plain pass over the context and its path."""
    from helpers import make_tiny_checkpoint

    from engine import LLM
    from engine.model_runner import ForwardItem

    runner = LLM(str(make_tiny_checkpoint(tmp_path / "t", arch="llama", seed=8)), dtype="float32", device="cpu",
                 num_kv_blocks=64, block_size=4, skip_tokenizer_init=True).engine.target
    _attend_on(runner, path)
    context, table = list(range(40, 57)), [3, 4, 5, 6, 7, 8, 9]
    runner.forward([ForwardItem(context, 0, table, 1)])   # the root (the context's last token) computed
    tree = DraftTree()
    tree.add(7), tree.add(9)                      # depth 1
    tree.add(11, 0), tree.add(12, 0), tree.add(13, 1)   # depth 2
    tree.add(14, 2)                               # depth 3
    levels, logits = [(0, 2), (2, 5), (5, 6)], {}
    full = tree.ancestor_mask().numpy()
    for lo, hi in levels:
        item = ForwardItem(tree.tokens[lo:hi], len(context) + lo, table, hi - lo, full[lo:hi, :hi])
        for node, row in zip(range(lo, hi), runner.forward([item])):
            logits[node] = row
    for node in range(len(tree)):
        tokens = context + [tree.tokens[n] for n in tree.path(node)]
        reference = runner.forward([ForwardItem(tokens, 0, [20, 21, 22, 23, 24, 25], 1)])[0]
        torch.testing.assert_close(logits[node], reference, rtol=1e-4, atol=1e-4)


def test_tree_rows_equal_chain_rows_bit_for_bit_in_the_kernel(tmp_path):
    """The attention kernel reads a tree row's context and path as a chain row reads its consecutive
    positions: every node's logits equal, bit for bit, those of a chain verification pass over its
    path (and so plain decoding's, which chains equal), so greedy output with trees is plain decoding's
    whatever near ties the numerics meet."""
    from helpers import make_tiny_checkpoint

    from engine import LLM
    from engine.model_runner import ForwardItem

    runner = LLM(str(make_tiny_checkpoint(tmp_path / "t", arch="qwen3", seed=9)), dtype="float32", device="cpu",
                 num_kv_blocks=64, block_size=4, skip_tokenizer_init=True).engine.target
    assert runner.fused_ops
    context = list(range(60, 76))                 # 4 blocks, shared by the tree's table and the chains'
    runner.forward([ForwardItem(context[:-1], 0, [3, 4, 5, 6], 1)])
    tree = DraftTree()
    a, b = tree.add(7), tree.add(9)
    a1, b1 = tree.add(11, a), tree.add(13, b)
    tree.add(12, a), tree.add(15, b1)
    start = len(context) - 1
    logits = runner.forward([ForwardItem([context[-1]] + tree.tokens, start, [3, 4, 5, 6, 7, 8], len(tree) + 1,
                                         tree.fed_mask())])
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in tree.path(node)]
        chain = runner.forward([ForwardItem([context[-1]] + path, start, [3, 4, 5, 6, 9, 10], len(path) + 1)])
        assert torch.equal(logits[1 + node], chain[-1]), node
        assert torch.equal(logits[0], chain[0])


def test_a_tree_holds_the_chain_first_and_adds_alternatives_that_pay():
    """chain_first puts the proposer's own chain first; cut keeps the chain the plan asked for and the
    alternatives whose probability clears p_min (the break-even chance of a row), within the slots."""
    tree = DraftTree()
    a, b = tree.add(4), tree.add(7)
    a1, a2, b1 = tree.add(5, a), tree.add(6, a), tree.add(8, b)
    probs = [0.6, 0.4, 0.3, 0.3, 0.4]
    first = chain_first(tree, probs, [4, 6, 99])
    assert first.chain == 3 and first.tokens[:3] == [4, 6, 99] and first.chances[:3] == [0.6, 0.3, 0.3]   # 99: added back
    kept = cut(first, chain_length=2, max_nodes=8, p_min=0.35)
    assert kept.tokens == [4, 6, 7, 8] and kept.chain == 2   # 5 (0.3) does not pay; 7 and 8 (0.4) do
    assert [kept.tokens[n] for n in kept.path(3)] == [7, 8]
    assert cut(first, chain_length=2, max_nodes=3, p_min=0.0).tokens == [4, 6, 7]
    assert cut(first, chain_length=1, max_nodes=8, p_min=0.5).tokens == [4]


def test_a_tree_keeps_its_nodes_chances_to_judge_its_alternatives():
    """The proposer's chances travel with the nodes through chain_first and cut; alternatives() sets the
    alternatives' summed chance against how many of them the accepted path holds (what calibrates the bar)."""
    tree = DraftTree()
    a, b = tree.add(4), tree.add(7)
    tree.add(5, a), tree.add(8, b)
    first = chain_first(tree, [0.6, 0.4, 0.5, 0.3], [4, 5])
    assert first.chances == [0.6, 0.5, 0.4, 0.3]
    kept = cut(first, chain_length=2, max_nodes=8, p_min=0.35)
    assert kept.tokens == [4, 5, 7] and kept.chances == [0.6, 0.5, 0.4]
    assert kept.alternatives(accepted=[2]) == (pytest.approx(0.4), 1)
    assert kept.alternatives(accepted=[0, 1]) == (pytest.approx(0.4), 0)
    assert DraftTree([1, 2], [-1, -1]).alternatives([1]) == (0.0, 0)   # no chances given: nothing to judge
