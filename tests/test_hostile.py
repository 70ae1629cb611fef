"""What a hostile client sends: every case is a clear 400 naming the field (or, for an error the server
did not expect, a 500 that shows an id and nothing internal), the bounded cases are refused before any
tokenizing, rendering or engine work, and the same server then serves a normal request.

One in-process server (a tiny random model, no speculation) serves the module; the commands it
sends to its engine core are recorded, so a test can tell what crossed to the engine.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx
import pytest

from conftest import InProcessServer
from server.core_messages import Add, Command

MODEL = "tiny"
MAX_PROMPT_CHARS = 4000
USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def served(tiny_pair):
    """(url, the Server, the commands sent to the engine core so far)."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=4))
    app = create_app(engine, load_tokenizer(str(target)), MODEL, max_prompt_chars=MAX_PROMPT_CHARS)
    server = app.state.server
    sent: list[Command] = []
    core = server.async_engine.core
    submit = core.submit
    core.submit = lambda commands: (sent.extend(commands), submit(commands))[-1]
    with InProcessServer(app) as http_server:
        yield http_server.url, server, sent


@pytest.fixture
def url(served):
    return served[0]


def post(url: str, path: str, body, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def assert_400(response: httpx.Response, param: str | None, *phrases: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    for phrase in phrases:
        assert phrase in error["message"], error
    assert "Traceback" not in error["message"] and "Error:" not in error["message"], error
    return error["message"]


def assert_serves(url: str) -> None:
    """The same server answers a normal chat request and a normal completion afterwards."""
    chat = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
    done = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2, done.text


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---- malformed chat history: a 400 naming the field ------------------------------------------------

@pytest.mark.parametrize("messages,where,phrase", [
    ([*USER, {"role": "assistant", "tool_calls": [{**CALL, "function": "add"}]}], "messages.1.tool_calls.0.function",
     "valid dictionary"),
    ([*USER, {"role": "assistant", "tool_calls": 5}], "messages.1.tool_calls", "valid list"),
    ([*USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": {"a": 1}}}]}],
     "messages.1.tool_calls.0.function.arguments", "valid string"),
    ([*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}],
     "messages.1.tool_calls.0.id", "required"),
    ([*USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}], "messages.1.tool_calls.0.type",
     "'function'"),
    ([*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "2"}], "messages.2",
     "tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0", "only assistant messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages.0.content", "reads text only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content", "text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content", "str"),
    ([{"role": "user", "content": "x", "name": 5}], "messages.0.name", "valid string"),
    ([{"role": "function", "content": "x"}], "messages.0", "name"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_messages_are_400s_naming_the_field(url, messages, where, phrase):
    message = assert_400(post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}), "messages",
                         phrase)
    assert message.startswith(f"{where}: "), message
    assert_400(post(url, "/tokenize", {"messages": messages}), "messages", phrase)
    assert_serves(url)


def test_content_parts_beside_tool_calls_render(url):
    """An assistant turn with text parts and calls (which once reached the template unjoined) is valid."""
    messages = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "let me add"}], "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    done = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert done.status_code == 200, done.text
    for tools in (None, [TOOL]):   # with tools the prompt outgrows the tiny context: rendered, not run
        tokens = post(url, "/tokenize", {"messages": messages, "tools": tools}).json()["tokens"]
        text = post(url, "/detokenize", {"tokens": tokens}).json()["prompt"]
        assert "let me add" in text and '"add"' in text


