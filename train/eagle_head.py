"""The EAGLE head as a trainable transformers-style module, its unrolled training forward, and its
export (the format engine/models/eagle.py loads). The trainer is train/eagle.py.

For a token sequence x_0..x_{T-1} and the target's feature h_p (its final hidden state at p, after
the final norm, so that the target's logits at p are lm_head(h_p)):

    u_p    = fc(cat(h_p, embed(x_{p+1})))       fc: [2H -> H], no bias
    out_p  = norm(LlamaDecoderLayer(u_p))       one pre-norm layer, causal, RoPE at absolute position p
    logits = lm_head(out_p)                     predicts x_{p+2}

embed and lm_head are the target's (frozen, shared, not saved), and so is its rotary embedding
(rope_theta / rope scaling exactly as the target's). out_p stands in for h_{p+1}, so the head chains:
its next step, at position p + 1, takes (out_p, the token just drafted).

With feature layers (EAGLE-3's fused features), h_p is fuse(cat(the outputs of those decoder layers
at p)), fuse: [L*H -> H], for the target's features; chained steps take the head's own output.

With a draft vocabulary (EAGLE-3's reduced vocabulary), logits are lm_head's rows of those tokens
only: on a small target the full LM head is most of the head's cost (49152 x 576 against a 4M
parameter layer for SmolLM2-135M), and the few thousand tokens its answers use cover ~99% of them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.models.eagle import (DRAFT_VOCAB, FEATURE, FUSED, HEAD_FORMAT,   # the format both sides share
                                 head_format_problem)
from engine.models.llama import check_feature_layers as check_layers
from train.common import TrainError

FUSE_TENSOR = "fuse.weight"
HEAD_TENSORS = ("fc.weight", "layer.input_layernorm.weight", "layer.self_attn.q_proj.weight",
                "layer.self_attn.k_proj.weight", "layer.self_attn.v_proj.weight", "layer.self_attn.o_proj.weight",
                "layer.post_attention_layernorm.weight", "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight",
                "layer.mlp.down_proj.weight", "norm.weight")


def head_config(target, unroll: int = 1, dtype: str = "bfloat16", feature_layers: list[int] | None = None) -> dict:
    """config.json of a head for this target: the target's config, as one plain Llama layer."""
    layers = check_feature_layers(target, feature_layers)
    config = target.config.to_dict()
    config.pop("layer_types", None)   # per-layer lists of the target's depth
    config.update(architectures=["EagleHead"], model_type="llama", num_hidden_layers=1, attention_bias=False,
                  mlp_bias=False, dtype=dtype,
                  eagle={"format": HEAD_FORMAT, "feature": FEATURE, "unroll": unroll,
                         "target_hidden_size": target.config.hidden_size,
                         "target_vocab_size": target.config.vocab_size})
    if layers:
        config["eagle"].update(feature=FUSED, feature_layers=layers)
    return config


def check_feature_layers(target, layers) -> list[int]:
    """The engine's rule (engine.models.llama.check_feature_layers) as a TrainError; [] for none."""
    try:
        return list(check_layers(layers or [], target.config.num_hidden_layers))
    except ValueError as exc:
        raise TrainError(str(exc)) from None


def target_features(target, input_ids: torch.Tensor, feature_layers=()) -> torch.Tensor:
    """[B, T, H]: the target's final-norm hidden states h (its logits are lm_head(h)); with feature
    layers, [B, T, L*H + H]: those layers' outputs, concatenated, then h (EagleHeadTrainer.head_input
    and .final take them apart)."""
    if not feature_layers:
        return target.get_decoder()(input_ids=input_ids).last_hidden_state
    out = target.get_decoder()(input_ids=input_ids, output_hidden_states=True)
    # hidden_states[i + 1] is layer i's output for every layer but the last (whose entry is normed)
    return torch.cat([out.hidden_states[i + 1] for i in feature_layers] + [out.last_hidden_state], dim=-1)


