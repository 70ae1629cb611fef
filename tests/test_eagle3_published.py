"""Published EAGLE-3 heads (engine/models/eagle3.py): a head in the EAGLE / SpecForge release format
loads for its target, reads the target layers its config names (vLLM's numbering: id j is the hidden
state entering layer j), computes what the published architecture computes (checked against a
reference written here from the architecture's description, not from the engine's modules), chains
on its pre-norm output, stays lossless, and a head that does not fit its target fails at start-up
with a message that names the problem."""
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_checkpoint, run_requests
from safetensors.torch import save_file

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_runner import ForwardItem

TARGET_LAYERS = 8   # vLLM's default ids for 8 layers: (2, 4, 5)
VOCAB, HIDDEN, HEADS, KV_HEADS, INTER = 272, 64, 4, 2, 96


def make_published_head(path, seed=0, draft_vocab: list[int] | None = None, layer_ids=None,
                        own_embeddings=False, norm_before_residual=False, drop=(), extra=None):
    """A head directory in the published EAGLE-3 format, random weights."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": INTER,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "hidden_act": "silu",
              "max_position_embeddings": 512, "vocab_size": VOCAB, "torch_dtype": "float32",
              "draft_vocab_size": len(draft_vocab) if draft_vocab else VOCAB,
              "norm_before_residual": norm_before_residual}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    config.update(extra or {})
    (path / "config.json").write_text(json.dumps(config))
    head_dim = HIDDEN // HEADS
    shapes = {"fc.weight": (HIDDEN, 3 * HIDDEN), "midlayer.self_attn.q_proj.weight": (HEADS * head_dim, 2 * HIDDEN),
              "midlayer.self_attn.k_proj.weight": (KV_HEADS * head_dim, 2 * HIDDEN),
              "midlayer.self_attn.v_proj.weight": (KV_HEADS * head_dim, 2 * HIDDEN),
              "midlayer.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
              "midlayer.mlp.gate_proj.weight": (INTER, HIDDEN), "midlayer.mlp.up_proj.weight": (INTER, HIDDEN),
              "midlayer.mlp.down_proj.weight": (HIDDEN, INTER),
              "lm_head.weight": (config["draft_vocab_size"], HIDDEN)}
    norms = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.post_attention_layernorm.weight", "norm.weight")
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: 0.15 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    tensors.update({name: 1.0 + 0.2 * torch.randn(HIDDEN, generator=generator) for name in norms})
    if own_embeddings:
        tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator)
    if draft_vocab:
        ids = torch.tensor(draft_vocab)
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    for name in drop:
        tensors.pop(name)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("eagle3") / "target", arch="llama", seed=21,
                                    num_layers=TARGET_LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN,
                                    num_heads=HEADS, num_kv_heads=KV_HEADS))


def spec(head, gamma=3):
    return {"method": "eagle", "draft": {"head": str(head)}, "num_speculative_tokens": gamma, "adaptive": False}


def rms(x, weight, eps=1e-5):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, theta):
    """Neox-style rotary embedding of x [T, heads, d]."""
    d = x.shape[-1]
    angles = positions[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)
    return x * cos + rotated * sin


def reference(path, embed_table, features, tokens, target_ids):
    """The published EAGLE-3 step over rows t = 0..T-1 at positions 0..T-1, causal: row t reads
    feature features[t] (the target's three layers through fc, or a head output as it is) and the
    embedding of tokens[t]. -> (pre-norm outputs [T, H], logits [T, VOCAB] with -inf off the draft
    vocabulary)."""
    from safetensors.torch import load_file
    w = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    embed_table = w.get("embed_tokens.weight", embed_table)
    f = torch.stack([w["fc.weight"] @ row if row.numel() == 3 * HIDDEN else row for row in features])
    normed = rms(f, w["midlayer.hidden_norm.weight"])
    residual = normed if config["norm_before_residual"] else f
    a = torch.cat((rms(embed_table[tokens], w["midlayer.input_layernorm.weight"]), normed), dim=-1)
    d, count = HIDDEN // HEADS, len(tokens)
    positions = torch.arange(count)
    q = rope((a @ w["midlayer.self_attn.q_proj.weight"].T).view(count, HEADS, d), positions, config["rope_theta"])
    k = rope((a @ w["midlayer.self_attn.k_proj.weight"].T).view(count, KV_HEADS, d), positions, config["rope_theta"])
    v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(count, KV_HEADS, d)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(count, count, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(count, HEADS * d)
    r = residual + attended @ w["midlayer.self_attn.o_proj.weight"].T
    x = rms(r, w["midlayer.post_attention_layernorm.weight"])
    out = r + (F.silu(x @ w["midlayer.mlp.gate_proj.weight"].T) * (x @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    small = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((count, VOCAB), float("-inf"))
    logits[:, target_ids] = small
    return out, logits


@pytest.mark.parametrize("variant", ["defaults", "explicit"])
def test_a_published_head_computes_the_published_architecture(target, tmp_path, variant):
    """Teacher-forced over a sequence, then one chained step on the head's own (pre-norm) output:
    the served logits are the reference's. "defaults": vLLM's default layers, a draft vocabulary
    (d2t, unsorted), the target's embeddings. "explicit": layer ids named in eagle_config, the
    head's own embeddings, norm_before_residual, the full vocabulary."""
    from transformers import AutoModelForCausalLM

    if variant == "defaults":
        draft_vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:64].tolist()
        head = make_published_head(tmp_path / "head", seed=1, draft_vocab=draft_vocab)
        layer_ids, target_ids = [2, 4, 5], draft_vocab
    else:
        layer_ids, target_ids = [1, 3, 6], list(range(VOCAB))
        head = make_published_head(tmp_path / "head", seed=2, layer_ids=layer_ids, own_embeddings=True,
                                   norm_before_residual=True)
    engine = Engine(EngineConfig(model=target, dtype="float32", speculative=spec(head)))
    assert engine.target.model.model.feature_layers == tuple(j - 1 for j in layer_ids)

    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    table: list[int] = []
    engine.pool.allocate(table, 32)
    engine.target.forward([ForwardItem(ids.tolist(), 0, table, 0)])   # the target keeps its features
    features = engine.target.read_features([(table, 0, 19)])
    runner = engine.spec.router.proposers["eagle"].runner
    logits, hidden = runner.forward([ForwardItem(ids[1:].tolist(), 0, table, 19)], features, return_hidden=True)
    draft = int(logits[-1].argmax())
    chained = runner.forward([ForwardItem([draft], 19, table, 1)], hidden[-1:])

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        states = model.model(ids[None], output_hidden_states=True).hidden_states   # [j]: entering layer j
        truth = torch.cat([states[j][0, :19] for j in layer_ids], dim=-1)
        torch.testing.assert_close(features, truth, atol=2e-4, rtol=1e-4)
        embed = model.model.embed_tokens.weight
        out, expected = reference(head, embed, list(truth), ids[1:].tolist(), target_ids)
        _, expected_chained = reference(head, embed, list(truth) + [out[18]], ids[1:].tolist() + [draft], target_ids)
    torch.testing.assert_close(logits, expected[:19], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chained[0], expected_chained[19], atol=1e-4, rtol=1e-4)


