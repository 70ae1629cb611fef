"""Weight-only bf16 / int8 linears (quantization: bf16 | int8): the C++ kernel against torch, Q8_0
round trips, the engine on them, and clear errors where they cannot serve."""
import numpy as np
import pytest
import torch
from helpers import make_tiny_checkpoint

from engine.models import streamed_linear
from engine.models.cpu_linear import cpu_has_fast_bf16
from engine.models.streamed_linear import (BLOCKED_ROWS, NATIVE_BF16_ROWS, PREFILL_ROWS, ROW_GRID, StreamedLinear,
                                           check_quantization, dequantize_int8, kernel_unavailable_reason,
                                           quantize_int8, stream_linears)
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(kernel_unavailable_reason() is not None,
                                reason=f"streamed-linear kernel: {kernel_unavailable_reason()}")


@pytest.fixture
def kernel_only(monkeypatch):
    """The kernel for every row count, also where the CPU has native bf16 (there, passes of
    NATIVE_BF16_ROWS rows and more go through oneDNN's bf16 matmul, which rounds the activations)."""
    monkeypatch.setattr(streamed_linear, "cpu_has_fast_bf16", lambda: False)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 14, 16, 17, 33, 65, PREFILL_ROWS, PREFILL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_streamed_linear_matches_torch_on_its_own_weights(fmt, rows, bias, kernel_only):
    """Every row count (the streamed 4-row tiles and their tails below 14 rows; the register blocks
    of 3 rows x 4 outputs and their tails from 14; the GEMM path past PREFILL_ROWS) and an odd
    output width (its tails, and a 32-output chunk cut short) equal F.linear on the weight the layer
    holds."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 37, bias=bias)
    layer = StreamedLinear(linear, fmt)
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, layer.dense_weight(), None if linear.bias is None else linear.bias)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        batched = layer(x.reshape(1, rows, 96))   # leading dims and a non-contiguous view pass through
        torch.testing.assert_close(batched.reshape(rows, 37), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.t().contiguous().t()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="the CPU has no native bf16")
@pytest.mark.parametrize("rows", [1, NATIVE_BF16_ROWS - 1, NATIVE_BF16_ROWS, 33, PREFILL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_bf16_passes_use_onednn_where_the_cpu_has_native_bf16(rows, bias):
    """Below NATIVE_BF16_ROWS rows the kernel computes in fp32 (decode and narrow verification);
    from there oneDNN's bf16 matmul on the packed weight, which is F.linear on the activations
    rounded to bf16; leading dimensions pass through."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 37, bias=bias)
    layer = StreamedLinear(linear, "bf16")
    assert layer.native_rows == NATIVE_BF16_ROWS and layer.packed is not None
    x = torch.randn(2, rows, 96)
    exact = torch.nn.functional.linear(x, layer.dense_weight(), linear.bias)
    rounded = torch.nn.functional.linear(x.bfloat16().float(), layer.dense_weight(), linear.bias)
    with torch.inference_mode():
        out = layer(x[0])
        out_3d = layer(x)
    assert out.dtype == torch.float32 and out_3d.shape == (2, rows, 37)
    if rows < NATIVE_BF16_ROWS:
        torch.testing.assert_close(out, exact[0], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, rounded[0], rtol=2e-2, atol=2e-2)
        assert not torch.equal(out, exact[0])   # the activations were rounded: it really took oneDNN's path
    torch.testing.assert_close(out_3d, rounded, rtol=2e-2, atol=2e-2)


