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


def rotary_dim(config, head_dim: int) -> int:
    """The dimensions of each head that rotate: all, or with partial_rotary_factor (Phi-4-mini: 0.75)
    the first head_dim * factor of them (the rest pass unrotated)."""
    params = _rope_parameters(config)
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * partial)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {dim} rotary dimensions of {head_dim}: "
                         "it must give an even number from 2 to the head size")
    return dim


def rotary_order(config, head_dim: int) -> torch.Tensor | None:
    """With partial RoPE, the order in which a head's query/key dimensions are kept (new dimension j is
    the checkpoint's order[j]), so that the full-head neox kernels serve it: the rotary pairs (i,
    i + rotary / 2) become the kernels' pairs (i, i + head_dim / 2) and the passing dimensions pair up
    with each other at angle 0 (RotaryEmbedding: cos 1, sin 0). A q . k product is the same in any
    order shared by both; None when every dimension rotates."""
    rotary = rotary_dim(config, head_dim)
    if rotary == head_dim:
        return None
    half, passing = rotary // 2, (head_dim - rotary) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rotary, rotary + passing),
                      torch.arange(half, rotary), torch.arange(rotary + passing, head_dim)])


def rope_inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32 on CPU, attention_scaling), computed exactly as transformers does."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = rotary_dim(config, head_dim)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}, longrope")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling or 1.0)


def rope_angles(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(each position's rotation angles [max_positions, rotary_dim // 2] fp32, attention_scaling).

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
        freqs, attention_scaling = rope_angles(self.config, self.head_dim, self.max_positions)   # [P, R/2]
        half = self.head_dim // 2
        # Partial RoPE: the passing dimensions (rotary_order puts them after the rotary ones in each
        # half) at angle 0 and scale 1: cos 1, sin 0, exactly.
        scale = torch.ones(half)
        scale[:freqs.shape[1]] = attention_scaling
        freqs = torch.nn.functional.pad(freqs, (0, half - freqs.shape[1]))
        angles, scale = torch.cat((freqs, freqs), dim=-1), torch.cat((scale, scale))   # [P, D], [D]
        cos = angles.cos() * scale
        sin = angles.sin() * scale
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        cache = torch.stack((cos, sin_signed), dim=1).unsqueeze(2)  # [P, 2, 1, D]
        self.cos_sin_cache = cache.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin_signed, each [T, 1, head_dim] (broadcast over heads)."""
        return self.cos_sin_cache[positions].unbind(1)
