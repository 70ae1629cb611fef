"""ServerConfig: one frozen config object from YAML, then SPECSERVE_* environment variables, then flags.

Every option is declared once in OPTIONS (server/options.py), which names its YAML key, environment
variable and flag. Later sources win; the `speculative` mapping is
merged key by key, and so is each of its sections (a flag giving only num_speculative_tokens keeps the
YAML's method and draft model).

Relative paths (model, tokenizer, speculative.draft.model) are used as written, i.e. relative to the
current directory, not to the YAML file: `make serve` runs from the repository root.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from engine.config import SECTIONS, EngineConfig, SpeculativeConfig
from engine.sampling_params import SamplingParams
from server.options import (ENGINE_CORES, ENV_PREFIX, LOG_LEVELS, OPTIONS, OPTIONS_BY_KEY, SAMPLING_DEFAULT_FIELDS,
                            SERVER_KEYS, TOOL_CALL_PARSERS, YAML_ALIASES, Option)

DEFAULT_MAX_TOOL_CALLS_PER_TURN = 32   # distinct tool calls after which a turn ends (a backstop to repeats ending it)
DEFAULT_MAX_BODY_SIZE = 4 * 2**20   # bytes: a full 128k-token prompt as JSON token ids fits (about 1 MiB), and
# the body's JSON parse, which holds the event loop, stays short (docs/configuration.md)
DEFAULT_WATCHDOG_TIMEOUT = 120.0     # seconds without a step while requests wait: /health says the engine is stuck
DEFAULT_SHUTDOWN_TIMEOUT = 25.0     # on SIGTERM: drain this long (Kubernetes kills after 30 s by default)
DEFAULT_LIMIT_CONCURRENCY = 1000    # connections: below the usual 1024 open files, so the limit answers first
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0    # seconds an idle kept-alive connection stays open (uvicorn's default)
DEFAULT_HEADER_TIMEOUT = 10.0       # seconds for a request's head to arrive
DEFAULT_BODY_TIMEOUT = 60.0         # seconds for a whole body to arrive: the largest default body at 280 KB/s


class ConfigError(ValueError):
    """A config value is missing, unknown or malformed; the message names the key and its source."""


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    served_model_name: str
    tokenizer: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None          # one key, or several separated by commas (each its own tenant)
    tenant_header: str | None = None    # a header naming the request's tenant (set by a gateway in front)
    log_level: str = "info"
    engine_core: str = "process"        # where Engine.step() runs: its own process, or a thread of the API's
    engine_threads: int | None = None   # the engine's compute threads (None: every core this process may use)
    max_num_waiting: int | None = 512   # queued requests past which new ones get a 429
    max_body_size: int = DEFAULT_MAX_BODY_SIZE          # bytes of a request body past which it is a 413
    max_prompt_chars: int | None = None   # characters of prompt text per request (None: 32 per context token)
    watchdog_timeout: float = DEFAULT_WATCHDOG_TIMEOUT  # seconds without a finished step while requests wait
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # on SIGTERM: seconds in-flight requests may still run
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY   # open connections past which new requests get 503
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE      # seconds an idle kept-alive connection stays open
    header_timeout: float = DEFAULT_HEADER_TIMEOUT              # seconds a request's head may take to arrive
    body_timeout: float = DEFAULT_BODY_TIMEOUT                  # seconds a request's body may take to arrive
    tool_call_parser: str = "auto"      # how the model writes tool calls (auto: from its chat template)
    max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN   # calls after which a choice's turn ends
    # sampling fields a request leaves unset take these values (the model's generation_config.json, then the
    # config's sampling_defaults)
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.engine_core not in ENGINE_CORES:
            raise ConfigError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, got {self.engine_core!r}")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ConfigError(f"engine_threads must be at least 1, got {self.engine_threads}")
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ConfigError(f"max_num_waiting must be >= 0, got {self.max_num_waiting}")
        if self.watchdog_timeout <= 0:
            raise ConfigError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ConfigError(f"limit_concurrency must be at least 1, got {self.limit_concurrency}")
        for key in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.max_body_size < 1024:
            raise ConfigError(f"max_body_size must be at least 1KiB, got {self.max_body_size}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError(f"max_prompt_chars must be at least 1, got {self.max_prompt_chars}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")
        if self.max_tool_calls_per_turn < 1:
            raise ConfigError(f"max_tool_calls_per_turn must be at least 1, got {self.max_tool_calls_per_turn}")
        if self.api_key is not None and not all(split_api_keys(self.api_key)):
            raise ConfigError("api_key must not be empty, nor hold an empty key between commas (leave it unset "
                              "to turn authentication off)")
        if self.tenant_header is not None and not re.fullmatch(r"[A-Za-z0-9-]+", self.tenant_header):
            raise ConfigError(f"tenant_header must be a header name (letters, digits and '-'), got "
                              f"{self.tenant_header!r}")


def split_api_keys(api_key: str | None) -> tuple[str, ...]:
    """The keys of an api_key setting: none, one, or several separated by commas."""
    return () if api_key is None else tuple(key.strip() for key in api_key.split(","))


def model_sampling_defaults(model: str) -> dict:
    """The sampling fields a Hugging Face checkpoint's generation_config.json sets (its authors'
    recommended settings, which vLLM applies by default too); none for a GGUF file, which carries none."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
        defaults = {key: config[key] for key in SAMPLING_DEFAULT_FIELDS if key in config}
        SamplingParams(**defaults)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: unusable sampling defaults ({exc}); fix the file or set sampling_defaults") \
            from None
    return defaults


