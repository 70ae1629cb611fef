"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regular expression, a
choice among strings, a Lark grammar), its matcher, and the token masks it puts on emitted positions.

A constrained request is masked at every row that can emit a token for it (a plain decode row, each
verification row, the bonus row) before sampling and before the accept/reject test, so its output
follows the target's distribution restricted to the tokens the grammar allows (renormalised), with
or without speculation: verification compares the draft against that masked distribution, which is
the one plain decoding samples. A draft is cut at its first token the grammar forbids: it could never
be accepted, and where the draft was one-hot (n-gram, suffix, forced tokens), greedy or seeded the
row that follows samples from the masked target exactly as its rejection would. A token drawn from
a real draft distribution q is kept instead (the draft model masks its own drafts, so only a
proposer that does not would draw one): its certain rejection must resample from the residual
max(0, p' - q), which the cut would skip. The matcher advances by the tokens a step keeps.

Grammars are llguidance's (MIT; what llama.cpp and vLLM offer): an Earley parser over the
tokenizer's byte strings that computes masks lazily, with rollback, its work per mask bounded by its
parser limits ("fuel"). Grammars are built off the engine loop: a constrained request waits in the
GrammarQueue while a worker thread compiles its spec (grammar strings are cached per spec) and builds
its matcher; one that fails, or is not ready GRAMMAR_COMPILE_TIMEOUT after it was queued, ends with an
error naming the problem, and the other requests are served meanwhile. An aborted request's compile
that has not started never runs. A compile that has started cannot be stopped from outside, but
llguidance's parser limits (fuel, lexer states, grammar size) end even a pathological one, so no
grammar holds a worker for long.

Bookkeeping and masks only: no model code here.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as OpenAI's models write it, {"a": 1, "b": [1, 2]}: one layout, no other whitespace. Flexible
# whitespace lets a model pad forever between tokens (a random model did, to max_tokens); a schema's
# own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Seconds a grammar may take to compile (the server's check of a spec, the engine's matcher) before
# its request is refused. llguidance's own limits stop pathological grammars well before this; what
# is left is a machine too loaded to compile in time.
GRAMMAR_COMPILE_TIMEOUT = 10.0
# A JSON schema deeper or larger than this is refused before anything recurses over it (serializing,
# compiling, a chat template's tojson); the schemas of real tools and outputs stay far below both.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 50_000


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `value`: the schema as JSON text (json_schema), the
    expression (regex), the choices as a JSON list (choice), the Lark grammar (grammar); json_object
    has none. Frozen and hashable: it travels with SamplingParams and keys the grammar cache."""
    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output {self.kind}: the value must be text, got {type(self.value).__name__}")

    @classmethod
    def json_schema(cls, schema) -> "StructuredOutput":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema: not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        check_json_size(schema, "json_schema")
        return cls("json_schema", json.dumps(schema))   # key order kept: properties are written in schema order

    @classmethod
    def choice(cls, choices) -> "StructuredOutput":
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice: a non-empty list of non-empty strings is needed, got {choices!r}")
        return cls("choice", json.dumps(list(choices)))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) for this spec; ValueError when it does not compile."""
        return _grammar(self.kind, self.value)


def check_json_size(value, where: str = "", max_depth: int = MAX_SCHEMA_DEPTH, max_nodes: int = MAX_SCHEMA_NODES
                    ) -> None:
    """ValueError (naming `where` when given) when a JSON value nests deeper than max_depth objects
    and arrays or holds more than max_nodes values. Walked without recursion and stopped at the first
    excess, so the check itself is bounded whatever it is given."""
    prefix = f"{where}: " if where else ""
    pending, seen = [(value, 1)], 0
    while pending:
        item, depth = pending.pop()
        seen += 1
        if seen > max_nodes:
            raise ValueError(f"{prefix}more than {max_nodes} values; a value this large is not supported")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth > max_depth:
            raise ValueError(f"{prefix}nested deeper than {max_depth} levels")
        pending.extend((child, depth + 1) for child in children)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, value: str) -> str:
    """Built and checked once per spec (a server sees the same schema request after request)."""
    from llguidance import LLMatcher

    try:
        grammar = _build(kind, value)
    except ValueError as exc:
        raise ValueError(f"{kind}: {exc}") from None
    error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise ValueError(f"{kind}: {messages[0]}")
    return grammar


