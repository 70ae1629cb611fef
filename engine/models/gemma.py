"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

Both differ from the Llama family (engine/models/llama.py) in the same ways, read from the Hugging
Face config as transformers defines them:
    - the token embedding is scaled by sqrt(hidden_size), that factor first rounded to the model dtype;
    - RMSNorm scales by (1 + weight), in fp32, and rounds once at the end;
    - each block norms its attention and MLP outputs too (post_attention_layernorm,
      post_feedforward_layernorm) before adding them to the residual stream, and norms the MLP's input
      with pre_feedforward_layernorm;
    - the MLP gate is gelu (tanh approximation), and attention scales by query_pre_attn_scalar ** -0.5;
    - layers alternate between sliding-window and full attention (config.layer_types).
Gemma 2 soft-caps the attention scores (attn_logit_softcapping) and the final logits
(final_logit_softcapping). Gemma 3 instead RMS-norms each query and key head before RoPE, and has two
RoPEs: full layers rotate with rope_parameters["full_attention"] (theta 1e6, maybe linear scaling),
sliding ones with rope_parameters["sliding_attention"] (theta 1e4: the older rope_local_base_freq).

The classes keep CausalLM's interface (engine/models/llama.py) and Hugging Face's parameter names, with
q/k/v and gate/up fused as there, so the loader, the GGUF linears and the runner treat them alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import Attention, CausalLM, FusedLinear, layer_sliding_windows, scatter_draft_logits
from engine.models.rope import RotaryEmbedding

# transformers' names of the MLP gate activations Gemma configs use -> F.gelu's `approximate`.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) in fp32, round to x's dtype once (Llama
    rounds before its scaling)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))   # (1 + 0): the identity scale
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaAttention(Attention):
    """The Llama family's attention with Gemma's query scale (query_pre_attn_scalar), Gemma 2's score
    soft-capping, and Gemma 3's q/k norms scaling by (1 + weight)."""

    def __init__(self, config, head_dim: int, sliding_window: int | None, qk_norm: bool):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, head_dim, bias, bias, qk_norm=False, sliding_window=sliding_window)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)   # Gemma 2; None for Gemma 3
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)

    def norm_heads(self, qk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(qk, weight, self.q_norm.eps)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation not in _GELU:
            raise ValueError(f"unsupported Gemma hidden_activation {activation!r}; supported: {', '.join(_GELU)}")
        self.approximate = _GELU[activation]
        self.intermediate = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, [self.intermediate] * 2, ["gate_proj", "up_proj"],
                                        bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, sliding_window: int | None, qk_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, head_dim, sliding_window, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, cos, sin, kv_cache, meta):
        """The residual stream in, the residual stream out: each sub-block's output is normed before it is added."""
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def rope_configs(config) -> dict[str, object]:
    """layer type -> a config whose flat rope_parameters are that type's, for rope.RotaryEmbedding. Gemma 3
    keys its rope_parameters by layer type; Gemma 2 has one RoPE for every layer."""
    from transformers import LlamaConfig

    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" not in params and "sliding_attention" not in params:
        return {"full_attention": config, "sliding_attention": config}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {kind: LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                              head_dim=head_dim, max_position_embeddings=config.max_position_embeddings,
                              rope_parameters=dict(params[kind]))
            for kind in ("full_attention", "sliding_attention")}


class GemmaModel(nn.Module):
    def __init__(self, config, head_dim: int, qk_norm: bool):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, head_dim, window, qk_norm) for window in self.windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        ropes = rope_configs(config)
        self.rotary_emb = RotaryEmbedding(ropes["full_attention"], head_dim, config.max_position_embeddings)
        self.rotary_emb_local = None if ropes["sliding_attention"] is ropes["full_attention"] else \
            RotaryEmbedding(ropes["sliding_attention"], head_dim, config.max_position_embeddings)
        self.feature_layers: tuple[int, ...] = ()   # as LlamaModel's (CausalLM.set_feature_layers)
        self.captured: torch.Tensor | None = None

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling (bf16: 25.3 -> 25.25 for 640).
        self.embed_scale = torch.tensor(self.hidden_size ** 0.5, dtype=dtype, device=device)

    def forward(self, input_ids, positions, meta, kv_caches):
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        full = self.rotary_emb(positions)
        local = full if self.rotary_emb_local is None else self.rotary_emb_local(positions)
        captured = []
        for index, (layer, kv_cache, window) in enumerate(zip(self.layers, kv_caches, self.windows)):
            cos, sin = full if window is None else local
            hidden = layer(hidden, cos, sin, kv_cache, meta)
            if index in self.feature_layers:
                captured.append(hidden)
        if captured:
            self.captured = torch.cat(captured, dim=-1)
        return self.norm(hidden)


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 decoder + LM head, with CausalLM's interface (forward, compute_logits,
    init_buffers, tie_weights, features) around a Gemma decoder (build_decoder)."""

    qk_norm = False
    tied_by_default = True
    _fused_ops = False

    def __init__(self, config):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
        super().__init__(config)
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def build_decoder(self, config) -> nn.Module:
        return GemmaModel(config, self.head_dim, self.qk_norm)

    @property
    def fused_ops(self) -> bool:
        return self._fused_ops

    @fused_ops.setter
    def fused_ops(self, on: bool) -> None:
        # llama.use_fused_cpu_ops sets this to have the runner attend with the C++ kernel's backend. The
        # kernel has no soft-capping: Gemma 2 (every layer soft-capped) keeps the torch reference instead of
        # having its layers build each pass's reference metadata (PassMetadata.reference).
        # Gemma 3 uses the kernel: q/k norms come before it, and its RoPE tables are per layer anyway.
        self._fused_ops = bool(on) and self.attn_softcap is None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32, soft-capped where the config says so."""
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.output_tokens is not None:
            logits = scatter_draft_logits(logits, self.output_tokens, self.vocab_size)
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    qk_norm = False


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True
