"""Test helpers: tiny random Hugging Face checkpoints that load offline.

    from helpers import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3", seed=1)

The directory holds config.json, generation_config.json, model.safetensors
(fp32; sharded when max_shard_size is given) and a byte-level tokenizer that
AutoTokenizer.from_pretrained(path) reads without network access.

Token ids: 0-255 are the raw bytes, then the special tokens below; the vocab
is padded with "<extra_i>" tokens up to vocab_size, so len(tokenizer) ==
config.vocab_size.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(256, 256 + len(SPECIAL_TOKENS))
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# ChatML-style, so server tests can use chat completions with the tiny models.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Config classes not named after the architecture (Gemma3Config is the multimodal one).
CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig"}

# Mixtures of experts: 8 experts, top-2, so routing matters (the families' defaults are far from tiny).
MOE_DEFAULTS = {
    "qwen3_moe": lambda hidden: dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden),
    "mixtral": lambda hidden: dict(num_local_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda hidden: dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=hidden),
}


def _byte_to_unicode() -> dict[int, str]:
    """Map every byte to a printable character (the GPT-2 byte-level scheme)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " " and not (0x7F <= b <= 0xA0)
                 and b != 0xAD]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def make_tokenizer(vocab_size: int = MIN_VOCAB_SIZE):
    """A byte-level PreTrainedTokenizerFast with len() == vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    specials = SPECIAL_TOKENS + [f"<extra_{i}>" for i in range(vocab_size - MIN_VOCAB_SIZE)]
    for i, token in enumerate(specials):
        vocab[token] = 256 + i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def make_tiny_config(arch: str = "llama", vocab_size: int = 272, hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, tie_word_embeddings: bool = False,
                     max_position_embeddings: int = 512, **overrides):
    """A transformers config for a tiny model of the given family (fp32)."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    config_cls = getattr(transformers, CONFIG_CLASSES.get(arch) or ARCHITECTURES[arch].replace("ForCausalLM", "Config"))
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    kwargs.update(MOE_DEFAULTS[arch](hidden_size) if arch in MOE_DEFAULTS else {})
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.architectures = [ARCHITECTURES[arch]]
    return config


def make_tiny_checkpoint(path, arch: str = "llama", vocab_size: int = 272, hidden_size: int = 64,
                         num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                         tie_word_embeddings: bool = False, seed: int = 0, max_position_embeddings: int = 512,
                         max_shard_size: str | int | None = None, **overrides) -> Path:
    """Save a tiny random model (fp32 safetensors) plus tokenizer into `path`; return it.

    Every parameter is random, norm weights and biases included (Hugging Face
    initialises those to 1 / 0, which would hide loading mistakes). `overrides`
    go to the transformers config (e.g. rope_parameters, attention_bias,
    sliding_window, initializer_range)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = make_tiny_config(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                              tie_word_embeddings, max_position_embeddings, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith((".bias", "_bias")):   # "_bias": gpt-oss's experts
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path


def train_bpe_tokenizer(files: list[Path], out_dir: Path, vocab_size: int, model_max_length: int = 512):
    """A byte-level BPE tokenizer trained on text files, saved as a transformers directory
    ("<|endoftext|>" is eos and bos, "<|pad|>" pads); returns the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((Path(f).read_text() for f in files), trainer=trainer, length=len(files))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            pad_token="<|pad|>", model_max_length=model_max_length).save_pretrained(out_dir)
    return tok


