"""What the routes share: the Server (engine bridge, tokenizer, checks, generation start and run) and
the SSE response of a generation.

Once a stream has started, an error is sent as a `data: {"error": ...}` event followed by
`data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import ContextLengthError
from engine.sampling_params import SamplingParams
from engine.structured import GRAMMAR_COMPILE_TIMEOUT, StructuredOutput
from server import protocol as p
from server import response_fields
from server.async_engine import (
    AsyncEngine, Choice, EngineDeadError, Generation, RequestFailedError, ShuttingDownError,
)
from server.config import DEFAULT_WATCHDOG_TIMEOUT
from server.errors import APIError, error_body, internal_error
from server.middleware import request_tenant
from server.tool_parsers import choose_parser
from server.tools import template_renders_tools
from engine.tokenizer import TextStream, TokenStrings

logger = logging.getLogger("specserve.server")
# Grammar checks run here, not in the default executor that other blocking work shares.
_GRAMMAR_CHECKS = ThreadPoolExecutor(2, thread_name_prefix="grammar-check")

# Threads for the text work of requests (tokenizing, chat templates, detokenizing, building large
# responses), so that none of it holds the event loop; a few, so one long prompt delays no other.
TEXT_WORKERS = 4
# max_prompt_chars unset: this many characters per token of the context. Any text this long is far
# past the context (real text runs 3 to 5 characters a token), so the cap refuses it before it is
# tokenized and never refuses a prompt that would fit.
PROMPT_CHARS_PER_TOKEN = 32


def server_error(exc: Exception) -> APIError:
    if isinstance(exc, ShuttingDownError):
        return APIError(503, str(exc), "server_error", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError) and exc.invalid_request:
        return APIError(400, str(exc), code="invalid_grammar")
    return internal_error(exc, "the engine", "the engine failed this request", code="engine_error")


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _param_in(message: str, names: set[str]) -> str | None:
    """The request field a ValueError's message starts with ("speculative.method ..." -> speculative)."""
    first = message.split(" ", 1)[0].split(".", 1)[0]
    return first if first in names else None


