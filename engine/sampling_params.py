"""Per-request sampling settings: validated once, frozen afterwards."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import MAX_SPEC_TOKENS, SPEC_METHODS
from engine.structured import StructuredOutput

_GREEDY_EPS = 1e-5
# Bounds that keep every value finite and non-zero where the sampler computes it (float32 tensors):
# - temperature: OpenAI's API stops at 2; past 100 the output is noise for any model.
MAX_TEMPERATURE = 100.0
# - top_p: any distribution's most likely token holds at least 1/V of its mass, so every top_p
#   below 1e-8 keeps that token alone, as 1e-8 does (vocabularies are far below 1e8 tokens);
#   a smaller one is raised to it rather than underflow float32 to 0, which would keep nothing.
MIN_TOP_P = 1e-8
# - repetition_penalty: a seen token's logit divided or multiplied by 100 already decides every
#   choice a larger factor would; within [0.01, 100] logits stay far inside float32's range.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# - stop_token_ids: distinct ids per request (each must also be in the vocabulary: Engine.add_request).
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0            # 0 or -1: disabled; at most the vocabulary size (Engine.add_request)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)   # checked once per emitted token
    ignore_eos: bool = False
    logprobs: int | None = None          # top-n logprobs per generated token (0: the chosen one only)
    prompt_logprobs: int | None = None   # same for prompt tokens (the first prompt token has none)
    # Per-request speculation control: the strategy (config.SPEC_METHODS; None: the
    # engine's) and the most drafts per step (None: the engine's num_speculative_tokens).
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    structured: StructuredOutput | None = None   # what the output must match (engine/structured.py)
    # Whose cached prefixes and earlier outputs the request may draw on (prefix cache, suffix drafting):
    # a digest of its API key or tenant header (server/middleware.py), never the key; None: no tenant.
    tenant: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if 0.0 < self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str):
            if not ok:
                raise ValueError(f"{name} {msg}")

        # Comparisons are written so that NaN fails them.
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
              f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0, "top_k",
              f"must be -1, 0 or a positive integer, got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative token ids")
        check(self.speculative_method is None or self.speculative_method in SPEC_METHODS, "speculative.method",
              f"must be one of {', '.join(SPEC_METHODS)}, got {self.speculative_method!r}")
        check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
              f"must be a StructuredOutput, got {type(self.structured).__name__}")
        k = self.num_speculative_tokens
        check(k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_SPEC_TOKENS),
              "speculative.num_speculative_tokens", f"must be an integer in 0..{MAX_SPEC_TOKENS}, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
