"""ServerConfig loading (YAML < SPECSERVE_* environment < flags) and the `specserve` command line."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from server.cli import build_parser, main
from server.config import ConfigError, load_config, read_yaml
from server.config_reference import reference_tables, rewrite
from server.options import OPTIONS, parse_size

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    """A working directory with two checkpoint-looking directories (the config only checks config.json)."""
    for name in ("target", "draft"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_yaml(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_yaml_then_env_then_flags(models):
    config_file = write_yaml(models / "configs" / "pair.yaml", """
model: models/target
port: 1000
max_num_seqs: 8
kv_cache_memory: 2GiB
speculative:
  method: draft
  num_speculative_tokens: 4
  draft:
    model: models/draft
    temperature: 0.5
""")
    env = {"SPECSERVE_PORT": "2000", "SPECSERVE_MAX_NUM_SEQS": "16", "SPECSERVE_API_KEY": "k",
           "SPECSERVE_SPECULATIVE_CONFIG": json.dumps({"num_speculative_tokens": 2, "draft": {"temperature": 0.7}})}
    config = load_config(config_file, {"port": "3000"}, environ=env)
    assert config.port == 3000 and config.engine.max_num_seqs == 16 and config.api_key == "k"
    assert config.engine.kv_cache_memory_bytes == 2 * 2**30
    spec = config.engine.speculative   # merged key by key: method and draft model from YAML, the rest from env
    assert (spec.method, spec.draft.model, spec.num_speculative_tokens) == ("draft", "models/draft", 2)
    assert spec.draft.temperature == 0.7
    assert config.served_model_name == "models/target" and config.tokenizer == "models/target"
    assert config.host == "127.0.0.1" and config.engine.dtype == "auto"

    flags = {"speculative": '{"method": "ngram"}', "served_model_name": "pair", "enable_prefix_caching": False}
    config = load_config(config_file, flags, environ={"SPECSERVE_CUDA_GRAPHS": "true"})
    assert config.engine.speculative.method == "ngram" and config.served_model_name == "pair"
    assert config.engine.enable_prefix_caching is False and config.port == 1000 and config.engine.cuda_graphs


def test_an_empty_api_key_variable_is_an_error_not_auth_off(models):
    with pytest.raises(ConfigError, match="SPECSERVE_API_KEY is set but empty"):
        load_config(None, {"model": "models/target"}, environ={"SPECSERVE_API_KEY": " "})


def test_config_file_from_env_and_defaults(models):
    config_file = write_yaml(models / "c.yaml", "model: models/target\n")
    config = load_config(None, {}, environ={"SPECSERVE_CONFIG": config_file, "SPECSERVE_DTYPE": "float32"})
    assert config.engine.dtype == "float32" and config.port == 8000 and config.api_key is None
    assert config.engine.speculative.method == "none"
    config = load_config(None, {"model": "models/target"}, environ={"SPECSERVE_MODEL": "elsewhere"})
    assert config.engine.model == "models/target"


def test_relative_model_paths_resolve_against_the_current_directory(models, tmp_path_factory, monkeypatch):
    config_file = write_yaml(models / "configs" / "rel.yaml", "model: models/target\n")
    assert load_config(config_file, environ={}).engine.model == "models/target"
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    with pytest.raises(ConfigError, match="models/target"):
        load_config(config_file, environ={})


def test_unknown_key_is_an_error_naming_it(models):
    config_file = write_yaml(models / "bad.yaml", "model: models/target\nmax_num_seqz: 4\n")
    with pytest.raises(ConfigError, match="max_num_seqz"):
        load_config(config_file, environ={})
    config_file = write_yaml(models / "bad_spec.yaml", "model: models/target\nspeculative:\n  gamma: 4\n")
    with pytest.raises(ConfigError, match="gamma"):
        load_config(config_file, environ={})


@pytest.mark.parametrize("text, key", [
    ("model: models/target\nport: eighty\n", "port"),
    ("model: models/target\ndtype: fp8\n", "dtype"),
    ("model: models/target\nkv_cache_memory: lots\n", "kv_cache_memory"),
    ("model: models/target\nenable_prefix_caching: maybe\n", "enable_prefix_caching"),
    ("model: models/target\nspeculative: draft\n", "speculative"),
    ("model: models/target\nspeculative: {method: ngram, adaptive: 'false'}\n", "speculative.adaptive"),
    ("model: models/target\nspeculative: {method: ngram, draft: {dtype: bf16}}\n", "speculative.draft.dtype"),
    ("model: models/target\nspeculative: {method: ngram, ngram: {max: 0}}\n", "speculative.ngram"),
    ("model: models/target\nspeculative: {ngram: {maximum: 3}}\n", "speculative.ngram: maximum"),
    ("model: models/target\nspeculative: {ngram: 3}\n", "speculative.ngram must be a mapping"),
    ("model: models/target\nmax_num_seqs: 0\n", "max_num_seqs"),
    ("model: models/target\nattention_backend: fastest\n", "attention_backend"),
    ("model: models/target\ncpu_kernels: sometimes\n", "cpu_kernels"),
    ("port: 1\n", "model"),
    ("- model\n", "mapping"),
])
def test_bad_values_name_the_key(models, text, key):
    with pytest.raises(ConfigError, match=key):
        load_config(write_yaml(models / "bad.yaml", text), environ={})


def test_attention_backend_and_cpu_kernels_are_options(models):
    """The attention backend and the fused CPU ops are configuration keys (with their variables and flags);
    the kernel backend without the fused ops is an error naming both."""
    config = load_config(None, {"model": "models/target", "attention_backend": "torch"},
                         environ={"SPECSERVE_CPU_KERNELS": "0"})
    assert config.engine.attention_backend == "torch" and config.engine.cpu_kernels is False
    assert load_config(None, {"model": "models/target"}, environ={}).engine.attention_backend == "auto"
    with pytest.raises(ConfigError, match="attention_backend kernel .* cpu_kernels"):
        load_config(None, {"model": "models/target", "attention_backend": "kernel"},
                    environ={"SPECSERVE_CPU_KERNELS": "false"})


def test_bad_environment_value_names_the_variable(models):
    with pytest.raises(ConfigError, match="SPECSERVE_SPECULATIVE_CONFIG"):
        load_config(None, {"model": "models/target"}, environ={"SPECSERVE_SPECULATIVE_CONFIG": "{not json"})


def test_parse_size():
    assert parse_size(1024) == 1024 and parse_size("4GiB") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5g") == 1_500_000_000 and parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("4 parsecs")


def test_help_documents_every_option():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())
    for option in OPTIONS:
        assert option.flag_name in help_text and option.env in help_text
    for flag in ("--config", "--model", "--served-model-name", "--host", "--port", "--api-key",
                 "--speculative-config", "--dtype", "--device", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--num-kv-blocks", "--kv-cache-memory", "--block-size", "--seed",
                 "--log-level"):
        assert flag in help_text
    top = build_parser().format_help()
    for command in ("distill", "train-default", "generate", "convert-gguf", "prepare-default"):
        assert command in top


@pytest.mark.parametrize("command, module", [("distill", "train.distill"), ("train-default", "train.default"),
                                             ("generate", "train.generate"), ("convert-gguf", "engine.models.gguf"),
                                             ("prepare-default", "engine.models.prepare")])
def test_training_subcommands_forward_argv(monkeypatch, command, module):
    calls = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(main=lambda argv: calls.append(argv) or 0))
    assert main([command, "--steps", "3", "--help"]) == 0
    assert calls == [["--steps", "3", "--help"]]


def test_cli_config_error_exits_2(models, capsys):
    config_file = write_yaml(models / "bad.yaml", "model: models/target\nwhatever: 1\n")
    assert main(["serve", "--config", config_file]) == 2
    assert "whatever" in capsys.readouterr().err


def test_repository_configs_use_known_keys():
    files = sorted((REPO / "configs").glob("*.yaml"))
    for path in files:
        assert "model" in read_yaml(str(path)), path


def test_the_docs_tables_are_the_generated_ones():
    """docs/configuration.md's tables of keys are written from OPTIONS and SpeculativeConfig's fields
    (`python -m server.config_reference docs/configuration.md`), so they cannot drift from the code."""
    text = (REPO / "docs" / "configuration.md").read_text()
    assert rewrite(text) == text, "docs/configuration.md is stale: python -m server.config_reference " \
                                  "docs/configuration.md"
    tables = reference_tables()
    assert all(f"| `{option.key}`" in "".join(tables.values()) for option in OPTIONS if option.key != "speculative")
    assert "| `suffix.cache_tokens` | int | `65536` |" in tables["## Speculative keys"]
