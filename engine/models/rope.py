"""Rotary position embeddings (RoPE) as transformers computes them, precomputed per position.

Every RoPE type whose frequencies do not depend on the running sequence (default, linear, llama3,
yarn) comes from one table of angles; LongRoPE (Phi-3) switches from its short to its long factors
per position (rope_angles). The cache holds cos and a signed sin per position, in the model's dtype,
which the attention (engine/attention.py: apply_rope, and the C++ kernel) reads by position.
"""
from __future__ import annotations

import torch
from torch import nn

def _rope_parameters(config) -> dict:
    """RoPE settings from a transformers-5 `rope_parameters` dict or from the older
    `rope_theta` / `rope_scaling` attributes, as one dict with rope_type and rope_theta."""
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


# RoPE variants whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32 on CPU, attention_scaling), computed exactly as transformers does."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}, longrope")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling or 1.0)


def rope_angles(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(each position's rotation angles [max_positions, head_dim // 2] fp32, attention_scaling).

    LongRoPE (Phi-3) rescales the frequencies by short factors up to original_max_position_embeddings
    and by long ones past it. Here the choice is per position: a key's rotation must not change once
    it is in the paged cache, and a request's output must not depend on its batch. transformers
    instead rotates a whole forward by the long factors once its longest position passes that
    length, so the two agree on every sequence shorter than it, and past it on the positions
    from it on (the long table)."""
    positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
    params = _rope_parameters(config)
    if params["rope_type"] != "longrope":
        inv_freq, attention_scaling = rope_inverse_frequencies(config, head_dim)
        return positions[:, None] * inv_freq[None, :], attention_scaling
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    short, attention_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=original + 1)
    inv_freq = torch.where((positions >= original)[:, None], long.float()[None, :], short.float()[None, :])
    return positions[:, None] * inv_freq, float(attention_scaling or 1.0)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with cos/sin precomputed for every position up to max_positions.

    Cache layout [max_positions, 2, 1, head_dim]: cos, and sin with its first half
    negated, so that rope(x) = x * cos + roll(x, head_dim / 2) * sin_signed, which
    equals Hugging Face's x * cos + rotate_half(x) * sin term for term."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, 2, 1, head_dim), persistent=False)

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        """(Re)compute the cache in fp32 on the CPU, then store it in the model's dtype."""
        freqs, attention_scaling = rope_angles(self.config, self.head_dim, self.max_positions)   # [P, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)                # [P, D]
        cos = angles.cos() * attention_scaling
        sin = angles.sin() * attention_scaling
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        cache = torch.stack((cos, sin_signed), dim=1).unsqueeze(2)  # [P, 2, 1, D]
        self.cos_sin_cache = cache.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin_signed, each [T, 1, head_dim] (broadcast over heads)."""
        return self.cos_sin_cache[positions].unbind(1)
