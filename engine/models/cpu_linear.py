"""oneDNN linears with pre-packed weights, for serving on CPU.

torch's default CPU linear (MKL) re-packs the weight on every call, which makes small batches
expensive: on the AVX2 machines this project is developed on, a 5-row matmul (verifying 4 draft
tokens) costs ~4x a 1-row one, and 16 rows ~5-7x. oneDNN with the weight packed once at start-up
costs ~2x and ~4x respectively, and a single row is no slower. This is what makes verification
cheap enough for speculation to pay on a CPU.

Packing replaces each nn.Linear by a PackedLinear holding only the packed copy, so memory does not
grow (except for a tied lm_head, which gets its own packed copy of the embedding). Results differ
from F.linear by floating-point reassociation only (~1e-6 relative in fp32).
"""
from __future__ import annotations

import os

import torch
from torch import nn

# oneDNN JIT-builds a primitive per weight shape and row count (~1.5 ms, ~0.56 MiB) and caches it,
# in oneDNN's cache and in ideep's, 1,024 entries each by default: an engine serving every row count
# a batch can have grew by ~700 MiB. 256 keeps ~36 row counts of a Llama's 7 linear shapes built
# (~200 MiB at most, measured). Read at the first packed matmul; a value set in the environment wins.
PRIMITIVE_CACHE_CAPACITY = 256
for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, str(PRIMITIVE_CACHE_CAPACITY))

# The batch-size hint oneDNN packs for: 1 keeps single-token decode at least as fast as MKL's
# GEMV while still speeding up verification and batched decode.
PACK_HINT_ROWS = 1


def cpu_has_fast_bf16() -> bool:
    """Native bf16 matmuls (AVX512-BF16 / AMX); elsewhere torch emulates bf16 slowly."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_has_fast_bf16()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_HINT_ROWS)
            self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` (in place) for a PackedLinear; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