def _has_avx512_bf16() -> bool:
    return kernel_unavailable_reason() is None and cpu_has_fast_bf16() and streamed_linear.cpu_kernels.extension().has_avx512_bf16()


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
def test_passes_narrower_than_exact_rows_keep_row_independent_results():
    """exact_rows (the engine passes one request's largest verification pass, 1 + its largest chain or
    tree): every pass below it stays on the kernel, so a 33-row tree pass computes each row as the
    1-row decode step would, whatever the shape's measured crossing to oneDNN."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(2 * 96, 40)
    layer = StreamedLinear(linear, "bf16", exact_rows=33)
    assert layer.native_rows >= 33
    x = torch.randn(32, 2 * 96)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.cat([layer(x[i:i + 1]) for i in range(32)]))


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, BLOCKED_ROWS - 1, BLOCKED_ROWS, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_narrow_bf16_passes_use_dot_products_where_the_cpu_has_avx512_bf16(rows, bias):
    """Below BLOCKED_ROWS rows: the blocked copy and bf16 dot products, which is F.linear on the
    activations rounded to bf16 (bf16 products are exact in fp32; only the order of the sums
    differs), and each row's result is bit for bit the one it gets alone (a verification row equals
    the decode row). From the shape's measured crossing (never below BLOCKED_ROWS): oneDNN's bf16
    matmul (its output rounded to bf16). The layer keeps no row-major copy."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(2 * 96, 40, bias=bias)
    layer = StreamedLinear(linear, "bf16")
    assert layer.blocks is not None and layer.weight is None and layer.native_rows >= BLOCKED_ROWS
    assert torch.equal(layer.dense_weight(), linear.weight.detach().bfloat16().float())
    x = torch.randn(rows, 2 * 96)
    rounded = torch.nn.functional.linear(x.bfloat16().float(), layer.dense_weight(), linear.bias)
    with torch.inference_mode():
        out = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
        out_3d = layer(x.reshape(1, rows, -1))
    tolerance = 2e-5 if rows < layer.native_rows else 2e-2   # oneDNN's output is bf16
    torch.testing.assert_close(out, rounded, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out_3d.reshape(rows, 40), rounded, rtol=tolerance, atol=tolerance)
    if rows < layer.native_rows:
        assert torch.equal(out, alone)


@pytest.mark.parametrize("native, blocked, crossing", [
    (lambda r: 200 + r, lambda r: 3 * r, 64),        # oneDNN wins from ~100 rows: the kernel up to the grid's end
    (lambda r: 100 + r, lambda r: 3 * r, 48),        # within the margin from 47 rows: the first grid size past it
    (lambda r: 1.0, lambda r: 2.0, BLOCKED_ROWS),    # oneDNN always faster: never below the floor
    (lambda r: 2.0, lambda r: 1.0, ROW_GRID[-1]),     # the kernel always faster: oneDNN past the grid
    (lambda r: 0.5 if r == 24 else 2.0 if r < 48 else 0.5, lambda r: 1.0, 48),   # one win alone is noise
    (lambda r: 1.03, lambda r: 1.0, BLOCKED_ROWS),   # level: oneDNN (the kernel must win by a margin)
])
def test_each_shape_switches_to_onednn_where_it_measured_faster(monkeypatch, native, blocked, crossing):
    """The crossing is the first grid size from which oneDNN is about as fast or faster, there and at
    the next size."""
    monkeypatch.setattr(streamed_linear, "_best_seconds", lambda linear, rows, width: linear(rows))
    assert streamed_linear._measure_crossing(native, blocked, 64) == crossing


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
def test_bf16_blocks_round_trip_and_check_their_shapes():
    kernel = streamed_linear.cpu_kernels.extension()
    weight = torch.randn(12, 64).bfloat16()
    blocks = kernel.pack_bf16_blocks(weight)
    assert blocks.shape == weight.shape and not torch.equal(blocks, weight)
    assert torch.equal(kernel.unpack_bf16_blocks(blocks), weight)
    with pytest.raises(RuntimeError, match="N % 4 == 0 and K % 32 == 0"):
        kernel.pack_bf16_blocks(torch.randn(10, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x: contiguous fp32"):
        kernel.linear_bf16_blocks(torch.randn(2, 64).bfloat16(), blocks, None)


def test_native_bf16_path_is_only_for_bf16_weights_on_native_cpus(monkeypatch):
    linear = torch.nn.Linear(64, 16)
    monkeypatch.setattr(streamed_linear, "cpu_has_fast_bf16", lambda: False)
    assert StreamedLinear(linear, "bf16").native_rows is None
    monkeypatch.setattr(streamed_linear, "cpu_has_fast_bf16", lambda: True)
    assert StreamedLinear(linear, "int8").native_rows is None


@pytest.mark.parametrize("fmt, tolerance", [("bf16", 1e-2), ("int8", 2e-2)])
def test_streamed_weights_stay_close_to_the_original(fmt, tolerance):
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 192, bias=False)
    error = (StreamedLinear(linear, fmt).dense_weight() - linear.weight).abs().max() / linear.weight.abs().max()
    assert 0 < error < tolerance


def test_bf16_activations_come_back_in_bf16():
    linear = torch.nn.Linear(64, 16)
    layer = StreamedLinear(linear, "int8")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x.float(), layer.dense_weight(), linear.bias),
                               rtol=1e-2, atol=1e-2)


