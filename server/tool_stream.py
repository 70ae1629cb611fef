"""Tool calls streamed as OpenAI streams them: one choice's text deltas split into content deltas and
call deltas (a call's id and name once its arguments start, then their fragments as the model writes
them). Pure bookkeeping on text."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from server.tools import HEADER, Function, HermesParser, Llama3JsonParser, ToolCall, ToolParser, new_call_id, unquote


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
    """One choice's streamed output split into content deltas and call deltas. A Hermes call goes out
    as soon as its name is known, then its arguments as they come (held back only where they might
    end); a Llama 3.1 output that may be calls is held until it ends."""

    def __init__(self, parser: ToolParser, functions: list[Function]):
        self.parser, self.functions = parser, functions
        self.buffer = ""        # text received and not yet sent
        self.mode = "start"     # start (nothing decided), content, call (inside a Hermes block), json (Llama 3.1)
        self.calls: list[ToolCall] = []   # calls whose block has ended
        self._open: ToolCall | None = None   # the call streaming now (its id and name), in a Hermes block
        self._args_start = self._sent = 0    # where its arguments start in the block, and how much went out

    @property
    def num_calls(self) -> int:
        return len(self.calls) + (self._open is not None)

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
        start = HermesParser.START
        content, deltas = "", []
        while self.buffer:
            if self.mode != "call":
                at = self.buffer.find(start)
                if at < 0:   # keep back what may be the start of a marker
                    cut = len(self.buffer) - (0 if final else _partial_suffix(self.buffer, start))
                    content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                    break
                content, self.buffer, self.mode = content + self.buffer[:at], self.buffer[at + len(start):], "call"
                continue
            text, closed = self._block(final, deltas)
            content += text
            if not closed:
                break
        if self.num_calls and not content.strip():   # whitespace around calls is not content
            content = ""
        return content, deltas

    def _block(self, final: bool, deltas: list[CallDelta]) -> tuple[str, bool]:
        """Inside a <tool_call> block (self.buffer): send what can be sent. Returns the content it
        turned out to be (a block that is no call) and whether the block has ended."""
        end = HermesParser.END
        at = self.buffer.find(end)
        body = self.buffer if at < 0 else self.buffer[:at]
        header = HEADER.match(body) if self._open is None else None
        if header and (name := unquote(header[1])) in self._names:
            self._open = ToolCall(name, "", new_call_id())
            self._args_start, self._sent = header.end(), 0
            deltas.append(CallDelta(self.num_calls - 1, "", self._open))
        if at < 0 and not final:   # the arguments so far, but for what may be their end
            if self._open is not None:
                held = _partial_suffix(body, end)
                ready = body[self._args_start:len(body) - held].rstrip().rstrip("}").rstrip()
                self._send(ready, deltas)
            return "", False
        self.buffer, self.mode = ("" if at < 0 else self.buffer[at + len(end):]), "content"
        call = self.parser.parse_block(body, self.functions)
        if self._open is None:   # the name came late, or never: the block whole, as a call or as content
            if call is None:
                return HermesParser.START + body + ("" if at < 0 else end), True
            self.calls.append(call)
            deltas.append(CallDelta(self.num_calls - 1, call.arguments, call))
            return "", True
        if call is not None and call.arguments.startswith(self._sent_text(body)):
            self._send(call.arguments, deltas)   # the rest; a block that broke down stays as it went out
        self.calls.append(ToolCall(self._open.name, call.arguments if call else self._sent_text(body),
                                   self._open.id))
        self._open = None
        return "", True

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
            return text, []
        if not final:
            return "", []
        content, calls = self.parser.extract(self.buffer, self.functions)
        self.buffer = ""
        first = len(self.calls)
        self.calls += calls
        return content or "", [CallDelta(first + i, call.arguments, call) for i, call in enumerate(calls)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
