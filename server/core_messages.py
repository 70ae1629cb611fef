"""What the API process and the engine core say to each other: commands one way, messages the other.

Each is a frozen dataclass, matched by type at the other end. Both ends are this package, over a
private pipe (or a thread's queue), so they cross pickled as they are.

    API process -> engine core    Add, Abort, Stop
    engine core -> API process    Ready (once, at start), Added, Stepped, Idle, Aborted, Dead (the last)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine.outputs import EngineStatus
from engine.outputs import RequestOutput, StepStats
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API process needs to know of the engine, sent once when the core is ready."""
    model: str
    method: str
    proposers: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    dtype: str
    quantization: str
    device: str
    num_blocks: int
    block_size: int
    gamma: int
    num_threads: int
    pid: int

    @classmethod
    def of(cls, engine) -> EngineInfo:
        import torch
        return cls(engine.config.model, engine.method, tuple(engine.configured_proposers), engine.max_model_len,
                   engine.vocab_size, str(engine.dtype).replace("torch.", ""), engine.quantization, str(engine.device),
                   engine.pool.num_blocks, engine.pool.block_size, engine.gamma, torch.get_num_threads(), os.getpid())


# ---- commands: API process -> engine core ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Add:
    """Queue the requests (the choices of n) that share one prompt, which crosses once for all of them."""
    prompt_token_ids: list[int]
    requests: tuple[tuple[str, SamplingParams], ...]   # (request id, its params) per choice


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request; reason is its finish reason: "abort", or "stop" when a stop string ended it."""
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop of a process core (its process then exits)."""


Command = Add | Abort | Stop


# ---- messages: engine core -> API process ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built and the loop about to run: sent once, first."""
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Added:
    """The outcome of the adds applied before a step: per request, None or the error that refused it."""
    results: tuple[tuple[str, Exception | None], ...]


@dataclass(frozen=True, slots=True)
class Stepped:
    """A step's token deltas; stats only when the step ran a pass (else None)."""
    outputs: list[RequestOutput]
    stats: StepStats | None
    status: EngineStatus


@dataclass(frozen=True, slots=True)
class Idle:
    """No request is left in the engine: the loop sleeps until a command comes."""
    status: EngineStatus


@dataclass(frozen=True, slots=True)
class Aborted:
    """An aborted request's final output, which the engine itself does not send."""
    final: RequestOutput
    reason: str


@dataclass(frozen=True, slots=True)
class Dead:
    """The loop died (or the engine never started); the last message."""
    reason: str


Message = Ready | Added | Stepped | Idle | Aborted | Dead
