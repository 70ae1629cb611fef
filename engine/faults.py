"""Fault isolation around the engine's pass: what one request sends can fail that request only.

A pass that raises is judged. A device error is fatal (EngineDeadError): the device's state is
unknown. Otherwise the canary, a short pass of the engine's own, decides whose fault it was: when it
fails too, the engine's (the step counts as failed and its requests wait, unharmed, for the next;
max_step_failures such steps in a row are fatal); when it passes, a request's, found by rerunning
the batch in halves.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.decoder import StepResult
from engine.tensor_parallel import WorkerGroupError

logger = logging.getLogger("specserve.engine")


class EngineDeadError(RuntimeError):
    """The engine cannot go on (the device failed, or max_step_failures steps in a row failed and
    so did the canary pass after each), or its loop has stopped: no request can be served. The
    process should exit so that its orchestrator restarts it."""


# The canary pass's prompt: token ids every vocabulary has.
CANARY_PROMPT = (0, 1, 2, 3)

# Errors after which the device's state is unknown (CUDA's sticky errors): nothing on it is retried.
DEVICE_ERROR_MARKS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "illegal memory access",
                      "NCCL error", "HIP error")

Run = Callable[[SchedulerOutput], StepResult]                                # the pass: tensor work only
Apply = Callable[[SchedulerOutput, StepResult, bool], list[RequestOutput]]   # its bookkeeping (bool: the whole step)
Fail = Callable[[list[ScheduledRequest], Exception], list[RequestOutput]]    # end requests with an error


class FaultIsolation:
    def __init__(self, target: ModelRunner, pool: BlockPool, max_step_failures: int):
        self.target, self.pool = target, pool
        self.max_step_failures = max_step_failures
        self.num_failed_steps = 0   # consecutive failed steps whose canary pass failed too

    def step(self, batch: SchedulerOutput, run: Run, apply: Apply, fail: Fail) -> list[RequestOutput]:
        """run the batch's pass and apply it; a failure is judged, and fails the request at fault only."""
        try:
            result = run(batch)
        except Exception as exc:  # one bad request must not fail the batch, nor take the server down
            return self.isolate(batch, exc, run, apply, fail)
        self.num_failed_steps = 0
        return apply(batch, result, True)

    def isolate(self, batch: SchedulerOutput, exc: Exception, run: Run, apply: Apply, fail: Fail
                ) -> list[RequestOutput]:
        """Judge a failed pass: the engine's fault or a request's (see the module's docstring)."""
        check_device(exc)
        logger.error("an engine step of %d requests failed: %s: %s", len(batch.scheduled), type(exc).__name__, exc,
                     exc_info=exc)
        if self._canary_passes(run):
            self.num_failed_steps = 0
            return self._bisect(batch, exc, run, apply, fail)
        self.num_failed_steps += 1
        if self.num_failed_steps >= self.max_step_failures:
            raise EngineDeadError(f"{self.num_failed_steps} engine steps in a row failed, and so did a pass of the "
                                  f"engine's own after each; the last error: {type(exc).__name__}: {exc}") from exc
        return []

    def _bisect(self, batch: SchedulerOutput, exc: Exception, run: Run, apply: Apply, fail: Fail
                ) -> list[RequestOutput]:
        """Rerun the requests of a failed pass in halves: a half that passes is done, one that fails is
        halved again, and a request that fails alone is failed (finish_reason "error"). One bad request
        among n costs about 2 log2(n) passes, and nobody is rerun once they pass. A rerun is applied as
        a part of the step, not the whole: its timing is not that of the planned step."""
        items = batch.scheduled
        if len(items) == 1:
            logger.error("request %s failed alone: %s: %s", items[0].request.request_id, type(exc).__name__, exc)
            return fail(items, exc)
        half = len(items) // 2
        outputs = []
        for part in (SchedulerOutput(items[:half], batch.preempted), SchedulerOutput(items[half:], [])):
            try:
                result = run(part)
            except Exception as failed:
                check_device(failed)
                outputs += self._bisect(part, failed, run, apply, fail)
            else:
                outputs += apply(part, result, False)
        return outputs

    def _canary_passes(self, run: Run) -> bool:
        """One greedy pass (no drafts) over a fixed short prompt, in blocks of its own that are freed
        after and never published: the engine's health, judged apart from any request. Without a free
        block it cannot run, and blames no one: the failure is then judged as a request's."""
        canary = Request(request_id="canary", token_ids=list(CANARY_PROMPT), num_prompt_tokens=len(CANARY_PROMPT),
                         params=SamplingParams(max_tokens=1, temperature=0.0), arrival_time=time.monotonic(),
                         generator=None)
        if not self.pool.allocate(canary.block_table, canary.num_tokens):
            logger.warning("no free KV block for the canary pass: the failed step is judged by its requests alone")
            return True
        try:
            run(SchedulerOutput([ScheduledRequest.of(canary, canary.num_tokens)]))
            return True
        except Exception as exc:
            check_device(exc)
            logger.error("the canary pass failed too: %s: %s", type(exc).__name__, exc)
            return False
        finally:
            self.pool.free(canary.block_table)

    def check_alive(self) -> None:
        """EngineDeadError when a part of the engine in another process (a tensor-parallel worker) has
        died. The engine core asks while it waits for requests, so a dead group turns /health to 503
        at once rather than at the next request's pass."""
        workers = getattr(self.target, "workers", None)
        if workers is not None:
            try:
                workers.check()
            except WorkerGroupError as exc:
                check_device(exc)


def check_device(exc: Exception) -> None:
    """EngineDeadError when the error leaves the device (or the tensor-parallel group) unusable."""
    if isinstance(exc, WorkerGroupError):   # the shards are out of step: no pass can run again
        raise EngineDeadError(f"the tensor-parallel group failed: {exc}") from exc
    message = str(exc)
    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(m in message for m in DEVICE_ERROR_MARKS):
        raise EngineDeadError(f"the device failed: {type(exc).__name__}: {exc}") from exc
