"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss): the block against a per-token reference and
transformers' own, model parity with transformers (fp32, tiny random checkpoints with 8 experts,
top-2), both checkpoint layouts loaded strictly, greedy generation and speculative decoding
lossless, sampled speculation in the target's distribution, and one server round trip."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.models import load_model
from engine.models.moe import (HUB_NAMES, Experts, GptOssMoeBlock, SparseMoeBlock, grouped_mm_usable,
                               is_sparse_layer)
from helpers import make_tiny_checkpoint, run_requests
from test_models import CPU, TOL, copy_checkpoint, load_pair, logits_of, random_tokens
# The parity tests of test_models.py, run again here on this module's MoE `pair` fixture.
from test_models import test_batched_ragged, test_chunked_prefill, test_prefill_then_decode  # noqa: F401

INIT = 0.1   # initializer_range: experts large enough that a wrong routing shows in the logits

CASES = {
    # layer 1 dense (mlp_only_layers), weights renormalised over the top 2
    "qwen3_moe_dense_layer": dict(arch="qwen3_moe", num_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    # every second layer sparse (decoder_sparse_step), weights as the softmax gave them
    "qwen3_moe_sparse_step": dict(arch="qwen3_moe", num_layers=4, decoder_sparse_step=2, norm_topk_prob=False,
                                  head_dim=32),
    "mixtral": dict(arch="mixtral", sliding_window=64),
    # a window of 8 on layers 0 and 2 (layer_types alternate), full attention on 1 and 3; sinks
    "gpt_oss": dict(arch="gpt_oss", num_layers=4, sliding_window=8),
}


def make_moe_checkpoint(path, seed: int, **kwargs):
    """make_tiny_checkpoint with INIT, and gpt-oss's attention sinks drawn at the scale of attention
    logits (transformers draws them near 0, where they would hardly matter)."""
    path = make_tiny_checkpoint(path, seed=seed, initializer_range=INIT, **kwargs)
    if kwargs["arch"] == "gpt_oss":
        tensors = load_file(path / "model.safetensors")
        generator = torch.Generator().manual_seed(seed)
        for name in [n for n in tensors if n.endswith("sinks")]:
            tensors[name] = torch.randn(tensors[name].shape, generator=generator)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(our model, transformers' model) from the same tiny checkpoint."""
    return load_pair(make_moe_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **CASES[request.param]))


def test_sparse_layers_as_the_config_says(pair):
    ours, ref = pair
    sparse = [hasattr(layer.mlp, "experts") for layer in ours.model.layers]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in ref.model.layers]
    assert sparse == [is_sparse_layer(ref.config, i) for i in range(ours.num_layers)]
    assert not all(sparse) or ref.config.model_type in ("mixtral", "gpt_oss")
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    expected = {"gpt_oss": [8, None, 8, None], "mixtral": [64, 64]}.get(ref.config.model_type, [None] * len(windows))
    assert windows == expected


# ---- the block alone -------------------------------------------------------------------------

HIDDEN, INTER, EXPERTS = 32, 48, 8


def random_block(family: str, renormalize: bool, top_k: int = 2, seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, EXPERTS, top_k, INTER, renormalize, fp32_weights=family == "mixtral",
                           family=family)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return block


