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
Responses (and streamed usage chunks) carry `"speculative"` beside `usage` (response_fields.speculative).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from server import protocol as p
from server import response_fields
from server.async_engine import Choice
from server.middleware import GuardMiddleware
from server.config import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_TOOL_CALLS_PER_TURN, DEFAULT_WATCHDOG_TIMEOUT
from server.errors import APIError, document_errors, install_error_handlers
from server.serving import Server
from server.tool_stream import ToolCallStop, ToolStream
from server.tools import Function, ToolCall, template_messages
from engine.tokenizer import ChatTemplateError, render_chat

logger = logging.getLogger("specserve.server")


def create_app(engine, tokenizer, served_model_name: str, api_key: str | None = None, metrics=None,
               on_dead=None, max_num_waiting: int | None = None, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT, tool_call_parser: str = "auto",
               tenant_header: str | None = None, max_prompt_chars: int | None = None,
               max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
               sampling_defaults: dict | None = None) -> FastAPI:
    """engine: an Engine (its loop runs on a thread of this process) or a started
    server.engine_core.ProcessCore. on_dead(reason) is called once if the engine core dies.
    max_num_waiting: queued requests past which new ones get a 429 (None: unbounded);
    max_body_size: bytes of a request body past which it is a 413, unread; watchdog_timeout: seconds
    without a finished step, while requests wait, after which /health answers 503; tool_call_parser:
    how the model writes tool calls (server/tools.py; auto: from its chat template); api_key (one key or
    several separated by commas) and tenant_header: what names a request's tenant (server/middleware.py);
    max_prompt_chars: characters of prompt text one request may send (None: 32 per token of the context);
    max_tool_calls_per_turn: distinct tool calls after which a choice ends (server/tool_stream.py);
    sampling_defaults: values of the sampling fields a request leaves unset (ServerConfig's)."""
    server = Server(engine, tokenizer, served_model_name, api_key, metrics, on_dead, max_num_waiting,
                    watchdog_timeout, tool_call_parser, max_prompt_chars)
    server.max_tool_calls_per_turn = max_tool_calls_per_turn
    server.sampling_defaults = dict(sampling_defaults or {})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        yield
        server.async_engine.stop()
        server.text_work.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    # Authentication runs before the body is read, the size limit before it is parsed.
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_size=max_body_size, tenant_header=tenant_header)
    _add_routes(app, server)
    document_errors(app)
    return app


# ---- routes -----------------------------------------------------------------------------------

