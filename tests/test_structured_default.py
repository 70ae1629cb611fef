"""Structured outputs and tool calling on the real default target (SmolLM2-135M-Instruct, prepared by
`make test`) with the default config's speculation, over HTTP: JSON-schema answers that validate,
streamed and not, identical with and without speculation (greedy); a real tool call through the
fallback prompt (SmolLM2's template renders no tools) whose arguments validate."""
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from ci import in_ci
from conftest import InProcessServer

from server.config import read_yaml

pytestmark = pytest.mark.slow   # a real model, decoded for real

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = read_yaml(str(ROOT / "configs" / "default.yaml"))
TARGET = ROOT / DEFAULT["model"]
MODEL = "default"

if not (TARGET / "config.json").exists():
    if in_ci():
        pytest.fail(f"{TARGET} is missing: `make test` prepares it (specserve prepare-default)", pytrace=False)
    pytest.skip("the default target is not prepared: run `make target`", allow_module_level=True)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 40}, "role": {"enum": ["engineer", "teacher", "doctor", "other"]}},
    "required": ["name", "age", "city", "role"], "additionalProperties": False}
TEXTS = ["Maria Lopez is a 34 year old teacher who lives in Seville.",
         "Kenji Sato, 51, works as a doctor in Osaka.",
         "Our new engineer, Priya Nair (29), moved to Toronto last spring."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def serve(speculative: dict | None) -> InProcessServer:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    torch.set_num_threads(2)
    if speculative and "draft" in speculative:   # the config's relative paths, from the repository root
        speculative = {**speculative, "draft": {key: str(ROOT / path) for key, path in speculative["draft"].items()}}
    engine = Engine(EngineConfig(model=str(TARGET), dtype="float32", max_num_seqs=4, speculative=speculative))
    return InProcessServer(create_app(engine, load_tokenizer(str(TARGET)), MODEL))


@pytest.fixture(scope="module")
def clients():
    with serve(DEFAULT["speculative"]) as spec, serve(None) as plain:
        yield {name: openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
               for name, s in (("spec", spec), ("plain", plain))}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": f"Extract the person from this text as JSON: {text}"}]


def test_json_schema_answers_validate_and_speculation_changes_no_token(clients):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for text in TEXTS:
        answers = {}
        for name, client in clients.items():
            choice = client.chat.completions.create(model=MODEL, messages=ask(text), temperature=0, max_tokens=120,
                                                    response_format=response_format).choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            answers[name] = choice.message.content
        assert answers["spec"] == answers["plain"]
        streamed = clients["spec"].chat.completions.create(model=MODEL, messages=ask(text), temperature=0.8, seed=1,
                                                           max_tokens=120, stream=True,
                                                           response_format=response_format)
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)),
                            PERSON)


def test_a_real_tool_call(clients):
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    for choice_kind in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = clients["spec"].chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                           tool_choice=choice_kind, temperature=0, max_tokens=80)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_auto_on_a_real_model_answers_or_calls(clients):
    """tool_choice auto leaves the 135M model free: whatever it writes comes back as content or as
    calls that parse (never a broken call)."""
    messages = [{"role": "user", "content": "What is the weather like in Oslo? Use the tool."}]
    choice = clients["spec"].chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                     max_tokens=80).choices[0]
    for call in choice.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert choice.message.content or choice.message.tool_calls
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
