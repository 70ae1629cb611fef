"""The engine core: Engine.step() in a loop, fed commands, sending messages back.

The server runs it in a process of its own, as vLLM v1 does (`ProcessCore`): HTTP, tokenization,
detokenization, stop strings and SSE stay in the API process, so the engine's compute threads do
not share the GIL with them. Tests and embedders may run the same loop on a thread of the API
process (`ThreadCore`). Only the channel differs; the loop is one.

    API process                                   engine core (process or thread)
    -----------                                   -------------------------------
    submit([Add(prompt_token_ids, requests)])     sleep while idle; between steps apply commands
    submit([Abort(request_id, reason)])  ------>  step()
    on_message(message)  <----------------------  Ready(EngineInfo)                  once, at start
                                                  Added(((request_id, error), ...))  error: None or the ValueError
                                                  Stepped(outputs, stats, EngineStatus)
                                                  Idle(EngineStatus)
                                                  Aborted(final RequestOutput, reason)
                                                  Dead(reason)                       the loop died

The commands and messages are the frozen dataclasses of server/core_messages.py. Commands are
applied only between steps, so the engine is never touched by two threads. An Add carries its
prompt once for all the choices (n) that share it. Messages are pickled (both ends are this
package, over a private pipe) and small: a step's token deltas and its statistics. Commands to a
process core are pickled and written by a thread of their own, in order, so that a long prompt
never holds the event loop while the engine process is busy with a step and not reading.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from functools import cached_property
from typing import Callable

from engine.outputs import RequestOutput, RequestTiming
from server.core_messages import (
    Abort, Aborted, Add, Added, Command, Dead, EngineInfo, Idle, Message, Ready, Stepped, Stop,
)

logger = logging.getLogger("specserve.server")

IDLE_PAUSE_S = 0.005   # when nothing could be scheduled: wait this long for a command instead of spinning
IDLE_CHECK_S = 1.0     # while idle, ask the engine this often whether its other processes still live


class EngineCore:
    """The loop. `inbox.get(block, timeout)` returns the commands queued so far (when block, waiting
    up to timeout for one) or None to stop; `inbox.pause()` waits briefly for a command; `send(message)` delivers."""

    def __init__(self, engine, inbox, send: Callable[[Message], None]):
        self.engine, self.inbox, self.send = engine, inbox, send

    def run(self) -> None:
        last_step = 0
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = self.inbox.get(block=idle, timeout=IDLE_CHECK_S)
                if commands is None:
                    return
                if idle and not commands:   # a quiet second: a dead worker must not wait for a request
                    self.engine.check_alive()
                    continue
                self._apply(commands)
                if not self.engine.has_unfinished_requests():
                    self.send(Idle(self.engine.status()))
                    continue
                outputs = self.engine.step()
                status = self.engine.status()
                fresh = status.num_steps != last_step   # a step ran a pass
                last_step = status.num_steps
                if not fresh and not outputs:
                    self.inbox.pause()   # nothing could be scheduled this time: do not spin
                    continue
                self.send(Stepped(outputs, self.engine.last_stats if fresh else None, status))
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop is reported, not re-raised
            logger.exception("the engine loop died")
            self.send(Dead(f"the engine loop died: {type(exc).__name__}: {exc}"))

    def _apply(self, commands: list[Command]) -> None:
        added = []
        for command in commands:
            match command:
                case Add():
                    added += self._add(command)
                case Abort(request_id, reason):
                    self._abort(request_id, reason)
        if added:
            self.send(Added(tuple(added)))

    def _add(self, add: Add) -> list[tuple[str, Exception | None]]:
        results = []
        for request_id, params in add.requests:
            try:
                self.engine.add_request(request_id, add.prompt_token_ids, params)
                results.append((request_id, None))
            except Exception as exc:  # noqa: BLE001 - bad input fails its request, never the loop
                results.append((request_id, exc))
        return results

    def _abort(self, request_id: str, reason: str) -> None:
        request = self.engine.abort_request(request_id)
        if request is None:
            return   # it had finished already: its final output is on its way
        # The engine sends no final output for an aborted request: this one stands in for it.
        timing = RequestTiming(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                               time.monotonic())
        final = RequestOutput(request_id, [], finished=True, finish_reason=reason,
                              num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                              spec=request.spec_stats, timing=timing)
        self.send(Aborted(final, reason))


# ---- the core on a thread of the API process ----------------------------------------------------

class _ThreadInbox:
    def __init__(self):
        self.commands: deque[Command] = deque()
        self.wakeup = threading.Condition()
        self.stopping = False

    def put(self, commands: list[Command]) -> None:
        with self.wakeup:
            self.commands.extend(commands)
            self.wakeup.notify()

    def get(self, block: bool, timeout: float | None = None) -> list[Command] | None:
        """The commands queued so far; when block, first waits for one (at most timeout seconds: then
        none), or None once stopping."""
        with self.wakeup:
            if block and not self.commands and not self.stopping:
                self.wakeup.wait_for(lambda: self.commands or self.stopping, timeout)
            if self.stopping:
                return None
            commands = list(self.commands)
            self.commands.clear()
            return commands

    def pause(self) -> None:
        with self.wakeup:
            if not self.commands and not self.stopping:
                self.wakeup.wait(IDLE_PAUSE_S)

    def close(self) -> None:
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()


class ThreadCore:
    """The loop on a thread beside the event loop, over an Engine built in this process."""
    kind = "thread"

    def __init__(self, engine):
        self.engine = engine
        self._inbox = _ThreadInbox()
        self._thread: threading.Thread | None = None

    @cached_property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    def start(self, on_message: Callable[[Message], None]) -> None:
        core = EngineCore(self.engine, self._inbox, on_message)
        self._thread = threading.Thread(target=core.run, name="specserve-engine", daemon=True)
        self._thread.start()

    def submit(self, commands: list[Command]) -> None:
        self._inbox.put(commands)

    def stop(self, timeout: float) -> None:
        self._inbox.close()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# ---- the core in a process of its own ------------------------------------------------------------

class _PipeInbox:
    def __init__(self, conn):
        self.conn = conn

    def get(self, block: bool, timeout: float | None = None) -> list[Command] | None:
        commands = []
        if block:
            self.conn.poll(timeout)
        while self.conn.poll(0):
            command = self.conn.recv()
            if isinstance(command, Stop):
                return None
            commands.append(command)
        return commands

    def pause(self) -> None:
        self.conn.poll(IDLE_PAUSE_S)


def engine_threads(requested: int | None = None) -> int:
    """Compute threads for the engine: the request, else OMP_NUM_THREADS when set, else every core
    this process may use. The API process's work per token is small next to a step, and a core
    left idle for it costs batch throughput."""
    if requested:
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


def _process_main(config, conn, num_threads: int, log_level: str) -> None:
    """The engine process: build the engine, say ready, run the loop until told to stop."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the API process decides when the core stops
    import torch
    torch.set_num_threads(num_threads)
    from engine.engine import Engine
    try:
        engine = Engine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process, which exits
        logger.exception("the engine failed to start")
        conn.send(Dead(f"the engine failed to start: {type(exc).__name__}: {exc}"))
        return
    conn.send(Ready(EngineInfo.of(engine)))
    try:
        EngineCore(engine, _PipeInbox(conn), conn.send).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass   # the API process is gone: nothing left to serve


