"""Unit tests for engine/spec_decode/rejection.py: edge cases, reproducibility, and a
statistical check that speculative sampling emits exactly the target's distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import pooled_chisquare

from engine.sampler import sample
from engine.spec_decode.rejection import rejection_sample


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot(token: int, vocab: int) -> list[float]:
    return [1.0 if i == token else 0.0 for i in range(vocab)]


def run(target, drafts, num_draft, draft_probs=None, greedy=None, generators=None):
    target = torch.tensor(target, dtype=torch.float32)
    batch = target.shape[0]
    return rejection_sample(
        target,
        torch.tensor(drafts, dtype=torch.long).reshape(batch, -1),
        torch.tensor(num_draft, dtype=torch.long),
        None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32),
        torch.tensor(greedy if greedy is not None else [False] * batch),
        generators if generators is not None else [seeded(i) for i in range(batch)],
    )


# ---------------------------------------------------------------------------
# Hand-built edge cases


def test_greedy_all_accepted_emits_bonus_and_draws_nothing():
    p = [[0.1, 0.7, 0.2, 0.0], [0.0, 0.2, 0.3, 0.5], [0.6, 0.1, 0.1, 0.2], [0.2, 0.2, 0.5, 0.1]]
    gen = seeded(1)
    state = gen.get_state()
    out, accepted = run([p], [[1, 3, 0]], [3], greedy=[True], generators=[gen])
    assert out.tolist() == [[1, 3, 0, 2]] and accepted.tolist() == [3]
    assert torch.equal(gen.get_state(), state)


def test_greedy_first_mismatch_emits_target_argmax():
    p = [[0.1, 0.2, 0.7, 0.0], [0.0, 0.2, 0.3, 0.5], [0.6, 0.1, 0.1, 0.2], [0.2, 0.2, 0.5, 0.1]]
    out, accepted = run([p], [[2, 1, 0]], [3], greedy=[True])  # 2 ok, then argmax 3 != 1
    assert out.tolist() == [[2, 3, -1, -1]] and accepted.tolist() == [1]
    out, accepted = run([p], [[0, 3, 0]], [3], greedy=[True])
    assert out.tolist() == [[2, -1, -1, -1]] and accepted.tolist() == [0]


def test_greedy_ties_pick_lowest_index():
    p = [[0.4, 0.1, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]]
    assert run([p], [[2]], [1], greedy=[True])[0].tolist() == [[0, -1]]
    assert run([p], [[0]], [1], greedy=[True])[0].tolist() == [[0, 0]]


def test_sampled_q_equal_p_one_hot_always_accepts():
    vocab = 5
    drafts = [4, 0, 2]
    p = [one_hot(t, vocab) for t in drafts] + [one_hot(3, vocab)]
    q = [one_hot(t, vocab) for t in drafts]
    for seed in range(20):
        out, accepted = run([p], [drafts], [3], draft_probs=[q], generators=[seeded(seed)])
        assert out.tolist() == [[4, 0, 2, 3]] and accepted.tolist() == [3]


def test_p_zero_where_q_positive_always_rejects_and_recovers_from_residual():
    # p(draft) = 0: always rejected; residual max(0, p - q) = [0.5, 0, 0, 0]: token 0
    p = [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]
    q = [[0.0, 0.5, 0.5, 0.0]]
    batch = 200
    out, accepted = run([p] * batch, [[2]] * batch, [1] * batch, draft_probs=[q] * batch)
    assert accepted.tolist() == [0] * batch
    assert out.tolist() == [[0, -1]] * batch


def test_zero_drafts_is_plain_sampling_of_the_bonus():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 11, 64
    p = torch.randn(batch, 3, vocab, generator=gen).softmax(-1)
    drafts = torch.full((batch, 2), -1)
    out, accepted = rejection_sample(
        p, drafts, torch.zeros(batch, dtype=torch.long), torch.rand(batch, 2, vocab),
        torch.zeros(batch, dtype=torch.bool), [seeded(100 + b) for b in range(batch)],
    )
    expected = sample(p[:, 0], torch.zeros(batch, dtype=torch.bool), [seeded(100 + b) for b in range(batch)])
    assert accepted.tolist() == [0] * batch
    assert out[:, 0].tolist() == expected.tolist()
    assert (out[:, 1:] == -1).all()


def test_no_draft_positions_at_all():
    p = torch.tensor([[[0.0, 1.0, 0.0]], [[0.2, 0.3, 0.5]]])
    out, accepted = rejection_sample(
        p, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), None,
        torch.tensor([False, True]), [seeded(0), None],
    )
    assert out.tolist() == [[1], [2]] and accepted.tolist() == [0, 0]


def test_one_hot_draft_accepts_with_probability_p():
    # q one-hot at token 1 (draft_probs=None): accept with prob p(1) = 0.3; on
    # rejection the residual is p without token 1: [0.2, 0, 0.5] / 0.7
    p = [[0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]
    batch = 4000
    out, accepted = run([p] * batch, [[1]] * batch, [1] * batch, generators=[seeded(7 + b) for b in range(batch)])
    accept_rate = accepted.float().mean().item()
    assert abs(accept_rate - 0.3) < 4 * (0.3 * 0.7 / batch) ** 0.5
    assert (out[accepted == 1].tolist() == [[1, 2]] * int(accepted.sum()))
    recovered = out[accepted == 0, 0]
    assert set(recovered.tolist()) == {0, 2}
    share_of_0 = (recovered == 0).float().mean().item()
    assert abs(share_of_0 - 0.2 / 0.7) < 4 * (0.29 * 0.71 / len(recovered)) ** 0.5


def test_all_zero_draft_row_means_one_hot():
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 32, 3, 6
    p = torch.randn(batch, k + 1, vocab, generator=gen).softmax(-1)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    greedy = torch.zeros(batch, dtype=torch.bool)
    q = torch.randn(batch, k, vocab, generator=gen).softmax(-1)
    one_hot_rows = torch.arange(batch) % 2 == 0
    q[one_hot_rows] = 0.0
    mixed = rejection_sample(p, drafts, num_draft, q, greedy, [seeded(b) for b in range(batch)])
    as_none = rejection_sample(p, drafts, num_draft, None, greedy, [seeded(b) for b in range(batch)])
    as_full = rejection_sample(p, drafts, num_draft, q, greedy, [seeded(b) for b in range(batch)])
    assert torch.equal(mixed[0][one_hot_rows], as_none[0][one_hot_rows])
    assert torch.equal(mixed[0][~one_hot_rows], as_full[0][~one_hot_rows])


def test_mixed_batch_padding_and_counts():
    vocab = 4
    target = [
        # greedy, 3 drafts, all match -> bonus argmax 2
        [one_hot(1, vocab), one_hot(0, vocab), one_hot(3, vocab), one_hot(2, vocab)],
        # sampled, 0 drafts: bonus from row 0 (deterministic); rows 1.. are padding
        [one_hot(3, vocab), [0.25] * 4, [0.25] * 4, [0.25] * 4],
        # sampled, 2 drafts, one-hot targets matching -> both accepted, bonus from row 2
        [one_hot(2, vocab), one_hot(2, vocab), one_hot(1, vocab), [0.25] * 4],
        # greedy, 1 draft, mismatch -> argmax of row 0
        [[0.1, 0.1, 0.1, 0.7], [0.25] * 4, [0.25] * 4, [0.25] * 4],
        # sampled, 3 drafts: first accepted, p(second) = 0 -> rejected, residual max(0, p - q) = [.5, 0, 0, 0]
        [one_hot(3, vocab), [0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.25] * 4],
    ]
    drafts = [[1, 0, 3], [-1, -1, -1], [2, 2, 9], [0, 7, 7], [3, 3, 1]]
    q = [[one_hot(t, vocab) if 0 <= t < vocab else [0.0] * 4 for t in row] for row in drafts]
    q[4][1] = [0.0, 0.5, 0.0, 0.5]
    for seed in range(10):  # every row here is deterministic whatever the random draws
        generators = [seeded(10 * seed + b) for b in range(5)]
        out, accepted = run(
            target, drafts, [3, 0, 2, 1, 3], draft_probs=q, greedy=[True, False, False, True, False], generators=generators
        )
        assert accepted.tolist() == [3, 0, 2, 0, 1]
        assert out.tolist() == [
            [1, 0, 3, 2],
            [3, -1, -1, -1],
            [2, 2, 1, -1],
            [3, -1, -1, -1],
            [3, 0, -1, -1],
        ]


def test_residual_all_zero_falls_back_to_p():
    # q slightly above p everywhere: p(draft) < q(draft) can reject, and the
    # residual max(0, p - q) is all zero, so the token is drawn from p.
    p = [[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]]
    q = [[0.0, 0.61, 0.41]]
    batch = 300
    out, accepted = run([p] * batch, [[1]] * batch, [1] * batch, draft_probs=[q] * batch)
    rejected = out[accepted == 0, 0]
    assert len(rejected) > 0
    assert set(rejected.tolist()) <= {1, 2}


# ---------------------------------------------------------------------------
# Random draws: order, and reproducibility whatever the batch


def test_random_draw_order_per_sampled_row():
    vocab = 9
    gen = seeded(42)
    p = torch.full((1, 4, vocab), 1.0 / vocab)
    rejection_sample(p, torch.tensor([[0, 1, 2]]), torch.tensor([2]), None, torch.tensor([False]), [gen])
    reference = seeded(42)
    torch.rand(2, generator=reference)
    torch.empty(vocab).exponential_(generator=reference)
    assert torch.equal(gen.get_state(), reference.get_state())


def test_same_seed_same_output_alone_and_in_batch():
    gen = torch.Generator().manual_seed(9)
    vocab = 12
    mine_p = torch.randn(5, vocab, generator=gen).softmax(-1)     # K up to 4
    mine_q = torch.randn(4, vocab, generator=gen).softmax(-1)
    mine_drafts = torch.multinomial(mine_q, 1, generator=gen).flatten()

    def run_in(position: int, batch: int, k: int, steps: int = 3):
        other_p = torch.randn(batch, k + 1, vocab, generator=seeded(position + 50)).softmax(-1)
        other_q = torch.randn(batch, k, vocab, generator=seeded(position + 51)).softmax(-1)
        drafts = torch.randint(0, vocab, (batch, k), generator=seeded(position + 52))
        num_draft = torch.randint(0, k + 1, (batch,), generator=seeded(position + 53))
        greedy = torch.arange(batch) % 3 == 1
        other_p[position, :3] = mine_p[:3]
        other_q[position, :2] = mine_q[:2]
        drafts[position, :2] = mine_drafts[:2]
        num_draft[position], greedy[position] = 2, False
        mine = seeded(777)
        gens = [seeded(1000 + i) if i % 2 else None for i in range(batch)]
        gens[position] = mine
        results = []
        for _ in range(steps):
            out, accepted = rejection_sample(other_p, drafts, num_draft, other_q, greedy, gens)
            results.append((out[position, :3].tolist(), int(accepted[position])))
        return results

    alone = run_in(0, 1, 2)
    assert len(set(map(str, alone))) > 1  # the generator advances between calls
    assert run_in(2, 4, 2) == alone
    assert run_in(5, 7, 4) == alone   # wider padding, other sizes
    assert run_in(1, 3, 3) == alone


# ---------------------------------------------------------------------------
# Statistical losslessness


VOCAB, K, ROWS, CONTEXT = 8, 3, 20_000, 0


def lookup_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target P[prev] and draft Q[prev] ([V, V], rows sum to 1) with zeros in
    different places, so acceptance, p = 0 under q > 0 and the residual all matter."""
    rng = np.random.default_rng(1234)
    target = rng.gamma(0.7, size=(VOCAB, VOCAB)) * (rng.random((VOCAB, VOCAB)) > 0.25)
    draft = rng.gamma(0.7, size=(VOCAB, VOCAB)) * (rng.random((VOCAB, VOCAB)) > 0.25)
    target[:, 0] += 0.05  # no all-zero row
    draft[:, 1] += 0.05
    target /= target.sum(1, keepdims=True)
    draft /= draft.sum(1, keepdims=True)
    return torch.tensor(target, dtype=torch.float32), torch.tensor(draft, dtype=torch.float32)


