"""OpenAI wire format, requests: the pydantic models of completions, chat (its messages, tool calls and
content parts), tokenize and detokenize, and the limits on what one request may ask.

Requests ignore unknown fields (load generators send extra ones) but validate the known ones
strictly: no bool for a number, no string for a number or a bool (an int is still a float), and
enums (a message's role) are Literals. specserve's own extension object, `speculative`, is ours
alone: unknown keys inside it are a 400 (a misspelt option must not pass silently). An invalid
request is an APIError (server/errors.py); responses are built from server/response_fields.py.
Pydantic lives here and in the error models of server/errors.py only.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import MAX_SPEC_TOKENS, SPEC_METHODS
from engine.structured import MAX_SCHEMA_NODES, StructuredOutput, check_json_size
from server.errors import APIError, shown_value
from server.tools import Function, parse_tool_choice, parse_tools

MAX_N = 128
MAX_CHOICES = 256        # prompts x n of one request: each is an engine request
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512    # characters per stop string: each is matched against every delta
MAX_MESSAGES = 4096      # messages of one chat request: each is validated and rendered
MAX_TOOLS = 128          # OpenAI's own limit; each tool's schema is rendered into the prompt
# Fields that take any JSON (tools, tool_choice, response_format, ...) nest at most this deep, so that
# nothing that serializes or walks them recursively (error messages, templates) can overflow; the
# schemas inside are held to engine.structured's tighter MAX_SCHEMA_DEPTH where they are read.
MAX_JSON_DEPTH = 256


# OpenAI's chat roles ("function" is its deprecated one); chat templates see the role as given.
Role = Literal["system", "user", "assistant", "tool", "developer", "function"]


class _Request(BaseModel):
    """Strict types (`max_tokens: true` or `"5"` is a 400, not 1 or 5), unknown fields ignored."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def bounded_json(value: Any) -> Any:
    """A field of any JSON, refused (400 naming it) when it nests too deeply or is too large to walk."""
    check_json_size(value, max_depth=MAX_JSON_DEPTH, max_nodes=MAX_SCHEMA_NODES)
    return value


AnyJSON = Annotated[Any, AfterValidator(bounded_json)]


class StreamOptions(_Request):
    include_usage: bool = False


class SpeculativeOptions(_Request):
    """specserve's extension beside OpenAI's fields: `"speculative": {"method", "num_speculative_tokens"}`.

    method: "auto" (the engine's speculation policy picks among the server's proposers), "draft", "eagle",
    "ngram" or "suffix" (that proposer only; the server must have it), "none" (plain decoding).
    num_speculative_tokens: the most drafts per step for this request, 0..32 (0: plain decoding; the server's own
    num_speculative_tokens still caps it). Either may be left out: the server's setting applies."""
    model_config = ConfigDict(extra="forbid", strict=True)
    method: Literal[SPEC_METHODS] | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPEC_TOKENS)


class StructuredOutputsOptions(_Request):
    """vLLM's extension for constrained output, `"structured_outputs": {...}` with exactly one of: json (a JSON
    schema, as an object or its text), json_object (true: any JSON object), regex, choice (a list of strings),
    grammar (a Lark grammar). OpenAI's `response_format` covers the JSON cases."""
    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> StructuredOutput:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, json_object, regex, choice, grammar, got "
                             f"{', '.join(n.rstrip('_') for n in given) or 'none'}")
        kind = given[0]
        if kind == "json_":
            return StructuredOutput.json_schema(self.json_)
        if kind == "choice":
            return StructuredOutput.choice(self.choice)
        return StructuredOutput(kind) if kind == "json_object" else StructuredOutput(kind, getattr(self, kind))


