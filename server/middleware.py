"""ASGI middleware in front of the routes: authentication before the body is read, a body-size
limit before it is parsed, and the request's tenant.

A request without one of the keys is answered 401 before a byte of its body is read, and a body over
`max_body_size` is a 413 as soon as its Content-Length (or, sent in chunks, its running size) says
so: neither costs the server more than the bytes it has already seen.

The tenant is whose prefix cache and suffix cache a request shares (engine/kv_cache.py,
engine/spec_decode/suffix.py): the API key it came with, and within that key the value of the
configured `tenant_header` when the request carries one (a gateway in front names the tenant), so a
header subdivides its key's tenant and never reaches another key's. The engine gets a digest of
them, never the key. With neither, every request is the same tenant (None). It travels in
`request_tenant`, a context variable the routes' code reads when it builds SamplingParams.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from contextvars import ContextVar

from server.config import split_api_keys
from server.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/metrics"})   # probes and scrapers send no key

request_tenant: ContextVar[str | None] = ContextVar("request_tenant", default=None)


def tenant_digest(key: bytes | None, header_value: bytes | None) -> str | None:
    """A tenant's name inside the server, from the request's key and tenant header value (None: no tenant)."""
    if key is None and header_value is None:
        return None
    return hashlib.sha256(repr((key, header_value)).encode()).hexdigest()


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_size: int, tenant_header: str | None = None):
        """api_key: one key, several separated by commas, or None (no authentication)."""
        self.app, self.max_body_size = app, max_body_size
        self.api_keys = tuple(key.encode() for key in split_api_keys(api_key))
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        key = self._presented_key(headers)
        if self.api_keys and key is None and scope["path"] not in PUBLIC_PATHS:
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

        tenant = request_tenant.set(self._tenant(headers, key))
        try:
            await self.app(scope, replay, send)
        finally:
            request_tenant.reset(tenant)

    def _presented_key(self, headers: dict[bytes, bytes]) -> bytes | None:
        """The configured key the request's bearer token equals, or None. Every key is compared, each
        in constant time, so the time taken tells nothing about which key came close."""
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return None
        token_bytes, match = token.strip().encode("latin-1"), None
        for key in self.api_keys:
            if hmac.compare_digest(token_bytes, key):
                match = key
        return match

    def _tenant(self, headers: dict[bytes, bytes], key: bytes | None) -> str | None:
        header_value = headers.get(self.tenant_header) if self.tenant_header is not None else None
        return tenant_digest(key, header_value)

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
