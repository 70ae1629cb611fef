"""Tool calling (server/tools.py) through the official openai client: tools rendered by the chat
template (or the system prompt where it has none), calls parsed out of the output (Hermes blocks,
Llama 3.1's JSON), streamed as tool-call deltas, `tool_choice` required / named constraining the
output so that the arguments always parse, a tool round trip, and the errors a bad request gets.
Also OpenAI's `parse()` with a pydantic model. A tiny random model with a draft model at work."""
from __future__ import annotations

import json
import re

import openai
import pytest
from conftest import InProcessServer

from server.tool_stream import ToolStream
from server.tool_parsers import HermesParser, Llama3JsonParser, choose_parser
from server.tools import parse_tool_choice, parse_tools, template_messages

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer",
                                                                                           "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99},
                                                                    "b": {"type": "boolean"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
# A Hermes-style template that renders tools (as Qwen2.5's does; written for these tests).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = (   # Llama 3.1's way: the tools in the user turn, calls written as {"name", "parameters"}
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if tools and loop.last %}Call one of these with {\"name\": ..., \"parameters\": ...}: "
    "{{ tools | tojson }}\n{% endif %}{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call_args(call) -> dict:
    return json.loads(call.function.arguments)


def valid_weather(args: dict) -> bool:
    return args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("c", "f") and \
        set(args) <= {"city", "unit", "days"} and (1 <= args.get("days", 1) <= 7)


def valid_call(call) -> bool:
    args = call_args(call)
    if call.function.name == "get_weather":
        return valid_weather(args)
    return call.function.name == "add" and set(args) == {"a", "b"} and 0 <= args["a"] <= 99 and \
        isinstance(args["b"], bool)


# ---- the parsers, without a model -----------------------------------------------------------------

FUNCTIONS = parse_tools(TOOLS)
HERMES_OUTPUT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n</tool_call>')


def test_hermes_blocks_become_calls_and_the_rest_content():
    content, calls = HermesParser().extract(HERMES_OUTPUT, FUNCTIONS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 2, "b": True})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # a block naming no given function, or not JSON, stays content
    content, calls = HermesParser().extract('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', FUNCTIONS)
    assert calls == [] and content.startswith("<tool_call>")
    assert HermesParser().extract("<tool_call>\n{broken\n</tool_call>", FUNCTIONS)[1] == []


