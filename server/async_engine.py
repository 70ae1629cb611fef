"""The async bridge: the engine's step loop on its own thread, asyncio on the other side.

    engine thread                              event loop thread
    -------------                              -----------------
    wait on the condition while idle           add_requests(): register queue, submit "add"
    drain commands (add / abort)  <----------  abort(): submit "abort"
    step()
    call_soon_threadsafe(_deliver, outputs) -> per-request asyncio queues

Commands are applied only between steps, so the engine is never touched by two threads. An
abort is applied before the next step: the request's KV blocks are free within one step. The
request -> queue map is read and written on the event loop thread only.

A Generation is one HTTP request's side of the bridge: its choices (one engine request each), their
text (incremental detokenizer + stop strings), and an iterator over their deltas that ends a choice
whose stop string matched (aborting it in the engine). Its owner closes it when the response ends,
however it ends: close() aborts every unfinished choice (the client went away, or one failed).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.outputs import RequestOutput, RequestTiming, SpecStats, TokenLogprob
from engine.sampling_params import SamplingParams
from server.tokenizer import TextStream

logger = logging.getLogger("specserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._commands: deque[tuple] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None   # why the loop died, once it has

    # ---- lifecycle (event loop thread) ------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine loop died: {type(self.error).__name__}: {self.error}"
        return "the engine loop is not running"

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stopping

    # ---- requests (event loop thread) -------------------------------------------------
    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]], queue: asyncio.Queue) -> None:
        """Queue requests in the engine; their outputs (RequestOutput deltas, or an EngineDeadError)
        go to `queue`. Raises the engine's ValueError / ContextLengthError for bad input, in which
        case none of them stays queued."""
        futures = [self._loop.create_future() for _ in requests]
        for rid, _, _ in requests:
            self._queues[rid] = queue
        try:
            self._submit([("add", rid, prompt, params, fut) for (rid, prompt, params), fut in zip(requests, futures)])
        except EngineDeadError:
            for rid, _, _ in requests:
                self._queues.pop(rid, None)
            raise
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:   # client gone while waiting: added or not, drop them all
            for rid, _, _ in requests:
                self.abort(rid)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for rid, _, _ in requests:
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
            self._submit([("abort", request_id, reason)])
        except EngineDeadError:
            pass

    def _submit(self, commands: list[tuple]) -> None:
        with self._wakeup:
            if self.error is not None or self._stopping or self._thread is None:
                raise EngineDeadError("the engine loop is not running")
            self._commands.extend(commands)
            self._wakeup.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue   # aborted meanwhile
            if output.finished:
                del self._queues[output.request_id]
            queue.put_nowait(output)

    def _settle(self, settled: list[tuple[asyncio.Future, BaseException | None]]) -> None:
        for future, error in settled:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _fail_all(self, error: EngineDeadError, pending: list[tuple]) -> None:
        self._settle([(cmd[4], error) for cmd in pending if cmd[0] == "add"])
        queues = {id(q): q for q in self._queues.values()}
        self._queues.clear()
        for queue in queues.values():
            queue.put_nowait(error)

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        last_stats = None
        commands: list[tuple] = []   # taken from the queue, not yet applied: failed too if the loop dies
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    commands = []
                    break
                self._apply(commands)
                commands = []
                if not self.engine.has_unfinished_requests():
                    self._observe_idle()
                    continue
                outputs = self.engine.step()
                stats = self.engine.last_stats
                if stats is last_stats and not outputs:
                    self._pause()   # nothing could be scheduled this time: do not spin
                if self.metrics is not None:
                    if stats is not None and stats is not last_stats:
                        self.metrics.observe_step(stats)
                    for output in outputs:
                        if output.finished:
                            self.metrics.observe_request(output)
                last_stats = stats
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop is reported, not re-raised
            logger.exception("the engine loop died")
            self.error = exc
        with self._wakeup:
            pending, self._stopping = commands + list(self._commands), True
            self._commands.clear()
        try:
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self.dead_reason), pending)
        except RuntimeError:
            pass   # the event loop is closed already (shutdown)

    def _wait_for_work(self) -> list[tuple] | None:
        """Sleep while there is nothing to do; return the queued commands, or None to stop."""
        with self._wakeup:
            while not self._commands and not self._stopping and not self.engine.has_unfinished_requests():
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _pause(self, seconds: float = 0.005) -> None:
        with self._wakeup:
            if not self._commands and not self._stopping:
                self._wakeup.wait(seconds)

    def _apply(self, commands: list[tuple]) -> None:
        settled = []
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params, future = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                    settled.append((future, None))
                except Exception as exc:  # noqa: BLE001 - bad input fails its request, never the loop
                    settled.append((future, exc))
            else:
                self._abort(*command[1:])
        if settled:
            self._loop.call_soon_threadsafe(self._settle, settled)

    def _abort(self, request_id: str, reason: str) -> None:
        request = self.engine.requests.get(request_id)
        self.engine.abort_request(request_id)
        if request is None:
            return   # it had finished already: its final output is on its way
        # The engine sends no final output for an aborted request: this one stands in for it.
        timing = RequestTiming(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                               time.monotonic())
        final = RequestOutput(request_id, [], finished=True, finish_reason=reason,
                              num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                              spec=request.spec_stats, timing=timing)
        if self.metrics is not None:
            self.metrics.observe_request(final)
        if reason == "stop":
            self._loop.call_soon_threadsafe(self._deliver, [final])

    def _observe_idle(self) -> None:
        """No step runs while idle, so refresh the engine-state gauges that steps would have set."""
        if self.metrics is not None:
            self.metrics.num_running.set(0)
            self.metrics.num_waiting.set(0)
            self.metrics.kv_cache_usage.set(self.engine.pool.usage)

    # ---- introspection (any thread) ----------------------------------------------------
    def kv_blocks(self) -> dict[str, Any]:
        pool = self.engine.pool
        return {"kv_blocks_free": pool.num_free_blocks, "kv_blocks_total": pool.num_blocks}


class RequestFailedError(RuntimeError):
    """The engine failed this request (finish_reason "error")."""


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
        """Queue every choice in the engine; raises ValueError / ContextLengthError / EngineDeadError."""
        await self.engine.add_requests([(c.request_id, c.prompt_token_ids, c.params) for c in self.choices],
                                       self.queue)

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
                raise RequestFailedError(item.error or "the engine failed this request")
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