def naive_experts(experts: Experts, x, weights, ids) -> torch.Tensor:
    """Token by token, each of its experts on its own."""
    inter = experts.intermediate
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up = experts.gate_up_proj[e] @ x[t]
            out[t] += w * (experts.down_proj[e] @ (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def naive_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Routing recomputed from its definition (fp32 softmax over all experts, top-k, optionally
    renormalised), then the per-token experts."""
    weights, ids = torch.topk(torch.softmax((x @ block.gate.weight.T).float(), dim=-1), block.top_k)
    if block.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return naive_experts(block.experts, x, weights, ids)


@pytest.mark.parametrize("family, renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 33, 64])
@torch.inference_mode()
def test_block_matches_per_token_reference(family, renormalize, rows):
    block = random_block(family, renormalize, top_k=3 if rows == 7 else 2)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(block(x), naive_moe(block, x), atol=1e-5, rtol=1e-5)


def crafted_routing(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0 alone on experts 6 and 7; every other token on expert 0 and one of 1-3; experts 4 and 5
    get no token at all."""
    ids = torch.zeros(rows, 2, dtype=torch.long)
    ids[0] = torch.tensor([7, 6])
    ids[1:, 1] = 1 + torch.arange(rows - 1) % 3
    weights = torch.rand(rows, 2, generator=torch.Generator().manual_seed(rows))
    return weights, ids


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("grouped", [False, True], ids=["looped", "grouped"])
@torch.inference_mode()
def test_experts_with_lonely_and_idle_experts(rows, grouped):
    """The CPU loop and the grouped-GEMM path (torch._grouped_mm where this torch runs it on the CPU:
    the CUDA path's arithmetic) both equal the per-token sum."""
    if grouped and not grouped_mm_usable(CPU, torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    experts = random_block("qwen3_moe", True).experts
    experts.grouped = grouped
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, ids = crafted_routing(rows)
    torch.testing.assert_close(experts(x, weights, ids), naive_experts(experts, x, weights, ids),
                               atol=1e-5, rtol=1e-5)


def transformers_blocks(family: str, dtype: torch.dtype):
    """(our block, transformers' block as a function of x [T, H]) with the same random weights."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if family == "gpt_oss":
        config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                              num_experts_per_tok=2)
        ours, theirs = GptOssMoeBlock(config), GptOssMLP(config)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for param in ours.parameters():   # 4 x the usual scale, so the SwiGLU's clamps at +-7 bite
                param.copy_(4 * torch.randn(param.shape, generator=generator) / HIDDEN ** 0.5)
        theirs.load_state_dict(ours.state_dict())
        theirs.to(dtype).eval()
        return ours.to(dtype), lambda x: theirs(x[None])[0][0]   # GptOssMLP returns (out, router scores)
    if family == "mixtral":
        theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                     num_local_experts=EXPERTS, num_experts_per_tok=2))
    else:
        theirs = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                                                       num_experts=EXPERTS, num_experts_per_tok=2,
                                                       norm_topk_prob=True))
    ours = random_block(family, True).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    theirs.to(dtype).eval()
    return ours, lambda x: theirs(x[None])[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_block_equals_transformers_block(family, dtype):
    """Against transformers' own sparse block with the same weights: routing, weight dtypes and the
    order of the sums as each family has them (bf16 included, where rounding shows the order)."""
    ours, theirs = transformers_blocks(family, dtype)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    out, expected = ours(x), theirs(x)
    if dtype == torch.float32:   # fp32 GEMMs may block rows differently
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    else:   # bit for bit: the weighting and the sums round as transformers' do (keeping Mixtral's weights
        assert torch.equal(out, expected)   # in bf16 instead of fp32 is off by up to 0.016 here)
    if family == "gpt_oss" and dtype == torch.float32:   # the clamps were reached: the test saw them
        ours.experts.limit = float("inf")
        assert (ours(x) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("rows", [1, 5, 16])
@torch.inference_mode()
def test_gpt_oss_grouped_path(rows):
    """gpt-oss's layout (row-major [E, in, out], biases) through the grouped-GEMM path equals the loop."""
    if not grouped_mm_usable(CPU, torch.float32, column_major=False):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    block, _ = transformers_blocks("gpt_oss", torch.float32)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    looped = block(x)
    block.experts.grouped = True
    torch.testing.assert_close(block(x), looped, atol=1e-5, rtol=1e-5)


# ---- the model: routing matters, both checkpoint layouts, strictness --------------------------

ENGINE_CHECKPOINTS = {   # family -> (seed, config overrides) of the checkpoints the engine tests run
    "qwen3_moe": (3, dict(num_layers=2, mlp_only_layers=[0], norm_topk_prob=True)),
    "mixtral": (4, {}),
    "gpt_oss": (5, dict(sliding_window=8)),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return {family: make_moe_checkpoint(tmp_path_factory.mktemp(family), seed=seed, arch=family, **overrides)
            for family, (seed, overrides) in ENGINE_CHECKPOINTS.items()}


@torch.inference_mode()
def test_routing_matters(paths):
    """The parity tests would notice a routing slip: a prompt's tokens spread over most experts, and
    leaving the top-k weights unnormalised moves the logits far past the tolerance."""
    model = load_model(str(paths["qwen3_moe"]), torch.float32, CPU)
    block = model.model.layers[1].mlp
    seen = []
    block.register_forward_hook(lambda module, args, out: seen.append(
        torch.topk(module.gate(args[0]), module.top_k).indices))
    tokens = random_tokens(24, seed=1)
    normalised = logits_of(model, tokens)
    assert len(seen[0].unique()) >= 6
    block.renormalize = False
    assert (logits_of(model, tokens) - normalised).abs().max() > 100 * TOL


def fuse_experts(tensors: dict, num_layers: int, hub_block: str) -> dict:
    """The per-expert hub tensors of every sparse layer as our fused 3-D ones (transformers 5's in-memory
    layout), the router under `mlp.gate`."""
    out = dict(tensors)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.{hub_block}"
        names = sorted({k.split(".")[5] for k in tensors if k.startswith(prefix + ".experts.")}, key=int)
        if not names:
            continue
        gate, up, down = HUB_NAMES["mixtral" if hub_block == "block_sparse_moe" else "qwen3_moe"][1]
        pop = lambda e, n: out.pop(f"{prefix}.experts.{e}.{n}.weight")   # noqa: E731
        mlp = f"model.layers.{layer}.mlp"
        out[f"{mlp}.experts.gate_up_proj"] = torch.stack([torch.cat((pop(e, gate), pop(e, up))) for e in names])
        out[f"{mlp}.experts.down_proj"] = torch.stack([pop(e, down) for e in names])
        out[f"{mlp}.gate.weight"] = out.pop(f"{prefix}.gate.weight")
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_layout_loads_the_same_model(family, paths, tmp_path):
    source = paths[family]
    hub_block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    fused = copy_checkpoint(source, tmp_path / "fused", lambda t: fuse_experts(t, 2, hub_block))
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    tokens = random_tokens(9, seed=2)
    assert torch.equal(logits_of(load_model(str(fused), torch.float32, CPU), tokens),
                       logits_of(load_model(str(source), torch.float32, CPU), tokens))


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("edit, error", [
    (lambda t: {k: v for k, v in t.items() if k != EXPERT}, "missing.*" + EXPERT),
    (lambda t: {**t, EXPERT.replace(".3.", ".8."): t[EXPERT].clone()}, "unexpected.*experts\\.8\\.up_proj"),
    (lambda t: {**t, EXPERT: t[EXPERT][:-1]}, EXPERT + ".*shape"),
    (lambda t: {**fuse_experts(t, 2, "mlp"), EXPERT: t[EXPERT]}, "unexpected.*" + EXPERT),   # both layouts at once
    (lambda t: {**(f := fuse_experts(t, 2, "mlp")), "model.layers.1.mlp.experts.down_proj":
                f["model.layers.1.mlp.experts.down_proj"][:-1]}, "experts\\.down_proj.*shape"),
], ids=["missing_expert", "extra_expert", "expert_shape", "mixed_layouts", "fused_shape"])
def test_strict_loading_of_experts(paths, tmp_path, edit, error):
    path = copy_checkpoint(paths["qwen3_moe"], tmp_path / "m", edit)
    with pytest.raises(ValueError, match=error.replace("model.layers", "model\\.layers")):
        load_model(str(path), torch.float32, CPU)


@torch.inference_mode()
def test_gpt_oss_sinks_matter(paths):
    """The parity tests see the sinks: without them the logits move far past the tolerance."""
    model = load_model(str(paths["gpt_oss"]), torch.float32, CPU)
    tokens = random_tokens(12, seed=3)
    with_sinks = logits_of(model, tokens)
    for layer in model.model.layers:
        layer.self_attn.sinks = None
    assert (logits_of(model, tokens) - with_sinks).abs().max() > 100 * TOL


def test_gpt_oss_loading_is_strict(paths, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_bias"
    path = copy_checkpoint(paths["gpt_oss"], tmp_path / "no_bias", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", "\\.")):
        load_model(str(path), torch.float32, CPU)


def test_mxfp4_gpt_oss_is_refused(paths, tmp_path):
    """The hub's gpt-oss checkpoints keep their experts in MXFP4 blocks: a clear error, not a missing-tensor list."""
    import json

    path = copy_checkpoint(paths["gpt_oss"], tmp_path / "mxfp4", lambda t: t)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mxfp4.*bf16"):
        load_model(str(path), torch.float32, CPU)


# ---- the engine: greedy generation, speculation --------------------------------------------------

@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory):
    """A tiny dense Qwen3 with the same tokenizer: a poor draft, so rejections and rollbacks happen."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), arch="qwen3", seed=9, num_layers=1)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    motif = [rng.randrange(256) for _ in range(6)]
    return [motif * 4 + [rng.randrange(256)], [5], [9, 9, 9, 9, 9, 9]] + \
        [[rng.randrange(256) for _ in range(n)] for n in (3, 17, 40)]   # repetitive ones: n-gram and suffix hits


FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers_generate(family, paths, prompts):
    path = paths[family]
    outs = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=4).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist()


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SPEC_METHODS = {   # (target, dense draft) -> speculative config
    "dense_draft": lambda target, draft: {"method": "draft", "draft": {"model": str(draft)},
                                          "num_speculative_tokens": 4, "adaptive": False},
    # the target drafting for itself: every draft accepted, and an MoE model as the proposer
    "self_draft": lambda target, draft: {"method": "draft", "draft": {"model": str(target)},
                                         "num_speculative_tokens": 3, "adaptive": False},
    # the same, its linears (the routers among them) re-quantized to q8_0 at load: GGUF-served routers
    "q8_self_draft": lambda target, draft: {"method": "draft", "draft": {"model": str(target), "quantization": "q8_0"},
                                            "num_speculative_tokens": 3, "adaptive": False},
    "ngram": lambda target, draft: {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
                                    "ngram": {"max": 3}},
    "suffix": lambda target, draft: {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
}


@pytest.fixture(scope="module")
def plain_greedy(paths, prompts):
    return {family: run_requests(Engine(EngineConfig(model=str(path), dtype="float32")), prompts, GREEDY)[0]
            for family, path in paths.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", list(SPEC_METHODS))
def test_greedy_speculation_is_lossless(family, method, paths, dense_draft, prompts, plain_greedy):
    """Token for token plain greedy, in small blocks and chunked prefills, drafts rejected (the dense
    draft; n-gram and suffix mostly) and accepted (self-drafting) and rolled back."""
    config = EngineConfig(model=str(paths[family]), dtype="float32", block_size=4, max_num_batched_tokens=32,
                          speculative=SPEC_METHODS[method](paths[family], dense_draft))
    tokens, finals = run_requests(Engine(config), prompts, GREEDY)
    assert tokens == plain_greedy[family]
    proposed, accepted = sum(f.spec.proposed for f in finals), sum(f.spec.accepted for f in finals)
    assert proposed > 0 or method == "suffix" and family == "gpt_oss"   # its random output never repeats
    if method == "self_draft":
        assert accepted == proposed
    if method == "dense_draft":
        assert accepted < proposed


# ---- sampled speculation keeps the target's distribution -----------------------------------------

@pytest.fixture(scope="module")
def small_vocab_moe(tmp_path_factory):
    """A 16-token Qwen3-MoE target with peaked next-token distributions and a noisy copy as its draft
    (test_spec_decode.py's chi-square setting, with a sparse target)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers import make_noisy_copy
    from test_spec_decode import VOCAB

    root = tmp_path_factory.mktemp("moe_vocab16")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                            initializer_range=INIT, bos_token_id=0, eos_token_id=1)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    model.save_pretrained(root / "target")
    return str(root / "target"), str(make_noisy_copy(root / "target", root / "draft", noise=0.15))


@pytest.mark.slow   # chi-square: thousands of samples
@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "negative_control"])
def test_speculative_sampling_on_moe_matches_target_distribution(small_vocab_moe, monkeypatch, broken):
    """Draft-model rejection sampling on a sparse target: every position's marginal and every pair's joint
    agree with the distribution enumerated from transformers; a sampler that recovers from p instead
    of the residual (the negative control) is caught."""
    import engine.verify
    from helpers import recover_from_p
    from test_spec_decode import P_MIN, position_pvalues, run_case

    if broken:
        monkeypatch.setattr(engine.verify, "rejection_sample", recover_from_p)
    counts, acceptance, probs = run_case(*small_vocab_moe, "draft-temperature-top_k")
    pvalues = position_pvalues(counts, probs)
    if broken:
        assert min(pvalues.values()) < P_MIN, pvalues
    else:
        assert 0.3 <= acceptance <= 0.9, acceptance
        assert min(pvalues.values()) > P_MIN, pvalues


# ---- one server round trip ---------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_server_serves_a_moe_model(family, paths):
    """A chat completion over HTTP from an in-process server on each MoE target with n-gram
    speculation: the offline engine's greedy text (which equals transformers', above)."""
    import httpx

    from conftest import InProcessServer
    from engine.tokenizer import load_tokenizer, render_chat
    from server.api import create_app
    from server.metrics import Metrics

    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    engine = Engine(EngineConfig(model=str(paths[family]), dtype="float32", device="cpu", num_kv_blocks=64,
                                 max_num_seqs=8, speculative=spec))
    tokenizer = load_tokenizer(str(paths[family]))
    messages = [{"role": "user", "content": "abcabcabc"}]
    body = {"model": "moe", "messages": messages, "max_tokens": 16, "temperature": 0}
    with InProcessServer(create_app(engine, tokenizer, "moe", None, Metrics("moe", engine.method))) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    prompt = render_chat(tokenizer, messages)
    expected = LLM(str(paths[family]), dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert response["usage"]["completion_tokens"] == len(expected.token_ids)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(expected.token_ids,
                                                                            skip_special_tokens=True)
