"""Request validation as a client meets it: wrong types and unknown enum values are 400s naming the field.

Every bad body gets {"error": {"message", "type", "param", "code"}} with status 400, `param` the
top-level field, and a message that says where, what was expected and what came. No bool passes
for a number, no string for a number or a bool; an int still passes for a float; unknown
top-level fields are ignored. One in-process server (a tiny random model, no speculation) serves
the whole module.
"""
from __future__ import annotations

import httpx
import pytest

from conftest import InProcessServer

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tiny_pair):
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    target, _ = tiny_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=4))
    with InProcessServer(create_app(engine, load_tokenizer(str(target)), MODEL)) as server:
        yield server.url


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def assert_400(response: httpx.Response, param: str | None, where: str | None = None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert error["type"] == "invalid_request_error" and error["code"] is None, error
    assert error["param"] == param, error
    if where is not None:   # the message names the place and what was wrong with it
        assert error["message"].startswith(f"{where}: Input should be "), error
    return error["message"]


# Wrong values for fields both endpoints share: (field, value, what the message must say).
SHARED = [
    ("n", True, "integer"), ("n", "2", "integer"), ("n", 1.5, "integer"),
    ("temperature", "hot", "number"), ("temperature", True, "number"), ("temperature", "0.5", "number"),
    ("top_p", True, "number"), ("top_k", True, "integer"), ("top_k", 5.0, "integer"), ("min_p", False, "number"),
    ("seed", 1.5, "integer"), ("seed", True, "integer"), ("seed", "7", "integer"),
    ("presence_penalty", "1", "number"), ("frequency_penalty", True, "number"), ("repetition_penalty", "1", "number"),
    ("max_tokens", True, "integer"), ("max_tokens", "5", "integer"), ("max_tokens", 2.5, "integer"),
    ("stream", "yes", "boolean"), ("stream", 1, "boolean"), ("ignore_eos", "true", "boolean"),
    ("skip_special_tokens", 0, "boolean"),
    ("stop", 5, "str or list[str]"), ("stop", [1], "str or list[str]"), ("stop", {"a": 1}, "str or list[str]"),
    ("stop_token_ids", [True], "integer"), ("stop_token_ids", ["2"], "integer"), ("stop_token_ids", 2, "list"),
    ("stream_options", "yes", "dictionary"), ("model", 5, "string"), ("user", 5, "string"),
    ("logit_bias", {"5": True}, "number"), ("logit_bias", {"5": "1"}, "number"),
]
STREAM_OPTIONS = [({"include_usage": "yes"}, "boolean"), ({"include_usage": 1}, "boolean")]


@pytest.mark.parametrize("field,value,expected", SHARED, ids=lambda v: repr(v)[:20])
@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_wrong_types_of_shared_fields(url, path, base, field, value, expected):
    message = assert_400(post(url, path, {**base, "max_tokens": 1, field: value}), field)
    assert message.startswith(f"{field}") and expected in message, message


@pytest.mark.parametrize("options,expected", STREAM_OPTIONS)
@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_wrong_stream_options(url, path, base, options, expected):
    message = assert_400(post(url, path, {**base, "stream": True, "stream_options": options}), "stream_options",
                         "stream_options.include_usage")
    assert expected in message and "got" in message, message


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_stream_options_need_stream(url, path, base):
    """As OpenAI and vLLM answer: stream_options on a non-streaming request is a mistake, not a no-op."""
    message = assert_400(post(url, path, {**base, "max_tokens": 1, "stream_options": {"include_usage": True}}),
                         "stream_options")
    assert "stream is true" in message, message


@pytest.mark.parametrize("body,param,where", [
    ({"prompt": "a", "logprobs": True}, "logprobs", "logprobs"),      # completions' logprobs is a count
    ({"prompt": "a", "logprobs": "2"}, "logprobs", "logprobs"),
    ({"prompt": "a", "echo": 1}, "echo", "echo"),
    ({"prompt": "a", "echo": "true"}, "echo", "echo"),
    ({"prompt": "a", "best_of": True}, "best_of", "best_of"),
    ({"prompt": "a", "suffix": 5}, "suffix", "suffix"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": True}, "prompt", "prompt"),
    ({"prompt": [1, True]}, "prompt", "prompt"),
    ({"prompt": ["a", 1]}, "prompt", "prompt"),
    ({"prompt": [[1, "2"]]}, "prompt", "prompt"),
    ({"prompt": {"text": "a"}}, "prompt", "prompt"),
])
def test_wrong_completion_fields(url, body, param, where):
    assert_400(post(url, "/v1/completions", body), param, where)


@pytest.mark.parametrize("body,param,where", [
    ({"messages": MESSAGES, "logprobs": 1}, "logprobs", "logprobs"),   # chat's logprobs is a bool
    ({"messages": MESSAGES, "logprobs": "true"}, "logprobs", "logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": True}, "top_logprobs", "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": True}, "max_completion_tokens", "max_completion_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": "3"}, "max_completion_tokens", "max_completion_tokens"),
    ({"messages": MESSAGES, "add_generation_prompt": "no"}, "add_generation_prompt", "add_generation_prompt"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "messages.0.role"),
    ({"messages": [{"role": "User", "content": "hi"}]}, "messages", "messages.0.role"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "messages", "messages.0.role"),
    ({"messages": [MESSAGES[0], {"role": "bot", "content": "hi"}]}, "messages", "messages.1.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages.0.content"),
    ({"messages": [{"role": "user", "content": True}]}, "messages", "messages.0.content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages", "messages.0.content"),
    ({"messages": "hi"}, "messages", "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages", "messages"),
    ({"messages": ["hi"]}, "messages", "messages.0"),
])
def test_wrong_chat_fields(url, body, param, where):
    assert_400(post(url, "/v1/chat/completions", body), param, where)


