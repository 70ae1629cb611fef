"""uvicorn with a bounded, draining shutdown.

On the first SIGTERM (or SIGINT) the listening socket stays open, so that new requests get a 503
(`shutting_down`) instead of a refused connection and readiness probes fail; the requests in flight
run for up to shutdown_timeout (server.serving.Server.shutdown), and the rest end with an error
(streams: an error event and [DONE]). Then uvicorn stops as usual, waiting SHUTDOWN_BACKSTOP_S
at most for connections to close. A second signal skips the drain.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import uvicorn

SHUTDOWN_BACKSTOP_S = 5.0


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
