"""Model parity with transformers (fp32, tiny random checkpoints) and strict loading."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from engine.attention_backends import TorchBackend
from engine.attention_metadata import PassLayout
from engine.models import SUPPORTED_ARCHITECTURES, CausalLM, load_hf_config, load_model
from engine.models.rope import rope_inverse_frequencies
from helpers import make_tiny_checkpoint, make_tiny_config

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 32
TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# head_dim 16: 8 factors each; original length 64 of 256, so the attention scaling is sqrt(1 + ln 4 / ln 64)
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]}

CASES = {
    "llama": dict(arch="llama"),
    "llama_llama3_rope": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "llama_biases": dict(arch="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(arch="mistral", sliding_window=64),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32, attention_bias=True),  # head_dim != hidden / heads
    "phi3": dict(arch="phi3"),   # q/k/v and gate/up fused in the checkpoint
    # LongRoPE's short factors and attention scaling (the sequences here stay below the original length)
    "phi3_longrope": dict(arch="phi3", max_position_embeddings=256, rope_parameters=PHI3_LONGROPE),
    "phi3_partial_rope": dict(arch="phi3", partial_rotary_factor=0.75),   # Phi-4-mini rotates 3/4 of each head
}

# Disjoint, shuffled block tables (8 blocks = 32 tokens per sequence), so paging is exercised.
BLOCK_TABLES = [[9, 3, 14, 6, 21, 0, 17, 30], [1, 12, 5, 27, 8, 19, 2, 25]]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(our model, transformers' model) loaded from the same tiny checkpoint."""
    return load_pair(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **CASES[request.param]))


def load_pair(path):
    """Our fp32 model and transformers' from one checkpoint (the parity tests' pair)."""
    return load_model(str(path), torch.float32, CPU), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def new_kv_caches(model):
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape) for _ in range(model.num_layers)]


@torch.inference_mode()
def run_pass(model, kv_caches, items):
    """One flat forward pass. items: (new_token_ids, num_cached_tokens, block_table) per sequence.
    Returns logits of every new token, split per sequence."""
    ids = torch.tensor([t for new, _, _ in items for t in new])
    positions = torch.cat([torch.arange(cached, cached + len(new)) for new, cached, _ in items])
    layout = PassLayout([len(new) for new, _, _ in items], [cached + len(new) for new, cached, _ in items],
                        [table for _, _, table in items])
    meta = TorchBackend(BLOCK_SIZE, CPU).build(layout, model.sliding_window)
    logits = model.compute_logits(model(ids, positions, meta, kv_caches))
    assert logits.dtype == torch.float32
    return list(logits.split([len(new) for new, _, _ in items]))


@torch.inference_mode()
def reference_logits(ref, tokens):
    return ref(torch.tensor([tokens])).logits[0].float()


def assert_close(ours, theirs):
    err = (ours - theirs).abs().max().item()
    assert err < TOL, f"max abs logit error {err:.3g}"


def random_tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_then_decode(pair):
    ours, ref = pair
    kv = new_kv_caches(ours)
    tokens = random_tokens(7, seed=1)
    (prefill,) = run_pass(ours, kv, [(tokens, 0, BLOCK_TABLES[0])])
    assert_close(prefill, reference_logits(ref, tokens))
    last = prefill[-1]
    for _ in range(6):  # greedy decode, one token per pass, across several blocks
        tokens.append(int(last.argmax()))
        (step,) = run_pass(ours, kv, [(tokens[-1:], len(tokens) - 1, BLOCK_TABLES[0])])
        last = step[-1]
        assert_close(last, reference_logits(ref, tokens)[-1])


def test_batched_ragged(pair):
    ours, ref = pair
    kv = new_kv_caches(ours)
    a, b = random_tokens(5, seed=2), random_tokens(11, seed=3)
    out_a, out_b = run_pass(ours, kv, [(a, 0, BLOCK_TABLES[0]), (b, 0, BLOCK_TABLES[1])])
    assert_close(out_a, reference_logits(ref, a))
    assert_close(out_b, reference_logits(ref, b))
    # Mixed pass: one decode token for a, three new tokens (as in verification) for b.
    new_a, new_b = [42], [7, 99, 130]
    out_a, out_b = run_pass(ours, kv, [(new_a, len(a), BLOCK_TABLES[0]), (new_b, len(b), BLOCK_TABLES[1])])
    assert_close(out_a, reference_logits(ref, a + new_a)[-1:])
    assert_close(out_b, reference_logits(ref, b + new_b)[-3:])


