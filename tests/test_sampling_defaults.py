"""Per-model sampling defaults: the sampling fields a request leaves unset take the model's
generation_config.json values (as vLLM applies them), then the config's `sampling_defaults`; a
request's own value always wins. A GGUF file carries none, so the coder pair's config names
Qwen's. Bad defaults are a config error naming the field or the file, before the server starts."""
from __future__ import annotations

import json
import shutil

import pytest

from server.config import ConfigError, load_config


def checkpoint(tmp_path):
    """A directory the config takes as a checkpoint (nothing loads it here)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_defaults_come_from_the_model_then_the_config(tmp_path):
    model = checkpoint(tmp_path)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50}))
    assert load_config(None, {"model": str(model)}, environ={}).sampling_defaults == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 50}
    flags = {"model": str(model), "sampling_defaults": '{"temperature": 0.2, "min_p": 0.05}'}
    assert load_config(None, flags, environ={}).sampling_defaults == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 50, "min_p": 0.05}
    environ = {"SPECSERVE_SAMPLING_DEFAULTS": '{"top_k": 20}'}
    assert load_config(None, {"model": str(model)}, environ=environ).sampling_defaults["top_k"] == 20

    (model / "generation_config.json").write_text(json.dumps({"temperature": -3}))
    with pytest.raises(ConfigError, match="generation_config.json.*temperature"):
        load_config(None, {"model": str(model)}, environ={})


@pytest.mark.parametrize("value, message", [
    ('{"temperature": 500}', "temperature must be in"),
    ('{"seed": 1}', "seed: not a sampling field"),
    ('{"top_k": "many"}', "top_k"),
    ("[0.7]", "expected a mapping"),
])
def test_bad_defaults_name_the_field(tmp_path, value, message):
    with pytest.raises(ConfigError, match=f"sampling_defaults.*{message}"):
        load_config(None, {"model": str(checkpoint(tmp_path)), "sampling_defaults": value}, environ={})


def test_the_coder_pair_config_samples_as_qwen_recommends(tmp_path):
    """The config file as shipped, its two GGUF paths pointed at stand-in checkpoints: a clean
    checkout has not fetched the models."""
    text = open("configs/qwen2.5-coder-1.5b.yaml").read()
    stand_in = str(checkpoint(tmp_path))
    for gguf in ("qwen2.5-coder-1.5b-instruct.gguf", "qwen2.5-coder-0.5b-instruct.gguf"):
        assert f".cache/models/{gguf}" in text
        text = text.replace(f".cache/models/{gguf}", stand_in)
    (tmp_path / "coder.yaml").write_text(text)
    config = load_config(str(tmp_path / "coder.yaml"), {}, environ={})
    assert config.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_a_request_that_sets_no_temperature_takes_the_default(tiny_pair, tmp_path):
    """Served with temperature 0 as the default: unset means greedy whatever the seed, and a request's
    own temperature still samples."""
    import openai
    import torch
    from conftest import InProcessServer

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    config = load_config(None, {"model": str(target)}, environ={})
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu"))
    app = create_app(engine, load_tokenizer(str(target)), "tiny", sampling_defaults=config.sampling_defaults)
    with InProcessServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12}
        unset = {client.completions.create(**ask, seed=seed).choices[0].text for seed in range(3)}
        greedy = client.completions.create(**ask, temperature=0.0).choices[0].text
        assert unset == {greedy}
        sampled = {client.completions.create(**ask, temperature=1.0, seed=seed).choices[0].text for seed in range(4)}
        assert len(sampled) >= 3