def test_greedy_with_a_published_head_is_lossless(target, tmp_path):
    draft_vocab = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:128].tolist())
    head = make_published_head(tmp_path / "head", seed=5, draft_vocab=draft_vocab)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 3, [9], list(range(10, 50))]

    def generate(config):
        engine = Engine(config)
        return run_requests(engine, prompts, params)[0], engine

    plain, _ = generate(EngineConfig(model=target, dtype="float32"))
    for speculative in (spec(head, 3), {**spec(head, 4), "method": "auto", "proposers": ["eagle", "ngram"]}):
        outputs, engine = generate(EngineConfig(model=target, dtype="float32", speculative=speculative))
        assert outputs == plain
        assert engine.totals.num_draft_tokens > 0


@pytest.mark.parametrize("make, message", [
    (lambda p: make_published_head(p, extra={"vocab_size": 300}), "300 tokens"),
    (lambda p: make_published_head(p, layer_ids=[0, 3, 5]), "0 would be the embeddings"),
    (lambda p: make_published_head(p, layer_ids=[2, 4, 8]), "feature layers must be distinct decoder layers"),
    (lambda p: make_published_head(p, draft_vocab=list(range(64)), drop=("d2t",)), "needs a d2t tensor"),
    (lambda p: make_published_head(p, draft_vocab=[1, 2, 3, 3]), "one target id twice"),
    (lambda p: make_published_head(p, drop=("midlayer.hidden_norm.weight",)), "missing tensors"),
    (lambda p: make_published_head(p, extra={"eagle_config": {"use_aux_hidden_state": False}}),
     "use_aux_hidden_state"),
    (lambda p: make_published_head(p, extra={"architectures": ["Eagle3Speculator"]}), "Eagle3Speculator"),
])
def test_a_published_head_that_does_not_fit_fails_at_start_up(target, tmp_path, make, message):
    head = make(tmp_path / "head")
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=target, dtype="float32", speculative=spec(head)))


def test_a_published_head_shipped_as_pytorch_model_bin_loads_the_same(target, tmp_path):
    """Some releases ship pytorch_model.bin: read tensors-only, it serves what its safetensors twin does."""
    from safetensors.torch import load_file

    head = make_published_head(tmp_path / "safetensors", seed=6, draft_vocab=list(range(0, VOCAB, 2)))
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text((head / "config.json").read_text())
    torch.save(load_file(str(head / "model.safetensors")), pickled / "pytorch_model.bin")
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()

    def served(path):
        engine = Engine(EngineConfig(model=target, dtype="float32", speculative=spec(path)))
        table: list[int] = []
        engine.pool.allocate(table, 16)
        engine.target.forward([ForwardItem(ids, 0, table, 0)])
        features = engine.target.read_features([(table, 0, 11)])
        return engine.spec.router.proposers["eagle"].runner.forward([ForwardItem(ids[1:], 0, table, 11)], features)
    torch.testing.assert_close(served(pickled), served(head), atol=0, rtol=0)
