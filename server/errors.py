"""Errors in OpenAI's shape: every error, FastAPI's own included, leaves as
{"error": {"message", "type", "param", "code"}}; invalid requests are 400, never FastAPI's 422, with one
line naming the field, what was expected and what came. Unexpected failures are 500s that show the
client an id and leave the details in the log.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.response_fields import new_id

logger = logging.getLogger("specserve.server")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error this server sends (OpenAI's shape)."""
    error: ErrorDetail


ERROR_STATUSES = {400: "invalid request (the message names the field)", 401: "missing or invalid API key",
                  404: "unknown model", 413: "request body too large", 429: "too many queued requests (Retry-After)",
                  500: "the engine failed this request", 503: "the engine is dead, stuck or shutting down"}


def document_errors(app: FastAPI) -> None:
    """OpenAPI lists the errors the server really sends, with their schema, and not FastAPI's 422
    (invalid requests are 400s here)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(components["ErrorResponse"].pop("$defs", {}))
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, description in ERROR_STATUSES.items():
                        responses.setdefault(str(status), {"description": description, "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _is_union_branch(part: Any) -> bool:
    """pydantic names the branch of a union it tried in the error's loc: "str", "list[int]", ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[")))


def shown_value(value: Any, limit: int = 60) -> str:
    """A value as an error message shows it: its JSON, cut to `limit` characters."""
    text = json.dumps(_head(value, limit), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _head(value: Any, limit: int, depth: int = 3) -> Any:
    """The start of a value, enough to show it: a few items of each container a few levels down, so
    showing a huge or deeply nested value costs little."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [_head(item, limit, depth - 1) for item in value[:8]] if depth else ["..."]
    if isinstance(value, dict):
        items = [(key, value[key]) for _, key in zip(range(8), value)]
        return {str(key): _head(item, limit, depth - 1) for key, item in items} if depth else {"...": "..."}
    return value


def validation_message(errors: list[dict[str, Any]]) -> str:
    """One line for the first of pydantic's errors: where, what was expected, what came.

    A value that fits no branch of a union ("stop": [1]) gets one line naming the branches,
    not pydantic's error for the first branch alone ("stop.str: Input should be a valid string")."""
    if not errors:
        return "invalid request"
    locs = [[part for part in error.get("loc", ()) if part != "body"] for error in errors]
    first, loc, msg = errors[0], locs[0], str(errors[0].get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")   # our validators' own messages say what is wrong
    branch = next((i for i, part in enumerate(loc) if _is_union_branch(part)), None)
    if branch is not None:   # the errors of the other branches follow, under the same path
        path = loc[:branch]
        tried = [(error, other) for error, other in zip(errors, locs) if other[:branch] == path]
        msg = "Input should be " + " or ".join(dict.fromkeys(str(other[branch]) for _, other in tried))
        # the value itself, from a branch that failed on all of it (not on one of its items)
        first = next((error for error, other in tried if len(other) == branch + 1), {})
        loc = path
    where = ".".join(str(part) for part in loc)
    got = f", got {shown_value(first['input'])}" if "input" in first and first.get("type") != "missing" else ""
    return f"{where}: {msg}{got}" if where else f"{msg}{got}"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)


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
        return APIError(400, validation_message(errors), param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):   # FastAPI's json.loads of a body nested too deeply
            detail = "the request body nests too deeply to parse"
        # exc.headers carries what the status needs: Allow for a 405
        return JSONResponse(error_body(detail, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        error = internal_error(exc, f"{request.method} {request.url.path}")
        return error.response()


def internal_error(exc: BaseException, where: str, what: str = "internal error", code: str = "internal_error"
                   ) -> APIError:
    """A 500 that shows the client an id and nothing of the failure; the log has the details under it."""
    error_id = new_id("err")
    logger.error("%s, id %s, in %s: %s", what, error_id, where, exc, exc_info=exc)
    return APIError(500, f"{what}, id {error_id}; see the server log", "server_error", code=code)