def _parse(option: Option, value: Any, source: str) -> Any:
    if value is None:
        return None
    try:
        parsed = option.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: invalid value for {option.key!r}: {exc}") from None
    if option.choices and parsed not in option.choices:
        raise ConfigError(f"{source}: {option.key!r} must be one of {', '.join(option.choices)}, got {parsed!r}")
    return parsed


def read_yaml(path: str) -> dict[str, Any]:
    """The options of a YAML config file, parsed; unknown keys are an error naming the key."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of options, got {type(raw).__name__}")
    values = {}
    for key, value in raw.items():
        name = YAML_ALIASES.get(key, key)
        if name not in OPTIONS_BY_KEY:
            raise ConfigError(f"{path}: unknown config key {key!r} (known keys: {', '.join(OPTIONS_BY_KEY)})")
        if name in values:
            raise ConfigError(f"{path}: {key!r} repeats another key's setting ({name!r})")
        values[name] = _parse(OPTIONS_BY_KEY[name], value, path)
    return values


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options from SPECSERVE_<KEY> variables (SPECSERVE_SPECULATIVE_CONFIG: the speculative JSON).
    An empty variable counts as unset, except the API key's: an empty Secret must not silently
    turn authentication off."""
    api_key = OPTIONS_BY_KEY["api_key"].env
    if api_key in environ and not environ[api_key].strip():
        raise ConfigError(f"environment variable {api_key} is set but empty: give the key, or unset the variable "
                          f"to turn authentication off")
    return {option.key: _parse(option, environ[option.env], f"environment variable {option.env}")
            for option in OPTIONS if environ.get(option.env, "") != ""}


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; None means "not given"; the speculative mapping and its sections merge key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                continue
            if key == "speculative" and "speculative" in merged:
                value = _merge_speculative(merged["speculative"], value)
            merged[key] = value
    return merged


def _merge_speculative(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Key by key, and inside each section (draft, ngram, suffix) key by key too."""
    merged = {**base, **override}
    for name in SECTIONS:
        if isinstance(base.get(name), Mapping) and isinstance(override.get(name), Mapping):
            merged[name] = {**base[name], **override[name]}
    return merged


def build_config(values: Mapping[str, Any]) -> ServerConfig:
    """The ServerConfig (with its EngineConfig) from merged option values."""
    values = dict(values)
    model = values.pop("model", None)
    if not model:
        raise ConfigError("no model given: set --model, SPECSERVE_MODEL or 'model' in the config file")
    server = {key: values.pop(key) for key in SERVER_KEYS if key in values}
    if "kv_cache_memory" in values:
        values["kv_cache_memory_bytes"] = values.pop("kv_cache_memory")
    speculative = values.pop("speculative", None)
    try:
        spec = SpeculativeConfig.from_any(speculative)
        engine = EngineConfig(model=model, speculative=spec, **values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    server["sampling_defaults"] = {**model_sampling_defaults(model), **server.get("sampling_defaults", {})}
    server.setdefault("served_model_name", model.rstrip("/") or model)
    server.setdefault("tokenizer", model)
    return ServerConfig(engine=engine, **server)


def load_config(config_path: str | None = None, flags: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> ServerConfig:
    """YAML file (if any; SPECSERVE_CONFIG names one too), then SPECSERVE_* variables, then flags."""
    environ = os.environ if environ is None else environ
    config_path = config_path or environ.get(ENV_PREFIX + "CONFIG") or None
    from_file = read_yaml(config_path) if config_path else {}
    parsed_flags = {key: _parse(OPTIONS_BY_KEY[key], value, "command line") for key, value in (flags or {}).items()}
    return build_config(merge(from_file, read_env(environ), parsed_flags))

