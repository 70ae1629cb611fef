"""uvicorn with bounded connections and a bounded, draining shutdown.

Connections. At most `limit_concurrency` connections (or requests in flight) at once: past it
uvicorn answers 503 at once instead of queueing without bound. A connection must deliver its
request head (request line and headers) within `header_timeout` seconds of opening, or of its
first byte after a previous response, and the body within `body_timeout` seconds of the head;
otherwise it gets a 408 and is closed. An idle kept-alive connection is closed after
`timeout_keep_alive` seconds. A head larger than h11's limit (16 KiB) is uvicorn's 400 already. So
a client that opens connections and trickles bytes (slowloris) holds each for a bounded time and
never the app; uvicorn itself has no header or body deadline.

Shutdown. On the first SIGTERM (or SIGINT) the listening socket stays open, so that new requests get
a 503 (`shutting_down`) instead of a refused connection and readiness probes fail; the requests in
flight run for up to shutdown_timeout (server.serving.Server.shutdown), and the rest end with an
error (streams: an error event and [DONE]). Then uvicorn stops as usual, waiting SHUTDOWN_BACKSTOP_S
at most for connections to close. A second signal skips the drain.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from server.config import (
    DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_LIMIT_CONCURRENCY, DEFAULT_TIMEOUT_KEEP_ALIVE,
)
from server.errors import error_body

SHUTDOWN_BACKSTOP_S = 5.0


@dataclass(frozen=True)
class ConnectionLimits:
    """How much of the server one client connection may hold, and for how long."""
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits, **options) -> uvicorn.Config:
    """uvicorn's Config for `app` under these limits (options: uvicorn's others, such as log_level)."""
    return uvicorn.Config(BodyDeadline(app, limits.body_timeout), host=host, port=port,
                          http=head_deadline_protocol(limits.header_timeout),
                          limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.timeout_keep_alive,
                          **options)


REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def head_deadline_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol (h11, or httptools where installed) with a deadline on request heads."""

    class HeadDeadlineProtocol(AutoHTTPProtocol):
        """A connection gets header_timeout seconds from its opening, and from the first byte of each
        later request, to complete the request's head (uvicorn then starts a request cycle); past
        that, a 408 and the connection closed. Idle time between requests is timeout_keep_alive's."""
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head_clock()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_head_clock()   # the first bytes of the next request on a kept-alive connection
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:    # the head is complete: its request cycle has started
                self._stop_head_clock()

        def connection_lost(self, exc) -> None:
            self._stop_head_clock()
            super().connection_lost(exc)

        def _start_head_clock(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _stop_head_clock(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request head did not arrive within %g s", header_timeout)
                self.transport.write(REQUEST_TIMEOUT)
                self.transport.close()

    return HeadDeadlineProtocol


class BodyDeadline:
    """ASGI wrapper: a request's body must arrive within `timeout` seconds of its head. When it does
    not, the app sees the client gone (http.disconnect) and the client gets a 408 in OpenAI's error
    shape, on a connection then closed. After the body, receive() is the app's as before: a
    disconnect may come at any time."""

    def __init__(self, app, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = timed_out = response_started = False

        async def bounded_receive():
            nonlocal body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, bounded_receive, tracked_send)
        if timed_out and not response_started:
            await self._request_timeout(send)

    async def _request_timeout(self, send) -> None:
        body = json.dumps(error_body(f"the request body did not arrive within {self.timeout:g} s",
                                     "invalid_request_error", code="request_timeout")).encode()
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._loop is None or self.should_exit:
            return super().handle_exit(sig, frame)
        self._draining = True
        # A signal handler may only hand work to the loop, thread-safely.
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
