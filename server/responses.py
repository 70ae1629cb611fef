"""The Responses API, `POST /v1/responses`: what the openai-agents SDK and OpenAI's current examples use by
default, served on the chat completions path.

The subset vLLM serves: `input` as a string or a list of items (messages with roles user, system, developer
or assistant and content as a string or input_text / output_text / refusal parts; `function_call` and
`function_call_output` items, which become an assistant message's tool_calls and tool messages),
`instructions` (a system message first), function `tools` in the Responses' flat shape, `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema: the grammar response_format gives),
`max_output_tokens` (absent: the context's remainder), the sampling fields chat completions take
(specserve's `speculative` included), and `stream` with its typed events. Nothing is stored: `store` is
accepted and answered with `"store": false`, and what needs a stored response (`previous_response_id`,
`conversation`, `background`) is a 400.

The conversation is rendered by the chat template, tools and tool_choice go through server/tools.py (the
same grammar for required / named calls, the same parser), and the generation runs through the Server's
checks, admission and run, so speculation and structured outputs work as on chat completions. The
response carries specserve's `speculative` counters beside `usage`.

Streamed, the events are OpenAI's: response.created, response.in_progress, then per output item
output_item.added, its content_part.added / output_text.delta... / output_text.done / content_part.done
(a message) or function_call_arguments.delta... / .done (a call), output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut it, response.failed when the engine
failed it). Every event carries its sequence_number.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal, Union

from fastapi import FastAPI, Request
from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError

from server import protocol as p
from server import response_fields
from server.api import _end_tool_calls, _render, _tool_grammar
from server.async_engine import EngineDeadError, Generation, RequestFailedError
from server.errors import APIError, validation_message
from server.serving import Server, _SSEResponse, server_error
from server.tool_stream import ToolStream
from server.tools import Function, ToolCall


def add_route(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(server, body, request)


# ---- the request ----------------------------------------------------------------------------------

class InputText(p._Request):
    type: Literal["input_text"]
    text: str


class OutputText(p._Request):   # an earlier answer, as a client sends it back
    type: Literal["output_text"]
    text: str


class Refusal(p._Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]


def _text_as_parts(value: Any) -> Any:
    """A content given as a string is one input_text part (so a bad part's error names it, not a union)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


Content = Annotated[list[ContentPart], BeforeValidator(_text_as_parts, json_schema_input_type=str | list[ContentPart])]


class MessageItem(p._Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(p._Request):
    """A call the model made earlier: the assistant's tool call."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(p._Request):
    """A call's result: a tool message."""
    type: Literal["function_call_output"]
    call_id: str
    output: Content


def _item_type(value: Any) -> str | None:
    """An item's kind; a message may leave its type out (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type, custom_error_type="input_item", custom_error_message=(
                          "Input should be an item of type message (the default), function_call or "
                          "function_call_output"))]


def _text_as_message(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


# a string is one user message
Input = Annotated[list[InputItem], BeforeValidator(_text_as_message, json_schema_input_type=str | list[InputItem]),
                  Field(max_length=p.MAX_MESSAGES)]


class FunctionTool(p._Request):
    """A function tool in the Responses' flat shape (no nested "function" object)."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: p.AnyJSON = None   # a JSON schema object, checked with the chat tools' checks
    strict: bool | None = None


class NamedFunction(p._Request):
    type: Literal["function"]
    name: str


class TextFormat(p._Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: p.AnyJSON = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(p._Request):
    format: TextFormat | None = None


class ResponsesRequest(p._SamplingRequest):
    """A Responses API request; the sampling fields are chat completions' (one output per request)."""
    n: Literal[1] = 1
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = Field(None, max_length=p.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = None   # accepted; nothing is stored
    # What needs stored responses: declared so that asking for it is a 400, never silently ignored.
    previous_response_id: str | None = None
    conversation: p.AnyJSON = None
    background: bool | None = None
    prompt: p.AnyJSON = None   # a stored prompt template

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id: this server stores no responses; send the whole "
                                "conversation as input items", param="previous_response_id")
        if self.conversation is not None:
            raise APIError(400, "conversation: this server stores no conversations; send the whole conversation "
                                "as input items", param="conversation")
        if self.prompt is not None:
            raise APIError(400, "prompt: this server stores no prompt templates; send instructions and input",
                           param="prompt")
        if self.background:
            raise APIError(400, "background: responses run in the foreground only (stream them instead)",
                           param="background")
        if not self.input:
            raise APIError(400, "input: at least one item is needed", param="input")

    # ---- what the chat completions path takes ----
    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    @property
    def structured_param(self) -> str:
        return "text" if self.text_format is not None else super().structured_param

    def structured(self):
        """text.format as response_format would give it (vLLM's structured_outputs still works alone)."""
        form = self.text_format
        if form is None:
            return super().structured()
        if self.response_format is not None or self.structured_outputs is not None:
            raise APIError(400, "give text.format alone, not with response_format or structured_outputs",
                           param="text")
        try:
            if form.type != "json_schema":
                return p.response_format_spec({"type": form.type})
            if form.name is None or form.schema_ is None:
                raise ValueError("a json_schema format needs a name and a schema")
            return p.response_format_spec({"type": "json_schema",
                                           "json_schema": {"name": form.name, "schema": form.schema_}})
        except ValueError as exc:
            raise APIError(400, f"text.format: {exc}", param="text") from None

    def tool_setup(self) -> tuple[list[Function], str | Function]:
        """The functions and the tool_choice ("none", "auto", "required" or the named function)."""
        # A Responses function tool is strict unless it says otherwise (OpenAI's default there).
        tools = [{"type": "function", "function": {"strict": True, **tool.model_dump(exclude={"type"},
                                                                                    exclude_none=True)}}
                 for tool in self.tools or []]
        try:
            functions = p.request_tools(tools)
        except APIError as error:   # its message names the chat shape's place: tools[i].function.name
            raise APIError(400, error.message.replace(".function.", ".", 1), param="tools") from None
        choice = self.tool_choice
        if choice is None:
            return functions, "auto" if functions else "none"
        if isinstance(choice, NamedFunction):
            named = next((f for f in functions if f.name == choice.name), None)
            if named is None:
                raise APIError(400, f"tool_choice: no tool is named {choice.name!r}", param="tool_choice")
            return functions, named
        if choice != "none" and not functions:
            raise APIError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
        return functions, choice

    def chat_messages(self) -> list[p.ChatMessage]:
        """The conversation as chat messages: instructions first as the system message; a function_call
        item joins the assistant message just before it (the turn it was part of)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions \
            else []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
            else:
                messages.append({"role": item.role, "content": _joined(item.content)})
        try:
            return [p.ChatMessage.model_validate(message) for message in messages]
        except ValidationError as exc:   # a bound of the chat messages (calls in one turn)
            raise APIError(400, f"input: {validation_message(exc.errors())}", param="input") from None

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        text_format = self.text_format.model_dump(by_alias=True, exclude_none=True) if self.text_format \
            else {"type": "text"}
        tool_choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) \
            else self.tool_choice or "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "temperature": self.temperature,
                "top_p": self.top_p, "tool_choice": tool_choice,
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
                "text": {"format": text_format}, "store": False, "previous_response_id": None,
                "truncation": "disabled", "metadata": None, "user": self.user}


def _joined(content: list[InputText | OutputText | Refusal]) -> str:
    return "".join(part.refusal if isinstance(part, Refusal) else part.text for part in content)


# ---- the route ------------------------------------------------------------------------------------

async def create_response(server: Server, body: ResponsesRequest, request: Request):
    server.check_model(body.model)
    body.check_supported()
    functions, tool_choice = body.tool_setup()
    offered = functions if tool_choice != "none" else []   # "none": the model is not told of the tools
    prompt = await _render_input(server, body, offered)
    max_tokens = body.max_output_tokens or max(1, server.info.max_model_len - len(prompt))
    params = server.sampling_params(body, max_tokens=max_tokens)
    params, grammar_param = _tool_grammar(server, body, params, functions, tool_choice)
    await server.compile_grammar(params.structured, grammar_param)
    writer = ResponseWriter(new_id("resp"), server.served_model_name, body.echo(), len(prompt))
    choices = server.choices([prompt], params, body, writer.id)
    _end_tool_calls(server, choices, offered, body.parallel_tool_calls)
    generation = await server.start(choices, "input")
    if not body.stream:
        await server.run(generation, request)
        choice = choices[0]
        return await server.respond(lambda: writer.finished(
            _status(choice.finish_reason), *_parsed(server, choice.text, offered, body.parallel_tool_calls),
            generation))
    tools = ToolStream(server.tool_parser, offered) if offered else None
    return _SSEResponse(_events(server, generation, writer, tools, body.parallel_tool_calls), generation)


async def _render_input(server: Server, body: ResponsesRequest, offered: list[Function]) -> list[int]:
    """The conversation's tokens, converted and rendered on a text thread (as a chat completion's)."""
    try:
        return await server.off_loop(lambda: _render(server, body.chat_messages(), True, offered))
    except APIError as error:   # the conversation is this API's input
        raise APIError(error.status, error.message, error.type, "input", error.code) from None


def _parsed(server: Server, text: str, offered: list[Function], parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """A finished output's content and calls (parsed out when tools were offered)."""
    content, calls = server.tool_parser.extract(text, offered) if offered else (text, [])
    return content, calls if parallel else calls[:1]


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def _events(server: Server, generation: Generation, writer: "ResponseWriter", tools: ToolStream | None,
                  parallel: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed response; an engine failure ends it with response.failed."""
    for event in writer.start():
        yield _sse(event)
    last_sent = None
    try:
        async for choice, text, _ in generation.deltas():
            calls = []
            if tools is not None:   # content streams on; a call from its name on, its arguments as they come
                text, calls = tools.push(text)
                if choice.finish_reason:
                    more_text, more_calls = tools.finish()
                    text, calls = text + more_text, calls + more_calls
                calls = calls if parallel else [c for c in calls if c.index == 0]
            events = writer.content(text) if text else []
            for delta in calls:
                events += writer.call(delta.index, delta.arguments, delta.call)
            if events and server.metrics is not None:
                now = time.monotonic()
                if last_sent is not None:
                    server.metrics.observe_token_gap(now - last_sent)
                last_sent = now
            for event in events:
                yield _sse(event)
        for event in writer.finish(_status(generation.choices[0].finish_reason), generation):
            yield _sse(event)
    except (RequestFailedError, EngineDeadError) as exc:
        yield _sse(writer.failed(server_error(exc).message, generation))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\n{response_fields.sse(event)}"


# ---- the response and its events ---------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(eq=False)
class OutputItem:
    """An output item being written: a message (its text) or a function call (its arguments so far)."""
    id: str
    text: str = ""
    call: ToolCall | None = None

    def as_openai(self, status: str) -> dict[str, Any]:
        if self.call is None:
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [_output_text(self.text)] if status != "in_progress" else []}
        return {"id": self.id, "type": "function_call", "call_id": self.call.id, "name": self.call.name,
                "arguments": self.text, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseWriter:
    """The response object of one request, and for a stream its events in order, each numbered
    (sequence_number). Bookkeeping on text only."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], num_input_tokens: int):
        self.id, self.model, self.echo, self.num_input_tokens = response_id, model, echo, num_input_tokens
        self.created_at = response_fields.now()
        self.items: list[OutputItem] = []
        self.done: list[dict[str, Any]] = []   # the items that have ended, as sent
        self.open: OutputItem | None = None    # the item being streamed
        self.calls: dict[int, OutputItem] = {}   # a streamed call's index -> its item
        self.sequence_number = 0

    # ---- whole objects ----
    def response(self, status: str, output: list[dict[str, Any]], generation: Generation | None = None,
                 error: str | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "error": None, "incomplete_details": None, **self.echo,
                "usage": None}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            body["error"] = {"code": "server_error", "message": error}
        if generation is not None:
            num_output_tokens = generation.num_completion_tokens
            body["usage"] = {"input_tokens": self.num_input_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": self.num_input_tokens + num_output_tokens}
            body["speculative"] = response_fields.speculative([c.spec for c in generation.choices],
                                                              generation.num_discarded_tokens)
        return body

    def finished(self, status: str, content: str | None, calls: list[ToolCall], generation: Generation
              ) -> dict[str, Any]:
        """A finished response: its message (when it has content, or nothing else), then its calls. The
        last item carries the response's status (incomplete when cut short), as in a stream."""
        items = [OutputItem(new_id("msg"), content or "")] if content or not calls else []
        items += [OutputItem(new_id("fc"), call.arguments, call) for call in calls]
        output = [item.as_openai(status if item is items[-1] else "completed") for item in items]
        return self.response(status, output, generation)

    # ---- a stream's events ----
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response("in_progress", [])),
                self.event("response.in_progress", response=self.response("in_progress", []))]

    def content(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open.call is None else self._open_message()
        self.open.text += text
        return events + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                    logprobs=[])]

    def call(self, index: int, arguments: str, call: ToolCall | None) -> list[dict[str, Any]]:
        """A streamed call's delta: its first carries the call (id, name), the others more arguments."""
        events = []
        if call is not None:
            events += self._close("completed")
            self.calls[index] = OutputItem(new_id("fc"), call=call)
            events += self._open(self.calls[index])
        item = self.calls.get(index)
        if item is None or not arguments:
            return events
        item.text += arguments
        return events + [self.event("response.function_call_arguments.delta", item_id=item.id,
                                    output_index=self.items.index(item), delta=arguments)]

    def finish(self, status: str, generation: Generation) -> list[dict[str, Any]]:
        events = []
        if not self.items:   # nothing was written: the answer is an empty message
            events += self._open_message()
        events += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.response(status, self.done, generation))]

    def failed(self, message: str, generation: Generation) -> dict[str, Any]:
        return self.event("response.failed", response=self.response("failed", self.done, generation, message))

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1}

    def _open_message(self) -> list[dict[str, Any]]:
        events = self._close("completed") + self._open(OutputItem(new_id("msg")))
        return events + [self.event("response.content_part.added", **self._where(), content_index=0,
                                    part=_output_text(""))]

    def _open(self, item: OutputItem) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item.as_openai("in_progress"))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        if item.call is None:
            events = [self.event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=_output_text(item.text))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, arguments=item.text)]
        self.done.append(item.as_openai(status))
        self.open = None
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=self.done[-1])]
