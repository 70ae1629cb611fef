"""Engine configuration: frozen dataclasses, validated on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

QUANTIZATIONS = ("auto", "none", "bf16", "int8", "gguf")   # weight-only formats of the linears (CPU):
# engine/models/streamed_linear.py (bf16, int8) and engine/models/gguf_linear.py (a GGUF file's own blocks)

# What a draft's linears may be re-quantized into at load (`speculative.quantization`): the GGUF kernel
# types gguf's quantizer writes. A draft's precision moves only its acceptance, never the output.
DRAFT_QUANTIZATIONS = ("q4_0", "q4_1", "q5_0", "q8_0")

PROPOSERS = ("draft", "eagle", "ngram", "suffix")
SPEC_METHODS = ("auto", *PROPOSERS, "none")
MAX_SPEC_TOKENS = 32
# How model weights are obtained: read from the checkpoint, or random of its config's shapes (benchmarking
# a shape without its weights: vLLM's --load-format dummy).
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("bfloat16", "float16", "float32")


def check_model_path(path: str, what: str) -> None:
    """A model is a checkpoint directory (config.json) or a GGUF file (or a directory holding one)."""
    from engine.models.gguf import find_gguf

    if not os.path.isfile(os.path.join(path, "config.json")) and find_gguf(path) is None:
        raise ValueError(f"{what} {path!r} is not a checkpoint directory (no config.json) or a GGUF file")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"              # "auto" | "draft" | "eagle" | "ngram" | "suffix" | "none"
    model: str | None = None          # draft checkpoint directory (method "draft", or "auto" with a draft)
    head: str | None = None           # EAGLE head directory (method "eagle", or "auto" with a head)
    num_speculative_tokens: int = 4   # gamma: the most drafts a request verifies in one step
    proposers: tuple[str, ...] | None = None   # method "auto": the proposers it may route to (default:
                                               # "draft" / "eagle" when a model / head is given, "ngram", "suffix")
    adaptive: bool = True             # the goodput policy picks k per request and step; False: always gamma
    draft_p_min: float | None = None  # confidence stop: a fixed bar; None: the policy sets it
    draft_temperature: float | None = None  # None: each request's own temperature
    tree_nodes: int = 0               # n-gram, suffix, draft-model and EAGLE drafts as trees of up to this many nodes
                                      # (several continuations verified in one pass); 0: chains
    ngram_max: int = 4
    ngram_min: int = 1
    suffix_max_match: int = 24        # suffix: longest context suffix it matches
    suffix_cache_tokens: int = 1 << 16  # suffix: recent requests' outputs kept, all tenants together (0: none)
    suffix_min_prob: float = 0.1      # suffix: stop once the continuation's empirical probability falls below
    suffix_min_score: int = 2         # suffix: draft only when match length x frequency reaches this
    suffix_spec_factor: float = 1.0   # suffix: draft at most this many tokens per matched token (a long
                                      # match is a copy worth drafting far; a short one is a guess)
    dtype: str | None = None          # draft dtype; None: the target's
    quantization: str | None = None   # the draft model's linears re-quantized at load into this GGUF type
                                      # (q4_0 | q4_1 | q5_0 | q8_0), served by the CPU's GGUF kernels: a
                                      # draft step reads fewer bytes; acceptance may drop, output never
                                      # changes. None: the draft's weights served as the target's are
    draft_vocab: int | None = None    # the draft model's output layer over the first N token ids and the
                                      # special tokens only (BPE ids follow merge order, roughly frequency);
                                      # None: the whole vocabulary

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.method == "none":
            object.__setattr__(self, "proposers", ())
            return
        gamma = self.num_speculative_tokens
        if not isinstance(gamma, int) or not 1 <= gamma <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {gamma!r}")
        if self.method == "auto":
            default = ("draft",) * bool(self.model) + ("eagle",) * bool(self.head) + ("ngram", "suffix")
            object.__setattr__(self, "proposers", tuple(self.proposers or default))
            unknown = [p for p in self.proposers if p not in PROPOSERS]
            if unknown or not self.proposers:
                raise ValueError(f"speculative.proposers must be a non-empty list of {list(PROPOSERS)}, "
                                 f"got {list(self.proposers)}")
        else:   # a single method: `proposers` (say, merged in from a config file) does not apply
            object.__setattr__(self, "proposers", (self.method,))
        if self.draft_vocab is not None and (not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool)
                                             or self.draft_vocab < 1):
            raise ValueError(f"speculative.draft_vocab must be a positive integer (token ids), got {self.draft_vocab!r}")
        if "draft" in self.proposers:
            if not self.model:
                raise ValueError(f"speculative method {self.method!r} with a draft needs a draft model path "
                                 "(speculative.model)")
            check_model_path(self.model, "speculative draft model")
        if "eagle" in self.proposers:
            from engine.models.eagle import is_eagle_head

            if not self.head:
                raise ValueError(f"speculative method {self.method!r} with EAGLE needs a head directory "
                                 "(speculative.head)")
            if not is_eagle_head(self.head):
                raise ValueError(f"speculative head {self.head!r} is not an EAGLE head directory (config.json "
                                 "with an \"eagle\" block, from `specserve distill --head eagle`, or a "
                                 "published EAGLE-3 head, \"architectures\": [\"LlamaForCausalLMEagle3\"]; "
                                 "the speculators format, Eagle3Speculator, is not supported)")
        if not isinstance(self.tree_nodes, int) or isinstance(self.tree_nodes, bool) \
                or not 0 <= self.tree_nodes <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative.tree_nodes must be an integer in 0..{MAX_SPEC_TOKENS} (0: draft chains), "
                             f"got {self.tree_nodes!r}")
        if "ngram" in self.proposers and not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if "suffix" in self.proposers:
            for name in ("suffix_max_match", "suffix_min_score"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
            if not isinstance(self.suffix_cache_tokens, int) or self.suffix_cache_tokens < 0:
                raise ValueError(f"suffix_cache_tokens must be an integer >= 0, got {self.suffix_cache_tokens!r}")
            if not 0.0 <= self.suffix_min_prob <= 1.0:
                raise ValueError(f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob}")
            if not isinstance(self.suffix_spec_factor, (int, float)) or not self.suffix_spec_factor > 0:
                raise ValueError(f"suffix_spec_factor must be a number > 0, got {self.suffix_spec_factor!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative.adaptive must be true or false, got {self.adaptive!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"speculative.dtype must be one of {', '.join(DTYPES)} (or unset: the target's), "
                             f"got {self.dtype!r}")
        if self.quantization is not None:
            if not isinstance(self.quantization, str) or self.quantization.lower() not in DRAFT_QUANTIZATIONS:
                raise ValueError(f"speculative.quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} (or "
                                 f"unset: the draft served as the target), got {self.quantization!r}")
            if "draft" not in self.proposers:
                raise ValueError("speculative.quantization re-quantizes a draft model: it needs the draft "
                                 f"proposer (method draft or auto with speculative.model), method is {self.method!r}")
            object.__setattr__(self, "quantization", self.quantization.lower())
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ValueError(f"draft_temperature must be >= 0, got {self.draft_temperature}")
        if self.draft_p_min is not None and not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")

    @property
    def gamma(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {sorted(unknown)}")
        return cls(**value)


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
        self._check_tensor_parallel()
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "max_step_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_size", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

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
