"""Per-request state: plain Python bookkeeping, never touches the device."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.outputs import SpecStats, TokenLogprob
from engine.sampler import PositionalNoise
from engine.sampling_params import SamplingParams
from engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]                 # prompt followed by every accepted output token
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    generator: torch.Generator | None    # unseeded sampled requests: owned by this request, drawn in order
    noise: PositionalNoise | None = None  # seeded sampled requests: noise keyed by output position
    eos_token_ids: frozenset[int] = frozenset()
    grammar: GrammarState | None = None  # structured output: where the output stands in its grammar
    # Whose cached prefix blocks and suffix-cache outputs this request may read and adds to: its
    # params.tenant, or None (the common partition) where the engine shares them across tenants.
    tenant: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    # KV bookkeeping. The last token is never in the cache while decoding: the next
    # forward pass feeds it (plus any draft tokens).
    num_computed_tokens: int = 0         # positions whose KV is in the target cache (a draft model's
                                         # own cursor is its proposer's business)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chained sha256 of its full blocks
    # Speculation statistics (decode passes only, so recomputation never double-counts).
    num_proposed: int = 0
    num_accepted: int = 0
    num_target_forwards: int = 0
    passes_by_method: dict[str, int] = field(default_factory=dict)   # decode passes per proposer ("none": k = 0)
    passes_by_k: dict[int, int] = field(default_factory=dict)        # decode passes per number of drafts
    num_preemptions: int = 0
    # Outputs not yet handed back, and results kept for the final output.
    num_emitted: int = 0                 # output tokens already returned in RequestOutputs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    error: str | None = None
    invalid_request: bool = False   # that error is the request's own (its grammar), a client error
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def spec_stats(self) -> SpecStats:
        return SpecStats(self.num_proposed, self.num_accepted, self.num_target_forwards,
                         dict(self.passes_by_method), dict(self.passes_by_k))

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone, every token is recomputed as a prompt."""
        self.num_computed_tokens = 0
        self.block_hashes.clear()
        self.num_preemptions += 1
        self.status = RequestStatus.WAITING