class ProcessCore:
    """The loop in a child process (spawned: a fresh interpreter, so no OpenMP or CUDA state is
    inherited), talking over a pipe. A reader thread in the API process turns what arrives into
    on_message calls; when the child dies, on_message gets Dead(reason)."""
    kind = "process"

    def __init__(self, config, num_threads: int | None = None, log_level: str = "info",
                 start_timeout: float = 600.0):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_process_main, name="specserve-engine-core", daemon=True,
                                       args=(config, child_conn, engine_threads(num_threads), log_level))
        self.process.start()
        child_conn.close()
        self.info = self._wait_ready(start_timeout)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_error: str | None = None
        threading.Thread(target=self._write, name="specserve-core-writer", daemon=True).start()

    def _wait_ready(self, timeout: float) -> EngineInfo:
        if not self._conn.poll(timeout):
            self.process.kill()
            raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") \
                from None
        match message:
            case Ready(info):
                return info
            case Dead(reason):
                self.process.join(5)
                raise RuntimeError(reason)

    def start(self, on_message: Callable[[Message], None]) -> None:
        threading.Thread(target=self._read, args=(on_message,), name="specserve-core-reader", daemon=True).start()

    def _read(self, on_message: Callable[[Message], None]) -> None:
        try:
            while True:
                message = self._conn.recv()
                on_message(message)
                if isinstance(message, Dead):
                    return
        except (EOFError, OSError):
            self.process.join(1.0)
            if self.process.exitcode is not None or not self.process.is_alive():
                on_message(Dead(f"the engine process exited (exit code {self.process.exitcode})"))

    def submit(self, commands: list[Command]) -> None:
        """Queue commands for the writer thread; never blocks (the pipe may be full while the engine
        process runs a step)."""
        if self._send_error is not None or not self.process.is_alive():
            raise ConnectionError(f"the engine process is gone: {self._send_error or 'it exited'}")
        for command in commands:
            self._outbox.put(command)

    def _write(self) -> None:
        """Send the queued commands in order, until Stop or a broken pipe (the reader then reports
        the process's death)."""
        while True:
            command = self._outbox.get()
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError) as exc:
                self._send_error = str(exc)
                return
            if isinstance(command, Stop):
                return

    def stop(self, timeout: float) -> None:
        try:
            self.submit([Stop()])
        except ConnectionError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    @property
    def is_running(self) -> bool:
        return self.process.is_alive()
