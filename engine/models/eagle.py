"""An EAGLE-style self-drafting head: one decoder layer that runs on the target's own features.

For the token at position p + 1 and the target's feature h_p (its final hidden state at p, after
the final norm, so that the target's logits at p are lm_head(h_p)):

    u_p     = fc(cat(h_p, embed(x_{p+1})))          fc: [2H -> H], no bias
    out_p   = norm(DecoderLayer(u_p))               one Llama layer at absolute position p, own KV cache
    logits  = lm_head(out_p)                        predicts x_{p+2}

out_p stands in for the target's feature h_{p+1}, so the head chains: its next step takes
(out_p, the token it just drafted). The embedding table and the LM head are the target's,
shared and frozen; the head directory holds only fc, the layer and the norm (a few MB).

EAGLE-3's fused features ("feature": "fused_layers"): the target's feature at p is instead the
outputs of a few of its decoder layers (a low, a middle and a high one, "feature_layers"),
concatenated, and a `fuse` linear [L*H -> H] maps them to h_p before fc. Chained steps take the
head's own out_p as h_{p+1} directly, as EAGLE-3 does.

The head directory (written by `specserve distill --head eagle`, train/eagle.py):
  config.json        the target's config with "architectures": ["EagleHead"], "num_hidden_layers": 1,
                     and an "eagle" block {"format": 1, "feature": "final_norm_hidden", ...}
  model.safetensors  fc.weight, layer.{input_layernorm, self_attn.{q,k,v,o}_proj,
                     post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight, and
                     optionally draft_vocab (int64, ascending token ids; "draft_vocab_size" in the
                     "eagle" block): the head drafts only those tokens, through their rows of the
                     target's LM head (EAGLE-3's reduced vocabulary: on a small target the full LM
                     head costs several times the head's layer).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import CausalLM, DecoderLayer, RMSNorm, arrange_rotary_dims, scatter_draft_logits
from engine.models.rope import RotaryEmbedding

HEAD_FORMAT = 1
FEATURE = "final_norm_hidden"
FUSED = "fused_layers"
DRAFT_VOCAB = "draft_vocab"
PLAIN_LAYER = {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}


class SelfDraftingHead(nn.Module):
    """What every head shares: it looks like a one-layer model to ModelRunner (num_layers,
    num_kv_heads, head_dim, vocab_size, compute_logits), with the target's features as an extra
    input of forward, and it borrows the target's embedding table (and LM head) without owning them."""

    tie_word_embeddings = False   # for the strict loader: the head has no LM head of its own to tie

    def __init__(self, config, target: CausalLM):
        super().__init__()
        self.config = config
        self.num_layers = 1
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = target.vocab_size
        self.max_position_embeddings = target.max_position_embeddings
        self.sliding_window = None
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, target.max_position_embeddings)
        # The target's, not ours: kept out of state_dict so that loading and saving see the head only.
        # Its LM head is looked up at each call: serving swaps the target's linears for packed ones.
        self._shared = {"embed": target.model.embed_tokens, "target": target}

    def tie_weights(self) -> None:
        pass

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device, dtype)