def response_format_spec(value: Any) -> StructuredOutput | None:
    """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ValueError("json_schema must be an object with a name (and a schema)")
        return StructuredOutput.json_schema(body.get("schema", {}))
    raise ValueError(f"type must be one of text, json_object, json_schema; got {shown_value(value)}")


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's usual extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)   # what a torch generator takes
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculative: SpeculativeOptions | None = None
    response_format: AnyJSON = None
    structured_outputs: StructuredOutputsOptions | None = None

    @property
    def structured_param(self) -> str:
        """The field a structured output comes from, for errors."""
        return "response_format" if self.response_format is not None else "structured_outputs"

    def structured(self) -> StructuredOutput | None:
        """What the output must match, from response_format or structured_outputs; a 400 names a bad
        one. Its grammar is compiled (and checked) later, off the event loop (Server.compile_grammar)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        param = self.structured_param
        try:
            if self.response_format is not None:
                return response_format_spec(self.response_format)
            return None if self.structured_outputs is None else self.structured_outputs.spec()
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_limits(self) -> None:
        """Bounds on what one request may ask of the server (pydantic checks the types)."""
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        long = next((s for s in stops if len(s) > MAX_STOP_LENGTH), None)
        if long is not None:
            raise APIError(400, f"stop: a stop string may have at most {MAX_STOP_LENGTH} characters, got one of "
                                f"{len(long)}", param="stop")

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens and logprobs aside)."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
        kwargs = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        kwargs["stop_token_ids"] = tuple(self.stop_token_ids or ())
        kwargs["ignore_eos"] = self.ignore_eos
        kwargs["structured"] = self.structured()
        if self.speculative is not None:
            kwargs["speculative_method"] = self.speculative.method
            kwargs["num_speculative_tokens"] = self.speculative.num_speculative_tokens
        return kwargs


# The lists of prompts are bounded in the type too: pydantic tries each branch of the union, and a long
# list of token ids must fail the branches of many prompts at once (too long), not item by item.
Prompts = Annotated[list[str], Field(max_length=MAX_CHOICES)]
TokenPrompts = Annotated[list[list[int]], Field(max_length=MAX_CHOICES)]


class CompletionRequest(_SamplingRequest):
    prompt: str | Prompts | list[int] | TokenPrompts
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _at_most_max_choices_prompts(cls, value: Any) -> Any:
        """A list of prompts longer than a request's choices is refused before its items are validated
        (or tokenized): each prompt is a choice at least."""
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request ({len(value)} given)")
        return value


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCallItem(_Request):
    """An earlier tool call in the conversation (an assistant message's tool_calls)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# Content parts a text-only model cannot take: a clear 400 rather than a silent drop.
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video", "video_url")


class ChatMessage(_Request):
    """One message, typed as OpenAI types it; only these fields reach the chat template."""
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # a reasoning model's earlier thinking, for templates that show it

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PARTS:
                    raise ValueError(f"content[{i}] is an {kind!r} part: this server's model reads text only "
                                     f"(send {{\"type\": \"text\", \"text\": ...}} parts)")
        return value

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.role == "function" and self.name is None:
            raise ValueError("a function message needs the function's name")
        return self

    @property
    def text(self) -> str:
        """The content as one text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def num_chars(self) -> int:
        """Characters the template renders from this message (what a prompt size cap counts)."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text) + len(self.name or "") + len(self.reasoning_content or "") + calls

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content as text, unset fields left out."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = self.text
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: AnyJSON = None            # checked by server.tools.parse_tools (a 400 names the bad item)
    tool_choice: AnyJSON = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated form of tools: declared so that asking for it is a 400, never silently ignored.
    functions: AnyJSON = None
    function_call: AnyJSON = None

    def tool_setup(self) -> tuple[list[Function], str | Function]:
        """The tools and the tool_choice ("none", "auto", "required" or the named function)."""
        for param in ("functions", "function_call"):
            if getattr(self, param) is not None:
                raise APIError(400, f"{param}: the deprecated functions API is not supported; use tools and "
                                    f"tool_choice", param=param)
        functions = request_tools(self.tools)
        try:
            return functions, parse_tool_choice(self.tool_choice, functions)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: AnyJSON = None   # rendered with the messages, as a chat completion would
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def request_tools(value: Any) -> list[Function]:
    """A request's `tools` (unset: none); a 400 names the bad item. Their number and each schema's
    depth are bounded before anything reads them (their size as a whole by AnyJSON)."""
    if value is None:
        return []
    try:
        if isinstance(value, list):
            if len(value) > MAX_TOOLS:
                raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(value)}")
            for i, tool in enumerate(value):
                function = tool.get("function") if isinstance(tool, dict) else None
                if isinstance(function, dict) and "parameters" in function:
                    check_json_size(function["parameters"], f"tools[{i}].function.parameters")
        return parse_tools(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
