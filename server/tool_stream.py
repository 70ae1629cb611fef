"""Tool calls streamed as OpenAI streams them: one choice's text deltas split into content deltas and
call deltas (a call's id and name once its arguments start, then their fragments as the model writes
them), and the end of a turn's calls (ToolCallStop). Pure bookkeeping on text."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from server.tool_parsers import HEADER, HermesParser, Llama3JsonParser, ToolParser, partial_suffix, unquote
from server.tools import Function, ToolCall, new_call_id, repeats


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its first carries the call (id, name) and maybe the start of its
    arguments; the others carry more of the arguments' text. Concatenated: the call's arguments."""
    index: int                    # the call's place in the choice's calls
    arguments: str
    call: ToolCall | None = None  # on a call's first delta

    def as_openai(self) -> dict[str, Any]:
        if self.call is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.call.id, "type": "function",
                "function": {"name": self.call.name, "arguments": self.arguments}}


class ToolStream:
    """One choice's streamed output split into content deltas and call deltas; what it sends joins
    into what parser.extract gives the whole output (the same steps, the same calls).

    A Hermes call goes out as soon as its name is known, then its arguments as they come (held back
    only where they might end). A call of a function already called, which may repeat that call, a
    bare JSON call (the lenient parser) and a Llama 3.1 output that may be calls are held until they
    end. A call identical to an earlier one is dropped (`repeated` tells)."""

    def __init__(self, parser: ToolParser, functions: list[Function]):
        self.parser, self.functions = parser, functions
        self.buffer = ""        # text received and not yet sent
        self.mode = "start"     # start (nothing decided), content, call (inside a Hermes block), json (Llama 3.1)
        self.calls: list[ToolCall] = []   # calls that have ended, each once
        self.repeated = False             # a call repeated an earlier one
        self._open: ToolCall | None = None   # the call streaming now (its id and name), in a Hermes block
        self._args_start = self._sent = 0    # where its arguments start in the block, and how much went out
        self._held: list[ToolCall] = []      # Llama 3.1: calls complete so far, sent when the output ends
        self._held_end = 0                   # where they end in the buffer
        self._space = ""                     # whitespace that goes out only if content follows it
        self._started = False                # content has gone out

    @property
    def num_calls(self) -> int:
        return len(self.calls) + (self._open is not None)

    @property
    def num_complete(self) -> int:
        """Distinct calls that have ended, sent or held."""
        return len(self.calls) + len(self._held)

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        if isinstance(self.parser, HermesParser):
            return self._hermes(final=False)
        return self._whole_output(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        if isinstance(self.parser, HermesParser):
            return self._hermes(final=True)
        return self._whole_output(final=True)

    def _hermes(self, final: bool) -> tuple[str, list[CallDelta]]:
        content, deltas = "", []
        while self.buffer:
            if self.mode == "call":
                text, closed = self._block(final, deltas)
                content += text
                if not closed:
                    break
                continue
            at, kind = self.parser.next_opening(self.buffer, self.functions, final)
            content, self.buffer = content + self.buffer[:at], self.buffer[at:]
            if kind == "block":
                self.buffer, self.mode = self.buffer[len(HermesParser.START):], "call"
            elif kind == "bare":
                done, size, call = self.parser.bare_call(self.buffer, self.functions, final)
                if not done:
                    break
                content += self.buffer[:size] if call is None else ""
                self.buffer = self.buffer[size:]
                if call is not None:
                    self._take(call, deltas)
            else:
                break
        return self._content(content), deltas

    def _content(self, text: str) -> str:
        """Content as extract gives it, stripped: whitespace goes out once more content follows it."""
        text = self._space + text
        body = text.rstrip() if self._started else text.strip()
        self._space = text[len(text.rstrip()):]
        self._started = self._started or bool(body)
        return body

    def _block(self, final: bool, deltas: list[CallDelta]) -> tuple[str, bool]:
        """Inside a <tool_call> block (self.buffer): send what can be sent. Returns the content it
        turned out to be (a block that is no call) and whether the block has ended."""
        end = HermesParser.END
        at = self.buffer.find(end)
        body = self.buffer if at < 0 else self.buffer[:at]
        header = HEADER.match(body) if self._open is None else None
        if header and (name := unquote(header[1])) in self._names and name not in {c.name for c in self.calls}:
            self._open = ToolCall(name, "", new_call_id())
            self._args_start, self._sent = header.end(), 0
            deltas.append(CallDelta(self.num_calls - 1, "", self._open))
        if at < 0 and not final:   # the arguments so far, but for what may be their end
            if self._open is not None:
                held = partial_suffix(body, end)
                ready = body[self._args_start:len(body) - held].rstrip().rstrip("}").rstrip()
                self._send(ready, deltas)
            return "", False
        self.buffer, self.mode = ("" if at < 0 else self.buffer[at + len(end):]), "content"
        call = self.parser.parse_block(body, self.functions)
        if self._open is None:   # the name came late, or never, or may repeat: the block whole, as a call or content
            if call is None:
                return HermesParser.START + body + ("" if at < 0 else end), True
            self._take(call, deltas)
            return "", True
        if call is not None and call.arguments.startswith(self._sent_text(body)):
            self._send(call.arguments, deltas)   # the rest; a block that broke down stays as it went out
        self.calls.append(ToolCall(self._open.name, call.arguments if call else self._sent_text(body),
                                   self._open.id))
        self._open = None
        return "", True

    def _take(self, call: ToolCall, deltas: list[CallDelta]) -> None:
        """A call that has ended, sent whole, unless it repeats an earlier one."""
        if repeats(call, self.calls):
            self.repeated = True
            return
        self.calls.append(call)
        deltas.append(CallDelta(len(self.calls) - 1, call.arguments, call))

    def _send(self, arguments: str, deltas: list[CallDelta]) -> None:
        if len(arguments) > self._sent:
            deltas.append(CallDelta(self.num_calls - 1, arguments[self._sent:]))
            self._sent = len(arguments)

    def _sent_text(self, body: str) -> str:
        return body[self._args_start:self._args_start + self._sent]

    @functools.cached_property
    def _names(self) -> set[str]:
        return {f.name for f in self.functions}

    def _whole_output(self, final: bool) -> tuple[str, list[CallDelta]]:
        """Llama 3.1: an output that opens with "{" (or the tag) may be calls: held until it ends."""
        if self.mode == "start":
            head = self.buffer.lstrip()
            if not head:
                return "", []
            maybe_call = head.startswith("{") or head.startswith(Llama3JsonParser.TAG) or \
                Llama3JsonParser.TAG.startswith(head)
            self.mode = "json" if maybe_call else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return self._content(text), []
        if not final:
            self._hold_complete_calls()
            return "", []
        content, calls = self.parser.extract(self.buffer, self.functions)
        self.buffer, self._held = "", []
        first = len(self.calls)
        self.calls += calls
        return content or "", [CallDelta(first + i, call.arguments, call) for i, call in enumerate(calls)]

    def _hold_complete_calls(self) -> None:
        """The calls complete so far (each once), for the end of the turn: they go out when the output ends."""
        calls, self._held_end = self.parser.leading_calls(self.buffer, self.functions, self._held_end)
        for call in calls:
            if repeats(call, self._held):
                self.repeated = True
            else:
                self._held.append(call)


class ToolCallStop:
    """The end of a turn's tool calls, as a stop condition of a choice's text (TextStream.also_stop_at):
    a call identical to an earlier one of the turn (the model repeats itself), or the max_calls-th
    distinct call. Its text passes through whole; the repeat in it is dropped where the output is
    parsed (extract, ToolStream). Stopping ends the choice as a matched stop string does: its engine
    request is aborted, what it made after counted as discarded, and the finish reason is "stop", which
    calls make "tool_calls". So a model that writes the same call again and again, which a grammar of
    parallel calls lets it do, stops at the first repeat instead of the context's end."""

    def __init__(self, parser: ToolParser, functions: list[Function], max_calls: int):
        self.calls = ToolStream(parser, functions)
        self.max_calls = max_calls

    def push(self, text: str) -> tuple[str, bool]:
        self.calls.push(text)
        return text, self.calls.repeated or self.calls.num_complete >= self.max_calls

    def finish(self) -> str:
        return ""