def streamed(stream, text: str, size: int) -> tuple[str, list[tuple[str, str]], int]:
    """Content, calls (name, arguments joined from their deltas) and the number of deltas, when the
    text arrives `size` characters at a time."""
    content, names, arguments, num_deltas = "", {}, {}, 0
    pieces = [stream.push(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    for piece, deltas in pieces:
        content += piece
        for delta in deltas:
            num_deltas += 1
            if delta.call is not None:
                assert delta.index not in names and delta.call.id.startswith("call_")
                names[delta.index] = delta.call.name
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return content, [(names[i], arguments[i]) for i in sorted(names)], num_deltas


def test_a_streamed_output_gives_the_same_content_and_calls_at_any_chunking():
    expected_content, expected_calls = HermesParser().extract(HERMES_OUTPUT, FUNCTIONS)
    for size in (1, 2, 3, 7, 11, len(HERMES_OUTPUT)):
        content, calls, num_deltas = streamed(ToolStream(HermesParser(), FUNCTIONS), HERMES_OUTPUT, size)
        assert content == expected_content, size
        assert calls == [(c.name, c.arguments) for c in expected_calls], size
        if size <= 3:   # the arguments went out as they came, not whole at the block's end
            assert num_deltas > 2 * len(calls), (size, num_deltas)
    # text that only looks like a marker's start is sent once it cannot be one (whitespace once text follows)
    stream = ToolStream(HermesParser(), FUNCTIONS)
    assert stream.push("a <tool") == ("a", []) and stream.push("box>") == (" <toolbox>", [])
    # a call's name goes out first, its arguments but for what may be their end
    stream = ToolStream(HermesParser(), FUNCTIONS)
    assert stream.push('<tool_call>\n{"name": "add", "arguments": ') == ("", [])   # where do they start?
    _, [first, opening] = stream.push("{")
    assert (first.index, first.call.name, first.arguments, opening.arguments) == (0, "add", "", "{")
    assert [d.arguments for d in stream.push('"a": 4, "b": true}}')[1]] == ['"a": 4, "b": true']
    assert [d.arguments for d in stream.push("\n</tool_call>")[1]] == ["}"]
    # a block whose name comes last, or that is no call, is judged whole at its end
    late = '<tool_call>{"arguments": {"a": 1, "b": false}, "name": "add"}</tool_call> and <tool_call>{"x": 1}</tool_call>'
    content, calls, _ = streamed(ToolStream(HermesParser(), FUNCTIONS), late, 4)
    assert calls == [("add", '{"a": 1, "b": false}')] and content == 'and <tool_call>{"x": 1}</tool_call>'


def test_llama3_json_calls_and_plain_messages():
    parser = Llama3JsonParser()
    content, calls = parser.extract('{"name": "add", "parameters": {"a": 1, "b": false}}; '
                                    '{"name": "get_weather", "parameters": {"city": "Lima", "unit": "f"}}', FUNCTIONS)
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Lima", "unit": "f"}
    assert parser.extract("It is sunny.", FUNCTIONS) == ("It is sunny.", [])
    assert parser.extract('{"name": "add", "parameters": {"a": 1}} and more', FUNCTIONS)[1] == []
    stream = ToolStream(parser, FUNCTIONS)
    assert stream.push('{"name": "add", ') == ("", []) and stream.push('"parameters": {"a": 3, "b": true}}') == ("", [])
    assert [(d.index, d.call.name, d.arguments) for d in stream.finish()[1]] == [(0, "add", '{"a": 3, "b": true}')]
    prose = ToolStream(parser, FUNCTIONS)
    assert prose.push("Hello") == ("Hello", []) and prose.push(" there") == (" there", [])


def test_the_parser_follows_the_template_or_the_config():
    assert isinstance(choose_parser(HERMES_TEMPLATE), HermesParser)
    assert isinstance(choose_parser("... <|python_tag|> ..."), Llama3JsonParser)
    assert isinstance(choose_parser(None), HermesParser)   # no tools in the template: the fallback prompt's format
    assert isinstance(choose_parser(HERMES_TEMPLATE, "llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_parser(None, "xml")
    from server.options import TOOL_CALL_PARSERS
    from server.tool_parsers import PARSER_CLASSES
    assert TOOL_CALL_PARSERS == ("auto", *PARSER_CLASSES)   # the config key offers every parser


def test_templates_get_arguments_as_objects_and_the_fallback_writes_hermes():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": true}'}}
    messages = [{"role": "user", "content": "add"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    native = template_messages(messages, FUNCTIONS, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": True}
    fallback = template_messages(messages, FUNCTIONS, native=False)
    assert fallback[0]["role"] == "system" and '"name": "get_weather"' in fallback[0]["content"]
    assert fallback[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>'}
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function", "function": {"description": "x"}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0]: a tool is"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "given twice"),
    ({"get_weather": {}}, None, "tools: a list of tools"),
    ([], "required", "tool_choice: 'required' needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "no tool is named 'nope'"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_bad_tools_and_choices_are_named(tools, choice, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_tool_choice(choice, parse_tools(tools))


def test_tool_grammars_compile():
    for parser in (HermesParser(), Llama3JsonParser()):
        for parallel in (False, True):
            parser.grammar(FUNCTIONS, parallel).grammar()
            parser.grammar(FUNCTIONS[:1], parallel).grammar()


# ---- over HTTP ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """A tiny target and draft with room for the tools' signatures (a byte per token here)."""
    from helpers import make_noisy_copy, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tools")
    target = make_tiny_checkpoint(root / "target", arch="qwen2", seed=0, max_position_embeddings=2048)
    return target, make_noisy_copy(target, root / "draft", noise=0.1)


def build(tiny_pair, template: str | None, tool_call_parser: str = "auto") -> InProcessServer:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    from server.metrics import Metrics
    torch.set_num_threads(1)
    target, draft = tiny_pair
    spec = {"method": "auto", "draft": {"model": str(draft)}, "num_speculative_tokens": 4, "adaptive": False}
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=256, max_num_seqs=8,
                                 speculative=spec))
    tokenizer = load_tokenizer(str(target))
    if template is not None:
        tokenizer.chat_template = template
    metrics = Metrics(MODEL, engine.method, proposers=engine.configured_proposers)
    return InProcessServer(create_app(engine, tokenizer, MODEL, None, metrics, tool_call_parser=tool_call_parser))


@pytest.fixture(scope="module")
def hermes(long_pair):
    with build(long_pair, HERMES_TEMPLATE) as server:
        yield server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def others(long_pair):
    """The tiny model's own template (no tools: the fallback) and a Llama 3.1-style one."""
    with build(long_pair, None) as plain, build(long_pair, LLAMA3_TEMPLATE, "llama3_json") as llama:
        yield {name: openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
               for name, s in (("fallback", plain), ("llama3", llama))}


ASK = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 2?"}]


def test_tool_choice_required_always_yields_calls_whose_arguments_parse(hermes):
    _, client = hermes
    for seed in range(4):   # one call: the grammar ends after it
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, temperature=1.0, seed=seed,
                                                  max_tokens=120)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert valid_call(choice.message.tool_calls[0]) and choice.message.content is None
        assert response.speculative["methods"].get("grammar", 0) > 0   # the fixed parts drafted for free
    for seed in range(2):   # parallel calls: as many as the model writes (a random one may go on to max_tokens)
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=200).choices[0]
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
        assert all(valid_call(call) for call in choice.message.tool_calls)


def test_a_named_tool_choice_calls_that_function_streamed_or_not(hermes):
    _, client = hermes
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                          temperature=0.0, max_tokens=120)
    calls = full.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] * len(calls) and valid_weather(call_args(calls[0]))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 temperature=0.0, max_tokens=120, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 2 * len(calls)   # the arguments streamed in pieces
    firsts = [d for d in deltas if d.id is not None]   # a call's first delta: id, type, name
    assert [d.index for d in firsts] == list(range(len(calls)))
    assert all(d.id.startswith("call_") and d.type == "function" and d.function.name for d in firsts)
    joined = ["".join(d.function.arguments for d in deltas if d.index == i) for i in range(len(calls))]
    assert [(d.function.name, args) for d, args in zip(firsts, joined)] == \
        [(c.function.name, c.function.arguments) for c in calls]   # greedy: the same calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# The model is made to write a call by a grammar: "auto" must find it in free text, streamed or not.
SCRIPTED = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "f"}}\n'
            '</tool_call>')


