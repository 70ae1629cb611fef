"""OpenAI wire format: pydantic request models (the only pydantic in specserve), response shapes, errors.

Requests ignore unknown fields (load generators send extra ones). Responses are built as plain
dicts: they are written once and never validated. Every error, FastAPI's own included, leaves as
{"error": {"message", "type", "param", "code"}}; invalid requests are 400, never FastAPI's 422.
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.outputs import SpecStats, TokenLogprob

logger = logging.getLogger("specserve.server")

MAX_N = 128
LOGPROB_FLOOR = -9999.0   # JSON has no -inf: a token the warped distribution excludes gets this


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's usual extras)."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

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
        return kwargs


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # tool_calls, name, ... go to the chat template as given
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative(stats: list[SpecStats]) -> dict[str, int]:
    """specserve's own counters, summed over the choices; never inside OpenAI's objects."""
    return {"proposed": sum(s.proposed for s in stats), "accepted": sum(s.accepted for s in stats),
            "target_forwards": sum(s.target_forwards for s in stats)}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(entries: list[TokenLogprob | None], token_ids: list[int], token_str, text_offset: int
                        ) -> tuple[dict[str, list], int]:
    """OpenAI's legacy completions shape; entry None (a prompt's first token) has no logprob.

    The top_logprobs dicts also hold the chosen token (as vLLM does), so a client can always
    compare the chosen token with the best one. Returns the object and the next text offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = token_str(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite(entry.logprob))
        top = {token_str(t): finite(lp) for t, lp in entry.top}
        top.setdefault(text, finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out, text_offset


def chat_logprobs(entries: list[TokenLogprob], token_str) -> dict[str, list]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_str(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


# ---- errors ---------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON ({detail})").response()
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc and not loc[0].isdigit() else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        logger.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)
