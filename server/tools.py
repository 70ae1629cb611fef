"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat completions.

- The tools reach the model through its chat template (`tools=`), with the conversation's earlier
  calls as the template expects them (arguments as objects, not JSON text). A template that knows no
  tools (the default SmolLM2's) gets them as a system-prompt section in the Hermes format instead, and
  the conversation's calls and results written in that format.
- How each model family writes calls, how they are parsed out of its output and how generation is
  constrained to them: server/tool_parsers.py.
- A turn's calls end by themselves (server/tool_stream.py's ToolCallStop): at a call that repeats
  an earlier one, or at max_tool_calls_per_turn calls (one without parallel_tool_calls), generation
  stops as at a stop string, so a model that repeats itself never runs to the context's end.
- Streamed (server/tool_stream.py), content goes out as it comes, held back only while it might be a call's
  start; a call's first delta carries its id and name, then its arguments follow in fragments as
  the model writes them, joining into the non-streamed arguments (the model's own text).

Pure bookkeeping on text: no engine and no HTTP here.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")   # OpenAI's function names (and the dots some clients use)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict      # a JSON schema of the arguments object
    strict: bool = False  # a call's arguments must follow the schema, also under tool_choice "auto"

    def as_tool(self) -> dict[str, Any]:
        """The tool as OpenAI's requests carry it (what chat templates render)."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text of the arguments object
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the request's fields ---------------------------------------------------------------------

def parse_tools(value: Any) -> list[Function]:
    """`tools`: a list of {"type": "function", "function": {"name", "description", "parameters",
    "strict"}}; ValueError naming the first bad item."""
    if not isinstance(value, list):   # an empty list is no tools (some clients always send the field)
        raise ValueError("tools: a list of tools is needed")
    functions, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{...}}}}")
        body = tool["function"]
        name = body.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{where}.function.name: 1-64 letters, digits, _, . or -, got {json.dumps(name)}")
        if name in names:
            raise ValueError(f"{where}.function.name: {name!r} is given twice")
        description = body.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description: must be a string")
        parameters = body.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters: a JSON schema object is needed")
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict: must be a boolean")
        names.add(name)
        functions.append(Function(name, description, parameters, bool(strict)))
    return functions


def parse_tool_choice(value: Any, functions: list[Function]) -> str | Function:
    """`tool_choice`: "none", "auto" (the default with tools), "required", or {"type": "function",
    "function": {"name"}}: the chosen function. ValueError naming the problem."""
    if value is None:
        return "auto" if functions else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not functions:
            raise ValueError(f"tool_choice: {value!r} needs tools")
        return value
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice: \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, got {json.dumps(value)[:80]}")
    chosen = next((f for f in functions if f.name == name), None)
    if chosen is None:
        raise ValueError(f"tool_choice: no tool is named {name!r}")
    return chosen


def same_call(call: ToolCall, other: ToolCall) -> bool:
    """The same function with the same arguments, compared as parsed JSON (key order and spacing aside)."""
    if call.name != other.name:
        return False
    try:
        return json.loads(call.arguments) == json.loads(other.arguments)
    except json.JSONDecodeError:   # a streamed call that broke down: its text as sent
        return call.arguments == other.arguments


def repeats(call: ToolCall, earlier: list[ToolCall]) -> bool:
    """The call is identical to one of the earlier ones (a model that repeats itself)."""
    return any(same_call(call, other) for other in earlier)


def distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls, less those identical to an earlier one."""
    kept: list[ToolCall] = []
    for call in calls:
        if not repeats(call, kept):
            kept.append(call)
    return kept


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


# ---- the conversation, as templates want it ----------------------------------------------------

def template_messages(messages: list[dict[str, Any]], functions: list[Function] | None, native: bool
                      ) -> list[dict[str, Any]]:
    """The messages for the chat template. native (the template renders tools): earlier calls'
    arguments as objects (templates write them with tojson). Otherwise (the fallback): the tools in
    the system prompt, calls and results written in the Hermes format as plain messages."""
    if native:
        return [_arguments_as_objects(m) for m in messages]
    out = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if message.get("role") == "assistant" and calls:
            blocks = [f"<tool_call>\n{json.dumps(_call_payload(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif message.get("role") == "tool":
            result = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    if functions:
        prompt = fallback_system_prompt(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_payload(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    return {"name": function.get("name"), "arguments": _loads(function.get("arguments", {}))}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        fixed.append({**call, "function": {**function, "arguments": _loads(function.get("arguments", {}))}})
    return {**message, "tool_calls": fixed}


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def fallback_system_prompt(functions: list[Function]) -> str:
    """The tools section of a system prompt in the Hermes format, for a template that renders none."""
    tools = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor "
            "each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")
