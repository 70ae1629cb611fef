"""How each model family writes tool calls: parsing them out of its output, and constraining
generation to them.

- Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes, and the
  fallback system prompt of server/tools.py) or Llama 3.1's JSON form (`{"name", "parameters"}`, calls
  separated by `;`). Text outside the calls is the message's content; a block that does not parse as a
  call of a given function stays content. The Hermes family's default parser is the lenient one: small
  models also write calls as bare JSON, without the markers, some with the doubled braces their own
  template's text shows (`{{"name": ..., "arguments": {...}}}`); an object counts where it opens with
  an offered function's name and then its arguments object. A call identical to an earlier one of the
  same output (name and arguments compared as parsed JSON) is dropped: the model is repeating itself.
- `tool_choice` "required" or a named function constrains generation with a grammar built from the
  functions' parameter schemas (ToolParser.grammar), so the model can only write calls whose
  arguments parse and validate; the grammar's fixed parts (markers, keys, a sole function's name) are
  forced tokens, drafted for free.
- "auto" leaves the text free. Where a tool is `strict` (OpenAI's promise that a call's arguments
  follow its schema), the grammar is lazy (ToolParser.auto_grammar): any text, until the model opens
  a call (the family's marker); from there to the call's end it follows the call grammar, then text is
  free again. A bare call written without the marker is parsed leniently but not constrained.
  "none" leaves the tools out of the prompt.

Pure bookkeeping on text: no engine and no HTTP here.
"""
from __future__ import annotations

import json
import re
from typing import Any

from engine.structured import JSON_LAYOUT, StructuredOutput
from server.tools import Function, ToolCall, distinct, new_call_id

# Free text between calls under tool_choice "auto" (a marker token can never be part of it).
TEXT = 'TEXT: /(.|\\n)*/'
JSON_GAP = "[ \\t\\r\\n]{0,16}"   # whitespace between a bare call's tokens: bounded, so it cannot pad forever


class ToolParser:
    """How one model family writes tool calls: parse them out of its output, and constrain it to them.
    tokenizer: the served tokenizer, for a family whose grammar names its marker tokens."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

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

    def auto_grammar(self, functions: list[Function]) -> StructuredOutput:
        """tool_choice "auto" with strict tools: any text, and calls that follow the call grammar from
        their opening on (strict functions' arguments their schemas, the others' any object)."""
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


def _call_schema(functions: list[Function], arguments_key: str, strict_only: bool = False) -> dict[str, Any]:
    """A JSON schema of one call: {"name": <a function>, <arguments_key>: <its parameters>}, name first,
    in the one JSON layout structured outputs use (no free whitespace to pad with). strict_only: a
    function that is not strict takes any arguments object."""
    options = [{"type": "object", "properties": {"name": {"const": f.name},
                                                 arguments_key: _arguments_schema(f, strict_only)},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def _arguments_schema(function: Function, strict_only: bool = False) -> dict[str, Any]:
    """A call's arguments: the function's parameters, closed; any object for a function that is not
    strict where strict_only."""
    return closed(function.parameters) if function.strict or not strict_only else {"type": "object"}


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
        return StructuredOutput("grammar", f"start: call{more}\ncall: {self.start} {self._block(schema)}")

    def _block(self, schema: str) -> str:
        """A call block after its opening marker: the call object on a line of its own, then the end marker."""
        return f'"\\n" %json{schema} "\\n" {self.end}'

    def auto_grammar(self, functions):
        # Each kind of call opens at its trigger: the marker (a token of its own, which text never
        # holds, or text up to the marker's first occurrence: lazy), and for the lenient parser a
        # JSON object naming an offered function (what parse() reads as a call), where the rest of the
        # object must be that function's arguments.
        schema = json.dumps(_call_schema(functions, "arguments", strict_only=True))
        rules = [f"block: {self._block(schema)}"]
        if self.start.startswith("<["):
            calls = [f"TEXT {self.start} block"]
        else:
            calls, rules = ["block_opening block"], rules + [f"block_opening[lazy]: TEXT {self.start}"]
        for i, f in enumerate(functions if self.lenient else []):
            arguments = json.dumps({**_arguments_schema(f, strict_only=True), "x-guidance": JSON_LAYOUT})
            calls.append(f"bare{i}_opening bare{i}")
            rules += [f'bare{i}_opening[lazy]: /(.|\\n)*\\{{{JSON_GAP}"name"{JSON_GAP}:{JSON_GAP}"{re.escape(f.name)}"/',
                      f"bare{i}: ARGUMENTS_KEY %json{arguments} CLOSE"]
        bare = (f'\nARGUMENTS_KEY: /{JSON_GAP},{JSON_GAP}"(arguments|parameters)"{JSON_GAP}:{JSON_GAP}/\n'
                f"CLOSE: /{JSON_GAP}\\}}/") if self.lenient else ""
        return StructuredOutput("grammar", f"start: call* TEXT\ncall: {' | '.join(calls)}\n" + "\n".join(rules)
                                + f"\n{TEXT}{bare}")


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

    def auto_grammar(self, functions):
        """The whole output is a message, or calls: a message may not open with a call's brace."""
        schema = json.dumps(_call_schema(functions, "parameters", strict_only=True))
        tag = _literal(self.tokenizer, self.TAG)
        tag = f"{tag}? " if tag.startswith("<[") else ""   # the tag's token may open the calls
        return StructuredOutput("grammar", f"start: MESSAGE | {tag}call (\"; \" call)*\ncall: %json{schema}\n"
                                           "MESSAGE: /([^{](.|\\n)*)?/")


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


