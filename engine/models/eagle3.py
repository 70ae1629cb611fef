"""Published EAGLE-3 heads: the checkpoints the EAGLE authors and SpecForge release for real targets
(e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, lmsys/sglang-EAGLE3-*), served by the same proposer as
our own heads (engine/spec_decode/eagle.py).

The format (a Hugging Face-style directory):
  config.json        "architectures": ["LlamaForCausalLMEagle3"] (or "Eagle3LlamaForCausalLM"),
                     one Llama layer's sizes (hidden_size, heads, intermediate_size, rope settings),
                     "vocab_size" (the target's), "draft_vocab_size", optionally "target_hidden_size",
                     "norm_before_residual", and the target layers it reads,
                     "eagle_aux_hidden_state_layer_ids" (top level or inside "eagle_config"; when
                     absent, (2, L // 2, L - 3) for an L-layer target, as vLLM and SGLang pick).
  model.safetensors  fc.weight [H, 3 * target H], midlayer.{input_layernorm, hidden_norm,
                     self_attn.{q,k,v}_proj [.., 2H], self_attn.o_proj, post_attention_layernorm,
                     mlp.{gate,up,down}_proj}.weight, norm.weight, lm_head.weight [draft vocab, H],
                     d2t [draft vocab] (draft id i is target token i + d2t[i]), t2d (unused), and
                     optionally embed_tokens.weight (else the target's embedding table is used).

Layer id j names the hidden state entering the target's decoder layer j (0 would be the
embeddings), i.e. our feature layer j - 1 (the residual stream after layer j - 1).

One step at position p, from the feature f_p (fc of the target's three layers, or the head's own
previous output while it chains) and the embedding e of token x_{p+1}:

    a     = cat(input_layernorm(e), hidden_norm(f_p))          [2H] into q/k/v
    r     = f_p + attn(a)                                       (hidden_norm(f_p) + attn(a) with
    out_p = r + mlp(post_attention_layernorm(r))                 norm_before_residual)
    logits = lm_head(norm(out_p))                               over the draft vocabulary

out_p, before the final norm, is the next step's feature, as EAGLE-3 chains.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.eagle import SelfDraftingHead
from engine.models.llama import CausalLM, DecoderLayer, FusedLinear, RMSNorm, arrange_rotary_dims, scatter_draft_logits

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
OWN_EMBEDDINGS = "embed_tokens.weight"


def is_published_eagle3(path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    names = json.loads(config.read_text()).get("architectures") or []
    return bool(names) and names[0] in ARCHITECTURES


class PublishedEagle3Head(SelfDraftingHead):
    extra_tensors = ("d2t", "t2d")   # d2t is read by load_published_eagle3; t2d is its inverse

    def __init__(self, config, target: CausalLM, own_embeddings: bool):
        super().__init__(config, target)
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(getattr(config, "mlp_bias", False)),
                 "qk_norm": False}
        self.fc = nn.Linear(3 * target.hidden_size, hidden, bias=False)
        self.midlayer = DecoderLayer(config, self.head_dim, flags)
        attn = self.midlayer.self_attn   # q/k/v read the embedding and the feature side by side
        attn.qkv_proj = FusedLinear(2 * hidden, [attn.q_size, attn.kv_size, attn.kv_size],
                                    ["q_proj", "k_proj", "v_proj"], bias=bias)
        self.midlayer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or target.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(target.vocab_size, hidden) if own_embeddings else None
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.draft_vocab: torch.Tensor | None = None   # target token id of each draft id (None: the same)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """features [T, 3 * target H] (the target's layers) or [T, H] (the head's own outputs while
        it chains) -> [T, H], before the final norm."""
        embed = self._shared["embed"] if self.embed_tokens is None else self.embed_tokens
        embedded = embed(input_ids)
        features = features.to(embedded.dtype)
        if features.shape[-1] != self.hidden_size:
            features = self.fc(features)
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        cos, sin = self.rotary_emb(positions)
        hidden = layer.self_attn(torch.cat((layer.input_layernorm(embedded), normed), dim=-1),
                                 cos, sin, kv_caches[0], meta)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        return layer.mlp(hidden) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.lm_head(self.norm(hidden))
        if self.draft_vocab is None:
            return small.float()
        return scatter_draft_logits(small, self.draft_vocab, self.vocab_size)


def feature_layers_of(config, target: CausalLM, path) -> list[int]:
    """The head's target layer ids, as our feature layers (the residual stream after layer j - 1)."""
    eagle_config = getattr(config, "eagle_config", None) or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"the EAGLE-3 head in {path!r} reads the target's last hidden state only "
                         "(use_aux_hidden_state: false); only heads over three target layers are supported")
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or \
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
    layers = target.num_layers
    ids = list(ids) if ids else [2, layers // 2, layers - 3]
    if len(ids) != 3 or any(int(j) < 1 for j in ids):
        raise ValueError(f"the EAGLE-3 head in {path!r} reads target layers {ids}: it needs three layer ids "
                         "of at least 1 (0 would be the embeddings, which are not captured)")
    return [int(j) - 1 for j in ids]


def load_published_eagle3(path: str, target: CausalLM, dtype: torch.dtype,
                          device: torch.device) -> PublishedEagle3Head:
    """Load a published EAGLE-3 head strictly for this target; a ValueError names what does not fit."""
    from engine.models.loader import load_hf_config, load_weights, open_checkpoint

    config = load_hf_config(path)
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if config.vocab_size != target.vocab_size or target_hidden != target.hidden_size:
        raise ValueError(f"the EAGLE-3 head in {path!r} was trained for a target with hidden size "
                         f"{target_hidden} and {config.vocab_size} tokens; this target has "
                         f"{target.hidden_size} and {target.vocab_size}")
    layers = feature_layers_of(config, target, path)
    checkpoint = open_checkpoint(path)
    names = set(checkpoint.tensor_names())
    own_embeddings = OWN_EMBEDDINGS in names
    if config.hidden_size != target.hidden_size and not own_embeddings:
        raise ValueError(f"the EAGLE-3 head in {path!r} has hidden size {config.hidden_size}, not the "
                         f"target's {target.hidden_size}, so it needs its own {OWN_EMBEDDINGS}")
    with torch.device("meta"):
        head = PublishedEagle3Head(config, target, own_embeddings)
    load_weights(head, checkpoint, dtype, torch.device(device))
    arrange_rotary_dims(head)
    head.init_buffers(torch.device(device), dtype)
    if head.draft_vocab_size != target.vocab_size:
        head.draft_vocab = _draft_to_target(checkpoint, head.draft_vocab_size, target.vocab_size, path).to(device)
    target.set_feature_layers(layers)   # the target captures them; it says which layers it has
    return head.eval()


def _draft_to_target(checkpoint, draft_vocab_size: int, vocab_size: int, path) -> torch.Tensor:
    d2t = checkpoint.get("d2t")
    if d2t is None or d2t.shape != (draft_vocab_size,):
        raise ValueError(f"the EAGLE-3 head in {path!r} drafts {draft_vocab_size} of {vocab_size} tokens, so it "
                         f"needs a d2t tensor of shape [{draft_vocab_size}] (draft id -> target id offsets)")
    token_ids = torch.arange(draft_vocab_size) + d2t.to(torch.long)
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size or len(token_ids.unique()) != draft_vocab_size:
        raise ValueError(f"the EAGLE-3 head in {path!r}: d2t maps draft ids to target ids outside "
                         f"[0, {vocab_size}) or to one target id twice")
    return token_ids
