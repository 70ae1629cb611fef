"""The `speculative` mapping: per-proposer sections (draft, ngram, suffix), the flat keys of the previous
release accepted with a deprecation warning, and the errors that name a conflicting or unknown key."""
from __future__ import annotations

import json
import logging

import pytest

from engine.config import DraftConfig, NgramConfig, SpeculativeConfig, SuffixConfig
from server.config import ConfigError, load_config


@pytest.fixture
def draft(tmp_path) -> str:
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")   # all the config checks of a checkpoint
    return str(tmp_path / "draft")


def flat_and_nested(draft: str) -> tuple[dict, dict]:
    """Every flat key of the previous release with a value, and the same settings in the nested form."""
    flat = {"model": draft, "head": "heads/eagle", "dtype": "float32", "quantization": "q8_0", "draft_vocab": 100,
            "draft_temperature": 0.5, "draft_p_min": 0.2, "ngram_min": 2, "ngram_max": 3, "suffix_max_match": 10,
            "suffix_cache_tokens": 5, "suffix_min_prob": 0.3, "suffix_min_score": 3, "suffix_spec_factor": 2.0}
    nested = {"p_min": 0.2,
              "draft": {"model": draft, "head": "heads/eagle", "dtype": "float32", "quantization": "q8_0",
                        "vocab": 100, "temperature": 0.5},
              "ngram": {"min": 2, "max": 3},
              "suffix": {"max_match": 10, "cache_tokens": 5, "min_prob": 0.3, "min_score": 3, "spec_factor": 2.0}}
    return flat, nested


def test_flat_keys_give_the_nested_config_with_one_warning_each(draft, caplog):
    flat, nested = flat_and_nested(draft)
    common = {"method": "auto", "proposers": ["draft", "ngram", "suffix"], "num_speculative_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        from_flat = SpeculativeConfig.from_any({**common, **flat})
    from_nested = SpeculativeConfig.from_any({**common, **nested})
    assert from_flat == from_nested
    assert from_nested.draft == DraftConfig(draft, "heads/eagle", "float32", "q8_0", 100, 0.5)
    assert (from_nested.ngram, from_nested.p_min) == (NgramConfig(min=2, max=3), 0.2)
    assert from_nested.suffix == SuffixConfig(10, 5, 0.3, 3, 2.0)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == len(flat)
    assert "speculative.ngram_max is deprecated" in "\n".join(warnings)
    assert all(any(f"speculative.{key} " in w for w in warnings) for key in flat)
    assert any("write speculative.suffix.spec_factor" in w for w in warnings)
    assert any("speculative.draft_p_min" in w and "write speculative.p_min" in w for w in warnings)


def test_sections_take_their_dataclasses_or_mappings():
    assert SpeculativeConfig(method="ngram", ngram={"max": 3}) == SpeculativeConfig(method="ngram",
                                                                                    ngram=NgramConfig(max=3))
    assert SpeculativeConfig.from_any({"method": "ngram", "ngram": None}).ngram == NgramConfig()
    assert SpeculativeConfig().suffix.cache_tokens == 1 << 16


@pytest.mark.parametrize("value, message", [
    ({"ngram_max": 3, "ngram": {"max": 4}}, "speculative.ngram_max and speculative.ngram.max both given"),
    ({"draft_p_min": 0.1, "p_min": 0.2}, "speculative.draft_p_min and speculative.p_min both given"),
    ({"ngram": {"max": 3, "longest": 5}}, r"unknown key in speculative.ngram: longest \(known: min, max\)"),
    ({"draft": {"path": "x"}}, "unknown key in speculative.draft: path"),
    ({"suffix": [1]}, "speculative.suffix must be a mapping"),
    ({"gama": 4}, r"unknown speculative config keys: \['gama'\]"),
])
def test_conflicts_and_unknown_keys_are_errors_naming_them(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_any({"method": "ngram", **value})


def test_checks_apply_to_the_proposers_in_use():
    with pytest.raises(ValueError, match=r"speculative.ngram.min <= speculative.ngram.max, got 3, 2"):
        SpeculativeConfig(method="ngram", ngram={"min": 3, "max": 2})
    with pytest.raises(ValueError, match="speculative.p_min must be in"):
        SpeculativeConfig(method="ngram", p_min=2.0)
    with pytest.raises(ValueError, match="speculative.draft.model"):
        SpeculativeConfig(method="draft")
    SpeculativeConfig(method="ngram", suffix={"max_match": 0})   # suffix is not in use: not validated


def test_sources_nest_their_flat_keys_then_merge_section_by_section(draft, tmp_path, caplog):
    config_file = tmp_path / "flat.yaml"
    config_file.write_text(f"model: {draft}\nspeculative:\n  method: auto\n  model: {draft}\n  ngram_max: 3\n"
                           "  suffix: {min_score: 4}\n")
    env = {"SPECSERVE_SPECULATIVE_CONFIG": json.dumps({"ngram": {"min": 2}, "suffix_max_match": 12})}
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        spec = load_config(str(config_file), {"speculative": '{"draft": {"temperature": 0.4}}'},
                           environ=env).engine.speculative
    assert spec.draft == DraftConfig(model=draft, temperature=0.4)
    assert spec.ngram == NgramConfig(min=2, max=3) and (spec.suffix.min_score, spec.suffix.max_match) == (4, 12)
    assert len(caplog.records) == 3   # model, ngram_max, suffix_max_match
    config_file.write_text(f"model: {draft}\nspeculative:\n  ngram_max: 3\n  ngram: {{max: 4}}\n")
    with pytest.raises(ConfigError, match=f"{config_file}: .*speculative.ngram_max and speculative.ngram.max"):
        load_config(str(config_file), environ={})
