"""Structured outputs (engine/structured.py): grammars compile or fail naming the problem, the output
matches its grammar, speculation under a grammar keeps plain decoding's tokens, and drafts are cut at
their first forbidden token."""
import json

import pytest
import torch
from helpers import make_noisy_copy, make_tiny_checkpoint, one_worker_queue

from engine import LLM, SamplingParams
from engine.structured import StructuredOutput, constrain

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["alpha", "beta", "gamma"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
SPECS = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput("regex", "[0-9]{3}-[a-c]{2}"),
    "choice": StructuredOutput.choice(["yes please", "no thanks", "maybe"]),
    "grammar": StructuredOutput("grammar", 'start: "(" item ("," item)? ("," item)? ")"\nitem: "x" | "yy"'),
}


def matches(kind: str, text: str) -> bool:
    import re

    if kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"ok", "tag"} and isinstance(value["ok"], bool) and value["tag"] in ("alpha", "beta", "gamma")
    if kind == "regex":
        return re.fullmatch("[0-9]{3}-[a-c]{2}", text) is not None
    if kind == "choice":
        return text in ("yes please", "no thanks", "maybe")
    return re.fullmatch(r"\((x|yy)(,(x|yy)){0,2}\)", text) is not None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = make_tiny_checkpoint(root / "target", arch="qwen2", seed=0)
    return str(target), str(make_noisy_copy(target, root / "draft", noise=0.1))


PROMPTS = ["Answer in the format asked: ", "x x x x x x x x", "((x,yy,x,yy,x,yy"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def greedy(llm: LLM, spec: StructuredOutput, max_tokens: int = 40):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec)
    return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def plain(models):
    return LLM(models[0], dtype="float32")


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_output_matches_its_grammar(plain, kind):
    for out in greedy(plain, SPECS[kind]):
        assert out.finish_reason == "stop", out
        assert matches(kind, out.text), out.text


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_speculation_under_a_grammar_keeps_plain_decodings_tokens(models, plain, method):
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft":
        spec["draft"] = {"model": models[1]}
    llm = LLM(models[0], dtype="float32", speculative=spec)
    proposed = 0
    for kind in sorted(SPECS):
        expected = [o.token_ids for o in greedy(plain, SPECS[kind])]
        outs = greedy(llm, SPECS[kind])
        assert [o.token_ids for o in outs] == expected, kind
        proposed += sum(o.spec.proposed for o in outs)
    if method == "draft":
        assert proposed > 0


def test_a_draft_is_cut_at_its_first_token_the_grammar_forbids(plain):
    from types import SimpleNamespace

    from engine.spec_decode.base import Proposal

    engine = plain.engine
    state = engine.grammars.compiler.state(SPECS["choice"])
    good, bad = plain.tokenizer.encode("yes please"), plain.tokenizer.encode("yes sir")
    shared = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    sampled = SamplingParams(temperature=1.0)
    item = SimpleNamespace(request=SimpleNamespace(grammar=state, params=sampled, noise=None), samples=True)
    proposal = Proposal([list(bad)], None)   # one-hot drafts (n-gram, suffix): cut before the forbidden token
    masks = constrain([item], proposal)
    assert proposal.draft_token_ids[0] == bad[:shared]
    assert masks[0].shape == (shared + 1, engine.vocab_size)
    assert all(masks[0][j, good[j]] for j in range(shared + 1))   # the grammar's own path stays open
    assert not masks[0][shared, bad[shared]]
    # drawn from a real q: the forbidden token stays, for rejection sampling to resample from the residual
    q = torch.full((1, len(bad), engine.vocab_size), 1.0 / engine.vocab_size)
    proposal = Proposal([list(bad)], q)
    masks = constrain([item], proposal)
    assert proposal.draft_token_ids[0] == bad[:shared + 1] and masks[0].shape == (shared + 2, engine.vocab_size)
    assert not masks[0][shared, bad[shared]] and masks[0][shared + 1].all()   # a row its rejection never reaches
    state.advance(good)   # the masks left the matcher where it was
    assert state.finished


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("regex", "[0-9"), "regex"),
    (StructuredOutput("grammar", "start: undefined_rule"), "grammar"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
     "json_schema"),
])
def test_a_grammar_that_does_not_compile_is_an_error_naming_it(plain, spec, message):
    with pytest.raises(ValueError, match=message):
        spec.grammar()   # what the server checks (off its event loop) before it queues a request: a 400
    with pytest.raises(RuntimeError, match=message):   # the engine's own compile fails the request alone
        plain.generate(["hi"], SamplingParams(max_tokens=4, structured=spec))
    out = plain.generate(["hi"], SamplingParams(max_tokens=4, temperature=0.0))[0]   # the engine keeps serving
    assert len(out.token_ids) >= 1


