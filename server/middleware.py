"""ASGI middleware in front of the routes: authentication before the body is read, and a body-size
limit before it is parsed.

A request without the right key is answered 401 before a byte of its body is read, and a body over
`max_body_size` is a 413 as soon as its Content-Length (or, sent in chunks, its running size) says
so: neither costs the server more than the bytes it has already seen.
"""
from __future__ import annotations

import hmac
import json

from server.protocol import error_body

PUBLIC_PATHS = frozenset({"/health", "/metrics"})   # probes and scrapers send no key


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_size: int):
        self.app, self.api_key, self.max_body_size = app, api_key, max_body_size

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS and not self._authorized(headers):
            return await self._reply(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                     "authentication_error", "invalid_api_key",
                                     headers=[(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_size:
            return await self._too_large(send)
        # Read the body here, up to the limit, and replay it to the app: a body sent without a
        # Content-Length (chunked) is bounded too, and the app never sees a partial one.
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":   # the client left before sending it all
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_body_size:
                return await self._too_large(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()   # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, send) -> None:
        await self._reply(send, 413, f"the request body is larger than this server's limit of "
                                     f"{self.max_body_size} bytes", "invalid_request_error", "request_too_large")

    @staticmethod
    async def _reply(send, status: int, message: str, type_: str, code: str, headers=()) -> None:
        """An error in the shape every other error has, sent before the app sees the request."""
        body = json.dumps(error_body(message, type_, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})