def test_a_q8_0_tensor_comes_back_exactly():
    """int8 uses Q8_0's rule (per 32 weights, the largest magnitude maps to 127), so a dequantized
    Q8_0 GGUF tensor (the committed draft's format) is served with its own integers and scales."""
    from gguf import GGMLQuantizationType, quants

    weight = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    q8_0 = quants.dequantize(quants.quantize(weight, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    q, scales = quantize_int8(torch.from_numpy(q8_0))
    torch.testing.assert_close(dequantize_int8(q, scales), torch.from_numpy(q8_0), rtol=0, atol=1e-7)
    assert q.abs().amax(dim=1).eq(127).all()


def test_all_zero_groups_quantize_to_zero():
    weight = torch.zeros(4, 64)
    weight[1, 40] = 3.0
    q, scales = quantize_int8(weight)
    torch.testing.assert_close(dequantize_int8(q, scales), weight)


def test_stream_linears_swaps_every_linear_and_keeps_the_tied_embedding(tmp_path):
    from engine.models.loader import load_model

    path = make_tiny_checkpoint(tmp_path / "m", seed=0, tie_word_embeddings=True)
    model = load_model(str(path), torch.float32, torch.device("cpu"))
    embedding = model.model.embed_tokens.weight.clone()
    assert stream_linears(model, "int8") == 4 * 2 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding, rtol=0, atol=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    target = make_tiny_checkpoint(root / "target", seed=3, num_layers=2)
    draft = make_tiny_checkpoint(root / "draft", seed=4, num_layers=1)
    return str(target), str(draft)


def _greedy(model: str, prompts, **options) -> list[list[int]]:
    from engine.llm import LLM

    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, **options)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


PROMPTS = [[5, 9, 200, 17, 33], [40, 41, 42, 43, 44, 45, 46, 47] * 3, [7]]


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_engine_on_streamed_weights_decodes_like_a_model_holding_those_weights(pair, fmt, tmp_path, kernel_only):
    """The engine on int8 / bf16 linears gives the greedy tokens of plain fp32 decoding of a
    checkpoint whose weights are the ones the kernel computes with; speculation on top of it
    (draft model and n-gram) stays lossless."""
    from engine.models.loader import load_model
    from safetensors.torch import save_file

    target, draft = pair
    model = load_model(target, torch.float32, torch.device("cpu"))
    stream_linears(model, fmt)
    rounded = make_tiny_checkpoint(tmp_path / "rounded", seed=3, num_layers=2)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, StreamedLinear):
            state[f"{name}.weight"] = module.dense_weight()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    checkpoint = _hf_state(target, state)
    save_file(checkpoint, str(rounded / "model.safetensors"))

    reference = _greedy(str(rounded), PROMPTS)
    assert _greedy(target, PROMPTS, quantization=fmt) == reference
    assert _greedy(target, PROMPTS, quantization=fmt, speculative={
        "method": "draft", "draft": {"model": draft}, "num_speculative_tokens": 3}) == reference
    assert _greedy(target, PROMPTS, quantization=fmt, speculative={
        "method": "ngram", "num_speculative_tokens": 3}) == reference


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no AVX512-BF16")
def test_speculation_on_bf16_dot_products_decodes_exactly_like_plain_decoding(pair):
    """On the AVX512-BF16 path a row's result does not depend on its pass (below BLOCKED_ROWS rows),
    so greedy speculation gives plain decoding's tokens exactly, although activations are rounded
    to bf16: three requests verifying up to 3 drafts each stay below 16 rows."""
    from engine.llm import LLM

    target, draft = pair
    llm = LLM(target, dtype="float32", quantization="bf16", skip_tokenizer_init=True)
    layers = [m for m in llm.engine.target.model.modules() if isinstance(m, StreamedLinear)]
    assert layers and all(m.blocks is not None for m in layers)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = [out.token_ids for out in llm.generate(PROMPTS, params)]
    for speculative in ({"method": "draft", "draft": {"model": draft}, "num_speculative_tokens": 3},
                        {"method": "ngram", "num_speculative_tokens": 3}):
        assert _greedy(target, PROMPTS, quantization="bf16", speculative=speculative) == reference