def speculative_batch(one_hot_drafts: bool):
    """ROWS independent verifications from CONTEXT, each with 0..K drafts sampled from Q."""
    target, draft = lookup_tables()
    gen = seeded(5)
    num_draft = torch.randint(0, K + 1, (ROWS,), generator=gen)
    num_draft[: ROWS // 2] = K  # half the rows exercise the full K-token chain
    prev = torch.full((ROWS,), CONTEXT)
    drafts, target_rows, draft_rows = [], [target[prev]], []
    for _ in range(K):
        draft_rows.append(draft[prev])
        prev = torch.multinomial(draft[prev], 1, generator=gen).flatten()
        drafts.append(prev)
        target_rows.append(target[prev])
    drafts = torch.stack(drafts, 1)
    target_probs = torch.stack(target_rows, 1)
    draft_probs = torch.stack(draft_rows, 1)
    # padding past num_draft must not matter: garbage there
    pad = torch.arange(K + 1).unsqueeze(0) > num_draft.unsqueeze(1)
    target_probs[pad] = 1.0 / VOCAB
    drafts[pad[:, :K]] = -1
    draft_probs[pad[:, :K]] = torch.rand(int(pad[:, :K].sum()), VOCAB, generator=gen)
    return target, target_probs, drafts, num_draft, None if one_hot_drafts else draft_probs


def first_three_tokens(target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Completes rows that emitted fewer than 3 tokens by sampling from the target chain."""
    gen = seeded(6)
    tokens = out[:, :3].clone()
    for j in range(1, 3):
        missing = tokens[:, j] < 0
        tokens[missing, j] = torch.multinomial(target[tokens[missing, j - 1]], 1, generator=gen).flatten()
    return tokens


def chi_square_pvalues(target: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float]:
    """p-values of (first token marginal, joint of the first three), exact target
    probabilities, cells with expected count < 5 pooled."""
    t = target.double().numpy()
    first = t[CONTEXT]
    joint = first[:, None, None] * t[:, :, None] * t[None, :, :]  # P(a) P(b|a) P(c|b)
    observed_first = np.bincount(tokens[:, 0].numpy(), minlength=VOCAB)
    flat = (tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]).numpy()
    observed_joint = np.bincount(flat, minlength=VOCAB**3)
    return pooled_chisquare(observed_first, first), pooled_chisquare(observed_joint, joint.flatten())


def always_accept(target_probs, drafts, num_draft, draft_probs, is_greedy, generators):
    """Broken: emits every draft (p made one-hot at each draft), then the bonus."""
    forced = target_probs.clone()
    valid = torch.arange(K).unsqueeze(0) < num_draft.unsqueeze(1)
    judging = forced[:, :K]
    judging[valid] = torch.nn.functional.one_hot(drafts[valid], VOCAB).float()
    return rejection_sample(forced, drafts, num_draft, None, is_greedy, generators)


def recover_from_p(target_probs, drafts, num_draft, draft_probs, is_greedy, generators):
    """Broken: correct acceptance, but the recovered token comes from p, not the residual."""
    out, accepted = rejection_sample(target_probs, drafts, num_draft, draft_probs, is_greedy, generators)
    rejected = (accepted < num_draft).nonzero().flatten()
    fresh = torch.multinomial(target_probs[rejected, accepted[rejected]], 1, generator=seeded(8)).flatten()
    out[rejected, accepted[rejected]] = fresh
    return out, accepted


def run_statistical(sampler, one_hot_drafts: bool, unseeded: bool = False) -> tuple[float, float]:
    """unseeded: every row draws from the global RNG (drawn for all rows in one call), else each
    from its own generator."""
    target, target_probs, drafts, num_draft, draft_probs = speculative_batch(one_hot_drafts)
    torch.manual_seed(11)
    generators = [None if unseeded else seeded(10_000 + b) for b in range(ROWS)]
    out, accepted = sampler(target_probs, drafts, num_draft, draft_probs, torch.zeros(ROWS, dtype=torch.bool), generators)
    assert torch.equal((out >= 0).sum(1), accepted + 1)
    return chi_square_pvalues(target, first_three_tokens(target, out))


@pytest.mark.slow   # chi-square: thousands of samples
@pytest.mark.parametrize("unseeded", [False, True], ids=["own-generators", "global-rng"])
@pytest.mark.parametrize("one_hot_drafts", [False, True], ids=["draft-probs", "one-hot-drafts"])
def test_emitted_tokens_follow_the_target_distribution(one_hot_drafts, unseeded):
    p_first, p_joint = run_statistical(rejection_sample, one_hot_drafts, unseeded)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


@pytest.mark.parametrize("broken", [always_accept, recover_from_p])
def test_statistical_test_rejects_a_broken_sampler(broken):
    p_first, p_joint = run_statistical(broken, one_hot_drafts=False)
    assert min(p_first, p_joint) < 1e-3, (p_first, p_joint)


def test_coupled_rows_emit_the_targets_own_draws_and_draw_nothing():
    """Seeded rows (PositionalNoise) come with the target's draw per row: accept while it equals the
    draft, then emit it; q and the row's generator play no part."""
    p = torch.full((3, 4, 5), 0.2)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    choice = torch.tensor([[1, 2, 4, 0], [1, 2, 3, 4], [-1, -1, -1, -1]])   # row 2: not coupled
    gens = [seeded(0), seeded(1), seeded(2)]
    states = [g.get_state() for g in gens]
    out, accepted = rejection_sample(p, drafts, torch.tensor([3, 3, 0]), torch.rand(3, 3, 5),
                                     torch.tensor([False, False, False]), gens, choice)
    assert accepted.tolist() == [2, 3, 0]
    assert out[0].tolist() == [1, 2, 4, -1] and out[1].tolist() == [1, 2, 3, 4]
    assert torch.equal(gens[0].get_state(), states[0]) and torch.equal(gens[1].get_state(), states[1])
    assert not torch.equal(gens[2].get_state(), states[2])   # the ordinary sampled row drew its numbers


def test_positional_noise_depends_on_seed_and_position_only():
    from engine.sampler import PositionalNoise

    a, b = PositionalNoise(7, 50, "cpu"), PositionalNoise(7, 50, "cpu")
    assert torch.equal(a.at(3), b.at(3)) and not torch.equal(a.at(3), a.at(4))
    assert not torch.equal(a.at(3), PositionalNoise(8, 50, "cpu").at(3))
    first = a.at(5).clone()
    a.forget_before(10)
    assert torch.equal(a.at(5), first)   # forgotten, then drawn again: the same numbers


def test_greedy_fast_path_emits_what_the_general_path_does(monkeypatch):
    """verify._accept's shortcut for plain greedy rows (argmax per row, no [B, K+1, V] distributions)
    against the general path on the same logits: drafts that match the argmax for a while, fully,
    not at all, none at all; ties resolved to the lowest index by both."""
    from types import SimpleNamespace

    from engine import verify
    from engine.sampling_params import SamplingParams
    from engine.spec_decode.base import Proposal

    rng = np.random.default_rng(0)
    vocab, lengths = 50, [0, 1, 3, 4, 4, 2]
    logits = torch.tensor(rng.integers(0, 6, size=(sum(n + 1 for n in lengths), vocab)), dtype=torch.float32)  # ties
    best = logits.argmax(dim=-1).tolist()
    drafts, sample_rows, row = [], {}, 0
    for i, n in enumerate(lengths):
        truth = best[row:row + n]
        keep = [n, n, 1, n, 0, 2][i]   # how many drafts agree with the target before the first miss
        drafts.append(truth[:keep] + [(t + 1) % vocab for t in truth[keep:]])
        sample_rows[i] = list(range(row, row + n + 1))
        row += n + 1
    request = SimpleNamespace(params=SamplingParams(temperature=0.0), noise=None, generator=None,
                              output_token_ids=[], token_ids=[], num_prompt_tokens=0, num_output_tokens=0)
    scheduled = [SimpleNamespace(request=request) for _ in lengths]

    def accept() -> verify.VerifyResult:
        result = verify.VerifyResult([[] for _ in lengths], [0] * len(lengths), [None] * len(lengths),
                                     [[] for _ in lengths])
        verify._accept(scheduled, Proposal(drafts, None), logits, sample_rows, result)
        return result

    fast = accept()
    monkeypatch.setattr(verify, "_plain_greedy", lambda params: False)
    general = accept()
    assert fast.token_ids == general.token_ids and fast.num_accepted == general.num_accepted
    assert fast.num_accepted == [0, 1, 1, 4, 0, 2]