def test_a_slow_compile_holds_up_no_other_request_and_times_out(plain, monkeypatch):
    """Grammars compile on worker threads: a plain request runs to its end while a constrained one
    waits for its matcher; a compile past the queue's timeout fails its request, naming why."""
    import threading

    engine = plain.engine
    release = threading.Event()
    real_state = engine.grammars.compiler.state

    def slow_state(spec):
        release.wait(10)
        return real_state(spec)

    monkeypatch.setattr(engine.grammars.compiler, "state", slow_state)
    engine.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, structured=SPECS["regex"]))
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        for out in engine.step():
            finished[out.request_id] = out
    assert "slow" not in finished and engine.has_unfinished_requests() and engine.status().num_waiting == 1
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["slow"].finish_reason in ("stop", "length") and finished["slow"].error is None
    release.clear()
    monkeypatch.setattr(engine.grammars, "timeout", 0.2)
    engine.add_request("stuck", [5, 6], SamplingParams(max_tokens=4, structured=SPECS["choice"]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("stuck", "error")]
    assert "did not compile within 0.2 s" in outputs[0].error
    release.set()


def wait_for(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_aborted_requests_queued_compile_never_runs(plain, monkeypatch):
    """A request aborted while its grammar waits for a worker: its compile is cancelled, not run; the
    request before it and the engine go on."""
    engine = plain.engine
    queue, release, compiled = one_worker_queue(engine, monkeypatch)
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, structured=SPECS["regex"]))
    engine.add_request("aborted", [5, 6], SamplingParams(max_tokens=4, structured=SPECS["choice"]))
    wait_for(lambda: compiled == ["regex"])   # the only worker is busy: "aborted" waits in the queue
    assert engine.abort_request("aborted") is not None and len(queue) == 1
    release.set()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert compiled == ["regex"], compiled
    assert set(finals) == {"busy"} and finals["busy"].error is None
    out = plain.generate(["hi"], SamplingParams(max_tokens=20, temperature=0.0, structured=SPECS["choice"]))[0]
    assert out.text in ("yes please", "no thanks", "maybe") and compiled == ["regex", "choice"]