def pooled_chisquare(observed, probs) -> float:
    """Pearson's test of counts against exact probabilities (arrays of any one shape), the cells of
    expected count < 5 pooled into one; 0 if a cell of probability 0 was observed."""
    import numpy as np
    from scipy.stats import chisquare

    observed, probs = np.ravel(observed), np.ravel(probs)
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * observed.sum()
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def make_noisy_copy(source, path, noise: float, seed: int = 0) -> Path:
    """Copy a checkpoint directory with Gaussian noise (noise x each tensor's std) added to every
    weight: a draft of the same tokenizer whose acceptance is between a copy's (1.0) and a random
    model's, so rejection, rollback and partial acceptance all happen."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, path = Path(source), Path(path)
    shutil.copytree(source, path)
    generator = torch.Generator().manual_seed(seed)
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            scale = noise * (tensor.float().std() if tensor.numel() > 1 else 1.0)
            tensors[name] = tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return path


def make_scripted_checkpoint(path, script: str, vocab_size: int = MIN_VOCAB_SIZE) -> Path:
    """A Llama checkpoint whose every next token depends only on the current one, so its output is
    known in advance: after any token outside `script` it writes `script` (UTF-8, one byte token
    each; its bytes must be distinct) and then EOS. Attention and MLP outputs are zero, the
    embedding is one-hot and the head maps each token to its successor, which gets a logit of
    sqrt(hidden_size) against 0 (probability 1 - 1e-5, sampled or not)."""
    from transformers import AutoModelForCausalLM

    chain = list(script.encode())
    if len(set(chain)) != len(chain):
        raise ValueError(f"the script's bytes must be distinct: {script!r}")
    hidden = 320
    config = make_tiny_config("llama", vocab_size, hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    successor = torch.full((vocab_size,), chain[0])
    successor[chain] = torch.tensor(chain[1:] + [EOS_ID])
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.zero_() if not name.endswith("norm.weight") else param.fill_(1.0)
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        model.lm_head.weight[successor, torch.arange(vocab_size)] = 1.0
    model.save_pretrained(path)
    make_tokenizer(vocab_size).save_pretrained(path)
    return Path(path)


EAGLE_TENSORS = ("fc.weight", "layer.input_layernorm.weight", "layer.self_attn.q_proj.weight",
                 "layer.self_attn.k_proj.weight", "layer.self_attn.v_proj.weight", "layer.self_attn.o_proj.weight",
                 "layer.post_attention_layernorm.weight", "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight",
                 "layer.mlp.down_proj.weight", "norm.weight")


def make_eagle_head(target, path, seed: int = 0, scale: float = 0.2, copy_target: bool = False,
                    draft_vocab: list[int] | None = None, feature_layers: list[int] | None = None) -> Path:
    """An EAGLE head directory (the format engine/models/eagle.py loads) for a target checkpoint: the
    target's config with the eagle block, and random fp32 weights of the right shapes.

    copy_target (a one-layer target): fc passes the token's embedding and drops the feature, and the
    layer and norm are the target's, so the head at position p computes the target at p + 1 over
    the tokens after the first (RoPE sees only relative positions): a head that agrees with its
    target almost always, for tests that need high acceptance.

    draft_vocab: the (ascending) token ids the head may draft. feature_layers: an EAGLE-3-style head
    over those decoder layers' fused outputs."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    config.update(architectures=["EagleHead"], model_type="llama", num_hidden_layers=1, attention_bias=False,
                  mlp_bias=False, eagle={"format": 1, "feature": "final_norm_hidden", "unroll": 1,
                                         "target_hidden_size": hidden, "target_vocab_size": config["vocab_size"]})
    config.pop("layer_types", None)
    if feature_layers:
        config["eagle"].update(feature="fused_layers", feature_layers=list(feature_layers))
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"fc.weight": (hidden, 2 * hidden), "layer.self_attn.q_proj.weight": (heads * head_dim, hidden),
              "layer.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
              "layer.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
              "layer.self_attn.o_proj.weight": (hidden, heads * head_dim),
              "layer.mlp.gate_proj.weight": (inter, hidden), "layer.mlp.up_proj.weight": (inter, hidden),
              "layer.mlp.down_proj.weight": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in EAGLE_TENSORS:
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(hidden, generator=generator)
        else:
            shape = shapes[name]
            tensors[name] = scale * torch.randn(shape, generator=generator) / shape[1] ** 0.5
    if copy_target:
        from safetensors.torch import load_file

        weights = load_file(str(Path(target) / "model.safetensors"))
        if any(key.startswith("model.layers.1.") for key in weights):
            raise ValueError("copy_target needs a one-layer target")
        tensors = {name: weights["model.norm.weight" if name == "norm.weight" else
                                 name.replace("layer.", "model.layers.0.", 1)].clone()
                   for name in EAGLE_TENSORS if name != "fc.weight"}
        tensors["fc.weight"] = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)
    if feature_layers:
        shape = (hidden, len(feature_layers) * hidden)
        tensors["fuse.weight"] = scale * torch.randn(shape, generator=generator) / shape[1] ** 0.5
    if draft_vocab is not None:
        tensors["draft_vocab"] = torch.tensor(draft_vocab, dtype=torch.long)
        config["eagle"]["draft_vocab_size"] = len(draft_vocab)
        (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def run_requests(engine, prompts, params, after_step=None) -> tuple[list[list[int]], list]:
    """Add one request per prompt (ids "0", "1", ...; `params` for all, or a list with one each), step the
    engine until every request has finished (calling after_step(engine) after each step), and check that every
    KV block came back. Returns each prompt's tokens and its final output, in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i] if isinstance(params, list) else params)
    tokens, finals = {str(i): [] for i in range(len(prompts))}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if after_step is not None:
            after_step(engine)
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    ids = [str(i) for i in range(len(prompts))]
    return [tokens[i] for i in ids], [finals[i] for i in ids]


def recover_from_p(target_probs, draft_ids, num_drafts, draft_probs, is_greedy, generators, coupled_choice=None):
    """A rejection sampler subtly broken, for negative controls: the right acceptance test, but a
    rejected draft is replaced by a sample from p (under a grammar, the masked p'), not from the
    residual max(0, p - q)."""
    import torch

    from engine.spec_decode.rejection import rejection_sample

    out, accepted = rejection_sample(target_probs, draft_ids, num_drafts, draft_probs, is_greedy, generators,
                                     coupled_choice)
    rows = (accepted < num_drafts).nonzero().flatten()
    fresh = torch.multinomial(target_probs[rows, accepted[rows]], 1, generator=torch.Generator().manual_seed(8))
    out[rows, accepted[rows]] = fresh.flatten()
    return out, accepted


def one_worker_queue(engine, monkeypatch, timeout: float | None = None):
    """The engine's grammar queue replaced by a one-worker one whose first regex compile blocks until
    released; returns (queue, release, the kinds whose compile ran, in order)."""
    import threading

    from engine.structured import GRAMMAR_COMPILE_TIMEOUT, GrammarQueue

    queue = GrammarQueue(engine.grammars.compiler, timeout=timeout or GRAMMAR_COMPILE_TIMEOUT, workers=1)
    monkeypatch.setattr(engine, "grammars", queue)
    release, compiled = threading.Event(), []
    real_state = queue.compiler.state

    def recording_state(spec):
        compiled.append(spec.kind)
        if spec.kind == "regex":
            release.wait(30)
        return real_state(spec)

    monkeypatch.setattr(queue.compiler, "state", recording_state)
    return queue, release, compiled


def branching_prompts(num_branching: int, plain_lengths: tuple[int, ...]) -> list[list[int]]:
    """Contexts whose last tokens occurred before with different continuations (copying proposers
    draft and branch there), then random ones of the given lengths (nothing to copy)."""
    import random

    rng = random.Random(3)
    out = []
    for _ in range(num_branching):
        stem = [rng.randrange(256) for _ in range(3)]
        tails = [[rng.randrange(256) for _ in range(4)] for _ in range(3)]
        out.append([t for tail in tails for t in stem + tail] + stem)
    return out + [[rng.randrange(256) for _ in range(n)] for n in plain_lengths]
