"""Linears served from a GGUF file's quantized blocks (`quantization: gguf`, the CPU default for GGUF models).

A Q4_K_M checkpoint holds ~0.6 bytes a weight; dequantized to bf16 it is 2, and a decode step reads
every weight once, so on a CPU (memory-bound) serving the blocks as stored is worth ~3x. At load each
supported tensor (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) is repacked, bit for bit, into tiles of 16
outputs (engine/csrc/gguf_linear.cpp): no float copy of the weight is ever made. A pass quantizes its
input rows to int8 per 32 values (as llama.cpp does) and sums with AVX512-VNNI integer dot products,
so its result is the dequantized weight times the int8-rounded rows, to fp32 rounding; a row's result
does not depend on the other rows of its pass. Tensors of other types (F16, Q5_K, ...) load dequantized
and are served like `quantization: bf16`.

A fused linear (q/k/v, gate/up) keeps one part per checkpoint tensor, each of its own type: Q4_K_M
stores some v projections in Q6_K and their q/k siblings in Q4_K.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from engine import cpu_kernels
from engine.models.llama import FusedLinear

# The GGUF types with a kernel, by name: their type ids (ggml.h), as gguf_linear.cpp takes them.
KERNEL_TYPES = {name: int(GGMLQuantizationType[name]) for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")}


def quantize_blocks(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """A float matrix [out, in] as GGUF blocks of `type_name` (uint8 [out, bytes a row]), by gguf's
    reference quantizer (llama.cpp's rounding)."""
    from gguf import quants

    array = weight.detach().float().cpu().contiguous().numpy()
    return torch.from_numpy(quants.quantize(array, GGMLQuantizationType[type_name]))


def unavailable_reason() -> str | None:
    """None when `quantization: gguf` can serve here; its fast path also needs AVX512-VNNI (vnni_available)."""
    return cpu_kernels.unavailable_reason()


def vnni_available() -> bool:
    return unavailable_reason() is None and cpu_kernels.extension().has_avx512_vnni()


def servable(type_name: str, in_features: int) -> bool:
    return type_name in KERNEL_TYPES and in_features % GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0] == 0


class GGUFPart:
    """One checkpoint tensor of a GGUFLinear: its tiles, GGUF type and output rows."""

    def __init__(self, raw: torch.Tensor, type_name: str, in_features: int):
        self.type_name, self.type_id, self.rows = type_name, KERNEL_TYPES[type_name], raw.shape[0]
        self.tiles = cpu_kernels.extension().gguf_repack(raw.contiguous(), self.type_id, in_features)


class GGUFLinear(nn.Module):
    """A linear (or a fused one: `shard_names`, `output_sizes` as FusedLinear's) over GGUF blocks, in
    fp32 out. `bias` is an ordinary parameter, filled by the loader like any other."""

    portable = False   # tests set it: the portable C++ loop instead of AVX512-VNNI

    def __init__(self, in_features: int, parts: list[GGUFPart], bias: bool, shard_names: list[str] | None = None):
        super().__init__()
        self.in_features, self.parts = in_features, parts
        self.output_sizes = [part.rows for part in parts]
        self.out_features = sum(self.output_sizes)
        self.shard_names = list(shard_names or [])
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self._kernel = cpu_kernels.extension()
        self._tiles, self._types = [p.tiles for p in parts], [p.type_id for p in parts]   # the call's arguments, once

    shards = FusedLinear.shards   # (hf sibling name, row offset, rows) per part: where the loader puts the bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
        out = self._kernel.gguf_linear(rows, self._tiles, self._types, self.output_sizes, bias, self.portable)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        types = "+".join(part.type_name for part in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=GGUF {types}"
