"""Text: chat templates, incremental detokenization, stop strings, token strings.

The engine core works in token ids only; everything that knows about text lives here, for the
server and for the offline API (engine/llm.py).
"""
from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output, so tokenizers that drop a word's leading space when
# it starts a decode (sentencepiece) still produce " word" for the first output token.
PROMPT_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no chat template, or the template rejected them."""


def load_tokenizer(path: str):
    """The tokenizer of a checkpoint directory, or of a GGUF file (its vocabulary and chat template)."""
    from transformers import AutoTokenizer

    from engine.models.gguf import find_gguf, open_gguf

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return open_gguf(gguf_file).tokenizer()
    return AutoTokenizer.from_pretrained(path)


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the messages rendered with the tokenizer's chat template (with `tools`, OpenAI's
    tool objects, for a template that renders them).

    A content given as a list of parts is joined from its text parts (other kinds are refused)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template: use /v1/completions with a "
                                "plain prompt instead")
    messages = [_flatten_content(message) for message in messages]
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as exc:  # jinja's raise_exception (e.g. "roles must alternate") and template bugs
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    # The template already writes any BOS token it wants.
    return tokenizer.encode(text, add_special_tokens=False)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
        raise ChatTemplateError("only text content parts are supported")
    return {**message, "content": "".join(str(part.get("text", "")) for part in content)}


class IncrementalDetokenizer:
    """Turns output tokens into text one token at a time, never splitting a multi-byte character.

    Decodes a short window (prefix_offset..end) and emits what it adds over the already emitted part
    (prefix_offset..read_offset). Text that ends in U+FFFD is an unfinished UTF-8 sequence: it is held
    back until a later token completes it, or until finish().
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._prefix_text: str | None = None   # decoded on first use: the engine validates the prompt first

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        self.token_ids.append(token_id)
        text = self._decode(self.prefix_offset)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return new_text

    def finish(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return self._decode(self.prefix_offset)[len(self._prefix_text):]


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries, without ever releasing them.

    push() releases text that can no longer be part of a stop string and holds back the longest
    tail that could still grow into one. On a match it releases the text before the match only.
    """

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text to release, whether a stop string matched)."""
        if not self.stop:
            return text, False
        held = self._held + text
        matches = [i for i in (held.find(s) for s in self.stop) if i >= 0]
        if matches:
            self._held = ""
            return held[:min(matches)], True
        keep = self._partial_match_length(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held


class TextStream:
    """Detokenizer plus stop strings: the text of one choice as its tokens arrive."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matchers = [StopStringMatcher(stop)]

    def also_stop_at(self, matcher) -> None:
        """Another end of the text after the stop strings, with StopStringMatcher's push(text) ->
        (text, stopped) and finish() -> text (the server's end of a turn's tool calls)."""
        self.matchers.append(matcher)

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text to emit, whether a stop string ended the text here)."""
        return self._through(self.detokenizer.push(token_id), final=False)

    def finish(self) -> tuple[str, bool]:
        return self._through(self.detokenizer.finish(), final=True)

    def _through(self, text: str, final: bool) -> tuple[str, bool]:
        for matcher in self.matchers:
            text, stopped = matcher.push(text)
            if stopped:
                return text, True
            if final:
                text += matcher.finish()
        return text, False


class TokenStrings:
    """Display text of single tokens (logprobs), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text
