"""The options of a server: each declared once in OPTIONS, with the value parser that reads it and its
docs/configuration.md wording. The YAML keys, the environment variable names (SPECSERVE_<KEY>) and the
command-line flags (--<key-with-dashes>) all come from this table, so the three sources can never drift
apart; server/config.py reads and merges them into a ServerConfig.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from engine.config import ATTENTION_BACKENDS, DTYPES, LOAD_FORMATS, QUANTIZATIONS, nest_flat_keys, speculative_fields
from engine.sampling_params import SamplingParams

ENV_PREFIX = "SPECSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENGINE_CORES = ("process", "thread")
TOOL_CALL_PARSERS = ("auto", "hermes_lenient", "hermes", "llama3_json")   # server/tools.py's parsers
# The request fields a deployment (or the model's generation_config.json) may give defaults for.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty")


# ---- value parsers: each takes a YAML value or an env/flag string ------------------------

def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def _parse_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _parse_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _parse_str(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"expected a string, got {value!r}")
    return str(value)


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '512MiB', '4GiB', '2g', '1073741824'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size in bytes such as 4GiB or 512MiB, got {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _parse_api_keys(value: Any) -> str:
    """One key, several separated by commas, or (in YAML) a list of keys: kept comma-separated."""
    if isinstance(value, list):
        keys = [_parse_str(key) for key in value]
        if any("," in key for key in keys):
            raise ValueError("a key in a list of keys must not contain a comma")
        return ",".join(keys)
    return _parse_str(value)


def _parse_sampling_defaults(value: Any) -> dict:
    """Request sampling fields and their default values, checked as a request's are."""
    defaults = _parse_mapping(value)
    unknown = sorted(set(defaults) - set(SAMPLING_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a sampling field (known: {', '.join(SAMPLING_DEFAULT_FIELDS)})")
    SamplingParams(**defaults)   # ValueError naming the field
    return defaults


def _parse_speculative(value: Any) -> dict:
    """The `speculative` mapping in its nested form (flat keys of earlier releases moved into their sections)."""
    return nest_flat_keys(_parse_mapping(value))


def _parse_mapping(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object, got {value!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping / JSON object, got {value!r}")
    return dict(value)


# The type each parser reads, as docs/configuration.md's type column names it (server/config_reference.py).
PARSER_TYPES = {_parse_int: "int", _parse_float: "float", _parse_bool: "bool", _parse_str: "string",
                parse_size: "size", _parse_mapping: "mapping"}


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    help: str
    metavar: str | None = None
    flag: str | None = None             # default: --key-with-dashes
    choices: tuple[str, ...] | None = None
    # docs/configuration.md's row (server/config_reference.py writes it): the default and the full sentence,
    # in Markdown, and the type where the parser and the choices do not say it
    default: str = ""
    doc: str = ""
    type: str | None = None

    @property
    def env(self) -> str:   # SPECSERVE_ + the flag's name: SPECSERVE_SPECULATIVE_CONFIG for --speculative-config
        return ENV_PREFIX + self.flag_name[2:].replace("-", "_").upper()

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("model", _parse_str, "target model: a Hugging Face checkpoint directory or a GGUF file", "PATH",
           default="**required**",
           doc="the target: a checkpoint directory (`config.json` + safetensors) or a GGUF file, or a directory "
               "holding exactly one `.gguf` and no `config.json`; the families the README lists (Llama, Mistral, "
               "Qwen2/3, Phi-3/4-mini, Gemma 2/3, Qwen3-MoE, Mixtral, gpt-oss)"),
    Option("served_model_name", _parse_str, "model name clients send and see (default: the model path)", "NAME",
           default="the `model` path (trailing `/` removed)",
           doc="the model name clients send and see; any other name in a request is a 404"),
    Option("tokenizer", _parse_str, "tokenizer directory (default: the model's)", "PATH",
           default="the `model` path",
           doc="tokenizer directory, or a GGUF file whose vocabulary and chat template are used"),
    Option("host", _parse_str, "address to listen on (default 127.0.0.1)", "HOST",
           default="`127.0.0.1`",
           doc="address to listen on; with no `api_key` on a non-loopback host, a warning is logged at start-up"),
    Option("port", _parse_int, "port to listen on (default 8000)", "PORT",
           default="`8000`", doc="0..65535"),
    Option("api_key", _parse_api_keys, "require 'Authorization: Bearer KEY' on every endpoint but /health and "
           "/metrics; several keys separated by commas (a list in YAML), each a tenant of its own whose prefix "
           "cache and suffix cache no other key reads (default: no authentication)", "KEY[,KEY...]",
           type="string, or a list in YAML", default="unset (no authentication)",
           doc="requires `Authorization: Bearer KEY` on every endpoint except `/health` and `/metrics`; checked "
               "before the body is read (401). Several keys: separated by commas (`SPECSERVE_API_KEY=key1,key2`) or "
               "a YAML list. Each key is a tenant: the prefix cache and the suffix cache of one key are never read "
               "for another (see `share_caches_across_tenants`); no key may be empty"),
    Option("tenant_header", _parse_str, "a request header naming the request's tenant within its API key, for a "
           "gateway in front (e.g. X-Tenant-Id): requests carrying it share the prefix cache and suffix cache "
           "with its value's other requests only; without it, the API key is the tenant (default: none)", "NAME",
           type="header name", default="unset",
           doc="for a gateway in front that names tenants: a request carrying this header (e.g. `X-Tenant-Id`) "
               "belongs to the tenant its value names within its API key (the gateway's key, or none), so a client "
               "holding another key cannot join that tenant by sending the name; without the header, its API key is "
               "its tenant, and with no key either, it shares the caches with every such request. The engine sees a "
               "digest of key and value, never either"),
    Option("share_caches_across_tenants", _parse_bool, "one prefix cache and suffix cache for every tenant, for "
           "deployments whose keys are all one client's (default false: each API key or tenant header value has "
           "its own)", "BOOL",
           default="`false`",
           doc="one prefix cache and one suffix cache for every tenant, as with a single key: for deployments whose "
               "keys all belong to one client. By default each tenant (API key, or `tenant_header` value) reuses "
               "only its own prompts' KV blocks and drafts only from its own earlier outputs, so neither time to "
               "first token nor a response's `speculative` counters tell one tenant anything about another's prompts "
               "or outputs"),
    Option("speculative", _parse_speculative, "speculative decoding as a JSON object, e.g. "
           "'{\"method\": \"draft\", \"draft\": {\"model\": \"models/draft\"}, \"num_speculative_tokens\": 4}' "
           "(keys: " + ", ".join(name for name, _ in speculative_fields()) + "; merged key by key over the "
           "config file's)", "JSON", flag="--speculative-config"),
    Option("dtype", _parse_str, "compute and KV cache dtype (default auto: on a CPU, float32 over bf16 weights "
           "where the CPU kernels build, else the CPU's native type; the checkpoint's 16-bit type on GPU)",
           choices=("auto", *DTYPES),
           default="`auto`",
           doc="weights, activations and KV cache. `auto` on GPU: the checkpoint's 16-bit type (bfloat16 for an fp32 "
               "checkpoint). `auto` on CPU: float32 computed over weight-only bf16/int8 weights wherever the C++ "
               "kernels build (on CPUs with native bf16, unless the weight files exceed a quarter of memory or "
               "`quantization: none`); otherwise bfloat16 where the CPU has native bf16 (AVX512-BF16 / AMX), else "
               "float32"),
    Option("device", _parse_str, "auto | cpu | cuda | cuda:N (default auto)", "DEVICE",
           type="`auto` \\| `cpu` \\| `cuda` \\| `cuda:N`", default="`auto`",
           doc="`auto` picks CUDA when available; asking for CUDA without it is an error"),
    Option("max_model_len", _parse_int, "context length: prompt + output tokens (default: the model's)", "N",
           default="the smallest of the target's (and draft's) `max_position_embeddings` and what the KV cache holds",
           doc="context length, prompt + output; >= 1; a value above what the model and KV cache allow is an error"),
    Option("max_num_seqs", _parse_int, "most requests in one batch (default 64)", "N",
           default="`64`", doc="most requests in one batch; >= 1"),
    Option("max_num_batched_tokens", _parse_int, "token budget of one engine step (default 2048)", "N",
           default="`2048`",
           doc="token budget of one engine step: decodes, their draft tokens and prefill chunks share it (decodes "
               "first); longer prompts are prefilled in chunks; >= 1"),
    Option("num_kv_blocks", _parse_int, "fixed number of KV cache blocks (default: sized from --kv-cache-memory)", "N",
           default="unset", doc="a fixed number of KV blocks instead of sizing from `kv_cache_memory`; >= 1"),
    Option("kv_cache_memory", parse_size, "memory for the KV caches of target and draft, e.g. 4GiB "
           "(default 1GiB)", "SIZE",
           default="`1GiB`",
           doc="memory for the KV caches: the target's, plus a draft model's, plus an EAGLE head's layer and the "
               "target features it reads; sets the number of blocks unless `num_kv_blocks` is given, capped at what "
               "`max_num_seqs` full-length sequences can use; >= 1"),
    Option("block_size", _parse_int, "tokens per KV cache block (default 16; 256 with flash-attn)", "N",
           default="`16`; `256` when flash-attn serves a model",
           doc="tokens per KV block; >= 1; a multiple of 256 with flash-attn"),
    Option("enable_prefix_caching", _parse_bool, "reuse KV blocks of shared prompt prefixes (default true)",
           "BOOL",
           default="`true`",
           doc="reuse the KV blocks of shared prompt prefixes (chained hashes over full blocks); flags "
               "`--enable-prefix-caching` / `--no-enable-prefix-caching`"),
    Option("cuda_graphs", _parse_bool, "replay decode and verification passes as CUDA graphs, padded to batch "
           "buckets (GPU only; default false)", "BOOL",
           default="`false`",
           doc="replay decode and verification passes as CUDA graphs padded to batch buckets; needs a CUDA device "
               "(an error otherwise); flag `--cuda-graphs true`"),
    Option("quantization", _parse_str, "weight-only format of the linears on CPU: gguf (a GGUF file's own "
           "quantized blocks, int8 activations), bf16 (2 bytes a weight) or int8 (one scale per 32 weights, "
           "Q8_0's grouping), computed by C++ kernels built on first use; none keeps the dtype's weights "
           "(default auto: gguf for a quantized GGUF model on an AVX512-VNNI CPU, else bf16 where dtype auto "
           "computes in float32 on a CPU, else none)", choices=QUANTIZATIONS,
           default="`auto`",
           doc="weight-only format of the linears on CPU, computed by C++ kernels built on first use: `gguf` (a GGUF "
               "file's own Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks, repacked exactly; each pass's rows rounded "
               "to int8 per 32 values, as llama.cpp does; tensors of other types served as `bf16`), `bf16` (2 bytes "
               "a weight) or `int8` (one scale per 32 weights, Q8_0's grouping). `auto`: `gguf` for a GGUF model "
               "with such blocks on a CPU with AVX512-VNNI; else `bf16` where `dtype: auto` resolved to float32 on a "
               "CPU and the kernel is available; else `none`. `gguf` runs without AVX512-VNNI through a portable "
               "loop (several times slower). The quantized formats are errors on a GPU or without the kernels"),
    Option("tensor_parallel_size", _parse_int, "shard the target over this many processes on this node "
           "(tensor parallelism: gloo on CPU, NCCL over cuda:0..N-1; under torchrun, its RANK / WORLD_SIZE / "
           "MASTER_ADDR / MASTER_PORT; default 1)", "N",
           default="1", doc="the target sharded over this many processes on this node (tensor parallelism, "
               "engine/tensor_parallel.py): gloo on CPU, NCCL over cuda:0..N-1; under torchrun, its RANK / "
               "WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Qwen3-MoE and "
               "Mixtral safetensors checkpoints (MoE: per-expert tensors, each expert's intermediate split); the "
               "shards keep unquantized linears without the CPU's fused ops; no EAGLE heads, no CUDA graphs. The "
               "draft model stays unsharded on rank 0. A worker that exits makes the engine dead"),
    Option("load_format", _parse_str, "auto reads the weights; dummy gives the model's shapes random ones, read "
           "from nothing but its config (to benchmark a shape without its weights; default auto)",
           choices=LOAD_FORMATS,
           default="`auto`",
           doc="`auto` reads the weights; `dummy` gives the target (and a draft model) random weights of their "
               "configs' shapes (norm weights 1, biases 0, the rest N(0, 0.02)), read from nothing but `config.json` "
               "(or a GGUF's header): a shape's costs without its weights, as `bench/gpu_scale.py` measures an "
               "8B-shaped target. Its output is noise"),
    Option("attention_backend", _parse_str, "who computes attention: kernel (the C++ CPU kernel for decode and "
           "verification rows, torch for prefill chunks), torch (the reference, any device), flash (flash-attn; "
           "CUDA, float16 / bfloat16) or auto (flash where it serves, else kernel where the fused CPU ops run, "
           "else torch; default)", choices=ATTENTION_BACKENDS,
           default="`auto`",
           doc="who computes attention, chosen once per model at start-up: `kernel` (the C++ CPU kernel of "
               "`cpu_kernels` for decode and verification rows; prefill chunks and soft-capped layers on torch), "
               "`torch` (the torch SDPA reference, on any device), `flash` (flash-attn: a CUDA device and float16 "
               "or bfloat16), or `auto`: `flash` where it can serve the model, else `kernel` where the model runs "
               "on the fused CPU ops, else `torch`. An explicit `kernel` or `flash` that cannot serve is an error"),
    Option("cpu_kernels", _parse_bool, "fuse a layer's small ops (add + RMSNorm, silu * up, RoPE + cache write + "
           "attention) in C++ on a CPU in float32 (default true; false keeps torch's ops, for debugging)", "BOOL",
           default="`true`",
           doc="run a layer's small ops through the fused C++ CPU kernels (add + RMSNorm, silu * up, and the "
               "attention kernel) where the model computes in float32 on a CPU with AVX2; `false` keeps torch's "
               "ops everywhere (for debugging; the quantized linears still follow `quantization`)"),
    Option("seed", _parse_int, "engine seed for requests that give none (default 0)", "N",
           default="`0`",
           doc="seeds the random generators of sampled requests that give no seed (each request gets its own, drawn "
               "in order; such output is not independent of the batch, unlike a request's own `seed`)"),
    Option("log_level", _parse_str, "logging level (default info)", choices=LOG_LEVELS,
           default="`info`",
           doc="logging level of the server and the engine process; `debug` also turns on uvicorn's access log"),
    Option("engine_core", _parse_str, "where the engine loop runs: process (its own, the default: it shares no "
           "GIL with HTTP work) or thread (a thread of the API process)", choices=ENGINE_CORES,
           default="`process`",
           doc="where `Engine.step()` runs: in a child process (it shares no GIL with HTTP work), or on a thread of "
               "the API process"),
    Option("engine_threads", _parse_int, "compute threads of the engine (default: every core the process may use)",
           "N",
           default="`OMP_NUM_THREADS` if set, else every core the process may use",
           doc="the engine's torch compute threads; >= 1"),
    Option("max_num_waiting", _parse_int, "queued requests (submitted, not yet running) past which new ones "
           "are answered 429 with Retry-After (default 512)", "N",
           default="`512`",
           doc="submitted requests not yet running, past which new ones get a 429 with `Retry-After: 1` (a request "
               "with n choices counts n); >= 0 (0 rejects every request)"),
    Option("watchdog_timeout", _parse_float, "seconds without a finished engine step, while requests wait, "
           "after which /health answers 503 (default 120)", "SECONDS",
           default="`120`",
           doc="seconds without a finished engine step while requests are in flight, after which `/health` answers "
               "503 (`engine_stalled`); > 0"),
    Option("shutdown_timeout", _parse_float, "on SIGTERM: stop admitting (503), let in-flight requests run this "
           "many seconds, then end the rest with an error (default 25, inside Kubernetes' 30 s grace)", "SECONDS",
           default="`25`",
           doc="on SIGTERM: stop admitting (503), let requests in flight run this long, then end the rest with an "
               "error; >= 0 (inside Kubernetes' default 30 s grace period)"),
    Option("max_step_failures", _parse_int, "failed engine steps in a row after which a canary pass of the "
           "engine's own failed too (the engine's fault, not a request's) before the "
           "engine is declared dead and the server exits 1 (default 5)", "N",
           default="`5`",
           doc="failed engine steps in a row after which a canary pass of the engine's own failed too (the engine's "
               "fault, not a request's) before the engine is declared dead and the server exits 1; >= 1. A request "
               "that fails alone is that request's error and never counts"),
    Option("tool_call_parser", _parse_str, "how the model writes tool calls: hermes_lenient (<tool_call> blocks: "
           "Qwen2.5, Qwen3, Hermes; and bare JSON calls {\"name\": <an offered function>, \"arguments\": {...}}, "
           "also in doubled braces, as small models write them), hermes (the blocks only) or llama3_json (Llama "
           "3.1's JSON form); default auto: from the chat template, hermes_lenient for the Hermes family and "
           "where the template shows none (the tools then go in the system prompt)", choices=TOOL_CALL_PARSERS,
           default="`auto`", doc="how the model writes tool calls: `hermes_lenient` (`<tool_call>{\"name\", "
               "\"arguments\"}</tool_call>` blocks: Qwen2.5, Qwen3, Hermes; and bare JSON calls `{\"name\": <an "
               "offered function>, \"arguments\": {...}}` without the markers, also in the doubled braces `{{...}}` "
               "small models copy from their template), `hermes` (the blocks only), or `llama3_json` (Llama 3.1's "
               "`{\"name\", \"parameters\"}`); `auto` reads the chat template (Llama 3.1's `<\\|python_tag\\|>` or "
               "`\"parameters\"`: llama3_json, else hermes_lenient). A template that renders no tools gets them in "
               "the system prompt in the Hermes format ([structured.md](structured.md#tool-calling-servertoolspy))"),
    Option("max_tool_calls_per_turn", _parse_int, "distinct tool calls after which a choice's turn ends with "
           "finish_reason tool_calls (a call that repeats an earlier one ends it too; without "
           "parallel_tool_calls, the first call does; default 32)", "N",
           default="`32`",
           doc="distinct tool calls after which a chat choice ends with `finish_reason: \"tool_calls\"`, as at a "
               "stop string; a call identical to an earlier one ends it too (and is dropped), and without "
               "`parallel_tool_calls` the first call does; >= 1"),
    Option("sampling_defaults", _parse_sampling_defaults, "default values of the sampling fields a request leaves "
           "unset, as a JSON object, e.g. {\"temperature\": 0.7, \"top_p\": 0.8, \"top_k\": 20}: over those of the "
           "model's generation_config.json, where it has one (a GGUF file has none); default: OpenAI's "
           "(temperature 1, no top_p, top_k or penalties)", "JSON",
           type="mapping (JSON in a flag or variable)",
           default="the model's `generation_config.json` sampling fields, else none (OpenAI's defaults)",
           doc="values for the sampling fields a request leaves unset: `temperature`, `top_p`, `top_k`, `min_p`, "
               "`repetition_penalty`, `presence_penalty`, `frequency_penalty`, each checked as a request's is; "
               "merged over those a Hugging Face checkpoint's `generation_config.json` sets (its authors' settings, "
               "which vLLM applies too). A GGUF file carries none: configs/qwen2.5-coder-1.5b.yaml gives Qwen's "
               "(temperature 0.7, top_p 0.8, top_k 20). A request's own value always wins; agent frameworks mostly "
               "send none"),
    Option("max_body_size", parse_size, "largest request body, e.g. 16MiB; larger ones are a 413 before "
           "they are read (default 4MiB)", "SIZE",
           default="`4MiB`",
           doc="request bodies larger than this are a 413 before they are read (chunked bodies too); >= 1 KiB. The "
               "body's JSON parse holds the event loop, so a larger limit lets one body delay every other request "
               "([benchmarks](benchmarks.md#hostile-bodies))"),
    Option("max_prompt_chars", _parse_int, "characters of prompt text one request may send (completion prompts, "
           "chat messages, /tokenize), refused with a 400 before they are tokenized or rendered (default: 32 per "
           "token of max_model_len, far past any text that fits the context)", "N",
           default="32 per token of `max_model_len`",
           doc="characters of prompt text one request may send (completion prompts summed, chat messages' content, "
               "names and earlier calls' arguments, a `/tokenize` prompt; as many tokens for `/detokenize`); more is "
               "a 400 (`context_length_exceeded`) before anything is tokenized or rendered; >= 1. Prompts given as "
               "token ids are held to `max_model_len` tokens and the vocabulary, before they reach the engine"),
    Option("limit_concurrency", _parse_int, "open connections (or requests in flight) past which a new request is "
           "answered 503 at once (default 1000)", "N",
           default="`1000`",
           doc="open connections (or requests in flight) past which a new request is answered 503 at once by uvicorn "
               "(plain text, `Connection: close`) instead of queueing; idle kept-alive connections and `/health` "
               "probes count too; >= 1"),
    Option("timeout_keep_alive", _parse_float, "seconds an idle kept-alive connection stays open (default 5)",
           "SECONDS",
           default="`5`", doc="an idle kept-alive connection is closed after this long; > 0"),
    Option("header_timeout", _parse_float, "seconds a connection has to deliver a request's head, from its opening "
           "or its next request's first byte; then a 408 and the connection closed (default 10)", "SECONDS",
           default="`10`",
           doc="a connection must deliver a request's head (request line and headers, at most 16 KiB: h11's limit, "
               "else a 400) within this long of opening, or of the first byte of its next request; past it, a 408 "
               "and the connection closed. uvicorn has no such deadline of its own: without it a connection that "
               "sends nothing, or a header a byte at a time (slowloris), is held forever and counts against "
               "`limit_concurrency`; > 0"),
    Option("body_timeout", _parse_float, "seconds a request's body has to arrive after its head; then a 408 and "
           "the connection closed (default 60)", "SECONDS",
           default="`60`",
           doc="a request's whole body must arrive within this long of its head; past it, a 408 (`request_timeout`, "
               "OpenAI's error shape) and the connection closed, the route never called; > 0"),
    Option("tensor_parallel_timeout", _parse_float, "seconds a tensor-parallel collective may wait for a worker "
           "before the engine is declared dead (a dead or stopped worker; default 60, far above any pass)",
           "SECONDS",
           default="`60`",
           doc="how long a tensor-parallel collective (a pass's all-reduce, rank 0 handing a worker its next pass) "
               "may wait for a worker; past it the group is out of step (a stopped or hung worker), the engine is "
               "dead: waiting clients get 503s or an `engine_dead` stream event and the server exits 1. A worker "
               "waiting for its next pass waits without limit. On CUDA, NCCL's watchdog enforces it by ending the "
               "process; > 0"),
)
OPTIONS_BY_KEY = {option.key: option for option in OPTIONS}
# Spelled as in EngineConfig; accepted in YAML files as an alias.
YAML_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
SERVER_KEYS = ("served_model_name", "tokenizer", "host", "port", "api_key", "log_level", "engine_core",
               "engine_threads", "max_num_waiting", "max_body_size", "watchdog_timeout", "shutdown_timeout",
               "limit_concurrency", "timeout_keep_alive", "header_timeout", "body_timeout",
               "tool_call_parser", "max_tool_calls_per_turn", "max_prompt_chars", "tenant_header", "sampling_defaults")
