"""The async bridge: the engine core (its own process, or a thread) on one side, asyncio on the other.

    engine core (server.engine_core)           event loop thread
    --------------------------------           -----------------
    sleep while idle                           add_requests(): register queue and future, submit Add
                                               (a prompt once, with the ids and params of its choices)
    apply commands (Add / Abort)  <----------  abort(): submit Abort
    step()
    messages -> _on_message (core's thread) -> call_soon_threadsafe -> futures, per-request asyncio queues

An abort is applied before the next step: the request's KV blocks are free within one step. The
request -> queue and request -> future maps are read and written on the event loop thread only.
Metrics are observed where messages arrive (the engine thread, or the reader thread of a process
core), never on the event loop.

A Generation is one HTTP request's side of the bridge: its choices (one engine request each), their
text (incremental detokenizer + stop strings), and an iterator over their deltas that ends a choice
whose stop string matched (aborting it in the engine). Its owner closes it when the response ends,
however it ends: close() aborts every unfinished choice (the client went away, or one failed).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine.faults import EngineDeadError
from engine.outputs import EngineStatus
from engine.outputs import RequestOutput, SpecStats, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import TextStream
from server.core_messages import Abort, Aborted, Add, Added, Command, Dead, EngineInfo, Idle, Message, Stepped
from server.engine_core import ProcessCore, ThreadCore

logger = logging.getLogger("specserve.server")


class ShuttingDownError(EngineDeadError):
    """The server is shutting down, and this request did not finish within shutdown_timeout."""


class AsyncEngine:
    """engine: an Engine (run on a thread of this process) or a started ProcessCore. on_dead is
    called once, on the event loop, if the core dies while serving (the CLI exits non-zero then)."""

    def __init__(self, engine, metrics=None, on_dead: Callable[[str], None] | None = None):
        self.core = engine if isinstance(engine, ProcessCore) else ThreadCore(engine)
        self.metrics = metrics
        self.on_dead = on_dead
        self._queues: dict[str, asyncio.Queue] = {}
        self._adding: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = self._stopping = False
        self._status: EngineStatus | None = None
        self._last_progress = time.monotonic()   # when the core last reported a step (or being idle)
        self.error: str | None = None   # why the loop died, once it has

    @property
    def info(self) -> EngineInfo:
        return self.core.info

    # ---- lifecycle (event loop thread) ------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = True
        self.core.start(self._on_message)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.core.stop(timeout)

    @property
    def dead_reason(self) -> str:
        return self.error or "the engine loop is not running"

    @property
    def is_alive(self) -> bool:
        return self._started and self.error is None and not self._stopping and self.core.is_running

    # ---- requests (event loop thread) -------------------------------------------------
    async def add_requests(self, prompts: list[tuple[list[int], list[tuple[str, SamplingParams]]]],
                           queue: asyncio.Queue) -> None:
        """Queue requests in the engine: per prompt, the (request id, params) of its choices. Each
        prompt crosses to the engine core once, however many choices share it. Their outputs
        (RequestOutput deltas, or an EngineDeadError) go to `queue`. Raises the engine's ValueError /
        ContextLengthError for bad input, in which case none of them stays queued."""
        ids = [rid for _, requests in prompts for rid, _ in requests]
        futures = [self._loop.create_future() for _ in ids]
        for rid, future in zip(ids, futures):
            self._queues[rid], self._adding[rid] = queue, future
        try:
            self._submit([Add(prompt, tuple(requests)) for prompt, requests in prompts])
        except EngineDeadError:
            for rid in ids:
                self._queues.pop(rid, None)
                self._adding.pop(rid, None)
            raise
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:   # client gone while waiting: added or not, drop them all
            for rid in ids:
                self.abort(rid)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid in ids:
                self.abort(rid)
            raise errors[0]

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Drop a request (client gone, or a stop string ended it: reason "stop"). Never blocks.

        A "stop" abort keeps the request's queue: whatever the engine generated before the abort
        landed still arrives, then a final output with the request's last speculation counters, so
        the response can account for every token the engine made for it."""
        queue = self._queues.get(request_id) if reason == "stop" else self._queues.pop(request_id, None)
        if queue is None:
            return   # finished, or aborted already
        try:
            self._submit([Abort(request_id, reason)])
        except EngineDeadError:
            pass

    def _submit(self, commands: list[Command]) -> None:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason)
        try:
            self.core.submit(commands)
        except ConnectionError as exc:
            raise EngineDeadError(str(exc)) from None

    # ---- messages from the core (its thread) -------------------------------------------
    def _on_message(self, message: Message) -> None:
        if isinstance(message, (Stepped, Idle, Added)):
            self._last_progress = time.monotonic()
        match message:
            case Stepped(outputs, stats, status):
                self._status = status
                if self.metrics is not None:
                    if stats is not None:
                        self.metrics.observe_step(stats)
                    for output in outputs:
                        if output.finished:
                            self.metrics.observe_request(output)
                if outputs:
                    self._call(self._deliver, outputs)
            case Added(results):
                self._call(self._settle, results)
            case Aborted(final, reason):
                if self.metrics is not None:
                    self.metrics.observe_request(final)
                if reason == "stop":
                    self._call(self._deliver, [final])
            case Idle(status):
                self._status = status
                if self.metrics is not None:
                    # No step runs while idle, so refresh the engine-state gauges that steps would have set.
                    self.metrics.num_running.set(0)
                    self.metrics.num_waiting.set(0)
                    self.metrics.kv_cache_usage.set(status.kv_cache_usage)
            case Dead(reason):
                self.error = reason
                self._call(self._fail_all, EngineDeadError(reason))

    def _call(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass   # the event loop is closed already (shutdown)

    # ---- delivery (event loop thread) ---------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue   # aborted meanwhile
            if output.finished:
                del self._queues[output.request_id]
            queue.put_nowait(output)

    def _settle(self, results: tuple[tuple[str, Exception | None], ...]) -> None:
        for request_id, error in results:
            future = self._adding.pop(request_id, None)
            if future is None or future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        self._end_all(error)
        if self.on_dead is not None and not self._stopping:
            self.on_dead(self.error)

    def _end_all(self, error: EngineDeadError) -> list[str]:
        """Every request in flight gets `error` (streams: an error event and [DONE]); returns their ids."""
        ended = list(dict.fromkeys([*self._adding, *self._queues]))
        for future in self._adding.values():
            if not future.done():
                future.set_exception(error)
        self._adding.clear()
        queues = {id(q): q for q in self._queues.values()}
        self._queues.clear()
        for queue in queues.values():
            queue.put_nowait(error)
        return ended

    async def drain(self, timeout: float) -> int:
        """Shutdown: wait up to `timeout` seconds for the requests in flight to finish, then end the
        rest with ShuttingDownError and abort them in the engine. Returns how many were cut short."""
        deadline = self._loop.time() + timeout
        while (self._queues or self._adding) and self.is_alive and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = self._end_all(ShuttingDownError(f"the server is shutting down: the request did not finish within "
                                              f"shutdown_timeout ({timeout:g} s)"))
        if cut and self.is_alive:
            self._submit([Abort(rid, "abort") for rid in cut])
        return len(cut)

    # ---- introspection (event loop thread) ----------------------------------------------
    def stalled_for(self) -> float:
        """Seconds since the core last reported progress while requests are in flight (0: idle, or
        progressing). A core that is alive but stuck (a hung kernel, a deadlock) shows here."""
        if not self._queues and not self._adding:
            return 0.0
        return time.monotonic() - self._last_progress

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running: those in flight here, less the engine's running
        ones as of its last step (a request submitted since is waiting anyway)."""
        running = self._status.num_running if self._status is not None else 0
        return max(0, len(self._queues) - running)

    def health(self) -> dict[str, Any]:
        """/health's body while alive: requests in the engine and its KV blocks (as of the last step)."""
        status = self._status
        info = self.info
        if status is None:
            status = EngineStatus(0, 0, 0, info.num_blocks, info.num_blocks, 0.0, 0)
        return {"status": "ok", "num_requests": status.num_requests, "kv_blocks_free": status.kv_blocks_free,
                "kv_blocks_total": status.kv_blocks_total, "engine": self.core.kind, "engine_pid": info.pid,
                "engine_threads": info.num_threads, "dtype": info.dtype, "quantization": info.quantization,
                "device": info.device}


class RequestFailedError(RuntimeError):
    """The engine failed this request (finish_reason "error"); invalid_request: through a fault of
    its own (a grammar that admits no output), a client error."""

    def __init__(self, message: str, invalid_request: bool = False):
        super().__init__(message)
        self.invalid_request = invalid_request


@dataclass(eq=False)
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text_stream: TextStream
    keep_output: bool = True   # False: scoring only (max_tokens 0), the one token generated is dropped
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    num_discarded: int = 0     # tokens the engine made for this choice that it does not return

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def drain(self, output: RequestOutput) -> None:
        """Take a delta that arrived after the choice ended (its stop string matched)."""
        self.num_discarded += len(output.new_token_ids)
        if output.finish_reason != "error":
            self.spec = output.spec

    def consume(self, output: RequestOutput) -> tuple[str, int]:
        """Take one engine delta; return (new text, index of the first new token in token_ids).

        Tokens are taken one by one so a stop string met inside an accepted run of draft tokens
        ends the choice right there: nothing after it is counted or returned."""
        start = len(self.token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.spec = output.spec
        if not self.keep_output:
            self.num_discarded += len(output.new_token_ids)
            if output.finished:
                self.finish_reason = "length"
            return "", start
        pieces = []
        for j, token_id in enumerate(output.new_token_ids):
            self.token_ids.append(token_id)
            if output.new_logprobs is not None:
                self.logprobs.append(output.new_logprobs[j])
            piece, stopped = self.text_stream.push(token_id)
            pieces.append(piece)
            if stopped:
                self.finish_reason = "stop"
                self.num_discarded += len(output.new_token_ids) - j - 1
                break
        if output.finished and self.finish_reason is None:
            piece, stopped = self.text_stream.finish()
            pieces.append(piece)
            self.finish_reason = "stop" if stopped else output.finish_reason
        text = "".join(pieces)
        self.text_parts.append(text)
        return text, start


class Generation:
    def __init__(self, engine: AsyncEngine, choices: list[Choice]):
        self.engine = engine
        self.choices = choices
        self.queue: asyncio.Queue = asyncio.Queue()

    async def start(self) -> None:
        """Queue every choice in the engine, each prompt once with the choices that share it; raises
        ValueError / ContextLengthError / EngineDeadError."""
        prompts: dict[int, tuple[list[int], list[tuple[str, SamplingParams]]]] = {}
        for c in self.choices:
            prompts.setdefault(id(c.prompt_token_ids), (c.prompt_token_ids, []))[1].append((c.request_id, c.params))
        await self.engine.add_requests(list(prompts.values()), self.queue)

    async def deltas(self) -> AsyncIterator[tuple[Choice, str, int]]:
        """(choice, new text, index of its first new token) per engine delta, until all are finished.
        Raises RequestFailedError when the engine fails a choice, EngineDeadError when the loop dies.

        A choice whose stop string matched is aborted in the engine and drained: the deltas the engine
        made before the abort landed, and its final counters, are taken as discarded tokens, so that
        usage + discarded tokens always equals what the engine generated (and counted in /metrics)."""
        pending = {c.request_id: c for c in self.choices}
        draining: dict[str, Choice] = {}
        while pending or draining:
            item = await self.queue.get()
            if isinstance(item, EngineDeadError):
                if not pending:
                    break   # every response is complete; only the counters of stopped tails are lost
                raise item
            choice = draining.get(item.request_id)
            if choice is not None:
                self._count_discarded(choice, choice.drain, item)
                if item.finished:
                    del draining[item.request_id]
                continue
            choice = pending.get(item.request_id)
            if choice is None:
                continue
            if item.finish_reason == "error":
                raise RequestFailedError(item.error or "the engine failed this request", item.invalid_request)
            text, start = self._count_discarded(choice, choice.consume, item)
            if choice.finish_reason is not None:
                del pending[item.request_id]
                if not item.finished:   # a stop string matched: the engine would go on
                    draining[item.request_id] = choice
                    self.engine.abort(item.request_id, reason="stop")
            yield choice, text, start

    def _count_discarded(self, choice: Choice, take, output: RequestOutput):
        before = choice.num_discarded
        result = take(output)
        if choice.num_discarded > before and self.engine.metrics is not None:
            self.engine.metrics.observe_discarded(choice.num_discarded - before)
        return result

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass

    def close(self) -> None:
        """Abort whatever is unfinished (client gone, or one choice failed); a no-op once all finished."""
        for choice in self.choices:
            self.engine.abort(choice.request_id)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices if c.keep_output)

    @property
    def num_discarded_tokens(self) -> int:
        return sum(c.num_discarded for c in self.choices)
