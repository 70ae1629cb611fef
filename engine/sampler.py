"""Sampling: penalties, warping logits into probabilities, drawing tokens, logprobs.

Everything here is a pure function of batched tensors (one row per logits row);
the engine builds the inputs once per step. The warped distributions returned by
`warp_probs` are what speculative verification compares (target p, draft q), so
they must be the exact distributions `sample` draws from.

Sampling uses the exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) i.i.d.
picks token i with probability p_i / sum(p). It needs no normalisation and no
cumulative sums, and each row consumes exactly one draw of V exponentials from
its own generator, so a seeded request draws the same numbers in the same order
whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampling_params import _GREEDY_EPS, SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling settings as device tensors. Shapes are [N]."""

    temperature: Tensor  # float32; rows with temperature < 1e-5 are greedy
    top_k: Tensor        # int64, 0 = off
    top_p: Tensor        # float32, 1.0 = off
    min_p: Tensor        # float32, 0.0 = off
    # Host-side summaries, filled by from_params so warp_probs never has to
    # read the device to decide which work to skip. None: computed on demand.
    needs_sort: bool | None = None    # some sampled row uses top-k or top-p
    needs_min_p: bool | None = None   # some sampled row uses min-p
    all_greedy: bool | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "SamplingTensors":
        sampled = [p for p in params if not p.greedy]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
            needs_min_p=any(p.min_p > 0.0 for p in sampled),
            all_greedy=not sampled,
        )

    @property
    def is_greedy(self) -> Tensor:
        return self.temperature < _GREEDY_EPS

    def _flags(self) -> tuple[bool, bool, bool]:
        if self.needs_sort is None or self.needs_min_p is None or self.all_greedy is None:
            sampled = ~self.is_greedy
            self.needs_sort = bool(((self.top_k > 0) | (self.top_p < 1.0)).logical_and(sampled).any())
            self.needs_min_p = bool((self.min_p > 0.0).logical_and(sampled).any())
            self.all_greedy = not bool(sampled.any())
        return self.needs_sort, self.needs_min_p, self.all_greedy


# ---------------------------------------------------------------------------
# Penalties