def _build(kind: str, value: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(value, JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":   # a Lark alternation of string literals (JSON's escapes are Lark's)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(value)))
    return LLMatcher.grammar_from_lark(value)


class GrammarCompiler:
    """Builds matchers over one tokenizer (llguidance's view of it, made once on first use: ~1 s)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: frozenset[int]):
        self.tokenizer_path, self.vocab_size, self.eos_token_ids = tokenizer_path, vocab_size, eos_token_ids

    @functools.cached_property
    def tokenizer(self):
        from llguidance.hf import from_tokenizer

        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path)
        eos = sorted(self.eos_token_ids) or None
        # The model's rows may outnumber the tokenizer's tokens (padding) or, rarely, fall short of
        # them: the matcher spans both, and masks keep the model's rows.
        return from_tokenizer(tokenizer, n_vocab=max(self.vocab_size, len(tokenizer)),
                              eos_token=eos[0] if eos and len(eos) == 1 else eos)

    def state(self, spec: StructuredOutput) -> "GrammarState":
        """A fresh matcher for one request; ValueError naming the problem when the spec does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{spec.kind}: {matcher.get_error()}")
        return GrammarState(matcher, self.tokenizer.vocab_size, self.vocab_size)


@dataclass
class CompileStats:
    """Grammars that became ready since the last drain, for the step's metrics."""
    seconds: list[float] = field(default_factory=list)
    cache_hits: int = 0


class GrammarQueue:
    """Constrained requests waiting for their matcher, built on a few worker threads so that a slow
    compile never holds up the engine's loop (the requests already running go on). The loop calls
    ready() each step and schedules what it returns. A request whose matcher is not ready `timeout`
    seconds after it was queued fails, whether its compile is running or still waiting for a worker;
    the clock starts no earlier than the one-off build of llguidance's tokenizer view, which is the
    engine's cost, not the grammar's."""

    def __init__(self, compiler: GrammarCompiler, timeout: float = GRAMMAR_COMPILE_TIMEOUT, workers: int = 2):
        self.compiler, self.timeout = compiler, timeout
        self._executor: ThreadPoolExecutor | None = None   # started on the first constrained request
        self._workers = workers
        self._pending: dict[str, tuple[object, Future]] = {}   # request id -> (request, future)
        self._queued_at: dict[str, float] = {}                # request id -> when it joined the queue
        self._tokenizer_ready_at: float | None = None        # when llguidance's tokenizer view was built
        self.stats = CompileStats()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request, spec: StructuredOutput) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="grammar")
        self._queued_at[request.request_id] = time.monotonic()
        future = self._executor.submit(self._compile, spec)
        self._pending[request.request_id] = (request, future)

    def _compile(self, spec: StructuredOutput) -> tuple["GrammarState", float, bool]:
        self.compiler.tokenizer   # built once per engine (seconds), before any deadline counts
        if self._tokenizer_ready_at is None:
            self._tokenizer_ready_at = time.monotonic()
        started = time.monotonic()
        hits = _grammar.cache_info().hits
        state = self.compiler.state(spec)
        cached = _grammar.cache_info().hits > hits
        state.masks([])   # the first mask over a tokenizer builds its token trie (a second, once): here, not in a step
        state.take_mask_seconds()
        if state.matcher.is_error():   # e.g. a regular expression no string matches
            raise ValueError(f"{spec.kind}: the grammar admits no output (no text matches it)")
        return state, time.monotonic() - started, cached

    def ready(self) -> tuple[list, list[tuple[object, str]]]:
        """Requests whose matcher is built (request.grammar set), and (request, error) for those whose
        compile failed or missed its deadline; both leave the queue."""
        done, failed = [], []
        for request_id, (request, future) in list(self._pending.items()):
            if future.done():
                error = future.exception()
                if error is None:
                    request.grammar, seconds, cached = future.result()
                    self.stats.seconds.append(seconds)
                    self.stats.cache_hits += cached
                    done.append(request)
                else:
                    failed.append((request, str(error) if isinstance(error, ValueError) else
                                   f"{type(error).__name__}: {error}"))
            elif self._past_deadline(request_id):
                kind = request.params.structured.kind
                failed.append((request, f"{kind}: the grammar did not compile within {self.timeout:g} s"))
            else:
                continue
            self.discard(request_id)
        return done, failed

    def _past_deadline(self, request_id: str) -> bool:
        if self._tokenizer_ready_at is None:   # the first compile is still building the tokenizer view
            return False
        return time.monotonic() - max(self._queued_at[request_id], self._tokenizer_ready_at) > self.timeout

    def wait(self, timeout: float) -> None:
        """Until a compile ends, for at most `timeout` seconds (at once when none is pending)."""
        if self._pending:
            concurrent.futures.wait([future for _, future in self._pending.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def discard(self, request_id: str) -> bool:
        """Forget a waiting request (aborted, failed or ready); a compile not yet started is cancelled,
        so it never runs. False when it was not waiting here."""
        self._queued_at.pop(request_id, None)
        request, future = self._pending.pop(request_id, (None, None))
        if future is None:
            return False
        future.cancel()
        return True

    def drain_stats(self) -> CompileStats:
        stats, self.stats = self.stats, CompileStats()
        return stats


class GrammarState:
    """One request's matcher: where its output stands in the grammar. The masks of a step are kept
    by draft prefix until the request advances: a draft model masks its proposals with them while it
    drafts, and verification reuses them for the same prefixes."""

    def __init__(self, matcher, matcher_vocab: int, vocab_size: int):
        self.matcher, self.matcher_vocab, self.vocab_size = matcher, matcher_vocab, vocab_size
        self._consumed = 0   # tokens advanced by: the matcher's position
        self._forced: tuple[int, list[int]] | None = None   # (position, forced tokens there)
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}   # draft prefix -> the mask after it, from here
        self.mask_seconds = 0.0   # spent computing masks since the engine last took it (take_mask_seconds)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens (a draft) the grammar allows in order from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def mask_after(self, prefix: list[int]) -> torch.Tensor:
        """bool [vocab]: the tokens allowed after this draft prefix (each of its tokens allowed). The
        matcher ends where it began."""
        key = tuple(prefix)
        row = self._rows.get(key)
        if row is None:
            from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

            started = time.perf_counter()
            bits = allocate_token_bitmask(1, self.matcher_vocab)
            if prefix and not self.matcher.consume_tokens(list(prefix)):
                raise RuntimeError(f"the grammar refused draft {list(prefix)}: {self.matcher.get_error()}")
            fill_next_token_bitmask(self.matcher, bits, 0)
            if prefix:
                self.matcher.rollback(len(prefix))
            row = self._rows[key] = unpack_bitmask(bits, self.vocab_size)[0]
            self.mask_seconds += time.perf_counter() - started
        return row

    def masks(self, draft: list[int]) -> torch.Tensor:
        """bool [len(draft) + 1, vocab]: the tokens allowed after each prefix of the draft (every draft
        token must be allowed: valid_prefix cut the draft)."""
        return torch.stack([self.mask_after(draft[:j]) for j in range(len(draft) + 1)])

    def take_mask_seconds(self) -> float:
        seconds, self.mask_seconds = self.mask_seconds, 0.0
        return seconds

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar admits as the only continuation from here (none where it branches),
        computed once per position."""
        if self._forced is None or self._forced[0] != self._consumed:
            self._forced = (self._consumed, self.matcher.compute_ff_tokens())
        return self._forced[1]

    def advance(self, tokens: list[int]) -> None:
        """The tokens a step kept (each was allowed by its row's mask)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused an emitted token: {self.matcher.get_error()}")
        self._consumed += len(tokens)
        if tokens:
            self._rows.clear()

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (only an end of sequence)."""
        return self.matcher.is_stopped()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens get no probability, in place (a forward's output is an inference tensor)."""
    with torch.inference_mode():
        return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] (bit b of word w: token 32 w + b) -> bool [rows, vocab_size]."""
    return ((bits.unsqueeze(-1) >> _BITS) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()


def constrain(scheduled, proposal) -> dict[int, torch.Tensor]:
    """Cut each constrained request's draft at its first token the grammar forbids (after it, where
    rejection sampling must judge it against q), and return the masks of its emitting rows, by
    position in `scheduled` (bool [1 + drafts, vocab]). Leaves every matcher where it was: a failed
    pass can be rerun."""
    masks = {}
    for i, item in enumerate(scheduled):
        state = item.request.grammar
        if state is None or not item.samples:
            continue
        draft = proposal.draft_token_ids[i]
        valid = state.valid_prefix(draft)
        if valid < len(draft):
            keep = valid + 1 if _judged_against_q(item.request, proposal, i, valid) else valid
            proposal.draft_token_ids[i] = draft = draft[:keep]
        masks[i] = state.masks(draft[:valid])
        if len(draft) > valid:   # after a forbidden token: a row its certain rejection never reaches
            masks[i] = torch.cat([masks[i], masks[i].new_ones(1, masks[i].shape[1])])
    return masks


def _judged_against_q(request, proposal, i: int, position: int) -> bool:
    """Whether a draft token is verified by rejection sampling against a real (not one-hot) q."""
    if request.params.greedy or request.noise is not None or proposal.draft_probs is None:
        return False
    return bool(proposal.draft_probs[i, position].amax() > 0)
