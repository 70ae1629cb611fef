"""What a proposer can offer a request is a value (issue 64): Proposer.offer answers without changing
the proposer, twice alike, and propose drafts within the offer handed back in each DraftJob. Checked
inside the engine's own steps for every proposer of an auto engine with draft trees (its greedy output
still plain decoding's), and directly on the copying proposers; proposers are built from one
registry and the router's map of them is read only."""
import pickle

import pytest
from helpers import branching_prompts, run_requests

from engine import SamplingParams
from engine.config import PROPOSERS, EngineConfig
from engine.engine import Engine
from engine.request import Request
from engine.setup import PROPOSER_BUILDERS
from engine.spec_decode.base import DraftJob, Offer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.suffix import SuffixProposer

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def state(proposer) -> bytes:
    """Everything the proposer keeps, but the networks it runs."""
    return pickle.dumps({k: v for k, v in vars(proposer).items() if k not in ("runner", "target")})


class Watched:
    """A proposer whose every offer is asked twice (the answers must agree and leave its state as it
    was) and whose proposals must keep to their jobs' offers; counts the drafts and trees it made."""

    def __init__(self, proposer):
        self.proposer, self.name = proposer, proposer.name
        self.drafted = self.trees = 0

    def offer(self, request, limit, max_nodes=0):
        before = state(self.proposer)
        offer = self.proposer.offer(request, limit, max_nodes)
        assert self.proposer.offer(request, limit, max_nodes) == offer
        assert state(self.proposer) == before
        assert offer.drafts <= limit and (offer.nodes == 0 or offer.drafts <= offer.nodes)
        return offer

    def propose(self, jobs):
        proposal = self.proposer.propose(jobs)
        for job, drafts, tree in zip(jobs, proposal.draft_token_ids, proposal.trees or [None] * len(jobs)):
            if tree is None:   # a chain: the plan's k at most, and what a copying proposer found
                assert len(drafts) <= min(job.k, job.offer.drafts)
                assert not job.offer.chain or drafts == list(job.offer.chain[:len(drafts)])
            else:              # a tree: within the nodes offered and the slots reserved
                assert 0 < len(tree) <= min(job.offer.nodes, job.num_lookahead)
                self.trees += 1
            self.drafted += len(drafts)
        return proposal

    def on_verified(self, request):
        self.proposer.on_verified(request)

    def on_finish(self, request_id):
        self.proposer.on_finish(request_id)


def prompts():
    return branching_prompts(2, (17,))


def test_offers_change_nothing_and_proposals_keep_to_them(tiny_pair):
    target, draft = map(str, tiny_pair)
    plain = run_requests(Engine(EngineConfig(model=target, dtype="float32")), prompts(), GREEDY)[0]
    spec = {"method": "auto", "proposers": ["draft", "ngram", "suffix"], "draft": {"model": draft},
            "num_speculative_tokens": 4, "adaptive": False, "tree_nodes": 8, "suffix": {"min_score": 1}}
    engine = Engine(EngineConfig(model=target, dtype="float32", speculative=spec))
    watched = {}
    for method, proposer in engine.spec.router.proposers.items():
        watched[method] = Watched(proposer)
        assert engine.spec.router.replace(method, watched[method]) is proposer
    assert run_requests(engine, prompts(), GREEDY)[0] == plain
    assert watched["draft"].drafted > 0 and watched["draft"].trees > 0   # a static plan: the first proposer


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), len(tokens), GREEDY, arrival_time=0.0, generator=None)


@pytest.mark.parametrize("proposer", [NgramProposer(1, 3), SuffixProposer(min_score=1)], ids=["ngram", "suffix"])
def test_a_copying_proposer_drafts_what_it_offered(proposer):
    stem = [7, 8, 9]
    request = _request("r", stem + [1, 2, 3, 4] + stem + [1, 2, 5, 6] + stem)
    before = state(proposer)
    offer = proposer.offer(request, 4, max_nodes=8)   # a request it has not seen: answered all the same
    assert state(proposer) == before
    proposer.on_verified(request)   # the outcome of a step is what moves its state
    assert proposer.offer(request, 4, max_nodes=8) == offer and state(proposer) != before
    assert offer.chain[:2] == (1, 2) and offer.drafts >= 2 and offer.nodes > offer.drafts
    chain = proposer.propose([DraftJob(request, 4, offer=offer)])
    assert chain.draft_token_ids == [list(offer.chain[:4])] and chain.trees is None
    tree = proposer.propose([DraftJob(request, offer.nodes, depth=offer.drafts, offer=offer)]).trees[0]
    assert tree.tokens[:tree.chain] == list(offer.chain[:tree.chain]) and len(tree) <= offer.nodes
    assert proposer.propose([DraftJob(request, 4, offer=Offer())]).draft_token_ids == [[]]   # nothing offered


def test_proposers_come_from_one_registry_and_the_router_hides_its_map(tiny_pair):
    assert set(PROPOSER_BUILDERS) == {"grammar", *PROPOSERS}
    engine = Engine(EngineConfig(model=str(tiny_pair[0]), dtype="float32",
                                 speculative={"method": "auto", "proposers": ["ngram", "suffix"]}))
    assert engine.spec.router.names == ["grammar", "ngram", "suffix"]   # the registry's order
    with pytest.raises(TypeError):
        engine.spec.router.proposers["ngram"] = NgramProposer(1, 2)
