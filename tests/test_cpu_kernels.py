"""The fused CPU ops (engine/csrc/decode_ops.cpp) against torch's, and the engine on them: same logits,
same greedy text, turned on only where they apply. The attention kernel's own checks are in
test_attention.py."""
import pytest
import torch
from helpers import make_tiny_checkpoint

from engine import cpu_kernels
from engine.models.llama import MLP, RMSNorm, rms_norm
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def ops():
    return cpu_kernels.extension()


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(ops, rows, with_residual):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.randn(576)
    normed, total = ops.add_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    expected_total = x + residual if with_residual else x
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    expected = rms_norm(expected_total, weight, torch.tensor(1e-5), 1 / 576)
    torch.testing.assert_close(normed, expected, rtol=2e-6, atol=2e-6)


def test_silu_mul_matches_torch_over_the_whole_range(ops):
    gate = torch.cat((torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, -87.5])))
    gate = gate[: len(gate) // 8 * 8].reshape(-1, 8).repeat(1, 2)   # rows of 16 gates
    up = torch.randn_like(gate)
    gate_up = torch.cat((gate, up), dim=1).contiguous()
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate_up), expected, rtol=1e-6, atol=1e-30)


def test_bad_inputs_name_the_problem(ops):
    with pytest.raises(RuntimeError, match=r"x: contiguous fp32 \[T, H\]"):
        ops.add_rms_norm(torch.randn(2, 64, dtype=torch.bfloat16), None, torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="weight: fp32"):
        ops.add_rms_norm(torch.randn(2, 64), None, torch.randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="width must be a multiple of 8"):
        ops.silu_mul(torch.randn(2, 20))
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        ops.rope_paged_attention(torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.ones(1, 8), torch.zeros(1, 8),
                                 torch.zeros(2, 1, 16, 1, 8), torch.zeros(1, dtype=torch.long),
                                 torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                 torch.zeros(1, 1, dtype=torch.int32), 1, 1.0, 0)


def test_usable_only_in_fp32_on_cpu():
    assert cpu_kernels.fused_ops_usable(torch.device("cpu"), torch.float32)
    assert not cpu_kernels.fused_ops_usable(torch.device("cpu"), torch.bfloat16)
    assert not cpu_kernels.fused_ops_usable(torch.device("cuda"), torch.float32)
    assert not cpu_kernels.fused_ops_usable(torch.device("cpu"), torch.float32, enabled=False)   # cpu_kernels: false


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused") / "m", seed=3, hidden_size=128,
                                num_heads=4, num_kv_heads=2, intermediate_size=128)


def _llm(path, fused: bool, **kwargs):
    from engine import LLM

    return LLM(path, dtype="float32", skip_tokenizer_init=True, cpu_kernels=fused, **kwargs)


def test_engine_on_fused_ops_matches_torch_ops(checkpoint):
    """The same greedy tokens and (nearly) the same logprobs with the fused ops as with torch's, over a
    prefill (torch attention) and decode steps (the kernel), for a batch of unequal prompts."""
    fused, reference = _llm(checkpoint, True), _llm(checkpoint, False)
    model = fused.engine.target.model
    assert fused.engine.target.fused_ops and not reference.engine.target.fused_ops
    assert fused.engine.target.attention.name == "kernel" and reference.engine.target.attention.name == "torch"
    assert all(m.kernels is not None for m in model.modules() if isinstance(m, (RMSNorm, MLP)))
    prompts = [[5, 6, 7] * k for k in (1, 4, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    for a, b in zip(fused.generate(prompts, params), reference.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in a.logprobs]),
                                   torch.tensor([t.logprob for t in b.logprobs]), rtol=1e-4, atol=1e-4)


def test_speculative_greedy_on_fused_ops_equals_plain(checkpoint):
    """Verification rows go through the kernel too: n-gram speculation decodes what plain decoding does."""
    plain = _llm(checkpoint, True)
    speculative = _llm(checkpoint, True, speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                      "adaptive": False})
    prompts = [[9, 10, 11, 12] * 6, [40, 41] * 20]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in speculative.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


def test_a_failed_build_turns_the_ops_off_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "their C++ code did not build (no compiler)")
    with caplog.at_level("WARNING", logger="specserve.engine"):
        assert not cpu_kernels.fused_ops_usable(torch.device("cpu"), torch.float32)
    assert "fused CPU ops are off" in caplog.text and "no compiler" in caplog.text
