"""Agent frameworks, unchanged, against a real `specserve serve`: each framework's own way of getting a
tool call or a typed object, with the framework's defaults and no max_tokens (as these clients send
it), each case bounded at 60 s of wall clock (a bound against runaway generation, not a speed target).

    HF_HUB_OFFLINE=1 python bench/agent_frameworks.py [--config configs/qwen2.5-coder-1.5b.yaml]
        [--cases pydantic_ai_output ...] [--repeat N] [--log-requests] [--url http://127.0.0.1:8000 --model NAME]

The cases (CASES):
  pydantic_ai_output         pydantic-ai `Agent(model, output_type=City)`: its output tool under
                             tool_choice "required", validated into City
  langchain_required         LangChain `ChatOpenAI(...).bind_tools([get_weather], tool_choice="required")`
  langchain_required_stream  the same, streamed, its chunks joined into one message
  langchain_structured       LangChain `.with_structured_output(City)` (response_format json_schema)
  agents_responses           the openai-agents SDK's tool loop on its default model (the Responses API):
                             an Agent with the get_weather function tool, run until its final answer
  agents_chat                the same loop on `OpenAIChatCompletionsModel` (chat completions)
  instructor_tools           instructor, Mode.TOOLS (a named tool_choice), validated into City
  instructor_json_schema     instructor, Mode.JSON_SCHEMA (response_format json_schema)

Without --url the script starts `specserve serve --config C` on a free port, runs every case in turn
and stops it. Printed per case: ok / fail, seconds, the tokens the server generated for it (from
/metrics), and the parsed call or the validated object (or the error). --log-requests prints the
bodies each framework sent, to see what a failing case asked for. tests/test_agents.py runs the same
cases in `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import agents
import httpx
import instructor
import openai
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE_SECONDS = 60.0
WEATHER_QUESTION = "What is the weather like in Paris right now?"
CITY_QUESTION = "Which city is the capital of France? Give the city and its country."
AGENT_INSTRUCTIONS = "You answer weather questions. Look the weather up with the get_weather tool, then answer briefly."


class City(BaseModel):
    """A city and the country it is in."""
    name: str = Field(description="the city's name", max_length=40)
    country: str = Field(description="the country the city is in", max_length=40)


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 22 degrees Celsius in {city}."


@dataclass(frozen=True)
class ToolCall:
    """A call as the framework parsed it: the function's name and its arguments object."""
    name: str
    arguments: dict


@dataclass(frozen=True)
class AgentRun:
    """An agent loop's calls of its tools (as the tool functions received them) and its final answer."""
    calls: tuple[ToolCall, ...]
    final_output: str


@dataclass(frozen=True)
class Endpoint:
    """Where the frameworks connect, and the request bodies they send there (recorded by an httpx hook)."""
    base_url: str              # ends in /v1
    model: str
    sent: list = field(default_factory=list)

    def _record(self, request: httpx.Request) -> None:
        self.sent.append(f"{request.method} {request.url.path} {request.content.decode(errors='replace')}")

    async def _record_async(self, request: httpx.Request) -> None:
        self._record(request)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="none", timeout=CASE_SECONDS, max_retries=0,
                             http_client=httpx.Client(event_hooks={"request": [self._record]}))

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", timeout=CASE_SECONDS, max_retries=0,
                                  http_client=httpx.AsyncClient(event_hooks={"request": [self._record_async]}))


# ---- the cases: each returns what its framework parsed ------------------------------------------

def pydantic_ai_output(endpoint: Endpoint) -> City:
    model = OpenAIChatModel(endpoint.model, provider=OpenAIProvider(openai_client=endpoint.async_client()))
    return Agent(model, output_type=City).run_sync(CITY_QUESTION).output


def langchain_model(endpoint: Endpoint) -> ChatOpenAI:
    return ChatOpenAI(model=endpoint.model, base_url=endpoint.base_url, api_key="none", timeout=CASE_SECONDS,
                      max_retries=0, http_client=httpx.Client(event_hooks={"request": [endpoint._record]}))


def langchain_calls(message) -> list[ToolCall]:
    return [ToolCall(call["name"], call["args"]) for call in message.tool_calls]


def langchain_required(endpoint: Endpoint) -> list[ToolCall]:
    model = langchain_model(endpoint).bind_tools([get_weather], tool_choice="required")
    return langchain_calls(model.invoke(WEATHER_QUESTION))


def langchain_required_stream(endpoint: Endpoint) -> list[ToolCall]:
    model = langchain_model(endpoint).bind_tools([get_weather], tool_choice="required")
    message = None
    for chunk in model.stream(WEATHER_QUESTION):
        message = chunk if message is None else message + chunk
    return langchain_calls(message)


def langchain_structured(endpoint: Endpoint) -> City:
    return langchain_model(endpoint).with_structured_output(City).invoke(CITY_QUESTION)


