"""GGUF checkpoints: tiny files written here with the `gguf` writer load strictly, equal the
safetensors path (exactly in F32, to the quantization's own rounding otherwise), carry their
tokenizer and chat template, convert to a safetensors directory, and serve through the engine."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.gguf import GGUFCheckpoint, find_gguf, permute_rotary, unpermute_rotary
from engine.models.gguf_writer import write_gguf
from engine.models.loader import load_hf_config, load_model
from helpers import make_tiny_checkpoint
from engine.tokenizer import load_tokenizer

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66]


def hf_state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def to_gguf(checkpoint, out, qtype="F32", drop=()):
    """Our writer over a tiny safetensors checkpoint (optionally without some tensors)."""
    from transformers import PreTrainedTokenizerFast

    config = load_hf_config(checkpoint)
    state = {k: v for k, v in hf_state(checkpoint).items() if k not in drop}
    # The tokenizer class as saved (AutoTokenizer would pick Qwen2Tokenizer for a qwen config, which adds a token).
    write_gguf(out, state, config, PreTrainedTokenizerFast.from_pretrained(checkpoint), qtype)
    return out


def logits(path, dtype=torch.float32) -> torch.Tensor:
    from engine.attention_backends import TorchBackend
    from engine.attention_metadata import PassLayout

    model = load_model(str(path), dtype, torch.device("cpu"))
    caches = [torch.zeros(2, 4, 16, model.num_kv_heads, model.head_dim) for _ in range(model.num_layers)]
    meta = TorchBackend(16, torch.device("cpu")).build(PassLayout([len(PROMPT)], [len(PROMPT)], [[0, 1]]))
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, caches)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf") / "llama", arch="llama", num_heads=4,
                                num_kv_heads=2, tie_word_embeddings=True)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                             ("qwen2", {}), ("qwen3", {})])
def test_f32_gguf_equals_the_safetensors_checkpoint(tmp_path, arch, overrides):
    checkpoint = make_tiny_checkpoint(tmp_path / arch, arch=arch, **overrides)
    path = to_gguf(checkpoint, tmp_path / "model.gguf")
    expected, got = logits(checkpoint), logits(path)
    assert torch.equal(expected, got)
    config, original = load_hf_config(path), load_hf_config(checkpoint)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        assert getattr(config, key) == getattr(original, key), key
    assert config.architectures == original.architectures


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_gguf_loads_the_dequantized_weights(llama, tmp_path, qtype):
    path = to_gguf(llama, tmp_path / "model.gguf", qtype)
    model = load_model(str(path), torch.float32, torch.device("cpu"))
    original = hf_state(llama)["model.layers.1.mlp.down_proj.weight"].numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    expected = gguf.quants.dequantize(gguf.quants.quantize(original, kind), kind)
    down = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, torch.from_numpy(expected.reshape(down.shape)))
    q_rows = hf_state(llama)["model.layers.0.self_attn.q_proj.weight"].numpy()   # permuted and back
    expected_q = gguf.quants.dequantize(gguf.quants.quantize(permute_rotary(q_rows, 4), kind), kind)
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[:q_rows.shape[0]],
                       torch.from_numpy(unpermute_rotary(expected_q.reshape(q_rows.shape), 4)))
    tolerance = {"Q8_0": 0.05, "F16": 0.01, "BF16": 0.05}.get(qtype, 0.5)
    assert (logits(path) - logits(llama)).abs().max() < tolerance


def test_k_quant_tensors_dequantize_through_the_same_path(llama, tmp_path):
    """gguf-py cannot write K-quants; raw Q4_K blocks (random codes, small scales) read back as gguf's own
    dequantization, in the [out, in] layout."""
    config = load_hf_config(llama)
    state = hf_state(llama)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    path = tmp_path / "plain.gguf"
    to_gguf(llama, path)
    source = GGUFCheckpoint(path)
    for key, field in source.reader.fields.items():
        if key.startswith(("llama.", "tokenizer.")) and key != "llama.vocab_size":
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    rows, cols = state["model.layers.0.mlp.down_proj.weight"].shape[0], 256
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // 256 * 144), dtype=np.uint8)
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = GGUFCheckpoint(tmp_path / "k.gguf")
    got = checkpoint.tensor("blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert got.shape == (rows, cols) and torch.equal(got, torch.from_numpy(expected))
    assert config.hidden_size == 64


def test_tokenizer_and_chat_template_come_from_the_file(llama, tmp_path):
    path = to_gguf(llama, tmp_path / "model.gguf")
    ours, original = load_tokenizer(str(path)), load_tokenizer(str(llama))
    text = "Hello, wörld! <|im_start|>user\n12345 日本</s>"
    assert ours.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == original.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)


def test_a_directory_holding_one_gguf_is_a_model(llama, tmp_path):
    (tmp_path / "dir").mkdir()
    to_gguf(llama, tmp_path / "dir" / "model.gguf")
    assert find_gguf(tmp_path / "dir") == tmp_path / "dir" / "model.gguf"
    assert find_gguf(llama) is None   # a checkpoint directory with config.json stays one
    to_gguf(llama, tmp_path / "dir" / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        find_gguf(tmp_path / "dir")


def test_missing_tensor_is_an_error_naming_it(llama, tmp_path):
    path = to_gguf(llama, tmp_path / "model.gguf", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_unsupported_architecture_is_an_error_naming_it(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        load_hf_config(tmp_path / "m.gguf")


def test_unknown_tensor_is_an_error_naming_it(llama, tmp_path):
    path = to_gguf(llama, tmp_path / "model.gguf")
    checkpoint = GGUFCheckpoint(path)
    checkpoint._tensors["blk.0.ssm_conv1d.weight"] = checkpoint._tensors["output_norm.weight"]
    with pytest.raises(ValueError, match="'blk.0.ssm_conv1d.weight' has no place"):
        checkpoint.tensor_names()


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        load_hf_config(tmp_path / "bad.gguf")


def test_convert_gguf_writes_an_equal_checkpoint_directory(llama, tmp_path):
    from server.cli import main

    path = to_gguf(llama, tmp_path / "model.gguf", "Q8_0")
    assert main(["convert-gguf", str(path), str(tmp_path / "converted")]) == 0
    converted = tmp_path / "converted"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (converted / name).exists(), name
    assert torch.equal(logits(converted), logits(path))
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == \
        load_hf_config(llama).eos_token_id


def test_engine_serves_a_gguf_file_like_its_checkpoint(llama, tmp_path):
    path = to_gguf(llama, tmp_path / "model.gguf")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [LLM(str(model), dtype="float32").generate([PROMPT], params)[0] for model in (llama, path)]
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[0].text == outputs[1].text


def test_gguf_and_hf_names_are_inverse():
    from engine.models.gguf import gguf_name, hf_name

    for name in ("token_embd.weight", "output.weight", "output_norm.weight", "blk.3.attn_q.bias",
                 "blk.12.ffn_down.weight", "blk.0.attn_k_norm.weight"):
        assert gguf_name(hf_name(name)) == name
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.weight' has no GGUF name"):
        gguf_name("model.layers.0.mlp.experts.weight")
