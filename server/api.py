"""The FastAPI app: OpenAI-compatible completions and chat completions over the async engine.

    create_app(engine, tokenizer, served_model_name, api_key=None, metrics=None) -> FastAPI

Every error leaves as {"error": {"message", "type", "param", "code"}}: 400 for invalid values
(pydantic's validation errors included), 401 for a missing or wrong API key (checked before the
body is read), 404 for an unknown model, 413 for a body over max_body_size, 429 (with Retry-After)
past max_num_waiting queued requests, 500 when the engine fails a request, 503 when the engine loop
is dead. Once a stream has
started, an error is sent as a `data: {"error": ...}` event followed by `data: [DONE]`.

Besides OpenAI's fields, a request may carry `"speculative": {"method", "num_speculative_tokens"}`
(protocol.SpeculativeOptions), which becomes SamplingParams.speculative_method /
num_speculative_tokens; a proposer the server was not configured with is a 400 naming those it has.
Responses (and streamed usage chunks) carry `"speculative"` beside `usage` (protocol.speculative).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.engine import ContextLengthError
from engine.sampling_params import SamplingParams
from server import protocol as p
from server.async_engine import AsyncEngine, Choice, EngineDeadError, Generation, RequestFailedError
from server.middleware import GuardMiddleware
from server.tokenizer import ChatTemplateError, TextStream, TokenStrings, render_chat

logger = logging.getLogger("specserve.server")
DEFAULT_MAX_BODY = 16 * 2**20   # bytes: a full 128k-token prompt as JSON token ids fits
DEFAULT_WATCHDOG_S = 120.0      # no step for this long while requests wait: /health says the engine is stuck


def _server_error(exc: Exception) -> p.APIError:
    if isinstance(exc, EngineDeadError):
        return p.APIError(503, str(exc), "server_error", code="engine_dead")
    return p.APIError(500, f"the engine failed this request: {exc}", "server_error", code="engine_error")


def _param_in(message: str, names: set[str]) -> str | None:
    """The request field a ValueError's message starts with ("speculative.method ..." -> speculative)."""
    first = message.split(" ", 1)[0].split(".", 1)[0]
    return first if first in names else None


