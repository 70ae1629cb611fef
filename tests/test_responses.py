"""The Responses API (POST /v1/responses) as clients meet it.

Units (no server): the input items become the chat messages a chat completion would carry, and a
stream's events come out in OpenAI's order, numbered, their deltas joining into the final output.

Over HTTP, with the official `openai` client and its typed parsing, against the real default target
(SmolLM2-135M-Instruct, prepared by `make test`) with the default config's speculation, one server
for the module: a string input; items with instructions and a function_call / function_call_output
round trip; tool_choice required and named (the grammar makes even the 135M model call); text.format
json_schema through `responses.parse`; streamed events in order; max_output_tokens cutting a response
short (status incomplete); the 400s a hostile or careless client gets, each followed by a normal
request on the same server; the speculation counters beside usage.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from ci import in_ci
from conftest import InProcessServer
from pydantic import BaseModel

from server.config import read_yaml
from server.responses import ResponsesRequest, ResponseWriter
from server.tools import ToolCall

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = read_yaml(str(ROOT / "configs" / "default.yaml"))
TARGET = ROOT / DEFAULT["model"]
MODEL = "default"
ERROR_KEYS = {"message", "type", "param", "code"}

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": WEATHER_PARAMETERS, "strict": True}
ASK = "What is the weather like in Paris right now?"


# ---- units ------------------------------------------------------------------------------------------

def test_items_become_the_chat_messages_of_the_same_conversation():
    request = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer "},
                                          {"type": "input_text", "text": "in one line."}]}]})
    call = lambda i, city: {"id": f"c{i}", "type": "function",   # noqa: E731
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    assert [m.model_dump(exclude_none=True) for m in request.chat_messages()] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call(1, "Oslo"), call(2, "Lima")]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "Rain", "tool_call_id": "c2"},
        {"role": "developer", "content": "Answer in one line."}]
    # a string is one user message; a call with no assistant text before it is an assistant turn of its own
    alone = ResponsesRequest.model_validate({"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}).chat_messages()
    assert [m.model_dump(exclude_none=True) for m in alone] == [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                        "arguments": "{}"}}]}]
    one = ResponsesRequest.model_validate({"input": "hi"}).chat_messages()
    assert [m.model_dump(exclude_none=True) for m in one] == [{"role": "user", "content": "hi"}]


def test_stream_events_are_in_order_numbered_and_join_into_the_output():
    writer = ResponseWriter("resp_x", MODEL, {}, num_input_tokens=7)
    call = ToolCall("get_weather", "", "call_1")
    events = writer.start() + writer.content("Check") + writer.content("ing.") + \
        writer.call(0, "", call) + writer.call(0, '{"city": ', None) + writer.call(0, '"Oslo"}', None)
    events += writer.finish("incomplete", generation=None)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.incomplete"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    message, function_call = final["output"]
    assert message["content"][0]["text"] == "Checking." and message["status"] == "completed"
    assert (function_call["call_id"], function_call["name"], function_call["arguments"], function_call["status"]) \
        == ("call_1", "get_weather", '{"city": "Oslo"}', "incomplete")   # cut short: the open item is incomplete
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    # nothing written at all: the answer is one empty message, and the response completed
    empty = ResponseWriter("resp_y", MODEL, {}, 1)
    events = empty.start() + empty.finish("completed", generation=None)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


# ---- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url():
    if not (TARGET / "config.json").exists():
        if in_ci():
            pytest.fail(f"{TARGET} is missing: `make test` prepares it (specserve prepare-default)", pytrace=False)
        pytest.skip("the default target is not prepared: run `make target`")
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    torch.set_num_threads(2)
    speculative = {**DEFAULT["speculative"], "draft": {"model": str(ROOT / DEFAULT["speculative"]["draft"]["model"])}}
    engine = Engine(EngineConfig(model=str(TARGET), dtype="float32", max_num_seqs=4, speculative=speculative))
    with InProcessServer(create_app(engine, load_tokenizer(str(TARGET)), MODEL)) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def assert_accounting(response) -> dict:
    """Output tokens + discarded = the first token + accepted drafts + one per target pass."""
    spec, usage = response.model_extra["speculative"], response.usage
    assert usage.output_tokens + spec["discarded"] == 1 + spec["accepted"] + spec["target_forwards"], spec
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    return spec


@pytest.mark.slow
def test_a_string_input(client):
    response = client.responses.create(model=MODEL, input="Name one colour.", temperature=0, max_output_tokens=40)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete") and response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.model_extra["store"] is False and response.usage.input_tokens > 0
    spec = assert_accounting(response)
    assert spec["methods"] and sum(spec["methods"].values()) == sum(spec["k"].values())


@pytest.mark.slow
def test_required_and_named_tool_choice_give_function_calls(client):
    for tool_choice in ("required", {"type": "function", "name": "get_weather"}):
        response = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                           parallel_tool_calls=False, temperature=0, max_output_tokens=80)
        assert response.status == "completed", response
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        assert_accounting(response)


@pytest.mark.slow
def test_a_function_call_round_trip_with_instructions(client):
    """The agent loop: the model's call goes back as an item with its output; the model then answers."""
    first = client.responses.create(model=MODEL, instructions="You report the weather.", input=ASK, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=80)
    [call] = first.output
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}]
    answer = dict(model=MODEL, instructions="You report the weather.", tools=[WEATHER], tool_choice="none",
                  temperature=0, max_output_tokens=40)
    second = client.responses.create(input=history, **answer)
    assert [item.type for item in second.output] == ["message"] and second.output_text.strip()
    assert second.instructions == "You report the weather."
    without = client.responses.create(input=history[:1], **{**answer, "max_output_tokens": 1})
    # the call and its result are in the prompt: at least their text's worth of tokens more
    assert second.usage.input_tokens >= without.usage.input_tokens + 10


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.slow
def test_text_format_json_schema_gives_valid_json(client):
    parsed = client.responses.parse(model=MODEL, input="Extract the person: Maria Lopez is 34 years old.",
                                    text_format=Person, temperature=0, max_output_tokens=60)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert json.loads(parsed.output_text) == parsed.output_parsed.model_dump()
    json_object = client.responses.create(model=MODEL, input="Give a JSON object with a key a.", temperature=0,
                                          max_output_tokens=40, text={"format": {"type": "json_object"}})
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


