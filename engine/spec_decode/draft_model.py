"""A small causal LM that drafts up to k tokens per request, batched over its requests.

The draft shares the target's block tables (same block ids, its own KV buffers), so rollback,
preemption and freeing are the target's bookkeeping; the proposer keeps only how far its own cache
is valid for each request (a cursor). It catches up lazily: a request it has not drafted for in a
while (the policy chose n-gram or plain decoding) first gets every token it has not seen, in
the same batched forward as the others' last token; then one token per sequential batched forward.
A request stops drafting early when the draft is unsure: once the product of the draft's
probabilities of its own tokens falls below the plan's p_min (the confidence stop). A request the
engine offers a draft tree (speculative.tree_nodes) gets one grown from the draft's top tokens
(tree_growth.py): a forward per depth over the frontier's nodes, under the tree's mask; the draft's
cache then holds the tree, so its cursor stays at the root and the accepted path is fed again. A constrained
request (structured outputs) drafts from the draft's distribution under its grammar's mask, so it
never proposes a token verification would cut, and q is that masked distribution.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.decode_grid import work_clock
from engine.model_runner import ForwardItem, ModelRunner
from engine.request import Request
from engine.sampler import SamplingTensors, sample, warp_probs
from engine.spec_decode.base import DraftJob, Offer, Proposal
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.tree_growth import TreeGrowth
from engine.structured import mask_logits
from engine.step_costs import DraftForward


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, target_vocab_size: int, draft_temperature: float | None = None):
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.draft_temperature = draft_temperature
        self._cursors: dict[str, tuple[int, int]] = {}   # request id -> (its preemption count, valid tokens)

    # ---- the lifecycle ------------------------------------------------------------
    def cursor(self, request: Request) -> int:
        """Tokens of the request whose KV is valid in the draft's cache: none after a preemption
        (the blocks were freed), never more than the target's (rollback)."""
        preemptions, valid = self._cursors.get(request.request_id, (request.num_preemptions, 0))
        if preemptions != request.num_preemptions:
            return 0
        return min(valid, request.num_computed_tokens)

    def _set_cursor(self, request: Request, valid: int) -> None:
        self._cursors[request.request_id] = (request.num_preemptions, valid)

    def offer(self, request: Request, limit: int, max_nodes: int = 0) -> Offer:
        """limit drafts, after its catch-up; with max_nodes past the limit, a tree of that many nodes
        holding them (grown when it proposes, if the plan leaves room for alternatives)."""
        return Offer(limit, self.catch_up_tokens(request), max_nodes if max_nodes > limit else 0)

    def catch_up_tokens(self, request: Request) -> int:
        return max(0, request.num_computed_tokens - self.cursor(request))

    def on_verified(self, request: Request) -> None:
        if request.request_id in self._cursors:
            self._set_cursor(request, self.cursor(request))

    def on_finish(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)

    # ---- drafting ----------------------------------------------------------------
    def propose(self, items: list[DraftJob]) -> Proposal:
        growing = {a for a, item in enumerate(items) if item.wants_tree and item.offer.nodes}
        if not growing:
            return self._propose_chains(items)
        if len(growing) == len(items):
            return self._propose_trees(items)
        return self._draft(items, growing)

    def _propose_chains(self, items: list[DraftJob]) -> Proposal:
        return self._draft(items, set())

    def _propose_trees(self, items: list[DraftJob]) -> Proposal:
        return self._draft(items, set(range(len(items))))

    def _draft(self, items: list[DraftJob], growing: set[int]) -> Proposal:
        """A chain for each job not in `growing`, a tree for each one in it, drafted together: one
        catch-up forward for all, then one forward per depth that feeds each chain its newest token
        and each tree its frontier (each node seeing the context and its ancestors)."""
        requests = [item.request for item in items]
        params = [self._draft_params(r.params) for r in requests]
        drafts: list[list[int]] = [[] for _ in items]
        growths = {g: TreeGrowth(items[g].num_lookahead, items[g].k, items[g].p_min, requests[g].eos_token_ids,
                                 items[g].tree_p_min) for g in growing}
        active = [a for a in range(len(items)) if a not in growing]   # chains still drafting
        feeding = sorted(growing)                                      # trees with a frontier to feed
        rows, catch_up = len(items), sum(self.catch_up_tokens(r) for r in requests)
        started = work_clock()
        logits = self._fit_vocab(self._catch_up(items))   # a row per job, in job order
        # q matters only to chain rows verified by rejection sampling: greedy and seeded (coupled) rows
        # accept by the target's own choice, and tree nodes are deterministic (zero rows).
        needs_q = any(not requests[a].params.greedy and requests[a].noise is None for a in active)
        draft_probs = logits.new_zeros(len(items), max(items[a].k for a in active), logits.shape[-1]) \
            if needs_q else None
        chain_logits, tree_logits = _rows(logits, active), _rows(logits, feeding)
        confidence, forwards, step = [1.0] * len(items), [], 0   # forwards: each draft step, timed
        while True:
            if active:
                self._extend_chains(chain_logits, requests, params, active, drafts, confidence, step, draft_probs)
            if feeding:
                self._expand_trees(tree_logits, [requests[g] for g in feeding], [growths[g] for g in feeding])
            # The .tolist() calls of the choices waited for the device: the step is over.
            forwards.append(DraftForward(self.name, rows, catch_up, work_clock() - started))
            active = [a for a in active if items[a].k > step + 1 and confidence[a] >= items[a].p_min
                      and drafts[a][-1] not in requests[a].eos_token_ids]   # nothing follows an end
            feeding = [g for g in feeding if growths[g].frontier]
            if not active and not feeding:
                break
            step, started, catch_up = step + 1, work_clock(), 0
            rows = len(active) + sum(len(growths[g].frontier) for g in feeding)
            logits = self._fit_vocab(self._feed([items[a] for a in active], [drafts[a] for a in active],
                                                [items[g] for g in feeding], [growths[g] for g in feeding]))
            chain_logits, tree_logits = logits[:len(active)], logits[len(active):]
        trees: list[DraftTree | None] = [None] * len(items)
        for g, growth in growths.items():
            tree = growth.result()
            drafts[g], trees[g] = tree.tokens, None if tree.is_chain else tree
        return Proposal(drafts, draft_probs, forwards, trees if any(t is not None for t in trees) else None)

    def _extend_chains(self, logits: torch.Tensor, requests: list[Request], params: list, active: list[int],
                       drafts: list[list[int]], confidence: list[float], step: int,
                       draft_probs: torch.Tensor | None) -> None:
        """Each active chain's next draft token from its row of logits (its grammar's mask applied),
        and the draft's confidence in it. requests, params: every job's (its draft sampling settings)."""
        requests, params = [requests[a] for a in active], [params[a] for a in active]
        _mask_by_grammar(logits, requests, [drafts[a] for a in active])
        if all(p.greedy for p in params):
            tokens, own = greedy_choice(logits)
        else:
            tokens, own = self._sampled_choice(logits, requests, params, step, draft_probs, active)
        for a, token, p in zip(active, tokens, own):
            drafts[a].append(token)
            confidence[a] *= p

    def _expand_trees(self, logits: torch.Tensor, requests: list[Request], growths: list[TreeGrowth]) -> None:
        """Each growing tree's frontier scored from its rows (a row per frontier node, in order)."""
        probs = self._confidences(logits, [r for r, growth in zip(requests, growths) for _ in growth.frontier])
        top, tokens = probs.topk(min(max(growth.room for growth in growths), probs.shape[-1]), dim=-1)
        top, tokens, row = top.tolist(), tokens.tolist(), 0
        for growth in growths:
            width = len(growth.frontier)
            growth.expand(list(zip(tokens[row:row + width], top[row:row + width])))
            row += width

    def _confidences(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The draft's distribution of each row's next token, as it would draw it: softmax for
        greedy requests, warped by the request's (draft) sampling settings for the others."""
        params = [self._draft_params(r.params) for r in requests]
        if all(p.greedy for p in params):
            return logits.float().softmax(dim=-1)
        return warp_probs(logits, SamplingTensors.from_params(params, logits.device))

    @staticmethod
    def _sampled_choice(logits: torch.Tensor, requests: list[Request], params: list, step: int,
                        draft_probs: torch.Tensor | None, active: list[int]) -> tuple[list[int], list[float]]:
        """Draft tokens of rows that may sample, and the draft's confidence in each: q for sampled
        rows; for greedy rows (whose q is one-hot) the draft's own softmax. Writes q into
        draft_probs (the rows rejection sampling verifies)."""
        tensors = SamplingTensors.from_params(params, logits.device)
        probs = warp_probs(logits, tensors)
        noise = [None if r.noise is None else r.noise.at(r.num_output_tokens + step)
                 for r in requests]   # seeded requests draft with the noise the target will draw with
        tokens = sample(probs, tensors.is_greedy, [r.generator for r in requests], noise)
        sure = torch.where(tensors.is_greedy.unsqueeze(1), logits.float().softmax(dim=-1), probs)
        own = sure.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if draft_probs is not None:
            draft_probs[torch.tensor(active, device=probs.device), step] = probs
        return tokens.tolist(), own.tolist()

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, draft_vocab] -> [n, target_vocab]: embedding tables padded to different sizes
        share one tokenizer; rows past the shorter table are padding, so q gives them no mass."""
        vocab = logits.shape[-1]
        if vocab == self.target_vocab_size:
            return logits
        if vocab > self.target_vocab_size:
            return logits[:, :self.target_vocab_size]
        return torch.nn.functional.pad(logits, (0, self.target_vocab_size - vocab), value=float("-inf"))

    def _draft_params(self, params):
        if self.draft_temperature is None or params.greedy:
            return params
        return dataclasses.replace(params, temperature=self.draft_temperature)

    def _catch_up(self, items: list[DraftJob]) -> torch.Tensor:
        """Feed the draft every token of each request up to its last one; logits for the first draft."""
        forward = []
        for item in items:
            request = item.request
            end = request.num_tokens
            start = min(self.cursor(request), end - 1)   # always feed >= 1 token
            forward.append(ForwardItem(request.token_ids[start:end], start, request.block_table, 1))
            self._set_cursor(request, end)
        return self.runner.forward(forward)

    def _feed(self, chains: list[DraftJob], drafts: list[list[int]], trees: list[DraftJob],
              growths: list[TreeGrowth]) -> torch.Tensor:
        """One forward: each chain's newest draft token (its cursor moves past it), then each tree's
        frontier (its newest nodes, at the slots after the nodes before them, each seeing the context
        and its ancestors; the cursor stays at the root: these positions hold guesses). Logits for
        what follows each fed token, in that order."""
        forward = []
        for item, tokens in zip(chains, drafts):
            request = item.request
            position = request.num_tokens + len(tokens) - 1
            forward.append(ForwardItem([tokens[-1]], position, request.block_table, 1))
            self._set_cursor(request, position + 1)
        return self.runner.forward(forward + frontier_items(trees, growths, lambda r: r.num_tokens))


def frontier_items(items: list[DraftJob], growths: list[TreeGrowth], root) -> list[ForwardItem]:
    """Each tree's frontier as one forward item: node n at slot root(request) + n (the root is the
    request's last token, its children from the next slot on), under the tree's mask."""
    return [ForwardItem([growth.tree.tokens[n] for n in growth.frontier], root(item.request) + growth.frontier[0],
                        item.request.block_table, len(growth.frontier), growth.feed_mask())
            for item, growth in zip(items, growths)]


def _rows(logits: torch.Tensor, jobs: list[int]) -> torch.Tensor:
    """The rows of these jobs (every row, as is, when they are all the jobs in order)."""
    if len(jobs) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(jobs, dtype=torch.long, device=logits.device))


def greedy_choice(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Greedy rows' draft tokens (argmax, lowest index on ties, as the sampler) and the draft's
    softmax probability of each, exp(max - logsumexp): none of the sampling tensors, one-hot rows
    and full softmax that the sampled path builds every step (on a GPU, where the forward replays
    as one graph, those small launches are much of a draft step)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    own = (logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)).exp()
    return tokens.tolist(), own.tolist()


def _mask_by_grammar(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> None:
    """Rows of constrained requests keep only the tokens their grammar allows after the draft so far."""
    for row, (request, draft) in enumerate(zip(requests, drafts)):
        if request.grammar is not None:
            allowed = request.grammar.mask_after(draft)
            if allowed.any():   # nothing allowed: the request is at its end, verification stops it
                mask_logits(logits[row], allowed)