def _add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await _completions(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await _chat_completions(server, body, request)

    from server.responses import add_route as add_responses_route   # built on this module's chat helpers
    add_responses_route(app, server)   # POST /v1/responses

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
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tokens = await server.off_loop(_render, server, body.messages, body.add_generation_prompt,
                                           p.request_tools(body.tools))
        else:
            server.check_prompt_chars(len(body.prompt), "prompt")
            tokens = await server.off_loop(lambda: server.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        server.check_model(body.model)
        # a token is one character or more of text: what /tokenize takes, /detokenize gives back
        limit, vocab_size = server.max_prompt_chars, len(server.tokenizer)
        if len(body.tokens) > limit:
            raise APIError(400, f"tokens: {len(body.tokens)} tokens, more than this server detokenizes in one "
                                f"request ({limit}, max_prompt_chars)", param="tokens")
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab_size):
            bad = next(t for t in body.tokens if not 0 <= t < vocab_size)
            raise APIError(400, f"token id {bad} is outside the vocabulary", param="tokens")
        return {"prompt": await server.off_loop(server.tokenizer.decode, body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/health")
    async def health():
        try:
            server.check_alive()   # shutting down, or the engine core dead: what new requests get
        except APIError as error:
            return error.response()
        stalled = server.async_engine.stalled_for()
        if stalled > server.watchdog_timeout:
            return APIError(503, f"the engine is stuck: no step has finished for {stalled:.0f} s while requests "
                                 f"wait (watchdog_timeout {server.watchdog_timeout:g} s)", "server_error",
                            code="engine_stalled").response()
        return server.async_engine.health()

    @app.get("/metrics", response_class=PlainTextResponse)   # Prometheus text format
    async def metrics():
        if server.metrics is None:
            raise APIError(404, "metrics are not enabled")
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


def _render(server: Server, messages: list[p.ChatMessage], add_generation_prompt: bool,
            functions: list[Function] | None = None) -> list[int]:
    """The conversation's tokens; the tools (when offered) rendered by the template, or in the system
    prompt where the template has no place for them. Its size is checked first. Routes run it on a
    text thread (server.off_loop): a template is Python, slow on a long conversation."""
    server.check_prompt_chars(sum(m.num_chars() for m in messages), "messages")
    dumped = template_messages([m.for_template() for m in messages], functions, server.native_tools)
    tools = [f.as_tool() for f in functions] if functions and server.native_tools else None
    try:
        return render_chat(server.tokenizer, dumped, add_generation_prompt, tools)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


# ---- /v1/completions ------------------------------------------------------------------------

async def _completion_prompts(server: Server, prompt, n: int) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt, and its text when it came as text. Counts, sizes and vocabulary
    ranges are checked before anything is tokenized or sent to the engine."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if len(prompt) == 0:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    server.check_num_choices(len(prompt), n)
    if isinstance(prompt[0], str):
        server.check_prompt_chars(sum(len(text) for text in prompt), "prompt")
        return await server.off_loop(lambda: [server.tokenizer.encode(text) for text in prompt]), list(prompt)
    if len(prompt) == 1:
        server.check_prompt_ids(prompt[0], "prompt")
    else:   # up to MAX_CHOICES prompts of up to max_model_len ids each
        await server.off_loop(lambda: [server.check_prompt_ids(ids, "prompt") for ids in prompt])
    return prompt, [None] * len(prompt)


async def _completions(server: Server, body: p.CompletionRequest, request: Request):
    server.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    scoring_only = max_tokens == 0 and body.echo   # scoring a prompt: echo (and logprobs), nothing generated
    prompts, texts = await _completion_prompts(server, body.prompt, body.n)
    params = server.sampling_params(
        body, max_tokens=1 if scoring_only else max_tokens, logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    await server.compile_grammar(params.structured, body.structured_param)
    request_id = response_fields.new_id("cmpl")
    choices = server.choices(prompts, params, body, request_id, keep_output=not scoring_only)
    generation = await server.start(choices, "prompt")
    # what echo puts in front of each choice's text: the prompt as given, else its decoded tokens
    echoed_prompts = await server.off_loop(lambda: [text if text is not None else server.tokenizer.decode(ids)
                                                    for ids, text in zip(prompts, texts)]) if body.echo else []
    echo_texts = [echoed_prompts[i] if body.echo else "" for i in range(len(prompts)) for _ in range(body.n)]

    def logprobs_of(choice: Choice, start: int, echoed: bool, offset: int) -> tuple[dict | None, int]:
        if body.logprobs is None:
            return None, offset
        ids, entries = choice.token_ids[start:], choice.logprobs[start:]
        if echoed:
            ids, entries = choice.prompt_token_ids + ids, (choice.prompt_logprobs or [None] * len(
                choice.prompt_token_ids)) + entries
        return response_fields.completion_logprobs(entries, ids, server.token_str, offset)

    num_prompt_tokens = sum(len(ids) for ids in prompts)
    head = {"id": request_id, "object": "text_completion", "created": response_fields.now(),
            "model": server.served_model_name}
    if not body.stream:
        await server.run(generation, request)

        def response() -> dict:
            out = []
            for choice in choices:
                text = echo_texts[choice.index] + choice.text
                logprobs, _ = logprobs_of(choice, 0, body.echo, 0)
                out.append({"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason})
            return {**head, "choices": out, **server.totals(generation, num_prompt_tokens)}
        return await server.respond(response)

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
    functions, tool_choice = body.tool_setup()
    offered = functions if tool_choice != "none" else []   # "none": the model is not told of the tools
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = await server.off_loop(_render, server, body.messages, body.add_generation_prompt, offered)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:   # as much as the context leaves (at least 1, so a full prompt gets the context error)
        max_tokens = max(1, server.info.max_model_len - len(prompt))
    elif max_tokens < 1:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    params = server.sampling_params(body, max_tokens=max_tokens,
                                    logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    params, grammar_param = _tool_grammar(server, body, params, functions, tool_choice)
    await server.compile_grammar(params.structured, grammar_param)
    request_id = response_fields.new_id("chatcmpl")
    choices = server.choices([prompt], params, body, request_id)
    _end_tool_calls(server, choices, offered, body.parallel_tool_calls)
    generation = await server.start(choices, "messages")
    head = {"id": request_id, "object": "chat.completion", "created": response_fields.now(),
            "model": server.served_model_name}

    def logprobs_of(choice: Choice, start: int) -> dict | None:
        return response_fields.chat_logprobs(choice.logprobs[start:], server.token_str) if body.logprobs else None

    if not body.stream:
        await server.run(generation, request)
        return await server.respond(lambda: {**head, "choices": [
            {**_chat_message(server, c, offered, body.parallel_tool_calls), "logprobs": logprobs_of(c, 0)}
            for c in choices], **server.totals(generation, len(prompt))})

    head = {**head, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if body.include_usage else {}
    first = [{**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], **usage_field} for c in choices]

    streams = [ToolStream(server.tool_parser, offered) if offered else None for _ in choices]

    def chunk(choice: Choice, text: str, start: int) -> dict | None:
        tools, calls = streams[choice.index], []
        if tools is not None:   # content streams on; a call from its name on, its arguments as they come
            text, calls = tools.push(text)
            if choice.finish_reason:
                more_text, more_calls = tools.finish()
                text, calls = text + more_text, calls + more_calls
            calls = calls if body.parallel_tool_calls else [c for c in calls if c.index == 0]
        if not (text or calls or choice.finish_reason or (body.logprobs and start < len(choice.token_ids))):
            return None
        delta = {**({"content": text} if text else {}),
                 **({"tool_calls": [c.as_openai() for c in calls]} if calls else {})}
        finish = _finish_reason(choice.finish_reason, tools.calls if tools is not None else [])
        item = {"index": choice.index, "delta": delta, "logprobs": logprobs_of(choice, start), "finish_reason": finish}
        return {**head, "choices": [item], **usage_field}

    last = (lambda: {**head, "choices": [], **server.totals(generation, len(prompt))}) if body.include_usage else None
    return server.stream(generation, first, chunk, last)


def _chat_message(server: Server, choice: Choice, offered: list[Function], parallel: bool) -> dict:
    """A finished choice's message (its tool calls parsed out when tools were offered) and finish reason."""
    content, calls = server.tool_parser.extract(choice.text, offered) if offered else (choice.text, [])
    calls = calls if parallel else calls[:1]
    message = {"role": "assistant", "content": content,
               **({"tool_calls": [call.as_openai() for call in calls]} if calls else {})}
    return {"index": choice.index, "message": message, "finish_reason": _finish_reason(choice.finish_reason, calls)}


def _end_tool_calls(server: Server, choices: list[Choice], offered: list[Function], parallel: bool) -> None:
    """Each choice's turn ends at a tool call that repeats an earlier one, or at the
    max_tool_calls_per_turn-th call (the first without parallel calls), as at a stop string."""
    if offered:
        max_calls = server.max_tool_calls_per_turn if parallel else 1
        for choice in choices:
            choice.text_stream.also_stop_at(ToolCallStop(server.tool_parser, offered, max_calls))


def _tool_grammar(server: Server, body: p.ChatCompletionRequest, params, functions: list[Function],
                  tool_choice) -> tuple:
    """tool_choice "required" or a named function: the output is constrained to calls (of any of the
    functions, or one of the named one), so their arguments always parse. "auto" with strict tools: the
    calls the model opens are (a lazy grammar), its text is free. Returns the params and the field a
    grammar error names."""
    if tool_choice == "auto" and params.structured is None and any(f.strict for f in functions):
        return dataclasses.replace(params, structured=server.tool_parser.auto_grammar(functions)), "tools"
    if tool_choice not in ("required",) and not isinstance(tool_choice, Function):
        return params, body.structured_param
    if params.structured is not None:
        raise APIError(400, f"tool_choice {_shown_choice(tool_choice)} cannot be combined with "
                            f"{body.structured_param}: both constrain the output", param="tool_choice")
    if tool_choice == "required":   # calls of any function, several where parallel_tool_calls allows
        grammar = server.tool_parser.grammar(functions, body.parallel_tool_calls)
    else:                            # one call of the named function
        grammar = server.tool_parser.grammar([tool_choice], parallel=False)
    return dataclasses.replace(params, structured=grammar), "tools"


def _shown_choice(tool_choice) -> str:
    return f"{{function: {tool_choice.name}}}" if isinstance(tool_choice, Function) else repr(tool_choice)


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for an output that ended on its calls."""
    return "tool_calls" if calls and reason == "stop" else reason
