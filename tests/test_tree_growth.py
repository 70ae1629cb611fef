"""TreeGrowth (engine/spec_decode/tree_growth.py): how a draft model's tree grows within its budget."""
from engine.spec_decode.tree_growth import TreeGrowth


def paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree))}


def test_the_drafts_own_chain_grows_first_and_reaches_the_depth_limit():
    growth = TreeGrowth(budget=5, max_depth=3, p_min=0.0, eos_token_ids=frozenset())
    growth.expand([([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1])])          # the root's top tokens
    assert len(growth.tree) == 3 and growth.frontier == [0, 1, 2]   # room left for two deeper nodes
    growth.expand([([5, 6], [0.9, 0.1])] * 3)                       # each frontier node's children
    assert len(growth.tree) == 4                                    # one more node: room for depth 3
    growth.expand([([7], [0.5])])
    tree = growth.result()
    assert len(tree) == 5 and growth.frontier == []
    assert tree.chain == 3 and tree.tokens[:3] == [1, 5, 7] and tree.is_chain is False   # the chain first
    assert tree.tokens[3:] == [2, 3]                                # then the alternatives, best first
    assert all(tree.parents[i] < i for i in range(len(tree)))


def test_p_min_cuts_alternatives_and_the_chain_past_its_first_node():
    growth = TreeGrowth(budget=8, max_depth=4, p_min=0.3, eos_token_ids=frozenset({9}))
    growth.expand([([1, 2], [0.2, 0.1])])      # below p_min: only the chain's first node
    assert growth.tree.tokens == [1] and growth.frontier == [0]
    growth.expand([([3], [0.5])])              # 0.2 x 0.5 < 0.3: the chain stops
    assert len(growth.tree) == 1 and growth.frontier == []
    eos = TreeGrowth(budget=8, max_depth=4, p_min=0.0, eos_token_ids=frozenset({9}))
    eos.expand([([9, 4], [0.6, 0.4])])         # an end of sequence is a leaf
    assert eos.tree.tokens == [9, 4] and eos.frontier == [1]


def test_the_budget_is_never_exceeded():
    growth = TreeGrowth(budget=3, max_depth=2, p_min=0.0, eos_token_ids=frozenset())
    growth.expand([([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1])])
    while growth.frontier:
        growth.expand([([5, 6, 7], [0.5, 0.3, 0.2])] * len(growth.frontier))
    assert len(growth.tree) == 3