class Server:
    """What the routes share: the engine bridge, the tokenizer and the served name."""

    def __init__(self, engine, tokenizer, served_model_name: str, api_key: str | None, metrics, on_dead=None,
                 max_num_waiting: int | None = None, watchdog_timeout: float = DEFAULT_WATCHDOG_S):
        self.async_engine = AsyncEngine(engine, metrics, on_dead)
        self.max_num_waiting = max_num_waiting
        self.watchdog_timeout = watchdog_timeout
        self.tokenizer = tokenizer
        self.token_str = TokenStrings(tokenizer)
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.metrics = metrics
        self.created = p.now()

    @property
    def info(self):
        return self.async_engine.info   # the engine's model, method, proposers, context length

    # ---- checks ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise p.APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.served_model_name}`).", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if not self.async_engine.is_alive:
            raise _server_error(EngineDeadError(self.async_engine.dead_reason))

    def check_admission(self, num_choices: int) -> None:
        """Past max_num_waiting queued requests, a 429 with Retry-After: a bounded queue keeps
        latency bounded and memory flat under a flood, and clients back off."""
        waiting = self.async_engine.num_waiting
        if self.max_num_waiting is not None and waiting + num_choices > self.max_num_waiting:
            if self.metrics is not None:
                self.metrics.observe_rejected()
            raise p.APIError(429, f"the server is overloaded: {waiting} requests are waiting (the limit is "
                                  f"{self.max_num_waiting}); retry later", "rate_limit_error",
                             code="server_overloaded", headers={"Retry-After": "1"})

    def check_speculative_method(self, method: str | None) -> None:
        """A request may pick a proposer only among those the server was configured with."""
        offered = list(self.info.proposers)
        if method in (None, "auto", "none") or method in offered:
            return
        choices = ", ".join(["auto", *offered, "none"])
        proposers = f"proposers: {', '.join(offered)}" if offered else "no proposer"
        raise p.APIError(400, f"speculative.method {method!r} is not available on this server (its speculative "
                              f"method is {self.info.method!r}, {proposers}); use one of {choices}",
                         param="speculative")

    def sampling_params(self, request: p._SamplingRequest, **fields) -> SamplingParams:
        if request.logit_bias:
            raise p.APIError(400, "logit_bias is not supported", param="logit_bias")
        if request.stream_options is not None and not request.stream:
            raise p.APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if request.speculative is not None:
            self.check_speculative_method(request.speculative.method)
        request.check_limits()
        try:
            return SamplingParams(**fields, **request.sampling_kwargs())
        except ValueError as exc:
            raise p.APIError(400, str(exc), param=_param_in(str(exc), set(type(request).model_fields))) from None

    # ---- generation -------------------------------------------------------------------
    def choices(self, prompts: list[list[int]], params: SamplingParams, request: p._SamplingRequest,
                request_id: str, keep_output: bool = True) -> list[Choice]:
        if len(prompts) * request.n > p.MAX_CHOICES:
            raise p.APIError(400, f"prompts x n is {len(prompts)} x {request.n}: at most {p.MAX_CHOICES} choices "
                                  f"per request", param="n" if request.n > 1 else "prompt")
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(request.n):
                index = i * request.n + j
                seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                stream = TextStream(self.tokenizer, prompt, request.stop_strings, request.skip_special_tokens)
                choices.append(Choice(index, f"{request_id}-{index}", prompt, seeded, stream, keep_output))
        return choices

    async def start(self, choices: list[Choice], prompt_param: str) -> Generation:
        self.check_alive()
        self.check_admission(len(choices))
        generation = Generation(self.async_engine, choices)
        try:
            await generation.start()
        except ContextLengthError as exc:
            raise p.APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise p.APIError(400, str(exc), param=prompt_param) from None
        except EngineDeadError as exc:
            raise _server_error(exc) from None
        return generation

    async def run(self, generation: Generation, request: Request) -> None:
        """Run a non-streaming generation to its end, aborting it if the client goes away."""
        collect = asyncio.ensure_future(generation.run_to_end())
        disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            collect.cancel()
            generation.close()
        if not collect.done() or collect.cancelled():
            raise p.APIError(499, "client disconnected")
        try:
            collect.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise _server_error(exc) from None

    @staticmethod
    def totals(generation: Generation, num_prompt_tokens: int) -> dict[str, Any]:
        """The usage object, and specserve's speculation counters beside it (summed over choices)."""
        return {"usage": p.usage(num_prompt_tokens, generation.num_completion_tokens),
                "speculative": p.speculative([c.spec for c in generation.choices], generation.num_discarded_tokens)}

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
                yield p.sse(first)
            async for choice, text, start in generation.deltas():
                payload = chunk(choice, text, start)
                if payload is None:
                    continue
                now = time.monotonic()
                if self.metrics is not None and choice.index in last_sent:
                    self.metrics.observe_token_gap(now - last_sent[choice.index])
                last_sent[choice.index] = now
                yield p.sse(payload)
            if last_chunk is not None:
                yield p.sse(last_chunk())
        except (RequestFailedError, EngineDeadError) as exc:
            error = _server_error(exc)
            yield p.sse(p.error_body(error.message, error.type, code=error.code))
        yield p.sse("[DONE]")


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the response's end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """Server-sent events whose generation is closed however the response ends: finished, failed,
    or cut short by a client disconnect (Starlette then cancels the stream without closing it)."""

    def __init__(self, events: AsyncIterator[str], generation: Generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def create_app(engine, tokenizer, served_model_name: str, api_key: str | None = None, metrics=None,
               on_dead=None, max_num_waiting: int | None = None, max_body_size: int = DEFAULT_MAX_BODY,
               watchdog_timeout: float = DEFAULT_WATCHDOG_S) -> FastAPI:
    """engine: an Engine (its loop runs on a thread of this process) or a started
    server.engine_core.ProcessCore. on_dead(reason) is called once if the engine core dies.
    max_num_waiting: queued requests past which new ones get a 429 (None: unbounded);
    max_body_size: bytes of a request body past which it is a 413, unread; watchdog_timeout: seconds
    without a finished step, while requests wait, after which /health answers 503."""
    server = Server(engine, tokenizer, served_model_name, api_key, metrics, on_dead, max_num_waiting,
                    watchdog_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        yield
        server.async_engine.stop()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = server
    p.install_error_handlers(app)
    # Authentication runs before the body is read, the size limit before it is parsed.
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_size=max_body_size)
    _add_routes(app, server)
    return app


# ---- routes -----------------------------------------------------------------------------------

def _add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await _completions(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await _chat_completions(server, body, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        server.check_model(model)
        return _model_card(server)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise p.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tokens = _render(server, body.messages, body.add_generation_prompt)
        else:
            tokens = server.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        server.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < len(server.tokenizer)]
        if bad:
            raise p.APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/health")
    async def health():
        if not server.async_engine.is_alive:
            return _server_error(EngineDeadError(server.async_engine.dead_reason)).response()
        stalled = server.async_engine.stalled_for()
        if stalled > server.watchdog_timeout:
            return p.APIError(503, f"the engine is stuck: no step has finished for {stalled:.0f} s while requests "
                                   f"wait (watchdog_timeout {server.watchdog_timeout:g} s)", "server_error",
                              code="engine_stalled").response()
        return server.async_engine.health()

    @app.get("/metrics")
    async def metrics():
        if server.metrics is None:
            raise p.APIError(404, "metrics are not enabled")
        from server.metrics import CONTENT_TYPE
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _model_card(server: Server) -> dict[str, Any]:
    return {"id": server.served_model_name, "object": "model", "created": server.created, "owned_by": "specserve",
            "root": server.info.model, "max_model_len": server.info.max_model_len}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "unknown"


def _render(server: Server, messages: list[p.ChatMessage], add_generation_prompt: bool) -> list[int]:
    try:
        return render_chat(server.tokenizer, [m.model_dump(exclude_none=True) for m in messages],
                           add_generation_prompt)
    except ChatTemplateError as exc:
        raise p.APIError(400, str(exc), param="messages") from None


# ---- /v1/completions ------------------------------------------------------------------------

def _completion_prompts(server: Server, prompt) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt, and its text when it came as text."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if len(prompt) == 0:
        raise p.APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        return [server.tokenizer.encode(text) for text in prompt], list(prompt)
    return [list(ids) for ids in prompt], [None] * len(prompt)


async def _completions(server: Server, body: p.CompletionRequest, request: Request):
    server.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise p.APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
    if body.suffix:
        raise p.APIError(400, "suffix is not supported", param="suffix")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    scoring_only = max_tokens == 0 and body.echo   # scoring a prompt: echo (and logprobs), nothing generated
    prompts, texts = _completion_prompts(server, body.prompt)
    params = server.sampling_params(
        body, max_tokens=1 if scoring_only else max_tokens, logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    request_id = p.new_id("cmpl")
    choices = server.choices(prompts, params, body, request_id, keep_output=not scoring_only)
    generation = await server.start(choices, "prompt")
    # what echo puts in front of each choice's text: the prompt as given, else its decoded tokens
    echo_texts = [(text if text is not None else server.tokenizer.decode(ids)) if body.echo else ""
                  for ids, text in zip(prompts, texts) for _ in range(body.n)]

    def logprobs_of(choice: Choice, start: int, echoed: bool, offset: int) -> tuple[dict | None, int]:
        if body.logprobs is None:
            return None, offset
        ids, entries = choice.token_ids[start:], choice.logprobs[start:]
        if echoed:
            ids, entries = choice.prompt_token_ids + ids, (choice.prompt_logprobs or [None] * len(
                choice.prompt_token_ids)) + entries
        return p.completion_logprobs(entries, ids, server.token_str, offset)

    num_prompt_tokens = sum(len(ids) for ids in prompts)
    head = {"id": request_id, "object": "text_completion", "created": p.now(), "model": server.served_model_name}
    if not body.stream:
        await server.run(generation, request)
        out = []
        for choice in choices:
            text = echo_texts[choice.index] + choice.text
            logprobs, _ = logprobs_of(choice, 0, body.echo, 0)
            out.append({"index": choice.index, "text": text, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason})
        return {**head, "choices": out, **server.totals(generation, num_prompt_tokens)}

    offsets = [0] * len(choices)
    echoed = [not body.echo] * len(choices)

    def chunk(choice: Choice, text: str, start: int) -> dict | None:
        i = choice.index
        first_echo = not echoed[i]
        if not (text or choice.finish_reason or first_echo or (body.logprobs is not None and
                                                                  start < len(choice.token_ids))):
            return None
        echoed[i] = True
        logprobs, offsets[i] = logprobs_of(choice, start, first_echo, offsets[i])
        text = (echo_texts[i] if first_echo else "") + text
        item = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        return {**head, "choices": [item], **({"usage": None} if body.include_usage else {})}

    last = (lambda: {**head, "choices": [], **server.totals(generation, num_prompt_tokens)}) \
        if body.include_usage else None
    return server.stream(generation, [], chunk, last)


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def _chat_completions(server: Server, body: p.ChatCompletionRequest, request: Request):
    server.check_model(body.model)
    body.check_unsupported()
    if body.top_logprobs is not None and not body.logprobs:
        raise p.APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = _render(server, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:   # as much as the context leaves (at least 1, so a full prompt gets the context error)
        max_tokens = max(1, server.info.max_model_len - len(prompt))
    elif max_tokens < 1:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise p.APIError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    params = server.sampling_params(body, max_tokens=max_tokens,
                                    logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    request_id = p.new_id("chatcmpl")
    choices = server.choices([prompt], params, body, request_id)
    generation = await server.start(choices, "messages")
    head = {"id": request_id, "object": "chat.completion", "created": p.now(), "model": server.served_model_name}

    def logprobs_of(choice: Choice, start: int) -> dict | None:
        return p.chat_logprobs(choice.logprobs[start:], server.token_str) if body.logprobs else None

    if not body.stream:
        await server.run(generation, request)
        out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_of(c, 0), "finish_reason": c.finish_reason} for c in choices]
        return {**head, "choices": out, **server.totals(generation, len(prompt))}

    head = {**head, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if body.include_usage else {}
    first = [{**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], **usage_field} for c in choices]

    def chunk(choice: Choice, text: str, start: int) -> dict | None:
        if not (text or choice.finish_reason or (body.logprobs and start < len(choice.token_ids))):
            return None
        item = {"index": choice.index, "delta": {"content": text} if text else {},
                "logprobs": logprobs_of(choice, start), "finish_reason": choice.finish_reason}
        return {**head, "choices": [item], **usage_field}

    last = (lambda: {**head, "choices": [], **server.totals(generation, len(prompt))}) if body.include_usage else None
    return server.stream(generation, first, chunk, last)