class Server:
    """What the routes share: the engine bridge, the tokenizer and the served name."""

    def __init__(self, engine, tokenizer, served_model_name: str, api_key: str | None, metrics, on_dead=None,
                 max_num_waiting: int | None = None, watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT,
                 tool_call_parser: str = "auto", max_prompt_chars: int | None = None):
        self.async_engine = AsyncEngine(engine, metrics, on_dead)
        self.max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.info.max_model_len
        self.text_work = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="specserve-text")
        self.max_num_waiting = max_num_waiting
        self.watchdog_timeout = watchdog_timeout
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.tool_parser = choose_parser(template, tool_call_parser, tokenizer)   # how this model writes tool calls
        self.native_tools = template_renders_tools(template)           # else the tools go in the system prompt
        self.token_str = TokenStrings(tokenizer)
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.metrics = metrics
        self.created = response_fields.now()
        self.shutting_down = False
        self.sampling_defaults: dict = {}   # for the sampling fields a request leaves unset (create_app's)

    @property
    def info(self):
        return self.async_engine.info   # the engine's model, method, proposers, context length

    # ---- checks ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                              f"`{self.served_model_name}`).", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down; retry on another replica", "server_error",
                           code="shutting_down", headers={"Retry-After": "1"})
        if not self.async_engine.is_alive:
            raise server_error(EngineDeadError(self.async_engine.dead_reason))

    def check_admission(self, num_choices: int) -> None:
        """Past max_num_waiting queued requests, a 429 with Retry-After: a bounded queue keeps
        latency bounded and memory flat under a flood, and clients back off."""
        waiting = self.async_engine.num_waiting
        if self.max_num_waiting is not None and waiting + num_choices > self.max_num_waiting:
            if self.metrics is not None:
                self.metrics.observe_rejected()
            raise APIError(429, f"the server is overloaded: {waiting} requests are waiting (the limit is "
                                f"{self.max_num_waiting}); retry later", "rate_limit_error",
                           code="server_overloaded", headers={"Retry-After": "1"})

    def check_num_choices(self, num_prompts: int, n: int) -> None:
        """prompts x n engine requests: checked from the counts alone, before anything is tokenized."""
        if num_prompts * n > p.MAX_CHOICES:
            raise APIError(400, f"prompts x n is {num_prompts} x {n}: at most {p.MAX_CHOICES} choices per request",
                           param="n" if n > 1 else "prompt")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Text to tokenize is capped (max_prompt_chars) before it is tokenized or rendered."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param}: {num_chars} characters, more than this server takes in one request "
                                f"({self.max_prompt_chars}, max_prompt_chars)", param=param,
                           code="context_length_exceeded")

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        """A prompt given as token ids: its length and vocabulary range, checked here rather than after
        it crossed to the engine core (its length first, so the range check is bounded too)."""
        limit, vocab_size = self.info.max_model_len, self.info.vocab_size
        if len(ids) > limit:
            raise APIError(400, f"{param}: {len(ids)} tokens, more than this model's maximum context length "
                                f"({limit})", param=param, code="context_length_exceeded")
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                           param=param)

    async def off_loop(self, work: Callable, *args):
        """work(*args) on a text thread, in this request's context (its tenant); its exceptions
        (APIError included) come back here."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.text_work, functools.partial(
            context.run, work, *args))

    async def respond(self, build: Callable[[], dict]) -> JSONResponse:
        """A finished request's JSON response, built and serialized on a text thread (n choices with
        logprobs make a large body)."""
        return await self.off_loop(lambda: JSONResponse(build()))

    def check_speculative_method(self, method: str | None) -> None:
        """A request may pick a proposer only among those the server was configured with."""
        offered = list(self.info.proposers)
        if method in (None, "auto", "none") or method in offered:
            return
        choices = ", ".join(["auto", *offered, "none"])
        proposers = f"proposers: {', '.join(offered)}" if offered else "no proposer"
        raise APIError(400, f"speculative.method {method!r} is not available on this server (its speculative "
                            f"method is {self.info.method!r}, {proposers}); use one of {choices}",
                       param="speculative")

    def sampling_params(self, request: p._SamplingRequest, **fields) -> SamplingParams:
        if request.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if request.speculative is not None:
            self.check_speculative_method(request.speculative.method)
        request.check_limits()
        try:
            return SamplingParams(**fields, **{**self.sampling_defaults, **request.sampling_kwargs()},
                                  tenant=request_tenant.get())
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_in(str(exc), set(type(request).model_fields))) from None

    async def shutdown(self, timeout: float) -> None:
        """SIGTERM: admit nothing more (503; /health too, so readiness fails), let the requests in
        flight run for up to `timeout` seconds, then end the rest with an error."""
        self.shutting_down = True
        logger.info("specserve: shutting down: draining requests in flight for up to %g s", timeout)
        cut = await self.async_engine.drain(timeout)
        if cut:
            logger.warning("specserve: %d requests did not finish within shutdown_timeout and were ended", cut)

    # ---- generation -------------------------------------------------------------------
    def choices(self, prompts: list[list[int]], params: SamplingParams, request: p._SamplingRequest,
                request_id: str, keep_output: bool = True) -> list[Choice]:
        self.check_num_choices(len(prompts), request.n)
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(request.n):
                index = i * request.n + j
                seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                stream = TextStream(self.tokenizer, prompt, request.stop_strings, request.skip_special_tokens)
                choices.append(Choice(index, f"{request_id}-{index}", prompt, seeded, stream, keep_output))
        return choices

    async def compile_grammar(self, spec: StructuredOutput | None, param: str) -> None:
        """Compile a structured output's grammar (cached per spec) on one of a few threads of its own,
        so that a slow one holds up no other request and a flood of them no other thread-pool work:
        one that does not compile, or not within GRAMMAR_COMPILE_TIMEOUT of its arrival, is a 400
        naming `param` (a check still queued then is cancelled, never run)."""
        if spec is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(_GRAMMAR_CHECKS, spec.grammar), GRAMMAR_COMPILE_TIMEOUT)
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None
        except TimeoutError:
            raise APIError(400, f"{param}: the grammar did not compile within {GRAMMAR_COMPILE_TIMEOUT:g} s",
                           param=param) from None

    async def start(self, choices: list[Choice], prompt_param: str) -> Generation:
        self.check_alive()
        self.check_admission(len(choices))
        generation = Generation(self.async_engine, choices)
        try:
            await generation.start()
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        except ValueError as exc:   # the prompt's, or a setting checked against the model (top_k, stop_token_ids)
            param = _param_in(str(exc), SAMPLING_FIELDS) or prompt_param
            raise APIError(400, str(exc), param=param) from None
        except EngineDeadError as exc:
            raise server_error(exc) from None
        structured = choices[0].params.structured if choices else None
        if structured is not None and self.metrics is not None:
            self.metrics.observe_structured(structured.kind, len(choices))
        return generation

    async def run(self, generation: Generation, request: Request) -> None:
        """Run a non-streaming generation to its end, aborting it if the client goes away."""
        collect = asyncio.ensure_future(generation.run_to_end())
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            collect.cancel()
            generation.close()
        if not collect.done() or collect.cancelled():
            raise APIError(499, "client disconnected")
        try:
            collect.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise server_error(exc) from None

    @staticmethod
    def totals(generation: Generation, num_prompt_tokens: int) -> dict[str, Any]:
        """The usage object, and specserve's speculation counters beside it (summed over choices)."""
        return {"usage": response_fields.usage(num_prompt_tokens, generation.num_completion_tokens),
                "speculative": response_fields.speculative([c.spec for c in generation.choices],
                                                           generation.num_discarded_tokens)}

    def stream(self, generation: Generation, first_chunks: list[dict],
               chunk: Callable[[Choice, str, int], dict | None], last_chunk: Callable[[], dict] | None
               ) -> StreamingResponse:
        """The SSE response of a generation: first_chunks, chunk(choice, new text, first new token)
        per delta (None: nothing to send yet), then last_chunk() and [DONE]."""
        return _SSEResponse(self._events(generation, first_chunks, chunk, last_chunk), generation)

    async def _events(self, generation, first_chunks, chunk, last_chunk) -> AsyncIterator[str]:
        last_sent: dict[int, float] = {}
        try:
            for first in first_chunks:
                yield response_fields.sse(first)
            async for choice, text, start in generation.deltas():
                payload = chunk(choice, text, start)
                if payload is None:
                    continue
                now = time.monotonic()
                if self.metrics is not None and choice.index in last_sent:
                    self.metrics.observe_token_gap(now - last_sent[choice.index])
                last_sent[choice.index] = now
                yield response_fields.sse(payload)
            if last_chunk is not None:
                yield response_fields.sse(last_chunk())
        except (RequestFailedError, EngineDeadError) as exc:
            error = server_error(exc)
            yield response_fields.sse(error_body(error.message, error.type, code=error.code))
        yield response_fields.sse("[DONE]")


async def _wait_for_disconnect(receive) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the response's end).
    while (await receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """Server-sent events beside a watcher of the client: a client that leaves is noticed at once,
    even while nothing is written (text held back behind a partial stop string or a tool call's
    JSON), and the generation is closed however the response ends (finished, failed, or the
    client gone), which aborts its engine requests and frees their KV. Starlette listens for the
    disconnect itself only on servers older than ASGI 2.4; this response does not depend on it."""

    def __init__(self, events: AsyncIterator[str], generation: Generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        disconnected = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            streaming.cancel()
            self.generation.close()
        if streaming.done() and not streaming.cancelled() and not isinstance(streaming.exception(), OSError):
            streaming.result()   # a failure of the stream itself; OSError: the client went away mid-write