@pytest.mark.slow
def test_streamed_events_in_order_with_deltas_joining_into_the_final_text(client):
    events = list(client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=30,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1].response
    assert kinds[-1] == f"response.{final.status}"   # response.completed, or response.incomplete when cut
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text and text.strip()
    assert final.usage.output_tokens > 0 and "speculative" in final.model_extra
    # the SDK's stream helper, on a call: the argument deltas join into the call it ends with
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_output_tokens=80) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        [call] = stream.get_final_response().output
    assert call.type == "function_call" and "".join(deltas) == call.arguments and len(deltas) > 1
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


@pytest.mark.slow
def test_max_output_tokens_cuts_the_response_short(client):
    response = client.responses.create(model=MODEL, input="Write a long story about a dragon.", temperature=0,
                                       max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Write a long story about a dragon.", temperature=0,
                                          max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text


def assert_400(response: httpx.Response, param: str, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", error
    assert error["param"] == param and says in error["message"], error


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
BAD = [  # (what the body adds to {"input": "hi"}, param, what the message says)
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"background": True}, "background", "background"),
    ({"input": []}, "input", "at least one item"),
    ({"input": 5}, "input", "valid list"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input.0: Input should be an item of type message"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "function_call_output"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input.0.message.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "'input_image'"),
    ({"input": [{**CALL, "call_id": None}]}, "input", "input.0.function_call.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input", "function_call_output.output"),
    ({"input": [{**CALL, "call_id": f"c{i}"} for i in range(200)]}, "input", "tool_calls: List should have at most"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools.0.type"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, "tools", "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "a name and a schema"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"n": 2}, "n", "n:"),
    ({"model": "other"}, "model", "does not exist"),
]


@pytest.mark.slow
def test_bad_requests_are_400s_naming_the_field_and_the_server_serves_on(url, client):
    for extra, param, says in BAD:
        response = httpx.post(url + "/v1/responses", json={"input": "hi", **extra}, timeout=60)
        if param == "model":
            assert response.status_code == 404 and response.json()["error"]["param"] == "model"
            continue
        assert_400(response, param, says)
    # store is accepted (OpenAI's default is to store); nothing is stored, and the response says so
    stored = client.responses.create(model=MODEL, input="Hi", store=True, max_output_tokens=3, temperature=0)
    assert stored.model_extra["store"] is False and stored.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=stored.id)
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=3).output_text


def test_an_engine_failure_mid_stream_ends_in_response_failed(tiny_pair, monkeypatch):
    """A request the engine fails (alone) ends its stream with response.failed, or is a 500 when not
    streamed, its error showing no internal text; the server then answers the next request."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    torch.set_num_threads(1)
    target, draft = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                                 speculative={"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 2}))
    tokenizer = load_tokenizer(str(target))
    poison = tokenizer.encode("~")[0]
    propose = engine.spec.router.propose

    def failing_propose(scheduled, plan):
        if any(poison in s.request.token_ids[:s.request.num_prompt_tokens] and s.request.num_output_tokens >= 2
               for s in scheduled):
            raise RuntimeError("injected failure")
        return propose(scheduled, plan)
    monkeypatch.setattr(engine.spec.router, "propose", failing_propose)
    body = {"model": MODEL, "input": "~ poisoned", "max_output_tokens": 30, "temperature": 0}
    with InProcessServer(create_app(engine, tokenizer, MODEL)) as server:
        with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "injected failure" not in failed["error"]["message"]
        whole = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
        assert whole.status_code == 500 and "injected failure" not in whole.text
        ok = httpx.post(server.url + "/v1/responses", json={**body, "input": "fine"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 30, ok.text
