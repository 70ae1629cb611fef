"""The FastAPI app: OpenAI-compatible completions and chat completions over the async engine.

    create_app(engine, tokenizer, served_model_name, api_key=None, metrics=None) -> FastAPI

Every error leaves as {"error": {"message", "type", "param", "code"}}: 400 for invalid values
(pydantic's validation errors included), 401 for a missing or wrong API key (checked before the
body is read), 404 for an unknown model, 413 for a body over max_body_size, 429 (with Retry-After)
past max_num_waiting queued requests, 500 when the engine fails a request, 503 when the engine loop
is dead; 503 also from /health when the engine is stuck. Once a stream has started, an error is
sent as a `data: {"error": ...}` event followed by `data: [DONE]` (server.serving).

Besides OpenAI's fields, a request may carry `"speculative": {"method", "num_speculative_tokens"}`
(protocol.SpeculativeOptions), which becomes SamplingParams.speculative_method /
num_speculative_tokens; a proposer the server was not configured with is a 400 naming those it has.
Responses (and streamed usage chunks) carry `"speculative"` beside `usage` (protocol.speculative).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from server import protocol as p
from server.async_engine import Choice
from server.middleware import GuardMiddleware
from server.config import DEFAULT_MAX_BODY_SIZE, DEFAULT_WATCHDOG_TIMEOUT
from server.serving import Server
from engine.tokenizer import ChatTemplateError, render_chat

logger = logging.getLogger("specserve.server")


def create_app(engine, tokenizer, served_model_name: str, api_key: str | None = None, metrics=None,
               on_dead=None, max_num_waiting: int | None = None, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT) -> FastAPI:
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
    p.document_errors(app)
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
        try:
            server.check_alive()   # shutting down, or the engine core dead: what new requests get
        except p.APIError as error:
            return error.response()
        stalled = server.async_engine.stalled_for()
        if stalled > server.watchdog_timeout:
            return p.APIError(503, f"the engine is stuck: no step has finished for {stalled:.0f} s while requests "
                                   f"wait (watchdog_timeout {server.watchdog_timeout:g} s)", "server_error",
                              code="engine_stalled").response()
        return server.async_engine.health()

    @app.get("/metrics", response_class=PlainTextResponse)   # Prometheus text format
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
