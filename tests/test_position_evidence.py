"""Copying proposers' per-draft evidence (spec_decode/estimates.py's PositionCalibration and
CalibrationRatio, the keys suffix and n-gram drafting report) and the controller planning on it: a
long copy drafts deep while a short guess in the same batch drafts nothing, and a request whose own
drafts fail where the traffic's succeed stops drafting."""
from __future__ import annotations

import random

from engine.spec_decode.base import length_bucket
from engine.spec_decode.controller import SpecController
from engine.spec_decode.estimates import CalibrationRatio, PositionCalibration
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.suffix import SuffixDraft, SuffixIndex
from test_controller import MAX_K, costs

COPY, GUESS = ("copy",), ("guess",)   # two evidence keys: one accepted 95% of the time, one 10%


def calibrated(rates: dict[tuple, float], judged: int = 400, seed: int = 0) -> SpecController:
    """A controller over a free proposer whose positions with each key were accepted at its rate."""
    controller = SpecController(["suffix"], MAX_K, costs(0.004), explore=False)
    rng = random.Random(seed)
    for key, rate in rates.items():
        for _ in range(judged):
            controller.calibration.observe("suffix", [key], int(rng.random() < rate))
    return controller


def plan(controller: SpecController, evidence: dict[str, list]) -> dict[str, int]:
    candidates = [(rid, {"suffix": len(keys)}, {"suffix": 0}) for rid, keys in evidence.items()]
    plans = controller.plan(candidates, evidence={rid: {"suffix": keys} for rid, keys in evidence.items()})
    return {rid: 0 if p.probe else p.k for rid, p in plans.items()}


def test_length_bucket():
    assert [length_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 400)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_calibration_learns_each_keys_rate_and_shrinks_unseen_keys_to_the_prior():
    calibration = PositionCalibration()
    for _ in range(300):
        calibration.observe("suffix", [COPY, COPY, GUESS], 2)   # copies accepted, the guess rejected
    assert calibration.rate("suffix", COPY, prior=0.5) > 0.95
    assert calibration.rate("suffix", GUESS, prior=0.5) < 0.05
    assert calibration.rate("suffix", ("never seen",), prior=0.3) == 0.3
    assert calibration.rate("ngram", COPY, prior=0.3) == 0.3   # per proposer


def test_ratio_starts_neutral_and_follows_the_requests_own_luck():
    ratio = CalibrationRatio()
    assert ratio.ratio() == 1.0
    for _ in range(10):
        ratio.observe([0.9], 0)   # the calibration promised 0.9, the request's drafts failed
    assert ratio.ratio() < 0.5
    for _ in range(200):
        ratio.observe([0.5], 1)
    assert 1.5 < ratio.ratio() <= 2.0


def test_a_long_copy_drafts_deep_while_a_guess_in_the_same_batch_drafts_nothing():
    controller = calibrated({COPY: 0.95, GUESS: 0.1})
    ks = plan(controller, {"copying": [COPY] * MAX_K, "guessing": [GUESS] * MAX_K})
    assert ks["copying"] >= 6 and ks["guessing"] == 0
    # a draft that starts as a guess and runs into a copy is priced as a guess for its first token
    mixed = plan(controller, {"mixed": [GUESS] + [COPY] * (MAX_K - 1)})["mixed"]
    assert mixed == 0


def test_evidence_plans_differ_from_one_rate_plans():
    """Same history, one engine-wide rate (0.52 pooled) against per-key rates: the pooled rate
    drafts the guess and the copy alike; the evidence tells them apart."""
    with_evidence = calibrated({COPY: 0.95, GUESS: 0.1})
    pooled = calibrated({COPY: 0.95, GUESS: 0.1})
    pooled.use_evidence = False
    for controller in (with_evidence, pooled):
        rng = random.Random(1)
        for _ in range(200):
            controller.global_counts["suffix"].observe(1, int(rng.random() < 0.52))
    evidence = {"copying": [COPY] * MAX_K, "guessing": [GUESS] * MAX_K}
    ks = plan(with_evidence, evidence)
    one_rate = plan(pooled, evidence)
    assert one_rate["copying"] == one_rate["guessing"]
    assert ks["copying"] > one_rate["copying"] and ks["guessing"] < max(one_rate["guessing"], 1)


def test_a_request_whose_copies_fail_stops_drafting_and_calibration_learns_from_it():
    controller = calibrated({COPY: 0.95})
    evidence = {"unlucky": [COPY] * MAX_K}
    assert plan(controller, evidence)["unlucky"] >= 6
    before = controller.calibration.rate("suffix", COPY, prior=0.5)
    ks = []
    while len(ks) < 40 and (not ks or ks[-1] > 0):   # its copies are rejected at the first token
        ks.append(plan(controller, evidence)["unlucky"])
        controller.observe("unlucky", "suffix", max(ks[-1], 1), 0)
    # one token stays worth a row down to ~13% acceptance at these costs: it drafts less, then stops
    assert ks[3] <= 2 and ks[-1] == 0 and len(ks) <= 30, ks
    assert controller.states["unlucky"].ratios["suffix"].ratio() < 0.5
    assert controller.calibration.rate("suffix", COPY, prior=0.5) < before
    # another request with the same evidence still drafts: its ratio is its own
    assert plan(controller, {"other": [COPY] * MAX_K})["other"] >= 4


def test_evidence_plans_have_no_confidence_stop():
    controller = calibrated({COPY: 0.95})
    plans = controller.plan([("r", {"suffix": MAX_K}, {"suffix": 0})], evidence={"r": {"suffix": [COPY] * MAX_K}})
    assert plans["r"].k >= 6 and plans["r"].p_min == 0.0


def test_suffix_evidence_describes_each_draft():
    index = SuffixIndex()
    index.extend([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 3, 4, 0])   # "5 6 7 8" twice: followed by 9, then by 3
    index.close_document()
    draft = index.lookup([0, 6, 7, 8], k=3, max_match=8, min_prob=0.0)
    assert draft.match_length == 3 and draft.support == (1, 1, 1)   # 9 and 3 split the first token
    evidence = draft.evidence()
    assert len(evidence) == len(draft.token_ids)
    # position j: a match of 3 + j tokens, one occurrence agreeing, half (or all) of them, own context
    assert evidence[0] == (length_bucket(3), 0, 1, False)
    assert evidence[1] == (length_bucket(4), 0, 2, False)
    assert SuffixDraft([1], [0.25], 1, 1, (1,), shared=True).evidence() == [(0, 0, 0, True)]


def test_ngram_match_reports_its_length():
    index = NgramIndex(1, 4)
    index.extend([1, 2, 3, 4, 5, 6, 1, 2, 3, 4])
    assert index.match(3) == ([5, 6, 1], 4)
    assert index.lookup(3) == [5, 6, 1]
    assert NgramIndex(2, 4).match(3) == ([], 0)