def test_auto_parses_calls_out_of_the_text_streamed_or_not(hermes):
    _, client = hermes
    forced = {"structured_outputs": {"grammar": f"start: {json.dumps(SCRIPTED)}"}}
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0,
                                          extra_body=forced).choices[0]
    assert full.message.content == "Checking." and full.finish_reason == "tool_calls"
    assert [(c.function.name, call_args(c)) for c in full.message.tool_calls] == [
        ("get_weather", {"city": "Lima", "unit": "f"})]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160,
                                                 temperature=0, stream=True, extra_body=forced))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert text.strip() == "Checking." and {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Lima", "unit": "f"}
    # tool_choice "none": the same text is a message, the tools are not even in the prompt
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=160,
                                          temperature=0, extra_body=forced).choices[0]
    assert none.message.content == SCRIPTED and not none.message.tool_calls and none.finish_reason == "stop"


LIMA = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "f"}}\n</tool_call>'
TWO = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n</tool_call>'
LIMA_AGAIN = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f", "city": "Lima"}}\n</tool_call>'
AFTER = '\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": false}}\n</tool_call>\nAnd on, and on.'


def test_a_repeated_call_ends_the_choice_streamed_or_not(hermes):
    """The model is made to write two calls, the first again (its keys in another order), then more:
    the repeat is dropped and ends the choice there (finish_reason tool_calls), as a stop string
    would; nothing after it is returned. Without parallel calls the first call ends it."""
    import httpx

    url, client = hermes
    script = f"{LIMA}\n{TWO}\n{LIMA_AGAIN}{AFTER}"
    forced = {"structured_outputs": {"grammar": f"start: {json.dumps(script)}"}}

    def num_tokens(text: str) -> int:
        return httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]

    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                              extra_body=forced)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, call_args(c)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Lima", "unit": "f"}), ("add", {"a": 2, "b": True})]
    assert response.usage.completion_tokens <= num_tokens(f"{LIMA}\n{TWO}\n{LIMA_AGAIN}") + 1 < num_tokens(script)

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, stream=True,
                                                 extra_body=forced))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.function.name) for d in firsts] == [(0, "get_weather"), (1, "add")]
    assert [json.loads("".join(d.function.arguments for d in deltas if d.index == i)) for i in (0, 1)] == [
        {"city": "Lima", "unit": "f"}, {"a": 2, "b": True}]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                            parallel_tool_calls=False, extra_body=forced)
    assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
    assert single.usage.completion_tokens <= num_tokens(LIMA) + 1
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)   # the server goes on
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_auto_takes_a_bare_call_in_doubled_braces_streamed_or_not(hermes):
    """What Qwen2.5-Coder-1.5B wrote for the openai-agents SDK: the call as plain content, no markers,
    the doubled braces of its template's text."""
    _, client = hermes
    bare = '{{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}'
    forced = {"structured_outputs": {"grammar": f"start: {json.dumps(bare)}"}}
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                          extra_body=forced).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    assert [(c.function.name, call_args(c)) for c in full.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, stream=True,
                                                 extra_body=forced))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]   # held until the object ended, then whole
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tool_round_trip(hermes):
    url, client = hermes
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120).choices[0]
    call = first.message.tool_calls[0]
    messages = ASK + [first.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    import httpx
    tokens = httpx.post(url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f'"arguments": {call.function.arguments}' in text   # an object, not a JSON string inside a string
    assert "<tool_response>\n12 degrees\n</tool_response>" in text and '"name": "get_weather"' in text


def test_a_template_without_tools_gets_them_in_the_system_prompt(others):
    client = others["fallback"]
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=3, max_tokens=120)
    assert response.choices[0].message.tool_calls and all(valid_call(c) for c in response.choices[0].message.tool_calls)
    assert response.usage.prompt_tokens > 300   # the tools' signatures are in the prompt


def test_llama3_json_calls_over_http(others):
    client = others["llama3"]
    for seed in range(2):
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        calls = response.choices[0].message.tool_calls
        assert calls and all(valid_call(c) for c in calls) and response.choices[0].message.content is None


def test_parse_with_a_pydantic_model(hermes):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        ok: bool
        colour: Literal["red", "green", "blue"]
        score: int = Field(ge=0, le=9)

    _, client = hermes
    for seed in range(3):
        parsed = client.beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=Verdict,
                                                    temperature=1.0, seed=seed, max_tokens=60)
        verdict = parsed.choices[0].message.parsed
        assert isinstance(verdict, Verdict) and verdict.colour in ("red", "green", "blue")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(hermes, extra, param):
    _, client = hermes
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)   # the server goes on
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_structured_requests_show_in_the_metrics(hermes):
    """Constrained requests by kind, the matcher builds (and their grammar cache hits), the mask's
    time and rows, and the forced tokens the grammar drafted, accepted every one."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url, client = hermes
    for _ in range(2):   # the same tools twice: the second build's grammar comes from the cache
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[ADD], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=100)
    samples = {(s.name, s.labels.get("kind") or s.labels.get("proposer")): s.value
               for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in family.samples}
    assert samples[("specserve:structured_requests_total", "grammar")] >= 2
    assert samples[("specserve:structured_compile_seconds_count", None)] >= 2
    assert samples[("specserve:structured_cache_hits_total", None)] >= 1
    assert samples[("specserve:structured_mask_seconds_total", None)] > 0
    assert samples[("specserve:structured_masked_rows_total", None)] > 0
    drafted = samples[("specserve:spec_decode_num_draft_tokens_by_proposer_total", "grammar")]
    accepted = samples[("specserve:spec_decode_num_accepted_tokens_by_proposer_total", "grammar")]
    assert drafted > 0 and accepted >= 0.9 * drafted   # certain; only those past an output's end go uncounted


def test_markers_the_tokenizer_added_are_named_by_token_id(tmp_path):
    """Qwen2.5's <tool_call> and </tool_call> are added tokens, which llguidance matches by id, not
    by their text: the required grammar names them so, and the model's own marker token passes."""
    from helpers import make_tokenizer

    from engine.structured import GrammarCompiler

    tokenizer = make_tokenizer(272)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(tmp_path)
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    grammar = choose_parser(None, tokenizer=tokenizer).grammar(FUNCTIONS[1:], parallel=False)
    assert f"<[{start}]>" in grammar.value and f"<[{end}]>" in grammar.value
    state = GrammarCompiler(str(tmp_path), len(tokenizer), frozenset([tokenizer.eos_token_id])).state(grammar)
    assert state.forced_tokens()[0] == start
    call = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": false}}\n</tool_call>')
    assert call[0] == start and call[-1] == end and state.valid_prefix(call) == len(call)
    assert '"<tool_call>' in HermesParser().grammar(FUNCTIONS, parallel=True).value   # no tokenizer: the text


