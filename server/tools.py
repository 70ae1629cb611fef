"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat completions.

- The tools reach the model through its chat template (`tools=`), with the conversation's earlier
  calls as the template expects them (arguments as objects, not JSON text). A template that knows no
  tools (the default SmolLM2's) gets them as a system-prompt section in the Hermes format instead, and
  the conversation's calls and results written in that format.
- The model's output is parsed into `tool_calls` by the parser of its family (ToolParser): Hermes-style
  `<tool_call>{"name", "arguments"}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes, and the fallback
  above) or Llama 3.1's JSON form (`{"name", "parameters"}`, calls separated by `;`). Text outside the
  calls is the message's content; a block that does not parse as a call of a given function stays
  content. The Hermes family's default parser is the lenient one: small models also write calls as
  bare JSON, without the markers, some with the doubled braces their own template's text shows
  (`{{"name": ..., "arguments": {...}}}`); an object counts where it opens with an offered
  function's name and then its arguments object. A call identical to an earlier one of the same
  output (name and arguments compared as parsed JSON) is dropped: the model is repeating itself.
- `tool_choice` "required" or a named function constrains generation with a grammar built from the
  functions' parameter schemas (ToolParser.grammar), so the model can only write calls whose
  arguments parse and validate; the grammar's fixed parts (markers, keys, a sole function's name) are
  forced tokens, drafted for free. "auto" leaves the output free and parses it; "none" leaves the
  tools out of the prompt.
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

from engine.structured import JSON_LAYOUT, StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")   # OpenAI's function names (and the dots some clients use)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict   # a JSON schema of the arguments object

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
        if not isinstance(body.get("strict", False), bool):
            raise ValueError(f"{where}.function.strict: must be a boolean")
        names.add(name)
        functions.append(Function(name, description, parameters))
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


# ---- the model's families ---------------------------------------------------------------------

class ToolParser:
    """How one model family writes tool calls: parse them out of its output, and constrain it to them.
    tokenizer: the served tokenizer, for a family whose grammar names its marker tokens."""

    def __init__(self, tokenizer=None):
        pass

    def extract(self, text: str, functions: list[Function]) -> tuple[str | None, list[ToolCall]]:
        """The content (None when there is none) and the calls in a finished output, each once."""
        content, calls = self.parse(text, functions)
        return content, distinct(calls)

    def parse(self, text: str, functions: list[Function]) -> tuple[str | None, list[ToolCall]]:
        """The content and every call, repeats included."""
        raise NotImplementedError

    def grammar(self, functions: list[Function], parallel: bool) -> StructuredOutput:
        """A grammar whose every output is one call (several when parallel) of these functions."""
        raise NotImplementedError

    @staticmethod
    def _call(payload: Any, functions: list[Function], keys: tuple[str, ...]) -> ToolCall | None:
        """A call of a given function from a parsed {"name", <arguments>} object (the arguments under
        the first of `keys` it has; none: no arguments), else None."""
        if not isinstance(payload, dict) or payload.get("name") not in {f.name for f in functions}:
            return None
        key = next((k for k in keys if k in payload), None)
        arguments = payload[key] if key is not None else {}
        if not isinstance(arguments, dict):
            return None
        return ToolCall(payload["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


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


def _call_schema(functions: list[Function], arguments_key: str) -> dict[str, Any]:
    """A JSON schema of one call: {"name": <a function>, <arguments_key>: <its parameters>}, name first,
    in the one JSON layout structured outputs use (no free whitespace to pad with)."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, arguments_key: closed(f.parameters)},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others where it leaves
    additionalProperties unset, as OpenAI's strict function calling reads a schema. Frameworks send
    schemas that leave it unset; a grammar that allowed any key would let a small model write
    invented keys without end. (The request's schema depth is bounded before it gets here.)"""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties", "not"):   # one subschema
        if isinstance(schema.get(key), dict):
            out[key] = closed(schema[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):   # a list of them
        if isinstance(schema.get(key), list):
            out[key] = [closed(item) for item in schema[key]]
    for key in ("properties", "$defs", "definitions"):       # a mapping of names to them
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(item) for name, item in schema[key].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


class HermesParser(ToolParser):
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call; only what
    the markers enclose is a call (strict)."""
    START, END = "<tool_call>", "</tool_call>"
    KEYS = ("arguments",)
    lenient = False   # bare JSON calls count too (HermesLenientParser)

    def __init__(self, tokenizer=None):
        # Where the tokenizer has the markers as tokens of their own (Qwen2.5's added tokens), the
        # grammar names those tokens: the model writes them so, and llguidance does not match an
        # added token against the marker's text.
        self.start, self.end = (_literal(tokenizer, marker) for marker in (self.START, self.END))

    def parse(self, text, functions):
        """One pass over the text with the steps a stream (server/tool_stream.py) takes, so both agree."""
        calls, content = [], []
        while text:
            at, kind = self.next_opening(text, functions, final=True)
            content.append(text[:at])
            text = text[at:]
            if kind == "block":
                end = text.find(self.END, len(self.START))
                body_end, size = (len(text), len(text)) if end < 0 else (end, end + len(self.END))
                call = self.parse_block(text[len(self.START):body_end], functions)
                whole, rest = text[:size], text[size:]
            elif kind == "bare":
                _, size, call = self.bare_call(text, functions, final=True)
                whole, rest = text[:size], text[size:]
            else:
                break
            if call is None:   # no call: its text stays content
                content.append(whole)
            else:
                calls.append(call)
            text = rest
        joined = "".join(content).strip()
        return (joined or None), calls

    def next_opening(self, text: str, functions: list[Function], final: bool) -> tuple[int, str]:
        """Where the next call opens in content text: (i, "block") at a marker, (i, "bare") at a bare
        call's opening (lenient), or (i, "") where none does: text[i:] (nothing when final) may still
        grow into one."""
        marker = text.find(self.START)
        before = len(text) if marker < 0 else marker
        if self.lenient:
            names = [f.name for f in functions]
            candidate = BARE_START.search(text, 0, before)
            while candidate:
                opening = _bare_opening(text, candidate.start(), names)
                if opening or (opening == 0 and not final):
                    return candidate.start(), ("bare" if opening else "")
                candidate = BARE_START.search(text, candidate.start() + 1, before)
        if marker >= 0:
            return marker, "block"
        return len(text) - (0 if final else partial_suffix(text, self.START)), ""

    def bare_call(self, text: str, functions: list[Function], final: bool) -> tuple[bool, int, ToolCall | None]:
        """text opens a bare call (next_opening): (done, size, call). Done with a call: text[:size] is
        that call, with its code fence and doubled brace; done without one: its first character is
        content (size 1); not done: it may still end."""
        brace = text.find("{")   # after a code fence, if any
        inner = len(text) - len(text[brace + 1:].lstrip(JSON_SPACE))
        start = inner if text.startswith("{", inner) else brace   # a doubled brace's inner object
        try:
            payload, end = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError:
            return final, 1, None
        call = self._call(payload, functions, ("arguments", "parameters"))
        if call is None:
            return True, 1, None
        # what closes the doubled brace and the code fence, where the model wrote it
        for closer in ["}"] * (start > brace) + ["```"] * (brace > 0):
            after = len(text) - len(text[end:].lstrip(JSON_SPACE))
            if closer.startswith(text[after:]) and not final:   # the text ends before it is known
                return False, 0, None
            end = after + len(closer) if text.startswith(closer, after) else end
        return True, end, ToolCall(call.name, _arguments_text(text[start:], call), call.id)

    def parse_block(self, body: str, functions: list[Function]) -> ToolCall | None:
        """A call from a block's text, its arguments as the model wrote them (what a stream sends)."""
        try:
            call = self._call(json.loads(body), functions, self.KEYS)
        except json.JSONDecodeError:
            call = None
        if call is None and self.lenient:   # a doubled brace, or "parameters"
            body = body.strip(JSON_SPACE)
            if not _bare_opening(body, 0, [f.name for f in functions]):
                return None
            done, size, call = self.bare_call(body, functions, final=True)
            return call if done and size == len(body) else None
        return None if call is None else ToolCall(call.name, _arguments_text(body, call), call.id)

    def grammar(self, functions, parallel):
        schema = json.dumps(_call_schema(functions, "arguments"))
        # After each call the turn may end (the grammar accepts, so end-of-sequence is allowed), also
        # after the newline that would lead to another call.
        more = ' ("\\n" call)* "\\n"?' if parallel else ""
        call = f'{self.start} "\\n" %json{schema} "\\n" {self.end}'
        return StructuredOutput("grammar", f"start: call{more}\ncall: {call}")

    @staticmethod
    def system_prompt(functions: list[Function]) -> str:
        """The tools section of a system prompt, for a template that renders none (the fallback)."""
        tools = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor "
                "each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


class HermesLenientParser(HermesParser):
    """Hermes blocks, and what small models of the family write instead: a bare JSON call
    {"name": <an offered function>, "arguments": {...}} (or "parameters") outside the markers, also
    with the doubled braces {{...}} of Qwen2.5's template text, or in a code fence (which goes with
    it). An object counts only where it opens
    with an offered function's name and then an arguments object; other JSON stays content."""
    lenient = True


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calls: the whole output is {"name": ..., "parameters": {...}} (several
    separated by "; "), after the <|python_tag|> special token when the model writes one."""
    TAG = "<|python_tag|>"

    def parse(self, text, functions):
        calls, end = self.leading_calls(text, functions)
        if not calls or text[end:].strip():   # anything that is not a call: the output is a message
            return (text.strip() or None), []
        return None, calls

    def leading_calls(self, text: str, functions: list[Function], start: int = 0) -> tuple[list[ToolCall], int]:
        """The complete calls the text holds from `start` (where earlier ones ended) on, and where they end."""
        calls, decoder = [], json.JSONDecoder()
        at = self._next_call(text, start)
        while text.startswith("{", at):
            try:
                payload, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                break
            call = self._call(payload, functions, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            start, at = end, self._next_call(text, end)
        return calls, start

    def _next_call(self, text: str, at: int) -> int:
        """Past the whitespace, the tag and a ";" in front of a call."""
        rest = text[at:].lstrip()
        rest = rest[len(self.TAG):].lstrip() if rest.startswith(self.TAG) else rest
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        return len(text) - len(rest)

    def grammar(self, functions, parallel):
        schema = json.dumps(_call_schema(functions, "parameters"))
        more = ' ("; " call)*' if parallel else ""
        return StructuredOutput("grammar", f"start: call{more}\ncall: %json{schema}")


JSON_SPACE = " \t\r\n"
BARE_START = re.compile(r"[{`]")   # where a bare call may open: its brace, or a code fence around it
# A Hermes call's opening, up to its arguments' first character: {"name": "<name>", "arguments":
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def _arguments_text(text: str, call: ToolCall) -> str:
    """A call's arguments as the model wrote them where its object (text's start) opens with the name
    (the usual order: what a stream sends), else as parsed."""
    header = HEADER.match(text)
    if not header:
        return call.arguments
    _, end = json.JSONDecoder().raw_decode(text, header.end())
    return text[header.end():end]


def _bare_opening(text: str, at: int, names: list[str]) -> int | None:
    """Whether text[at:] opens a bare call: {"name": "<one of names>", "arguments": { (or
    "parameters"), maybe in a code fence, maybe after a doubled "{", JSON whitespace between. Where it
    does, the opening's end; 0 where the text ends before that is known; None where it does not."""
    pieces = [("```json", "```", ""), ("{",), ("{", ""), ('"name"',), (":",), tuple(f'"{name}"' for name in names),
              (",",), ('"arguments"', '"parameters"'), (":",), ("{",)]
    for options in pieces:
        rest = text[at:].lstrip(JSON_SPACE)
        if not rest or any(len(o) > len(rest) and o.startswith(rest) for o in options):
            return 0
        taken = next((o for o in options if rest.startswith(o)), None)
        if taken is None:
            return None
        at = len(text) - len(rest) + len(taken)
    return at


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def unquote(text: str) -> str | None:
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:
        return None


PARSER_CLASSES = {"hermes_lenient": HermesLenientParser, "hermes": HermesParser, "llama3_json": Llama3JsonParser}


def choose_parser(chat_template: str | None, configured: str = "auto", tokenizer=None) -> ToolParser:
    """The parser a config key names, or the one the chat template writes calls for: the lenient
    Hermes one where it shows none (the fallback prompt asks for that format)."""
    if configured != "auto":
        if configured not in PARSER_CLASSES:
            raise ValueError(f"tool_call_parser must be auto or one of {', '.join(PARSER_CLASSES)}, got "
                             f"{configured!r}")
        return PARSER_CLASSES[configured](tokenizer)
    template = chat_template or ""
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return Llama3JsonParser(tokenizer)
    return HermesLenientParser(tokenizer)


def _literal(tokenizer, text: str) -> str:
    """A grammar terminal for a marker: its token by id where the tokenizer added it as one token
    (llguidance's <[id]>), else its text."""
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


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
        prompt = HermesParser.system_prompt(functions)
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