class EagleHead(SelfDraftingHead):
    """Our own format (the module docstring), as `specserve distill --head eagle` trains it."""

    extra_tensors = (DRAFT_VOCAB,)   # read by load_eagle_head, not the weight loader

    def __init__(self, config, target: CausalLM):
        super().__init__(config, target)
        self.feature_layers = list(config.eagle.get("feature_layers") or [])   # empty: the final hidden state
        if self.feature_layers:
            self.fuse = nn.Linear(len(self.feature_layers) * config.hidden_size, config.hidden_size, bias=False)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config, self.head_dim, PLAIN_LAYER)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.draft_vocab: torch.Tensor | None = None   # token ids the head drafts (None: all)
        self.draft_lm_head: nn.Linear | None = None    # their rows of the target's LM head

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft only these tokens. Call it before the target's linears are packed: it copies their
        rows of the target's LM head into a linear of its own."""
        ids = token_ids.to(torch.long)
        if ids.ndim != 1 or len(ids) == 0 or not bool((ids[1:] > ids[:-1]).all()) \
                or int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"an EAGLE head's {DRAFT_VOCAB} must be ascending token ids in [0, {self.vocab_size})")
        weight = getattr(self._shared["target"].lm_head, "weight", None)
        if weight is None:
            raise ValueError("the target's LM head is packed already: load the EAGLE head before packing the target")
        self.draft_vocab = ids.to(weight.device)
        self.draft_lm_head = nn.Linear(self.hidden_size, len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.draft_lm_head.weight.copy_(weight[self.draft_vocab])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; features [T, H] (the feature before each token: the target's,
        or the head's own outputs while it chains) or [T, L*H] (the target's fused layers) -> [T, H]."""
        embedded = self._shared["embed"](input_ids)
        if features.shape[-1] != self.hidden_size:
            features = self.fuse(features.to(embedded.dtype))
        hidden = self.fc(torch.cat((features.to(embedded.dtype), embedded), dim=-1))
        cos, sin = self.rotary_emb(positions)
        hidden, residual = self.layer(hidden, None, cos, sin, kv_caches[0], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, target vocab]; with a draft vocabulary, -inf outside it (q gives those tokens no mass)."""
        if self.draft_vocab is None:
            return self._shared["target"].lm_head(hidden).float()
        return scatter_draft_logits(self.draft_lm_head(hidden), self.draft_vocab, self.vocab_size)


def head_format_problem(eagle) -> str | None:
    """Why a config's "eagle" block is not a head of this format (None: it is). The engine's loader
    and the trainer (train/eagle_head.py) hold heads to this one rule."""
    if not isinstance(eagle, dict) or eagle.get("format") != HEAD_FORMAT or eagle.get("feature") not in (FEATURE, FUSED):
        return (f'not an EAGLE head of format {HEAD_FORMAT} (its config.json needs "eagle": {{"format": '
                f'{HEAD_FORMAT}, "feature": "{FEATURE}" or "{FUSED}"}})')
    if (eagle["feature"] == FUSED) != bool(eagle.get("feature_layers")):
        return f"feature {eagle['feature']!r} {'needs' if eagle['feature'] == FUSED else 'takes no'} feature_layers"
    return None


def is_eagle_head(path) -> bool:
    """Our own head directory, or a published EAGLE-3 one (engine/models/eagle3.py)."""
    from engine.models.eagle3 import is_published_eagle3

    config = Path(path) / "config.json"
    return config.is_file() and ("eagle" in json.loads(config.read_text()) or is_published_eagle3(path))


def load_eagle_head(path: str, target: CausalLM, dtype: torch.dtype, device: torch.device) -> SelfDraftingHead:
    """Load a head directory strictly (every tensor named above, nothing else) for this target; a
    published EAGLE-3 head through engine/models/eagle3.py."""
    from engine.models.eagle3 import is_published_eagle3, load_published_eagle3
    from engine.models.loader import load_hf_config, load_weights, open_checkpoint

    if is_published_eagle3(path):
        return load_published_eagle3(path, target, dtype, device)

    config = load_hf_config(path)
    eagle = getattr(config, "eagle", None)
    problem = head_format_problem(eagle)
    if problem:
        raise ValueError(f"{path!r}: {problem}")
    if config.hidden_size != target.hidden_size or eagle.get("target_vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"the EAGLE head in {path!r} was trained for a target with hidden size {config.hidden_size} "
                         f"and {eagle.get('target_vocab_size')} tokens; this target has {target.hidden_size} and "
                         f"{target.vocab_size}")
    with torch.device("meta"):
        head = EagleHead(config, target)
    checkpoint = open_checkpoint(path)
    load_weights(head, checkpoint, dtype, torch.device(device))
    arrange_rotary_dims(head)
    head.init_buffers(torch.device(device), dtype)
    vocab = checkpoint.get(DRAFT_VOCAB)
    if (vocab is None) != (eagle.get("draft_vocab_size") is None) or (
            vocab is not None and len(vocab) != eagle["draft_vocab_size"]):
        raise ValueError(f"the EAGLE head in {path!r}: config.json's draft_vocab_size "
                         f"({eagle.get('draft_vocab_size')}) does not match its {DRAFT_VOCAB} tensor "
                         f"({None if vocab is None else len(vocab)} tokens)")
    if vocab is not None:
        head.set_draft_vocab(vocab)
    if head.feature_layers:   # the target must capture them; it says which layers it has
        target.set_feature_layers(head.feature_layers)
    return head.eval()