def test_chunked_prefill(pair):
    ours, ref = pair
    kv = new_kv_caches(ours)
    tokens = random_tokens(10, seed=4)
    expected = reference_logits(ref, tokens)
    (first,) = run_pass(ours, kv, [(tokens[:6], 0, BLOCK_TABLES[1])])
    (second,) = run_pass(ours, kv, [(tokens[6:], 6, BLOCK_TABLES[1])])
    assert_close(first, expected[:6])
    assert_close(second, expected[6:])


def test_model_attributes(pair):
    ours, ref = pair
    config = ref.config
    assert ours.num_layers == config.num_hidden_layers
    assert ours.num_kv_heads == config.num_key_value_heads
    assert ours.head_dim == config.head_dim
    assert ours.vocab_size == config.vocab_size
    assert ours.max_position_embeddings == config.max_position_embeddings
    assert ours.sliding_window == (64 if config.model_type == "mistral" else None)
    assert not any(p.is_meta for p in ours.parameters())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == config.tie_word_embeddings


# ---------------------------------------------------------------- loading

@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ref"), arch="qwen2", seed=3)
    return path, load_model(str(path), torch.float32, CPU)


def logits_of(model, tokens, block_table=BLOCK_TABLES[0]):
    (out,) = run_pass(model, new_kv_caches(model), [(tokens, 0, block_table)])
    return out


