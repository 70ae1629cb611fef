"""Linears over GGUF blocks (engine/models/gguf_linear.py, engine/csrc/gguf_linear.cpp): the repack is exact,
each path (AVX512-VNNI where the CPU has it, and the portable loop) computes the dequantized weight times
the int8-rounded rows to fp32 rounding, rows do not depend on their pass, and a model served from its
blocks decodes the tokens of the same model dequantized."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.models.gguf_linear import KERNEL_TYPES, GGUFLinear, vnni_available
from engine.models.loader import load_model, special_token_ids
from helpers import make_tiny_checkpoint
from test_gguf import PROMPT, to_gguf

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
PATHS = [pytest.param(False, marks=pytest.mark.skipif(not vnni_available(), reason="no AVX512-VNNI")), True]
T = gguf.GGMLQuantizationType


def kernels():
    return cpu_kernels.extension()


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of `type_name` (uint8 [rows, bytes a row]): quantized Gaussian weights where gguf-py can
    quantize the type, else random codes with small fp16 scales (gguf-py cannot write K-quants)."""
    rng = np.random.default_rng(seed)
    kind = T[type_name]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // block, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[..., 208:210] = scales[..., :2]   # d is the block's last field
    else:                                    # Q4_K: d and dmin first
        raw[..., 0:4] = scales.reshape(rows, cols // block, 4)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, T[type_name]).reshape(rows, cols).astype(np.float32))


def int8_exact_rows(rows: int, cols: int) -> torch.Tensor:
    """Rows that int8 per 32 values holds exactly (integers times a scale, each group reaching 127), so
    the kernel's result is the dequantized weight times these very rows; other rows differ from the
    float matmul by where their values round (checked against a tolerance below)."""
    q = torch.randint(-127, 128, (rows, cols // 32, 32))
    q[..., 0] = 127 * torch.sign(torch.randn(rows, cols // 32))
    scale = torch.rand(rows, cols // 32, 1) * 0.1 + 0.01
    return (q * scale).reshape(rows, cols)


@pytest.mark.parametrize("type_name", sorted(KERNEL_TYPES))
def test_repack_holds_the_files_weights_exactly(type_name):
    rows, cols = 37, 512   # rows not a multiple of the 16-output tile
    raw = random_blocks(type_name, rows, cols)
    tiles = kernels().gguf_repack(torch.from_numpy(raw), KERNEL_TYPES[type_name], cols)
    back = kernels().gguf_dequantize_tiles(tiles, KERNEL_TYPES[type_name], rows, cols)
    assert torch.equal(back, dequantized(raw, type_name, rows, cols))
    file_bytes = raw.nbytes
    assert tiles.numel() <= file_bytes * 1.1 * 48 / 37   # the file's bytes (rows padded to 48), not a float copy


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("type_name", sorted(KERNEL_TYPES))
def test_kernel_is_the_dequantized_matmul_on_int8_rows(type_name, portable):
    rows, cols = 37, 512
    raw = random_blocks(type_name, rows, cols, seed=1)
    weight = dequantized(raw, type_name, rows, cols)
    tiles = kernels().gguf_repack(torch.from_numpy(raw), KERNEL_TYPES[type_name], cols)
    x, bias = int8_exact_rows(9, cols), torch.randn(rows)
    got = kernels().gguf_linear(x, [tiles], [KERNEL_TYPES[type_name]], [rows], bias, portable)
    expected = x.double() @ weight.double().T + bias.double()
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    # Any rows: close to the float matmul (int8 rows lose ~0.5%, as llama.cpp's activations do)
    y = torch.randn(9, cols)
    got = kernels().gguf_linear(y, [tiles], [KERNEL_TYPES[type_name]], [rows], bias, portable)
    assert (got - (y @ weight.T + bias)).abs().max() <= 0.02 * (y @ weight.T).abs().max()
    for i in (0, 4, 8):   # a row alone, bit for bit as in its pass: verification equals decoding
        alone = kernels().gguf_linear(y[i:i + 1].contiguous(), [tiles], [KERNEL_TYPES[type_name]], [rows], bias, portable)
        assert torch.equal(alone[0], got[i])


@pytest.mark.parametrize("portable", PATHS)
def test_parts_of_different_types_fill_their_own_columns(portable):
    """A fused q/k/v whose v is Q6_K and q/k Q4_K (as Q4_K_M files store some layers)."""
    cols, sizes, types = 256, [48, 16, 16], ["Q4_K", "Q4_K", "Q6_K"]
    raws = [random_blocks(t, n, cols, seed=i) for i, (t, n) in enumerate(zip(types, sizes))]
    tiles = [kernels().gguf_repack(torch.from_numpy(r), KERNEL_TYPES[t], cols) for r, t in zip(raws, types)]
    ids = [KERNEL_TYPES[t] for t in types]
    x = torch.randn(3, cols)
    fused = kernels().gguf_linear(x, tiles, ids, sizes, None, portable)
    apart = torch.cat([kernels().gguf_linear(x, [t], [i], [n], None, portable) for t, i, n in zip(tiles, ids, sizes)], 1)
    assert torch.equal(fused, apart)


def test_mismatched_tiles_are_an_error_naming_the_part():
    raw = random_blocks("Q8_0", 16, 64)
    tiles = kernels().gguf_repack(torch.from_numpy(raw), KERNEL_TYPES["Q8_0"], 64)
    with pytest.raises(RuntimeError, match="part 0"):
        kernels().gguf_linear(torch.randn(1, 128), [tiles], [KERNEL_TYPES["Q8_0"]], [16], None, True)
    with pytest.raises(RuntimeError, match="no kernel"):
        kernels().gguf_repack(torch.from_numpy(raw), 1, 64)   # F16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf_linear") / "qwen2", arch="qwen2")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_model_from_blocks_decodes_the_dequantized_models_tokens(qwen, tmp_path, qtype):
    path = to_gguf(qwen, tmp_path / "model.gguf", qtype)
    model = load_model(str(path), torch.float32, torch.device("cpu"), gguf_blocks=True)
    served = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(served) == 2 * 4 + 1   # per layer qkv, o, gate/up, down; and the (tied) LM head
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None   # qwen2's biases still load
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    blocks = LLM(str(path), quantization="gguf").generate([PROMPT], params)[0]
    dense = LLM(str(path), dtype="float32", quantization="none").generate([PROMPT], params)[0]
    assert blocks.token_ids == dense.token_ids


def test_quantization_auto_serves_a_quantized_gguf_from_its_blocks_where_vnni_runs(qwen, tmp_path, monkeypatch):
    from engine import setup

    cpu, fp32 = torch.device("cpu"), torch.float32
    quantized, dense = to_gguf(qwen, tmp_path / "q.gguf", "Q8_0"), to_gguf(qwen, tmp_path / "f.gguf", "F32")
    expected = "gguf" if vnni_available() else "bf16"
    assert setup.resolve_quantization("auto", "auto", fp32, cpu, str(quantized)) == expected
    assert setup.resolve_quantization("auto", "auto", fp32, cpu, str(dense)) == "bf16"   # nothing to serve as blocks
    assert setup.resolve_quantization("auto", "auto", fp32, cpu, str(qwen)) == "bf16"
    monkeypatch.setattr(setup.gguf_linear, "vnni_available", lambda: False)   # the portable loop is slower than bf16
    assert setup.resolve_quantization("auto", "auto", fp32, cpu, str(quantized)) == "bf16"


def test_a_safetensors_model_under_gguf_serves_its_linears_as_bf16(qwen):
    llm = LLM(str(qwen), quantization="gguf")
    assert llm.engine.quantization == "gguf"
    assert not any(isinstance(m, GGUFLinear) for m in llm.engine.target.model.modules())
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("quantization", ["gguf", "auto"])
def test_a_draft_vocabulary_keeps_greedy_decoding_exact(qwen, tmp_path, quantization):
    """`speculative.draft.vocab`: the draft's LM head over the first N ids and the special tokens only
    (from its GGUF blocks under gguf, a dense row subset otherwise); tokens outside get no mass."""
    draft = to_gguf(qwen, tmp_path / "draft.gguf", "Q8_0")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(qwen), quantization=quantization).generate([PROMPT], params)[0]
    spec = {"method": "draft", "draft": {"model": str(draft), "vocab": 100}, "num_speculative_tokens": 4,
            "adaptive": False}
    llm = LLM(str(qwen), quantization=quantization, speculative=spec)
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == plain.token_ids and out.spec.proposed > 0
    head = llm.engine.spec.router.proposers["draft"].runner.model
    specials = special_token_ids(draft)   # the tiny tokenizer's: 256 and up, after the bytes
    assert specials and min(specials) >= 256
    assert head.output_tokens.tolist() == list(range(100)) + specials
    logits = head.compute_logits(torch.randn(2, head.config.hidden_size))
    assert logits.shape == (2, head.vocab_size)
    assert torch.isinf(logits[:, 100:256]).all() and torch.isfinite(logits[:, head.output_tokens]).all()


def test_a_bad_draft_vocabulary_is_an_error_naming_it():
    from engine.config import SpeculativeConfig

    for bad in (0, -5, True, "32k"):
        with pytest.raises(ValueError, match="speculative.draft.vocab"):
            SpeculativeConfig(method="ngram", draft={"vocab": bad})


@pytest.mark.parametrize("draft_format", ["safetensors", "gguf"])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_a_requantized_draft_keeps_greedy_decoding_exact(qwen, tmp_path, draft_format, qtype):
    """`speculative.draft.quantization`: the draft's linears quantized at load (from a dense checkpoint or a
    GGUF file's dequantized blocks) and served by the GGUF kernels; the output is the target's."""
    draft = qwen if draft_format == "safetensors" else to_gguf(qwen, tmp_path / "draft.gguf", "Q8_0")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(str(qwen), quantization="none").generate([PROMPT], params)[0]
    spec = {"method": "draft", "draft": {"model": str(draft), "quantization": qtype, "vocab": 256},
            "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(qwen), quantization="none", speculative=spec)
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == plain.token_ids and out.spec.proposed > 0 and out.spec.accepted > 0
    model = llm.engine.spec.router.proposers["draft"].runner.model
    served = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(served) == 2 * 4 + 1 and {p.type_name for m in served for p in m.parts} == {qtype.upper()}
    assert model.lm_head.out_features == len(model.output_tokens)   # the draft vocabulary's rows of the blocks
    assert not any(isinstance(m, GGUFLinear) for m in llm.engine.target.model.modules())   # the target as asked


def test_quantize_blocks_is_ggufs_quantizer():
    from engine.models.gguf_linear import quantize_blocks

    weight = torch.randn(48, 64)
    for type_name in ("Q4_0", "Q8_0"):
        blocks = quantize_blocks(weight, type_name)
        assert blocks.dtype == torch.uint8 and blocks.shape[0] == 48
        back = dequantized(blocks.numpy(), type_name, 48, 64)
        assert (back - weight).abs().max() < (0.2 if type_name == "Q4_0" else 0.02) * weight.abs().max()


def test_a_bad_draft_quantization_is_an_error_naming_it():
    from engine.config import SpeculativeConfig

    for bad in ("q4_k", "int8", 4):
        with pytest.raises(ValueError, match="speculative.draft.quantization must be one of"):
            SpeculativeConfig(method="ngram", draft={"quantization": bad})
    with pytest.raises(ValueError, match="needs the draft proposer"):
        SpeculativeConfig(method="ngram", draft={"quantization": "q4_0"})