def test_message_shows_what_came(url):
    message = assert_400(post(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
                         "messages")
    assert "'user'" in message and "'tool'" in message and message.endswith('got "wizard"'), message
    message = assert_400(post(url, "/v1/completions", {"prompt": "a", "max_tokens": "5"}), "max_tokens")
    assert message == 'max_tokens: Input should be a valid integer, got "5"'
    message = assert_400(post(url, "/v1/completions", {"prompt": "a", "stop": [1]}), "stop")
    assert message == "stop: Input should be str or list[str], got [1]"
    message = assert_400(post(url, "/v1/completions", {"prompt": "x" * 500, "max_tokens": True}), "max_tokens")
    assert len(message) < 200, message


def test_tokenize_and_detokenize_are_strict_too(url):
    assert_400(post(url, "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}), "messages",
               "messages.0.role")
    assert_400(post(url, "/tokenize", {"prompt": "a", "add_special_tokens": "no"}), "add_special_tokens",
               "add_special_tokens")
    assert_400(post(url, "/detokenize", {"tokens": [1, True]}), "tokens", "tokens.1")
    assert_400(post(url, "/detokenize", {"tokens": ["1"]}), "tokens", "tokens.0")


def test_body_that_is_not_an_object(url):
    assert_400(post(url, "/v1/completions", [{"prompt": "a"}]), None)
    assert_400(post(url, "/v1/chat/completions", "hi"), None)


# ---- what must still pass -----------------------------------------------------------------------

def test_unknown_fields_are_ignored_and_ints_pass_for_floats(url):
    extras = {"frobnicate": 1, "extra": {"x": [1]}, "response_format": {"type": "text"}, "tools": None,
              "metadata": {"a": "b"}, "store": False, "parallel_tool_calls": False, "service_tier": "whatever"}
    floats = {"temperature": 1, "top_p": 1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0,
              "repetition_penalty": 1, "logit_bias": {}}
    done = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 3, "n": 2, **floats, **extras})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 4
    chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                              "logprobs": True, "top_logprobs": 2, **extras})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"][0]["logprobs"]["content"]) == 2


def test_every_openai_role_and_content_parts_pass(url):
    messages = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
                {"role": "user", "content": [{"type": "text", "text": "u"}], "name": "me"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "t", "tool_call_id": "c1"},
                {"role": "function", "content": "f", "name": "f"},
                {"role": "user", "content": "again"}]
    done = post(url, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 1})
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["message"]["role"] == "assistant"


def test_stream_with_usage_still_passes(url):
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"prompt": "a", "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"completion_tokens":2' in lines[-2]