def copy_checkpoint(src, dst, edit):
    """Copy a single-file checkpoint, passing its tensors through edit(dict) -> dict."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(reference_checkpoint, tmp_path):
    name = "model.layers.1.self_attn.k_proj.bias"
    path = copy_checkpoint(reference_checkpoint[0], tmp_path / "m",
                           lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
        load_model(str(path), torch.float32, CPU)


def test_unexpected_tensor_is_named(reference_checkpoint, tmp_path):
    name = "model.layers.0.mlp.extra_proj.weight"
    path = copy_checkpoint(reference_checkpoint[0], tmp_path / "m", lambda t: {**t, name: torch.zeros(3)})
    with pytest.raises(ValueError, match="unexpected.*" + name.replace(".", r"\.")):
        load_model(str(path), torch.float32, CPU)


def test_wrong_shape_is_named(reference_checkpoint, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = copy_checkpoint(reference_checkpoint[0], tmp_path / "m", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        load_model(str(path), torch.float32, CPU)


def test_unsupported_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(str(tmp_path), torch.float32, CPU)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_sharded_checkpoint_matches_single_file(reference_checkpoint, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "sharded", arch="qwen2", seed=3, max_shard_size="40KB")
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2
    sharded = load_model(str(path), torch.float32, CPU)
    tokens = random_tokens(6, seed=5)
    assert torch.equal(logits_of(sharded, tokens), logits_of(reference_checkpoint[1], tokens))


def test_tied_checkpoint_may_contain_lm_head(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "tied", arch="llama", tie_word_embeddings=True, seed=2)
    tied = load_model(str(source), torch.float32, CPU)
    path = copy_checkpoint(source, tmp_path / "with_head",
                           lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    with_head = load_model(str(path), torch.float32, CPU)
    assert with_head.lm_head.weight is with_head.model.embed_tokens.weight
    tokens = random_tokens(5, seed=6)
    assert torch.equal(logits_of(with_head, tokens), logits_of(tied, tokens))


def test_old_style_rope_config(tmp_path):
    """config.json written with rope_theta / rope_scaling (pre-transformers-5) still gives HF's logits."""
    path = make_tiny_checkpoint(tmp_path / "old", arch="llama", seed=4, rope_parameters=LLAMA3_ROPE)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    ours = load_model(str(path), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = random_tokens(40, seed=7)  # past original_max_position_embeddings (32)
    assert_close(logits_of(ours, tokens, BLOCK_TABLES[0] + BLOCK_TABLES[1]), reference_logits(ref, tokens))


def test_bfloat16_load(reference_checkpoint):
    path, fp32_model = reference_checkpoint
    model = load_model(str(path), torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    tokens = random_tokens(6, seed=8)
    (out,) = run_pass(model, [kv.bfloat16() for kv in new_kv_caches(model)], [(tokens, 0, BLOCK_TABLES[0])])
    assert out.dtype == torch.float32
    assert (out - logits_of(fp32_model, tokens)).abs().max().item() < 0.05


def test_yarn_rope_parity(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    path = make_tiny_checkpoint(tmp_path / "yarn", arch="qwen2", seed=5, rope_parameters=yarn)
    ours = load_model(str(path), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = random_tokens(24, seed=9)
    assert_close(logits_of(ours, tokens), reference_logits(ref, tokens))


def test_unsupported_rope_type(tmp_path):
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = make_tiny_checkpoint(tmp_path / "dyn", arch="llama", rope_parameters=dynamic)
    with pytest.raises(ValueError, match="dynamic"):
        load_model(str(path), torch.float32, CPU)


def test_legacy_rope_theta_attribute():
    """Configs without rope_parameters (transformers < 5) give theta through config.rope_theta."""
    inv_freq, scaling = rope_inverse_frequencies(SimpleNamespace(rope_theta=500000.0), head_dim=16)
    assert scaling == 1.0
    assert torch.equal(inv_freq, 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16)))


def test_direct_construction_runs():
    """CausalLM(config) outside the loader gets real buffers and random weights."""
    model = CausalLM(make_tiny_config("qwen3", num_layers=1)).eval()
    assert not model.model.rotary_emb.cos_sin_cache.is_meta
    out = logits_of(model, random_tokens(5, seed=10))
    assert out.shape == (5, model.vocab_size) and torch.isfinite(out).all()


# ---------------------------------------------------------------- sliding window

WINDOW = 16
WINDOW_CASES = {
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    # Qwen2 slides only from layer max_window_layers on: layer 0 full, layer 1 windowed.
    "qwen2_mixed_layers": dict(arch="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


@pytest.fixture(scope="module", params=list(WINDOW_CASES))
def windowed_pair(request, tmp_path_factory):
    """(our model, transformers' model, transformers' model with the window switched off), one checkpoint."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), seed=11, **WINDOW_CASES[request.param])
    ours = load_model(str(path), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no_window = {"sliding_window": None}
    if "qwen2" in request.param:
        no_window.update(use_sliding_window=False, layer_types=["full_attention"] * ours.num_layers)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **no_window).eval()
    return ours, ref, full


def long_tables(num_seqs: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Disjoint shuffled block tables of num_blocks blocks each (num_blocks * BLOCK_SIZE tokens)."""
    order = torch.randperm(num_seqs * num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i * num_blocks:(i + 1) * num_blocks] for i in range(num_seqs)]


def long_kv_caches(model, num_blocks: int):
    shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape) for _ in range(model.num_layers)]


def test_transformers_applies_the_window(windowed_pair):
    """The reference itself honours the window (sdpa, the default): the same weights without it agree
    inside the first WINDOW positions and differ past them, so the parity tests below test something."""
    ours, ref, full = windowed_pair
    assert ours.sliding_window == WINDOW
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == \
        [WINDOW if t == "sliding_attention" else None for t in getattr(ref.config, "layer_types", None) or
         ["sliding_attention"] * ours.num_layers]
    tokens = random_tokens(3 * WINDOW, seed=12)
    with_window, without = reference_logits(ref, tokens), reference_logits(full, tokens)
    assert_close(with_window[:WINDOW], without[:WINDOW])
    assert (with_window[WINDOW:] - without[WINDOW:]).abs().amax(dim=-1).min() > 1e-3


def test_window_prefill_decode_and_chunks(windowed_pair):
    ours, ref, _ = windowed_pair
    (table,) = long_tables(1, 20)   # 80 tokens
    tokens = random_tokens(3 * WINDOW + 5, seed=13)
    expected = reference_logits(ref, tokens)
    kv = long_kv_caches(ours, 20)
    (prefill,) = run_pass(ours, kv, [(tokens, 0, table)])   # one pass, 53 queries, window-masked
    assert_close(prefill, expected)
    chunked = [run_pass(ours, kv, [(tokens[a:a + 20], a, table)])[0] for a in range(0, len(tokens), 20)]
    assert_close(torch.cat(chunked), expected)   # chunks that start past the window
    last = expected[-1]
    for _ in range(12):   # greedy decode, one query per pass
        tokens.append(int(last.argmax()))
        (step,) = run_pass(ours, kv, [(tokens[-1:], len(tokens) - 1, table)])
        last = reference_logits(ref, tokens)[-1]
        assert_close(step[-1], last)


def test_window_ragged_batch(windowed_pair):
    """Sequences inside and past the window in one pass: decodes, a verification-like chunk, a prefill."""
    ours, ref, _ = windowed_pair
    tables = long_tables(3, 16, seed=1)   # 64 tokens each
    kv = long_kv_caches(ours, 48)
    a, b, c = random_tokens(40, seed=14), random_tokens(9, seed=15), random_tokens(30, seed=16)
    outs = run_pass(ours, kv, [(a, 0, tables[0]), (b, 0, tables[1]), (c[:10], 0, tables[2])])
    for out, seq in zip(outs, (a, b, c[:10])):
        assert_close(out, reference_logits(ref, seq))
    new_a, new_b = [42, 17, 99, 3], [7]   # a: 4 tokens as in verification; b: one decode token
    outs = run_pass(ours, kv, [(new_a, len(a), tables[0]), (new_b, len(b), tables[1]), (c[10:], 10, tables[2])])
    assert_close(outs[0], reference_logits(ref, a + new_a)[-4:])
    assert_close(outs[1], reference_logits(ref, b + new_b)[-1:])
    assert_close(outs[2], reference_logits(ref, c)[10:])
    decodes = run_pass(ours, kv, [([5], len(a) + 4, tables[0]), ([6], len(b) + 1, tables[1]), ([8], 30, tables[2])])
    for out, seq in zip(decodes, (a + new_a + [5], b + new_b + [6], c + [8])):
        assert_close(out, reference_logits(ref, seq)[-1:])


def test_window_metadata_must_match_the_layer():
    """A windowed layer handed metadata built without its window fails loudly instead of attending to all."""
    model = CausalLM(make_tiny_config("mistral", num_layers=1, sliding_window=4)).eval()
    meta = TorchBackend(BLOCK_SIZE, CPU).build(PassLayout([6], [6], [BLOCK_TABLES[0]]))
    with pytest.raises(ValueError, match="sliding window 4"), torch.inference_mode():
        model(torch.arange(6), torch.arange(6), meta, new_kv_caches(model))


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                                         {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["plain", "ngram", "draft"])
def test_engine_generates_past_the_window(tmp_path, speculative):
    """The whole engine on a windowed Mistral: a chunked prompt and 40 greedy tokens, three windows
    long, equal transformers' greedy tokens; the context is not capped at the window."""
    from engine import LLM, SamplingParams

    path = make_tiny_checkpoint(tmp_path / "mistral", arch="mistral", seed=11, sliding_window=WINDOW)
    if speculative and speculative["method"] == "draft":
        speculative = {**speculative, "draft": {"model": str(path)}}
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=12, block_size=4,
              speculative=speculative)
    assert llm.engine.max_model_len == 512   # max_position_embeddings, not the window
    prompts = [random_tokens(30, seed=17), random_tokens(5, seed=18)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        tokens = list(prompt)
        for _ in range(40):
            tokens.append(int(reference_logits(ref, tokens)[-1].argmax()))
        assert out.token_ids == tokens[len(prompt):]
    if speculative:
        assert sum(o.spec.accepted for o in outs) > 0


def test_longrope_rotates_by_the_long_factors_from_the_original_length_on(tmp_path):
    """Phi-3's LongRoPE: our table rotates positions below original_max_position_embeddings by the
    short factors and those from it on by the long ones (per position); transformers' rotary embedding
    gives the same cos/sin for positions below it, and for a forward whose positions pass it (then it
    switches to the long factors), for the positions from it on."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from engine.models.rope import RotaryEmbedding

    path = make_tiny_checkpoint(tmp_path / "phi3", arch="phi3", seed=1, max_position_embeddings=256,
                                rope_parameters=PHI3_LONGROPE)
    config = AutoConfig.from_pretrained(path)
    ours = RotaryEmbedding(config, config.head_dim, config.max_position_embeddings)
    ours.init_buffers(CPU, torch.float32)
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, config.head_dim)
    for positions in (torch.arange(0, 64), torch.arange(64, 80), torch.arange(200, 256)):
        cos, sin = theirs(x, positions[None])
        our_cos, our_sin = ours(positions)
        half = config.head_dim // 2
        assert torch.allclose(our_cos[:, 0], cos[0], atol=1e-6)
        assert torch.allclose(our_sin[:, 0, half:], sin[0, :, half:], atol=1e-6)
    short, long = ours(torch.tensor([63]))[0], ours(torch.tensor([64]))[0]
    assert not torch.allclose(short, long, atol=1e-2)   # the table does switch at the original length


def test_dummy_load_format_reads_nothing_but_the_config(tmp_path):
    """load_format dummy: a directory with only config.json serves (random weights: norms 1, biases 0,
    the rest N(0, 0.02)); without it, the missing weights are an error that says so."""
    import shutil

    import numpy as np

    from engine import LLM, SamplingParams
    from engine.config import EngineConfig

    checkpoint = make_tiny_checkpoint(tmp_path / "full", arch="qwen2", seed=2)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(checkpoint / "config.json", config_only / "config.json")
    params = dict(load_model(str(config_only), torch.float32, CPU, random_weights=True).named_parameters())
    assert torch.all(params["model.norm.weight"] == 1) and torch.all(params["model.layers.0.self_attn.qkv_proj.bias"] == 0)
    weight = params["model.layers.0.mlp.down_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.005
    llm = LLM(str(config_only), dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert len(out) == 6 and np.all(np.asarray(out) < 272)
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        EngineConfig(model=str(checkpoint), load_format="random")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(config_only), dtype="float32", device="cpu", skip_tokenizer_init=True)