def apply_penalties(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> Tensor:
    """Presence / frequency / repetition penalties, per row; returns a new tensor.

    logits: [N, V]. Presence and frequency count the row's output tokens (OpenAI
    semantics); repetition (CTRL / HF style: positive logits divided, negative
    multiplied) applies to every token seen in prompt + output. The input is not
    modified: the engine still needs the raw logits for logprobs.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device, vocab_size = logits.device, logits.shape[-1]
    counts = _token_counts([output_token_ids[i] for i in rows], vocab_size, device)       # [M, V]
    in_prompt = _token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    presence = column([params[i].presence_penalty for i in rows])
    frequency = column([params[i].frequency_penalty for i in rows])
    repetition = column([params[i].repetition_penalty for i in rows])

    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    selected = logits[row_index].float()   # index_select is far slower on vocab-wide rows (CPU)
    seen = in_prompt | (counts > 0)
    scaled = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, scaled, selected)
    selected = selected - frequency * counts - presence * (counts > 0).float()

    out = logits.clone()
    out.index_copy_(0, row_index, selected.to(logits.dtype))
    return out


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> Tensor:
    """[M, V] float32 occurrence counts. Rows are padded with the id V, which
    lands in a scratch column that is dropped."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


# ---------------------------------------------------------------------------
# Warping


def warp_probs(logits: Tensor, t: SamplingTensors) -> Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k,
    top-p and min-p, renormalised. Greedy rows are one-hot at argmax (lowest
    index on ties, as torch.argmax).

    Semantics (as vLLM / HF): top-k keeps every token whose logit is >= the k-th
    largest (ties at the boundary are kept); top-p, on the top-k-renormalised
    distribution, keeps the smallest prefix of the descending order whose mass
    reaches top_p (token i is kept iff the mass strictly before it is < top_p;
    ties ordered by lower index first); min-p drops tokens with probability
    below min_p * max probability.
    """
    needs_sort, needs_min_p, all_greedy = t._flags()
    logits = logits.float()
    greedy = t.is_greedy
    greedy_one_hot = _one_hot_argmax(logits)
    if all_greedy:
        return greedy_one_hot

    temperature = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
    logits = logits / temperature.unsqueeze(1)
    if needs_sort:
        logits = _top_k_top_p(logits, t.top_k, t.top_p)
    probs = logits.softmax(dim=-1)
    if needs_min_p:
        threshold = t.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where(greedy.unsqueeze(1), greedy_one_hot, probs)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


# A sort of the whole vocabulary per row is the slow part of top-p on CPU (49k-token vocabularies,
# dozens of rows). The nucleus is almost always far smaller: filter among the best candidates, and
# sort in full only the rows whose kept set might reach past them.
TOP_CANDIDATES = 1024


def _top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Masks filtered tokens to -inf; rows with neither filter pass through untouched."""
    rows = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    out = logits.clone()
    if len(rows) == 0:
        return out
    # Advanced indexing, not index_select: on CPU that is far slower for vocabulary-wide rows.
    sub, sub_k, sub_p = logits[rows], top_k[rows], top_p[rows]
    filtered, exact = _filter_candidates(sub, sub_k, sub_p)
    if not bool(exact.all()):
        inexact = (~exact).nonzero().squeeze(1)
        filtered[inexact] = _filter_sorted(sub[inexact], sub_k[inexact], sub_p[inexact])
    out[rows] = filtered
    return out


def _mask_sorted(sorted_logits: Tensor, top_k: Tensor, top_p: Tensor, log_norm: Tensor | None = None) -> Tensor:
    """Top-k then top-p over logits sorted in descending order (the first columns of a row suffice when
    log_norm, the log-sum-exp of what top-k keeps of the whole row, is given)."""
    width = sorted_logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), torch.full_like(top_k, width))
    kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if log_norm is None:
        sorted_probs = sorted_logits.softmax(dim=-1)
    else:
        sorted_probs = (sorted_logits - log_norm.unsqueeze(1)).exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 rows are left alone: float rounding can push mass_before to 1.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return sorted_logits.masked_fill(drop, float("-inf"))