def agents_run(endpoint: Endpoint, model_class: str, settings: agents.ModelSettings | None = None,
               tool_use_behavior: str = "run_llm_again") -> AgentRun:
    """The SDK's tool loop on one of its models, with the SDK's defaults unless given."""
    calls = []

    @agents.function_tool(name_override="get_weather")
    def get_weather_tool(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(ToolCall("get_weather", {"city": city}))
        return get_weather(city)

    agents.set_tracing_disabled(True)   # the SDK would send traces to OpenAI
    model = getattr(agents, model_class)(model=endpoint.model, openai_client=endpoint.async_client())
    agent = agents.Agent(name="weather", instructions=AGENT_INSTRUCTIONS, tools=[get_weather_tool], model=model,
                         model_settings=settings or agents.ModelSettings(), tool_use_behavior=tool_use_behavior)
    result = agents.Runner.run_sync(agent, WEATHER_QUESTION)
    return AgentRun(tuple(calls), str(result.final_output))


def agents_responses(endpoint: Endpoint) -> AgentRun:
    return agents_run(endpoint, "OpenAIResponsesModel")


def agents_chat(endpoint: Endpoint) -> AgentRun:
    return agents_run(endpoint, "OpenAIChatCompletionsModel")


def instructor_city(endpoint: Endpoint, mode_name: str) -> City:
    client = instructor.from_openai(endpoint.client(), mode=getattr(instructor.Mode, mode_name))
    return client.chat.completions.create(model=endpoint.model, response_model=City,
                                          messages=[{"role": "user", "content": CITY_QUESTION}])


def instructor_tools(endpoint: Endpoint) -> City:
    return instructor_city(endpoint, "TOOLS")


def instructor_json_schema(endpoint: Endpoint) -> City:
    return instructor_city(endpoint, "JSON_SCHEMA")


CASES: dict[str, Callable[[Endpoint], Any]] = {case.__name__: case for case in (
    pydantic_ai_output, langchain_required, langchain_required_stream, langchain_structured,
    agents_responses, agents_chat, instructor_tools, instructor_json_schema)}


# ---- running them ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    name: str
    seconds: float
    tokens: int          # tokens the server generated during the case
    result: Any = None   # what the framework parsed
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.seconds <= CASE_SECONDS and parsed(self.result)


def parsed(result) -> bool:
    """A validated object, at least one parsed call, or an agent run whose tool was called."""
    if isinstance(result, AgentRun):
        return bool(result.calls)
    return isinstance(result, City) or bool(result and all(isinstance(c, ToolCall) for c in result))


def generation_tokens(server_url: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server_url + "/metrics", timeout=10).text
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "specserve:generation_tokens_total"))


def run_case(name: str, server_url: str, model: str, case: Callable[[Endpoint], Any] | None = None
             ) -> tuple[Outcome, list[str]]:
    """One case (CASES[name] unless given) timed, with the tokens it cost and the requests it sent."""
    endpoint = Endpoint(server_url + "/v1", model)
    before, start = generation_tokens(server_url), time.monotonic()
    try:
        result, error = (case or CASES[name])(endpoint), ""
    except Exception as exc:   # a case's failure is its row in the table
        result, error = None, f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    return Outcome(name, seconds, generation_tokens(server_url) - before, result, error), endpoint.sent


def shown(result) -> str:
    if isinstance(result, BaseModel):
        return repr(result)
    if isinstance(result, AgentRun):
        return f"calls {[(c.name, c.arguments) for c in result.calls]}, answer {json.dumps(result.final_output)}"
    return repr(result)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(config: str) -> tuple[subprocess.Popen, str, str]:
    """`specserve serve --config config` on a free port, once /health answers: (process, url, log path)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="agent_frameworks_", suffix=".log", delete=False)
    command = [os.path.join(os.path.dirname(sys.executable), "specserve"), "serve", "--config", config,
               "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"the server is not ready after 900 s: see {log.name}")


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen2.5-coder-1.5b.yaml")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--url", help="an already running server (its root, without /v1) instead of starting one")
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--repeat", type=int, default=1, help="run the cases this many times (a sampled model varies)")
    p.add_argument("--log-requests", action="store_true", help="print the request bodies of every case")
    args = p.parse_args(argv)
    process = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        from engine.models.registry import fetch, registry_paths
        for registry_model in registry_paths(args.config):
            fetch(registry_model)
        process, url, log = start_server(args.config)
        print(f"server: {args.config} at {url}, log {log}")
    try:
        model = args.model or served_model(url)
        outcomes = []
        for name in args.cases * args.repeat:
            outcome, sent = run_case(name, url, model)
            outcomes.append(outcome)
            verdict = "ok" if outcome.ok else "FAIL"
            print(f"{name:26s} {verdict:4s} {outcome.seconds:6.1f} s {outcome.tokens:6d} tokens  "
                  f"{outcome.error or shown(outcome.result)}", flush=True)
            if args.log_requests or not outcome.ok:
                for body in sent:
                    print(f"    sent: {body[:4000]}")
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    print(f"{sum(o.ok for o in outcomes)} of {len(outcomes)} cases ok")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