class EagleHeadTrainer(nn.Module):
    """fc, one transformers LlamaDecoderLayer (`layer`) and `norm`; state_dict() is exactly the
    exported tensors. The target's embedding, LM head and rotary embedding are used, not owned."""

    def __init__(self, config: dict, target):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        super().__init__()
        check_target(target)
        eagle = config.get("eagle") or {}
        problem = head_format_problem(eagle)
        if problem:
            raise TrainError(f"the head config: {problem}")
        hidden = config["hidden_size"]
        if hidden != target.config.hidden_size or eagle.get("target_vocab_size") != target.config.vocab_size:
            raise TrainError(f"the head was made for a target with hidden size {hidden} and "
                             f"{eagle.get('target_vocab_size')} tokens; this target has {target.config.hidden_size} "
                             f"and {target.config.vocab_size}")
        self.head_config = config
        llama = LlamaConfig.from_dict({k: v for k, v in config.items() if k != "eagle"})
        llama._attn_implementation = "eager"
        self.feature_layers = check_feature_layers(target, eagle.get("feature_layers"))
        self.hidden_size = hidden
        if self.feature_layers:
            self.fuse = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.num_heads, self.num_kv_heads = llama.num_attention_heads, llama.num_key_value_heads
        self.head_dim = self.layer.self_attn.head_dim
        self.scaling = self.layer.self_attn.scaling
        # plain attributes, not submodules: kept out of parameters() and state_dict()
        self._shared = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings(),
                        "rotary": target.get_decoder().rotary_emb}
        self.register_buffer(DRAFT_VOCAB, None)   # all tokens, until set_draft_vocab

    def set_draft_vocab(self, token_ids) -> None:
        """Draft only these tokens (sorted, unique; saved with the head as DRAFT_VOCAB)."""
        ids = torch.as_tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
        vocab = self._shared["lm_head"].weight.shape[0]
        if len(ids) == 0 or ids[0] < 0 or ids[-1] >= vocab:
            raise TrainError(f"a draft vocabulary needs token ids in [0, {vocab})")
        self.register_buffer(DRAFT_VOCAB, ids.to(self.fc.weight.device))
        self.head_config["eagle"]["draft_vocab_size"] = len(ids)

    # ---------------------------------------------------------------- construction / io

    @classmethod
    def from_target(cls, target, unroll: int = 1, feature_layers: list[int] | None = None) -> "EagleHeadTrainer":
        """fc = [I, 0] (the feature passes through), the layer and norm copied from the target's last
        decoder layer and final norm (biases and q/k norms, if the target has them, are dropped);
        with feature layers, fuse passes the highest one through."""
        head = cls(head_config(target, unroll, feature_layers=feature_layers), target).float()
        hidden = target.config.hidden_size
        last = target.get_decoder().layers[-1].state_dict()
        with torch.no_grad():
            if head.feature_layers:
                head.fuse.weight.zero_()
                head.fuse.weight[:, -hidden:].copy_(torch.eye(hidden))
            head.fc.weight.zero_()
            head.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            head.layer.load_state_dict({k: last[k].float() for k in head.layer.state_dict()}, strict=True)
            head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        return head

    @classmethod
    def load(cls, path, target) -> "EagleHeadTrainer":
        """An exported head directory (or a training checkpoint), strictly, as fp32."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise TrainError(f"no EAGLE head in {path} (needs config.json and model.safetensors)")
        head = cls(json.loads((path / "config.json").read_text()), target).float()
        tensors = load_file(str(path / "model.safetensors"))
        vocab = tensors.pop(DRAFT_VOCAB, None)
        missing, extra = set(head.tensor_names) - set(tensors), set(tensors) - set(head.tensor_names)
        if missing or extra:
            raise TrainError(f"{path}: head tensors missing {sorted(missing)}, unexpected {sorted(extra)}")
        head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        if vocab is not None:
            head.set_draft_vocab(vocab.tolist())
        return head

    def save_pretrained(self, path, dtype: torch.dtype = torch.float32, **_) -> None:
        """config.json + model.safetensors (the names of HEAD_TENSORS) in `dtype`; also what
        train.common.save_checkpoint calls."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = dict(self.head_config, dtype=str(dtype).replace("torch.", ""))
        (path / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items() if k != DRAFT_VOCAB}
        assert tuple(sorted(tensors)) == tuple(sorted(self.tensor_names)), sorted(tensors)
        if self.draft_vocab is not None:
            tensors[DRAFT_VOCAB] = self.draft_vocab.detach().cpu().contiguous()
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return HEAD_TENSORS + ((FUSE_TENSOR,) if self.feature_layers else ())

    # ---------------------------------------------------------------- forward pieces

    def head_input(self, features: torch.Tensor) -> torch.Tensor:
        """What the head's first step takes of target_features' output: the final hidden state, or
        the fused layers."""
        return features[..., :-self.hidden_size] if self.feature_layers else features

    def final(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state in target_features' output (the teacher's logits come from it)."""
        return features[..., -self.hidden_size:]

    def _input(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self._shared["embed"](tokens)
        if feature.shape[-1] != self.hidden_size:   # the target's fused layers (chained steps feed their own)
            feature = self.fuse(feature.to(embedded.dtype))
        return self.fc(torch.cat((feature.to(embedded.dtype), embedded), dim=-1))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.zeros((), device=positions.device, dtype=torch.float32)
        return self._shared["rotary"](dummy, positions)   # fp32, as the target's own forward gets them

    def _qkv(self, x: torch.Tensor, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn, (b, t, _) = self.layer.self_attn, x.shape
        q = attn.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _attend(self, q, keys, values, extra: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Training-time-test attention. q [B, heads, T, d] (one chain step, query t = anchor t);
        keys/values [B, kv, T, d] of step 1 (true features), seen causally (s <= t); `extra` the
        (k, v) [B, kv, T, d] of the chain's later steps, each seen by anchor t at its own row t only."""
        b, _, t, d = q.shape
        qg = q.view(b, self.num_kv_heads, -1, t, d)                        # [B, kv, groups, T, d]
        scores = torch.einsum("bkgtd,bksd->bkgts", qg, keys).float()
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(qg * k.unsqueeze(2)).sum(-1, keepdim=True).float() for k, _ in extra]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1) * self.scaling, dim=-1).to(values.dtype)
        out = torch.einsum("bkgts,bksd->bkgtd", probs[..., :t], values)
        for i, (_, v) in enumerate(extra):
            out = out + probs[..., t + i: t + i + 1] * v.unsqueeze(2)
        return out.reshape(b, -1, t, d).transpose(1, 2).reshape(b, t, -1)

    def unrolled(self, features: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: the head's outputs ĥ [B, T, H] of chain steps 1..steps, row t of
        each for anchor t. Step j at anchor t is the query at position t + j - 1, input (h_t, x_{t+1})
        for j = 1, else (step j - 1's output, x_{t+j}); it predicts x_{t+j+1}. It attends to step 1's
        keys at positions 0..t and to steps 2..j of its own anchor, as the head's KV cache holds at
        inference. Rows whose token runs past T are fed the pad token 0 (their results are unused)."""
        b, t = input_ids.shape
        layer, outs, feature = self.layer, [], self.head_input(features)
        base = torch.arange(t, device=input_ids.device).expand(b, t)
        keys = values = None
        extra: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(1, steps + 1):
            tokens = torch.zeros_like(input_ids)
            tokens[:, :t - j] = input_ids[:, j:]
            u = self._input(feature, tokens)
            cos, sin = self._rope(base + (j - 1))
            q, k, v = self._qkv(layer.input_layernorm(u), cos, sin)
            if j == 1:
                keys, values = k, v
            else:
                extra.append((k, v))
            x = u + layer.self_attn.o_proj(self._attend(q, keys, values, extra))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            feature = self.norm(x)
            outs.append(feature)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary when there is one (column i is token draft_vocab[i])."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight.to(hidden.dtype))

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own logits over its whole vocabulary (features: target_features' output)."""
        return self._shared["lm_head"](self.final(features))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        weight = self._shared["lm_head"].weight
        return weight if self.draft_vocab is None else weight[self.draft_vocab]

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of logits columns."""
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    def plain_forward(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """One step over a whole sequence through transformers' own decoder layer with a causal mask:
        row p from (features[p], next_tokens[p]) at position p. The reference the unrolled forward
        (at step 1) and the engine's head are checked against."""
        b, t = next_tokens.shape
        u = self._input(self.head_input(features), next_tokens)
        cos, sin = self._rope(torch.arange(t, device=u.device).expand(b, t))
        mask = torch.full((t, t), float("-inf"), device=u.device).triu(1)[None, None]
        return self.norm(self.layer(u, attention_mask=mask, position_embeddings=(cos, sin)))


def head_logits_teacher_forced(head: EagleHeadTrainer, target, input_ids: torch.Tensor) -> torch.Tensor:
    """Step-1 head logits, teacher-forced, no unroll: for input_ids [B, T], logits [B, T - 1, V] whose
    row p comes from (h_p, x_{p+1}) at position p and predicts x_{p+2} (the last position has no next
    token, so it has no row). Plain fp32 transformers ops; for parity tests against the engine."""
    features = target_features(target, input_ids, head.feature_layers)
    return head.logits(head.plain_forward(features[:, :-1], input_ids[:, 1:]))


def check_target(target) -> None:
    """The head is a Llama layer on the target's features: the target must look like a Llama."""
    config, decoder = target.config, target.get_decoder()
    if getattr(config, "hidden_act", "silu") != "silu":
        raise TrainError(f"the target's activation is {config.hidden_act!r}; EAGLE heads need a silu (Llama-like) MLP")
    for name in ("rotary_emb", "layers", "norm"):
        if not hasattr(decoder, name):
            raise TrainError(f"the target ({type(target).__name__}) is not Llama-like: its decoder has no {name!r}")
    lm_head = target.get_output_embeddings()
    if lm_head is None or getattr(lm_head, "bias", None) is not None:
        raise TrainError("the target needs an LM head without bias")