def _filter_sorted(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    return torch.empty_like(logits).scatter_(1, order, _mask_sorted(sorted_logits, top_k, top_p))


def _filter_candidates(logits: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Filtered logits from the TOP_CANDIDATES best tokens, and per row whether that is exact: the kept
    set must end before the last candidate (so no token outside them, tied or not, could be kept)."""
    vocab_size = logits.shape[-1]
    width = min(TOP_CANDIDATES, vocab_size)
    values, order = logits.topk(width, dim=-1, sorted=True)
    use_k = (top_k > 0) & (top_k < width)
    kth = values.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
    kept_by_k = values.masked_fill(values < kth.unsqueeze(1), float("-inf"))
    log_norm = torch.where(use_k, kept_by_k.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    masked = _mask_sorted(values, torch.where(use_k, top_k, torch.zeros_like(top_k)), top_p, log_norm)
    exact = (width == vocab_size) | torch.isinf(masked[:, -1])
    exact &= ~use_k | (values[:, -1] < kth)
    exact &= (top_k <= 0) | (top_k >= vocab_size) | use_k   # a top-k reaching past the candidates needs them all
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, masked)
    return out, exact


# ---------------------------------------------------------------------------
# Drawing tokens


def draw_exponentials(generators: list[torch.Generator | None], vocab_size: int, device) -> Tensor:
    """[len(generators), V] Exp(1) noise: exactly one draw of V numbers per row
    from that row's generator. Rows without a generator share the global RNG
    (not reproducible anyway), so they are drawn in one call."""
    noise = torch.empty(len(generators), vocab_size, dtype=torch.float32, device=device)
    unseeded = []
    for i, gen in enumerate(generators):
        if gen is None:
            unseeded.append(i)
        else:
            fill_exponential_(noise[i], gen)
    if unseeded:
        index = torch.tensor(unseeded, dtype=torch.long, device=device)
        noise.index_copy_(0, index, fill_exponential_(torch.empty(len(unseeded), vocab_size, device=device), None))
    return noise


def fill_exponential_(out: Tensor, generator: torch.Generator | None) -> Tensor:
    """Fills `out` in place with Exp(1) noise drawn from `generator` (one draw)."""
    out.exponential_(generator=generator)
    # exponential_ can return exactly 0; p / 0 would be inf (or nan for p = 0,
    # which argmax would then pick). The clamp's bias is far below float resolution.
    return out.clamp_min_(torch.finfo(torch.float32).tiny)


class PositionalNoise:
    """Exp(1) noise for a seeded request, keyed by (seed, output position) instead of drawn in order.

    A seeded request samples the token at output position j as argmax(p / E_j) (an exact draw from
    p), and its draft model drafts position j as argmax(q / E_j) with the same E_j. Verification then
    accepts a draft when the target's own draw equals it, and emits the target's draw at the first
    mismatch. Whatever the draft length, the proposer, the batch or a preemption, the token at
    position j is argmax(p_j / E_j): seeded output depends on the seed and the model alone. The price
    is acceptance: agreement under this coupling is below the 1 - TV(p, q) of rejection sampling
    (at least (1 - TV) / (1 + TV)); a deterministic draft (n-gram) loses nothing."""

    def __init__(self, seed: int, vocab_size: int, device):
        self.seed, self.vocab_size, self.device = seed, vocab_size, torch.device(device)
        self._cache: dict[int, Tensor] = {}

    def at(self, position: int) -> Tensor:
        noise = self._cache.get(position)
        if noise is None:
            generator = torch.Generator(device=self.device).manual_seed(_mix(self.seed, position))
            noise = fill_exponential_(torch.empty(self.vocab_size, device=self.device), generator)
            self._cache[position] = noise
        return noise

    def forget_before(self, position: int) -> None:
        for old in [p for p in self._cache if p < position]:
            del self._cache[old]


def _mix(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position): unrelated generator seeds for neighbouring positions."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def exponential_race(probs: Tensor, noise: Tensor) -> Tensor:
    """argmax(probs / noise) per row: a draw from probs (need not be normalised)."""
    return (probs / noise).argmax(dim=-1)


def sample(probs: Tensor, is_greedy: Tensor, generators: list[torch.Generator | None],
           noise: list[Tensor | None] | None = None) -> Tensor:
    """[N, V] probs -> [N] token ids. Greedy rows take the argmax and draw no
    random numbers; sampled rows use their given noise row (PositionalNoise) if any, else
    their own generator (None: global RNG)."""
    tokens = probs.argmax(dim=-1)
    given = noise or [None] * len(probs)
    sampled = [not greedy for greedy in is_greedy.tolist()]
    sampled_rows = [i for i, s in enumerate(sampled) if s and given[i] is None]
    if sampled_rows:
        index = torch.tensor(sampled_rows, dtype=torch.long, device=probs.device)
        drawn = draw_exponentials([generators[i] for i in sampled_rows], probs.shape[-1], probs.device)
        tokens[index] = exponential_race(probs[index], drawn)   # not index_select: slow on wide rows
    coupled = [i for i, s in enumerate(sampled) if s and given[i] is not None]
    if coupled:
        index = torch.tensor(coupled, dtype=torch.long, device=probs.device)
        tokens[index] = exponential_race(probs[index], torch.stack([given[i] for i in coupled]))
    return tokens


# ---------------------------------------------------------------------------
# Logprobs


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """log_softmax of the raw logits [N, V]: the logprob of token_ids [N], and the
    num_top best ids [N, num_top] with their logprobs, by descending logprob."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1, sorted=True)
    return chosen, top_ids, top_logprobs
