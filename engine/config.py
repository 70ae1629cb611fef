"""Engine configuration: frozen dataclasses, validated on construction."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

QUANTIZATIONS = ("auto", "none", "bf16", "int8", "gguf")   # weight-only formats of the linears (CPU):
# engine/models/streamed_linear.py (bf16, int8) and engine/models/gguf_linear.py (a GGUF file's own blocks)

# What a draft's linears may be re-quantized into at load (`speculative.draft.quantization`): the GGUF kernel
# types gguf's quantizer writes. A draft's precision moves only its acceptance, never the output.
DRAFT_QUANTIZATIONS = ("q4_0", "q4_1", "q5_0", "q8_0")

PROPOSERS = ("draft", "eagle", "ngram", "suffix")
SPEC_METHODS = ("auto", *PROPOSERS, "none")
MAX_SPEC_TOKENS = 32
# How model weights are obtained: read from the checkpoint, or random of its config's shapes (benchmarking
# a shape without its weights: vLLM's --load-format dummy).
LOAD_FORMATS = ("auto", "dummy")
# Who computes attention (engine/attention_backends.py): auto picks flash-attn, else the C++ kernel, else torch.
ATTENTION_BACKENDS = ("auto", "kernel", "torch", "flash")
DTYPES = ("bfloat16", "float16", "float32")

logger = logging.getLogger("specserve.config")


def check_model_path(path: str, what: str) -> None:
    """A model is a checkpoint directory (config.json) or a GGUF file (or a directory holding one)."""
    from engine.models.gguf import find_gguf

    if not os.path.isfile(os.path.join(path, "config.json")) and find_gguf(path) is None:
        raise ValueError(f"{what} {path!r} is not a checkpoint directory (no config.json) or a GGUF file")


def setting(default, doc: str, type: str, shown_default: str | None = None):
    """A speculative key's field: its default, and the type and sentence docs/configuration.md's table shows
    (server/config_reference.py writes the table from these)."""
    return field(default=default, metadata={"doc": doc, "type": type, "default": shown_default})


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class DraftConfig:
    """`speculative.draft`: the model proposers, a draft model and an EAGLE head."""
    model: str | None = setting(None, "the draft model (checkpoint directory or GGUF); required when `draft` is "
                                "used; must share the target's tokenizer (checked at start-up)", "path")
    head: str | None = setting(None, "the EAGLE head directory: one from `specserve distill --head eagle`, or a "
                               "published EAGLE-3 head (`\"architectures\": [\"LlamaForCausalLMEagle3\"]`); required "
                               "when `eagle` is used", "path")
    dtype: str | None = setting(None, "the draft model's dtype (an EAGLE head always uses the target's); any other "
                                "value is an error", "`bfloat16` \\| `float16` \\| `float32` or null",
                                "null (the target's)")
    quantization: str | None = setting(
        None, "the draft model's linears quantized at load into this GGUF type (from a GGUF file's blocks, "
        "dequantized first, or from a dense checkpoint) and served by the CPU's GGUF kernels, whatever the target's "
        "`quantization`. A draft's precision moves only its acceptance, never the output, and a draft step is read "
        "from memory: Qwen2.5-Coder 0.5B at `q4_0` reads 278 MB a step instead of its file's Q5_0 / Q8_0 / Q6_K "
        "392 MB, at the same acceptance on code (0.912 against 0.906 at 4 drafts a step, odd HumanEval tasks). CPU "
        "only (an error on a GPU); needs the C++ kernels, and AVX512-VNNI to be fast",
        "`q4_0` \\| `q4_1` \\| `q5_0` \\| `q8_0` or null")
    vocab: int | None = setting(
        None, "the draft model's LM head over the first N token ids and the tokenizer's special tokens only (BPE "
        "ids follow merge order, roughly frequency), from the GGUF blocks' rows under `quantization: gguf`; null: "
        "the whole vocabulary. Lossless (the draft gives other tokens no mass); a smaller head makes draft steps "
        "cheaper and loses the draft positions whose token lies outside. Qwen2.5-Coder 0.5B / 1.5B on code: "
        "acceptance 0.93 (full) and 0.79 (32,768 ids) at 4 drafts a step; with the draft at `q4_0` on odd "
        "HumanEval tasks, 0.912 (full) and 0.855 (65,536 ids)", "int or null")
    temperature: float | None = setting(
        None, "temperature the draft model / EAGLE head samples sampled requests' drafts at; null: each request's "
        "own; >= 0. Output stays lossless either way; only acceptance changes", "float or null")

    def check(self, method: str, proposers: tuple[str, ...]) -> None:
        if self.vocab is not None and not _positive_int(self.vocab):
            raise ValueError(f"speculative.draft.vocab must be a positive integer (token ids), got {self.vocab!r}")
        if "draft" in proposers:
            if not self.model:
                raise ValueError(f"speculative method {method!r} with a draft needs a draft model path "
                                 "(speculative.draft.model)")
            check_model_path(self.model, "speculative draft model")
        if "eagle" in proposers:
            self._check_head(method)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"speculative.draft.dtype must be one of {', '.join(DTYPES)} (or unset: the target's), "
                             f"got {self.dtype!r}")
        if self.quantization is not None:
            self._check_quantization(method, proposers)
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"speculative.draft.temperature must be >= 0, got {self.temperature}")

    def _check_head(self, method: str) -> None:
        from engine.models.eagle import is_eagle_head

        if not self.head:
            raise ValueError(f"speculative method {method!r} with EAGLE needs a head directory "
                             "(speculative.draft.head)")
        if not is_eagle_head(self.head):
            raise ValueError(f"speculative head {self.head!r} is not an EAGLE head directory (config.json "
                             "with an \"eagle\" block, from `specserve distill --head eagle`, or a "
                             "published EAGLE-3 head, \"architectures\": [\"LlamaForCausalLMEagle3\"]; "
                             "the speculators format, Eagle3Speculator, is not supported)")

    def _check_quantization(self, method: str, proposers: tuple[str, ...]) -> None:
        if not isinstance(self.quantization, str) or self.quantization.lower() not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative.draft.quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} (or "
                             f"unset: the draft served as the target), got {self.quantization!r}")
        if "draft" not in proposers:
            raise ValueError("speculative.draft.quantization re-quantizes a draft model: it needs the draft "
                             f"proposer (method draft, or auto with speculative.draft.model), method is {method!r}")
        object.__setattr__(self, "quantization", self.quantization.lower())


@dataclass(frozen=True)
class NgramConfig:
    """`speculative.ngram`: prompt lookup, drafts copied from the request's own context."""
    min: int = setting(1, "shortest context suffix n-gram lookup matches; 1 <= `min` <= `max`", "int")
    max: int = setting(4, "longest context suffix n-gram lookup tries first", "int")

    def check(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ValueError(f"need 1 <= speculative.ngram.min <= speculative.ngram.max, got {self.min}, {self.max}")


@dataclass(frozen=True)
class SuffixConfig:
    """`speculative.suffix`: drafts from a suffix index over the request's context and recent outputs."""
    max_match: int = setting(24, "longest context suffix suffix drafting matches; >= 1", "int")
    cache_tokens: int = setting(
        1 << 16, "tokens of recent requests' outputs kept in the shared suffix cache, over all tenants (the oldest "
        "output of any tenant evicted first; each tenant drafts from its own); 0: no shared cache; >= 0", "int")
    min_prob: float = setting(0.1, "suffix drafting stops once the continuation's cumulative empirical probability "
                              "falls below this; in [0, 1]", "float")
    min_score: int = setting(2, "suffix drafting drafts only when match length × frequency reaches this; >= 1",
                             "int")
    # a long match is a copy worth drafting far; a short one is a guess
    spec_factor: float = setting(1.0, "a suffix draft is at most `ceil(spec_factor × match length)` tokens; > 0",
                                 "float")

    def check(self) -> None:
        for name in ("max_match", "min_score"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"speculative.suffix.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.cache_tokens, int) or self.cache_tokens < 0:
            raise ValueError(f"speculative.suffix.cache_tokens must be an integer >= 0, got {self.cache_tokens!r}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"speculative.suffix.min_prob must be in [0, 1], got {self.min_prob}")
        if not isinstance(self.spec_factor, (int, float)) or not self.spec_factor > 0:
            raise ValueError(f"speculative.suffix.spec_factor must be a number > 0, got {self.spec_factor!r}")


SECTIONS = {"draft": DraftConfig, "ngram": NgramConfig, "suffix": SuffixConfig}
# The flat keys of earlier releases, accepted (with a warning naming the new spelling) for one release.
FLAT_KEYS = {"model": ("draft", "model"), "head": ("draft", "head"), "dtype": ("draft", "dtype"),
             "quantization": ("draft", "quantization"), "draft_vocab": ("draft", "vocab"),
             "draft_temperature": ("draft", "temperature"), "draft_p_min": (None, "p_min"),
             "ngram_min": ("ngram", "min"), "ngram_max": ("ngram", "max"),
             "suffix_max_match": ("suffix", "max_match"), "suffix_cache_tokens": ("suffix", "cache_tokens"),
             "suffix_min_prob": ("suffix", "min_prob"), "suffix_min_score": ("suffix", "min_score"),
             "suffix_spec_factor": ("suffix", "spec_factor")}


def _dotted(section: str | None, key: str) -> str:
    return "speculative." + (f"{section}.{key}" if section else key)


def nest_flat_keys(value: Mapping[str, Any]) -> dict[str, Any]:
    """A `speculative` mapping in the nested form: each flat key of earlier releases moved into its place,
    with one deprecation warning per key; a key given both ways is an error naming both."""
    nested = {key: dict(section) if key in SECTIONS and isinstance(section, Mapping) else section
              for key, section in value.items() if key not in FLAT_KEYS}
    for flat in (key for key in value if key in FLAT_KEYS):
        section, key = FLAT_KEYS[flat]
        target = nested if section is None else nested.setdefault(section, {})
        if not isinstance(target, dict):
            raise ValueError(f"speculative.{section} must be a mapping of its keys, got {target!r}")
        if key in target:
            raise ValueError(f"speculative.{flat} and {_dotted(section, key)} both given: write only "
                             f"{_dotted(section, key)}")
        logger.warning("speculative.%s is deprecated and will be removed in the next release: write %s", flat,
                       _dotted(section, key))
        target[key] = value[flat]
    return nested


def _section(name: str, value: Any) -> Any:
    """A section's dataclass from itself, a mapping of its keys, or None (its defaults)."""
    cls = SECTIONS[name]
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative.{name} must be a mapping of its keys, got {value!r}")
    known = [f.name for f in fields(cls)]
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ValueError(f"unknown key{'s' * (len(unknown) > 1)} in speculative.{name}: {', '.join(map(str, unknown))}"
                         f" (known: {', '.join(known)})")
    return cls(**value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative`: which proposers draft and how far, at the top; each proposer's own settings in its
    section (`draft` for the model proposers, `ngram`, `suffix`)."""
    method: str = setting("none", "`auto`: the policy routes each request and step among `proposers`; a proposer "
                          "name: that proposer only; `none`: plain decoding (the other keys are then ignored and "
                          "not validated)", " \\| ".join(f"`{m}`" for m in SPEC_METHODS))
    proposers: tuple[str, ...] | None = setting(
        None, "`method: auto` only: the proposers the policy may use; a non-empty list of "
        + ", ".join(f"`{p}`" for p in PROPOSERS) + "; ignored for a single method", "list",
        "`draft` if `draft.model` is given, `eagle` if `draft.head` is given, then `ngram`, `suffix`")
    num_speculative_tokens: int = setting(4, "gamma: the most drafts a request verifies in one step; an integer in "
                                          f"1..{MAX_SPEC_TOKENS}", "int")
    adaptive: bool = setting(True, "`true`: `GoodputPolicy` picks each request's proposer and k in 0..gamma every "
                             "step; `false`: `StaticPolicy`, always gamma (or what the proposer offers) from the first "
                             "usable proposer in the order of `proposers`; must be a boolean", "bool")
    # Every proposer's drafts stop at this bar (a draft model's and the EAGLE head's own probabilities, suffix
    # drafting's empirical ones), so it belongs to drafting in general, not to one section.
    p_min: float | None = setting(None, "confidence stop of every proposer's drafts: a fixed bar in [0, 1]. null: "
                                  "`GoodputPolicy` sets the break-even bar each step; `StaticPolicy` uses no stop",
                                  "float or null")
    tree_nodes: int = setting(
        0, "draft trees: the most nodes a request's tree may have (several continuations verified in one pass; see "
        "[speculation.md](speculation.md#draft-trees)); n-gram, suffix, draft-model and EAGLE drafts become trees of "
        "up to this many nodes (at most gamma deep), constrained or penalized requests keep chains; 0: chains; an "
        f"integer in 0..{MAX_SPEC_TOKENS}. Ignored (with a warning) for a sliding-window target", "int")
    draft: DraftConfig = field(default_factory=DraftConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)

    def __post_init__(self):
        for name in SECTIONS:
            object.__setattr__(self, name, _section(name, getattr(self, name)))
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.method == "none":
            object.__setattr__(self, "proposers", ())
            return
        gamma = self.num_speculative_tokens
        if not isinstance(gamma, int) or not 1 <= gamma <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {gamma!r}")
        self._resolve_proposers()
        self.draft.check(self.method, self.proposers)
        if not isinstance(self.tree_nodes, int) or isinstance(self.tree_nodes, bool) \
                or not 0 <= self.tree_nodes <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative.tree_nodes must be an integer in 0..{MAX_SPEC_TOKENS} (0: draft chains), "
                             f"got {self.tree_nodes!r}")
        if "ngram" in self.proposers:
            self.ngram.check()
        if "suffix" in self.proposers:
            self.suffix.check()
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative.adaptive must be true or false, got {self.adaptive!r}")
        if self.p_min is not None and not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"speculative.p_min must be in [0, 1], got {self.p_min}")

    def _resolve_proposers(self) -> None:
        if self.method == "auto":
            default = ("draft",) * bool(self.draft.model) + ("eagle",) * bool(self.draft.head) + ("ngram", "suffix")
            object.__setattr__(self, "proposers", tuple(self.proposers or default))
            unknown = [p for p in self.proposers if p not in PROPOSERS]
            if unknown or not self.proposers:
                raise ValueError(f"speculative.proposers must be a non-empty list of {list(PROPOSERS)}, "
                                 f"got {list(self.proposers)}")
        else:   # a single method: `proposers` (say, merged in from a config file) does not apply
            object.__setattr__(self, "proposers", (self.method,))

    @property
    def gamma(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | Mapping | None") -> "SpeculativeConfig":
        """From a mapping in the nested form (`{"ngram": {"max": 4}}`) or with the flat keys of earlier releases."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        nested = nest_flat_keys(value)
        unknown = set(nested) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {sorted(unknown)}")
        return cls(**nested)


def speculative_fields() -> list[tuple[str, Any]]:
    """Every key of the `speculative` mapping with its field, sections' keys dotted (`ngram.max`)."""
    keys = []
    for top in fields(SpeculativeConfig):
        if top.name in SECTIONS:
            keys += [(f"{top.name}.{f.name}", f) for f in fields(SECTIONS[top.name])]
        else:
            keys.append((top.name, top))
    return keys


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"                   # auto | bfloat16 | float16 | float32
    device: str = "auto"                  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None      # default: the model's max_position_embeddings
    block_size: int | None = None         # default: 16 (256 with flash-attn)
    num_kv_blocks: int | None = None      # fixed block count; else sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    share_caches_across_tenants: bool = False   # one prefix cache and suffix cache for every tenant (API key)
    seed: int = 0
    max_step_failures: int = 5            # failed steps in a row whose canary pass failed too: the engine is dead
    cuda_graphs: bool = False             # decode and verification passes replayed as CUDA graphs (GPU only)
    quantization: str = "auto"            # auto | none | bf16 | int8 | gguf: weight-only formats of the linears (CPU)
    tensor_parallel_size: int = 1         # the target sharded over this many processes (engine/tensor_parallel.py)
    tensor_parallel_timeout: float = 60.0   # seconds a collective waits for a worker before the group is dead
    load_format: str = "auto"             # auto: read the weights | dummy: random ones of the config's shapes
    attention_backend: str = "auto"       # auto | kernel | torch | flash (engine/attention_backends.py)
    cpu_kernels: bool = True              # a layer's small ops fused in C++ on CPU in fp32 (engine/cpu_kernels.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        object.__setattr__(self, "speculative", SpeculativeConfig.from_any(self.speculative))
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        check_model_path(self.model, "model")
        self._check_attention()
        self._check_tensor_parallel()
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "max_step_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_size", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def _check_attention(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.cpu_kernels, bool):
            raise ValueError(f"cpu_kernels must be true or false, got {self.cpu_kernels!r}")
        if self.attention_backend == "kernel" and not self.cpu_kernels:
            raise ValueError("attention_backend kernel is one of the fused CPU ops: it needs cpu_kernels true")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0, got {self.tensor_parallel_timeout!r}")
        if size == 1:
            return
        if self.quantization not in ("auto", "none"):
            raise ValueError(f"quantization {self.quantization} is not supported with tensor_parallel_size > 1 "
                             "(the shards keep unquantized linears)")
        if self.cuda_graphs:
            raise ValueError("cuda_graphs is not supported with tensor_parallel_size > 1")
        if "eagle" in self.speculative.proposers:
            raise ValueError("EAGLE heads read the target's LM head and features: not supported with "
                             "tensor_parallel_size > 1")