def test_grammars_that_admit_nothing_or_never_end(hermes):
    """A grammar no text matches is a 400 naming it (found when its matcher is built, in the engine);
    one that never ends by right recursion runs into llguidance's limits: a 400 naming them; others
    are served meanwhile."""
    _, client = hermes
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": r"[^\s\S]"}})
    assert info.value.body["code"] == "invalid_grammar" and "admits no output" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=12,
                                  extra_body={"structured_outputs": {"grammar": 'start: "ab" start'}})
    assert info.value.body["message"].startswith("grammar: ") and "\n" not in info.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].finish_reason in ("stop", "length")


def test_a_slow_compile_is_a_400_and_holds_up_no_one(hermes, monkeypatch):
    """The server compiles a spec's grammar on a worker thread: past the timeout the request is a 400
    naming the field, and a plain request sent meanwhile is answered at once."""
    import threading
    import time

    import engine.structured as structured
    import server.serving as serving

    release = threading.Event()
    real = structured._grammar

    def slow(kind, value):
        release.wait(5)
        return real(kind, value)

    monkeypatch.setattr(structured, "_grammar", slow)
    monkeypatch.setattr(serving, "GRAMMAR_COMPILE_TIMEOUT", 1.0)
    _, client = hermes
    failure = []

    def constrained():
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
        except openai.BadRequestError as exc:
            failure.append(exc.body)

    thread = threading.Thread(target=constrained)
    thread.start()
    started = time.monotonic()
    client.completions.create(model=MODEL, prompt="y", max_tokens=2)
    assert time.monotonic() - started < 1.0 and thread.is_alive()   # served while the grammar compiles
    thread.join(10)
    release.set()
    assert failure and failure[0]["param"] == "structured_outputs" and "within 1 s" in failure[0]["message"]
