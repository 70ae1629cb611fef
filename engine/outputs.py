"""What the engine hands back: per-request deltas and per-step statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token_id, logprob), best first; empty unless asked for


@dataclass(frozen=True)
class SpecStats:
    """Cumulative speculation counters of one request.

    Every target pass that emits tokens for a request emits its accepted drafts plus one token of its
    own (the bonus, the correction of the first rejected draft, or, when the output ends inside an
    accepted run at EOS / a stop token / max_tokens, the token it ends on; drafts after that point
    are neither emitted nor counted as accepted). The prefill pass emits the first token. So, for a
    request with at least one output token:

        num_output_tokens == 1 + accepted + target_forwards
    """
    proposed: int = 0         # draft tokens proposed to the target (those after an end point included)
    accepted: int = 0         # proposed draft tokens that were accepted and emitted
    target_forwards: int = 0  # target passes that emitted tokens after the first (decode / verify passes,
                              # and the recomputation pass after a preemption)
    passes_by_method: dict[str, int] = field(default_factory=dict)   # decode passes per proposer ("none": k 0)
    passes_by_k: dict[int, int] = field(default_factory=dict)        # decode passes per number of drafts


@dataclass(frozen=True)
class RequestTiming:
    """Engine-side timestamps of one request (time.monotonic()), sent with its final output."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one engine step (a delta, not the whole text)."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0              # cumulative, new_token_ids included
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first delta; entry 0 is None
    spec: SpecStats = field(default_factory=SpecStats)
    error: str | None = None                # set when finish_reason == "error"
    invalid_request: bool = False           # that error is the request's own (its grammar admits no output)
    timing: RequestTiming | None = None     # only on the final output (finished=True)


@dataclass(frozen=True)
class StepStats:
    """Everything that happened in one Engine.step(), for metrics export."""
    method: str                       # the configured strategy (config.SPEC_METHODS)
    num_running: int
    num_waiting: int
    kv_cache_usage: float             # used blocks / total blocks, 0..1
    batch_size: int                   # requests that ran in this step
    num_batched_tokens: int           # tokens fed to the target this step
    num_preemptions: int
    num_prompt_tokens: int            # prompt tokens of requests that got their first token this step
    num_generation_tokens: int        # tokens emitted to requests this step
    num_drafts: int                   # requests that verified >= 1 draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    num_target_forwards: int          # requests that got tokens after their first from this pass (SpecStats)
    accepted_per_position: tuple[int, ...]   # index i: drafts accepted (and emitted) at position i
    accepted_lengths: tuple[int, ...]        # per request with drafts: drafts it emitted this step
    draft_time_s: float
    verify_time_s: float              # target forward + rejection sampling
    plain_step_time_s: float | None   # estimate of a plain decode step at this batch size (None: unknown yet)
    finished_reasons: tuple[str, ...] = ()   # finish reasons of requests that ended this step
    pure_decode: bool = False         # every scheduled request ran a decode / verify pass (no prefill work)
    chosen_k: tuple[int, ...] = ()    # per decode pass: the drafts it verified (0: plain decoding)
    drafts_by_proposer: tuple[tuple[str, int, int], ...] = ()   # (proposer, proposed, accepted) this step
    predicted_time_s: float | None = None    # the cost tables' price of the plan's draft + verify time
    mask_time_s: float = 0.0          # structured outputs: computing grammar masks (their share of draft + verify time)
    num_masked_rows: int = 0          # emitting rows a grammar masked
    num_tree_drafts: int = 0          # passes whose drafts were a tree (several continuations) this step
    grammar_compile_s: tuple[float, ...] = ()   # requests whose grammar became ready this step: compile seconds
    grammar_cache_hits: int = 0       # of those, grammars compiled before (a cached spec)


@dataclass
class SpecTotals:
    """Running totals since start-up: what an operator asks first is whether speculation pays."""
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forwards: int = 0
    num_generation_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        self.num_target_forwards += stats.num_target_forwards
        self.num_generation_tokens += stats.num_generation_tokens
        if len(self.accepted_per_position) < len(stats.accepted_per_position):
            self.accepted_per_position += [0] * (len(stats.accepted_per_position) - len(self.accepted_per_position))
        for i, n in enumerate(stats.accepted_per_position):
            self.accepted_per_position[i] += n
        self.draft_time_s += stats.draft_time_s
        self.verify_time_s += stats.verify_time_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(frozen=True)
class EngineStatus:
    """The engine's state between steps, for the server's health checks and gauges."""
    num_requests: int
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_cache_usage: float
    num_steps: int          # steps that ran a pass so far: a new step shows as a new count (last_stats)