def test_a_queued_compiles_deadline_counts_from_submission(plain, monkeypatch):
    """A compile that waits for a worker past the queue's timeout fails its request then, without ever
    running; so does the compile that held the worker too long. The engine serves the next request."""
    import time

    engine = plain.engine
    queue, release, compiled = one_worker_queue(engine, monkeypatch, timeout=0.5)
    engine.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=4, structured=SPECS["regex"]))
    wait_for(lambda: compiled == ["regex"])
    submitted = time.monotonic()
    engine.add_request("queued", [5, 6], SamplingParams(max_tokens=4, structured=SPECS["choice"]))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    waited = time.monotonic() - submitted
    assert {r: o.finish_reason for r, o in finals.items()} == {"stuck": "error", "queued": "error"}
    assert "did not compile within 0.5 s" in finals["queued"].error and 0.5 <= waited < 5, waited
    assert compiled == ["regex"] and not release.is_set()   # failed while the worker still held the first
    release.set()
    out = plain.generate(["hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) >= 4


def test_bad_specs_are_errors_naming_the_problem():
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("xml", "")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput.json_schema("{nope")
    with pytest.raises(ValueError, match="a schema is a JSON object"):
        StructuredOutput.json_schema([1, 2])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput.choice([])
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured={"type": "json_object"})


def test_forced_tokens_are_drafted_free_and_always_accepted(models, plain):
    """A schema's keys, quotes and enum tails admit one continuation: the grammar proposer drafts them,
    verification accepts every one (the masked distribution is one-hot there), and passes go down."""
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"enum": ["first_value", "second_value"]},
                                               "another_long_property_name": {"type": "boolean"}},
              "required": ["a_rather_long_property_name", "another_long_property_name"], "additionalProperties": False}
    spec = StructuredOutput.json_schema(schema)
    expected = greedy(plain, spec, 160)
    llm = LLM(models[0], dtype="float32", speculative={"method": "ngram", "num_speculative_tokens": 8, "adaptive": False})
    outs = greedy(llm, spec, 160)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for out in outs:
        json.loads(out.text)
        assert out.spec.passes_by_method.get("grammar", 0) > 0
        assert out.spec.target_forwards < len(out.token_ids) / 2   # most tokens were forced


def test_a_draft_model_drafts_under_the_grammar(models, plain, monkeypatch):
    """The draft model's proposals are masked by the request's grammar as it drafts: none is ever cut
    by verification's check, sampled or greedy, and greedy output stays plain decoding's."""
    from engine.structured import GrammarState

    cuts = []
    real = GrammarState.valid_prefix

    def recording(self, tokens):
        keep = real(self, tokens)
        cuts.append(len(tokens) - keep)
        return keep

    monkeypatch.setattr(GrammarState, "valid_prefix", recording)
    llm = LLM(models[0], dtype="float32", speculative={"method": "draft", "draft": {"model": models[1]},
                                                      "num_speculative_tokens": 4, "adaptive": False})
    for kind in ("regex", "grammar", "json_schema"):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=SPECS[kind]))
        assert all(matches(kind, o.text) for o in outs if o.finish_reason == "stop"), kind
        assert [o.token_ids for o in greedy(llm, SPECS[kind])] == [o.token_ids for o in greedy(plain, SPECS[kind])]
    assert len(cuts) > 20 and not any(cuts)


def test_properties_are_written_in_the_schemas_order(plain):
    """As OpenAI's structured outputs do: the schema's order, not an alphabetical one."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"enum": ["a", "b"]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = greedy(plain, StructuredOutput.json_schema(schema))[0]
    assert list(json.loads(out.text)) == ["zeta", "alpha"]


def test_a_grammar_refusing_a_token_fails_that_request_alone(plain, monkeypatch):
    """Should the grammar engine refuse a token its own mask allowed, that request ends with an error
    naming it; the step's other requests go on and the engine keeps serving."""
    from engine.structured import GrammarState

    real = GrammarState.advance

    def refusing(self, tokens):
        if getattr(self, "doomed", False):
            raise RuntimeError("the grammar refused an emitted token: test")
        real(self, tokens)

    monkeypatch.setattr(GrammarState, "advance", refusing)
    engine = plain.engine
    engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, structured=SPECS["regex"]))
    engine.add_request("fine", [5, 6, 8], SamplingParams(max_tokens=8, temperature=0.0, structured=SPECS["regex"]))
    finals = {}
    while engine.has_unfinished_requests():
        doomed = engine.requests.get("doomed")
        if doomed is not None and doomed.grammar is not None:
            doomed.grammar.doomed = True
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["doomed"].finish_reason == "error" and "refused an emitted token" in finals["doomed"].error
    assert finals["fine"].finish_reason == "stop" and finals["fine"].error is None