def test_a_template_that_fails_is_a_400(url):
    """The tiny template writes message['content'] as is: a user turn with none renders anyway or is a 400,
    never a 500."""
    response = post(url, "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1})
    assert response.status_code in (200, 400), response.text
    assert_serves(url)


# ---- sizes bounded before anything recurses over them -----------------------------------------------

@pytest.mark.parametrize("field,param", [
    ("response_format", "response_format"), ("structured_outputs", "structured_outputs"),
    ("structured_outputs_text", "structured_outputs"), ("tools", "tools")])
def test_deep_schemas_are_400s(url, field, param):
    deep = nested_schema(100)   # 200 levels: within any JSON field's bound, past a schema's
    body = {"messages": USER, "max_tokens": 2}
    if field == "response_format":
        body[field] = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    elif field == "structured_outputs":
        body[field] = {"json": deep}
    elif field == "structured_outputs_text":   # as text, too deep for Python's own json module
        body["structured_outputs"] = {"json": '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000}
    else:
        body[field] = [{"type": "function", "function": {"name": "deep", "parameters": deep}}]
    assert_400(post(url, "/v1/chat/completions", body), param, "nested deeper than 64 levels")
    assert_serves(url)


@pytest.mark.parametrize("field", ["tool_choice", "tools", "response_format", "functions"])
def test_any_json_field_nested_deeply_is_a_400(url, field):
    deep: list = []
    for _ in range(300):
        deep = [deep]
    assert_400(post(url, "/v1/chat/completions", {"messages": USER, field: deep}), field,
               f"{field}: nested deeper than 256 levels")
    assert_serves(url)


def test_large_schemas_and_too_many_tools_are_400s(url):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": i} for i in range(20_000)}}
    assert_400(post(url, "/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}}), "response_format", "more than 50000")
    medium = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": medium}} for i in range(2)]
    assert_400(post(url, "/v1/chat/completions", {"messages": USER, "tools": many}), "tools", "tools: more than 50000")
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert_400(post(url, "/v1/chat/completions", {"messages": USER, "tools": tools}), "tools", "at most 128 tools")
    assert_400(post(url, "/v1/chat/completions", {"messages": USER * 4097}), "messages", "at most 4096")
    assert_serves(url)


def test_a_body_nested_too_deeply_to_parse_is_a_400(url):
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 400 and "nests too deeply" in response.json()["error"]["message"], response.text
    assert_serves(url)


# ---- bounded work before any check ------------------------------------------------------------------

def test_300000_prompts_are_refused_at_once_while_health_answers(url, served):
    """The count is checked before a single prompt is tokenized; /health answers within 100 ms meanwhile."""
    _, _, sent = served
    sent.clear()
    body = json.dumps({"prompt": ["hi"] * 300_000, "max_tokens": 1}).encode()
    outcome: dict = {}

    def flood():
        started = time.monotonic()
        outcome["response"] = post(url, "/v1/completions", body)
        outcome["seconds"] = time.monotonic() - started

    with httpx.Client(timeout=5) as http:
        http.get(url + "/health")   # the connection is open before the probe starts
        thread = threading.Thread(target=flood)
        thread.start()
        probes = []
        while thread.is_alive():
            started = time.monotonic()
            assert http.get(url + "/health").status_code == 200
            probes.append(time.monotonic() - started)
        thread.join()
    assert_400(outcome["response"], "prompt", "at most 256 prompts", "(300000 given)")
    assert outcome["seconds"] < 5, outcome
    assert probes and max(probes) < 0.1, sorted(probes)[-5:]
    assert not sent   # nothing reached the engine
    assert_400(post(url, "/v1/completions", {"prompt": ["a"] * 200, "n": 2}), "n", "200 x 2")
    assert_serves(url)


def test_prompt_size_caps(url, served):
    _, server, sent = served
    sent.clear()
    long = "x" * (MAX_PROMPT_CHARS + 1)
    for path, body, param in [
            ("/v1/completions", {"prompt": long}, "prompt"),
            ("/v1/completions", {"prompt": ["x" * 2001, "x" * 2000]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": long}]}]},
             "messages"),
            ("/tokenize", {"prompt": long}, "prompt"),
            ("/tokenize", {"messages": [{"role": "system", "content": "x" * 2000}, {"role": "user", "content": long}]},
             "messages")]:
        response = post(url, path, body)
        assert_400(response, param, f"({MAX_PROMPT_CHARS}, max_prompt_chars)")
        assert response.json()["error"]["code"] == "context_length_exceeded"
    max_model_len, vocab_size = server.info.max_model_len, server.info.vocab_size
    assert_400(post(url, "/v1/completions", {"prompt": [5] * (max_model_len + 1)}), "prompt",
               f"more than this model's maximum context length ({max_model_len})")
    assert_400(post(url, "/v1/completions", {"prompt": [[5, 6], [5, vocab_size]]}), "prompt",
               f"token id {vocab_size} is outside the vocabulary")
    assert_400(post(url, "/v1/completions", {"prompt": [5, -1]}), "prompt", "token id -1 is outside")
    assert not sent   # refused on the API side: nothing crossed to the engine
    assert_400(post(url, "/detokenize", {"tokens": [5] * (MAX_PROMPT_CHARS + 1)}), "tokens",
               f"({MAX_PROMPT_CHARS}, max_prompt_chars)")
    assert_400(post(url, "/detokenize", {"tokens": [5, 10 ** 9]}), "tokens", "outside the vocabulary")
    fits = post(url, "/tokenize", {"prompt": "x" * MAX_PROMPT_CHARS})
    assert fits.status_code == 200 and fits.json()["count"] >= 1, fits.text
    assert_serves(url)


def test_a_prompt_crosses_to_the_engine_once_whatever_n_is(url, served):
    _, server, sent = served
    prompt = [(i * 7) % 200 + 10 for i in range(300)]
    sent.clear()
    done = post(url, "/v1/completions", {"prompt": prompt, "n": 64, "max_tokens": 1, "temperature": 1, "seed": 3})
    assert done.status_code == 200 and len(done.json()["choices"]) == 64, done.text
    adds = [command for command in sent if isinstance(command, Add)]
    assert len(adds) == 1, sent
    assert adds[0].prompt_token_ids == prompt and len(adds[0].requests) == 64
    requests = adds[0].requests
    assert len({rid for rid, _ in requests}) == 64 and [params.seed for _, params in requests] == list(range(3, 67))
    sent.clear()   # two prompts: one add each
    done = post(url, "/v1/completions", {"prompt": [prompt[:50], prompt[50:90]], "n": 3, "max_tokens": 1})
    assert done.status_code == 200 and len(done.json()["choices"]) == 6, done.text
    adds = [command for command in sent if isinstance(command, Add)]
    assert [(len(add.prompt_token_ids), len(add.requests)) for add in adds] == [(50, 3), (40, 3)]


# ---- errors the server did not expect ---------------------------------------------------------------

SECRET = "secret internal detail 0xdeadbeef"


def assert_internal_500(response: httpx.Response, code: str, caplog) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == code, error
    assert SECRET not in response.text and "RuntimeError" not in response.text, error
    match = re.search(r"id (err-[0-9a-f]+); see the server log", error["message"])
    assert match, error
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert logged and any(SECRET in r.getMessage() or (r.exc_info and SECRET in str(r.exc_info[1]))
                          for r in logged), [r.getMessage() for r in caplog.records][-5:]


def test_an_unexpected_error_is_a_500_with_an_id_and_nothing_internal(url, served, monkeypatch, caplog):
    _, server, _ = served
    caplog.set_level(logging.ERROR, logger="specserve.server")

    def broken(*args, **kwargs):
        raise RuntimeError(SECRET)
    monkeypatch.setattr(server, "totals", broken)
    assert_internal_500(post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2}), "internal_error", caplog)
    monkeypatch.undo()
    assert_serves(url)


def test_a_request_the_engine_fails_is_a_500_without_the_engine_s_text(url, served, monkeypatch, caplog):
    _, server, _ = served
    caplog.set_level(logging.ERROR, logger="specserve.server")
    engine = server.async_engine.core.engine
    poison = 77
    propose = engine.spec.router.propose

    def failing(scheduled, drafts):
        if any(s.request.token_ids[0] == poison for s in scheduled):
            raise RuntimeError(SECRET)
        return propose(scheduled, drafts)
    monkeypatch.setattr(engine.spec.router, "propose", failing)
    response = post(url, "/v1/completions", {"prompt": [poison, 20, 21], "max_tokens": 2})
    assert_internal_500(response, "engine_error", caplog)
    assert "the engine failed this request" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert_serves(url)