def _hf_state(path: str, replaced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` with the fused linears' rows (qkv, gate_up) replaced from `replaced`."""
    from safetensors.torch import load_file

    from engine.models.loader import load_model

    state = load_file(f"{path}/model.safetensors")
    model = load_model(path, torch.float32, torch.device("meta"))
    for name, module in model.named_modules():
        weight = replaced.get(f"{name}.weight")
        if weight is None:
            continue
        if not hasattr(module, "shards"):
            state[f"{name}.weight"] = weight
            continue
        parent = name.rsplit(".", 1)[0]
        for shard, offset, rows in module.shards():
            state[f"{parent}.{shard}.weight"] = weight[offset:offset + rows].contiguous()
    return state


def test_quantization_errors_name_the_problem(pair, monkeypatch):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of auto, none, bf16, int8, gguf, got 'int4'"):
        EngineConfig(model=pair[0], quantization="int4")
    for name in ("int8", "gguf"):
        with pytest.raises(ValueError, match="CPU weight format; this engine runs on cuda"):
            check_quantization(name, torch.device("cuda"))
    check_quantization("none", torch.device("cuda"))
    monkeypatch.setattr(streamed_linear, "kernel_unavailable_reason", lambda: "this CPU lacks avx2")
    with pytest.raises(ValueError, match="quantization 'bf16' is not available: this CPU lacks avx2"):
        check_quantization("bf16", torch.device("cpu"))


def test_quantization_auto_serves_bf16_weights_where_dtype_auto_falls_back_to_fp32(monkeypatch):
    from engine import setup

    cpu, fp32 = torch.device("cpu"), torch.float32
    assert setup.resolve_quantization("auto", "auto", fp32, cpu) == "bf16"
    assert setup.resolve_quantization("auto", "float32", fp32, cpu) == "none"     # fp32 asked for by name
    assert setup.resolve_quantization("auto", "auto", torch.bfloat16, cpu) == "none"   # native bf16
    assert setup.resolve_quantization("auto", "auto", torch.bfloat16, torch.device("cuda")) == "none"
    assert setup.resolve_quantization("int8", "float32", fp32, cpu) == "int8"
    monkeypatch.setattr(setup, "kernel_unavailable_reason", lambda: "no compiler")
    assert setup.resolve_quantization("auto", "auto", fp32, cpu) == "none"   # falls back, with a warning


def test_dtype_auto_computes_in_fp32_over_bf16_weights_on_cpus(monkeypatch, tmp_path):
    """dtype auto on a CPU: fp32 over bf16 weights wherever the kernels run (also with native bf16,
    where the kernel decodes faster than oneDNN's bf16 linear) unless quantization none asks for
    the model's own weights, or the weights held twice would crowd memory; native bf16 then, where
    the CPU has it."""
    from engine import setup

    cpu, fp32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(setup, "_memory_bytes", lambda: 8000)
    for native in (False, True):
        monkeypatch.setattr(setup, "cpu_has_fast_bf16", lambda: native)
        assert setup.resolve_dtype("auto", None, cpu, "auto", str(tmp_path)) == fp32
        assert setup.resolve_dtype("auto", None, cpu, "bf16", str(tmp_path)) == fp32
        assert setup.resolve_dtype("auto", None, cpu, "int8", str(tmp_path)) == fp32
        assert setup.resolve_dtype("auto", None, cpu, "none", str(tmp_path)) == (bf16 if native else fp32)
        assert setup.resolve_dtype("bfloat16", None, cpu, "auto", str(tmp_path)) == bf16
    monkeypatch.setattr(setup, "_memory_bytes", lambda: 3999)   # twice the weights past half of it
    assert setup.resolve_dtype("auto", None, cpu, "auto", str(tmp_path)) == bf16
    assert setup.resolve_dtype("auto", None, cpu, "int8", str(tmp_path)) == fp32   # no packed copy
    monkeypatch.setattr(setup, "cpu_has_fast_bf16", lambda: False)
    assert setup.resolve_dtype("auto", None, cpu, "auto", str(tmp_path)) == fp32   # one copy of bf16 weights
    monkeypatch.setattr(setup, "kernel_unavailable_reason", lambda: "no compiler")
    monkeypatch.setattr(setup, "cpu_has_fast_bf16", lambda: True)
    assert setup.resolve_dtype("auto", None, cpu, "auto", str(tmp_path)) == bf16


def test_server_option_reaches_the_engine(pair, tmp_path):
    from server.config import load_config

    config_file = tmp_path / "c.yaml"
    config_file.write_text(f"model: {pair[0]}\nquantization: int8\n")
    assert load_config(str(config_file), environ={}).engine.quantization == "int8"
    assert load_config(str(config_file), environ={"SPECSERVE_QUANTIZATION": "bf16"}).engine.quantization == "bf16"
    with pytest.raises(ValueError, match="quantization"):
        load_config(str(config_file), {"quantization": "q4"}, environ={})
