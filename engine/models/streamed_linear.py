"""Weight-only bf16 and int8 linears for CPUs: fewer bytes per weight, computed in fp32.

Decoding a small batch reads every weight once per step, so on a CPU its speed is the weights'
bytes over memory bandwidth. On CPUs without native bf16 (AVX2 only) the engine computes in fp32 and
oneDNN reads 4 bytes a weight. `quantization: bf16` keeps each linear's weight in bf16 (2 bytes) and
`quantization: int8` in int8 with one scale per 32 weights of a row (Q8_0's grouping: 1.125 bytes);
`engine/csrc/streamed_linear.cpp` widens them to fp32 in registers. A Q8_0 GGUF's weights come back
exactly under `int8`: its scale per 32 is their largest magnitude over 127, which is what
`quantize_int8` computes.

Activations stay in the model's dtype and the matmul runs in fp32; embeddings, norms and the KV
cache are untouched. The kernel streams the weight for a few rows and runs register blocks over
L2-sized chunks of it for more (verification of big batches, prefill chunks). Only passes of more
than PREFILL_ROWS rows widen the weight to fp32 for torch's GEMM: from there its better blocking
outweighs writing and reading the fp32 copy (SmolLM2-135M's 30 layers, bf16, 2 threads, AVX2 EPYC:
128 rows 309 ms a pass in the kernel against 468 widened, 256 rows 564 against 697, 512 rows level).

Where the CPU has native bf16 (AVX512-BF16 / AMX), dtype auto serves the same way (engine/setup.py),
with two changes. Narrow passes (decode, verification, small batches) go through
`engine/csrc/bf16_dot_linear.cpp` on a blocked copy of the weight: activations rounded to
bf16, AVX512-BF16 dot products summed in fp32, a row's result independent of the other rows in its
pass (SmolLM2-135M's linears, 2 threads, AVX512-BF16 EPYC, ms a pass at 1 / 4 / 8 rows: 10.7 / 10.1
/ 13.1, against 10.4 / 21.2 / 29.1 for the fp32 kernel here and 16.2 / 17.7 / 17.9 for oneDNN's bf16
matmul). Wider passes (prefill chunks, big batches) round the activations to bf16 and use oneDNN's
matmul on a packed copy. Where "wider" begins depends on the shape (from 16 rows for an LM head,
up to 64 for an output projection), so each shape's crossing is timed once at load
(`native_rows`). The layer holds those two copies and not the row-major one (twice the weights'
memory). Where the CPU has native bf16 through oneDNN but the kernel cannot use AVX512-BF16, the
fp32 kernel keeps passes below NATIVE_BF16_ROWS and the row-major copy. Results then depend on
whether a pass is narrower than the threshold, as they do in any bf16 engine.

The kernel is one of the engine's C++ CPU kernels (engine/cpu_kernels.py: built on first use,
needs AVX2 and FMA).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.models.cpu_linear import PACK_HINT_ROWS, cpu_has_fast_bf16

GROUP = 32               # int8 weights per scale
PREFILL_ROWS = 512       # above this many rows, widen the weight once and use torch's GEMM
NATIVE_BF16_ROWS = 4     # where the CPU has native bf16: from this many rows, bf16 weights go through
                         # oneDNN's bf16 matmul (see StreamedLinear.native_rows) ...
BLOCKED_ROWS = 16        # ... or, where the kernel has AVX512-BF16, from at least this many (fewer:
                         # bf16_dot_linear.cpp, whose rows do not depend on their pass) ...
ROW_GRID = (16, 24, 32, 48, 64)   # ... from the first of these where oneDNN measured as fast on the shape
BLOCK_OUTPUTS = 4        # the blocked layout groups this many outputs
_native_rows_by_shape: dict[tuple[int, int], int] = {}   # (in, out) -> rows from which oneDNN is faster
COLD_BYTES = 64 << 20    # weight bytes cycled through when timing the two (more than a CPU's caches) ...
MAX_COPIES = 64          # ... in at most this many copies of a layer's weight
SMALL_WEIGHTS = 1 << 16  # layers with fewer weights are not timed (tests' tiny models)
KERNEL_MARGIN = 1.05     # past BLOCKED_ROWS a shape keeps the kernel only where it is this much faster


def kernel_unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    return cpu_kernels.unavailable_reason()


def check_quantization(name: str, device: torch.device) -> None:
    """Raise a ValueError naming the problem when `quantization: name` (none, bf16, int8 or gguf:
    EngineConfig has checked the name, engine/setup.py resolved auto) cannot serve on `device`."""
    if name == "none":
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization {name!r} is a CPU weight format; this engine runs on {device}")
    reason = kernel_unavailable_reason()
    if reason:
        raise ValueError(f"quantization {name!r} is not available: {reason}")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 [N, K] and fp32 scales [N, K / 32]: per group of 32, the largest magnitude
    maps to 127 (Q8_0's rule, so a dequantized Q8_0 tensor comes back exactly)."""
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // GROUP, GROUP)
    scales = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, cols).contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return (q.reshape(rows, cols // GROUP, GROUP).float() * scales.unsqueeze(-1)).reshape(rows, cols)


class StreamedLinear(nn.Module):
    """A linear whose weight is kept in bf16 or int8 and computed in fp32 (see the module's doc).
    native_rows: from this many rows, a bf16 layer on a CPU with native bf16 uses oneDNN's bf16
    matmul on `packed` instead (None elsewhere); `blocks`, where the kernel has AVX512-BF16, serves
    the narrower passes (and `weight` is then None)."""

    def __init__(self, linear: nn.Linear, fmt: str, exact_rows: int = BLOCKED_ROWS):
        """exact_rows: passes of fewer rows stay on the kernel, whose rows do not depend on their pass
        (at least BLOCKED_ROWS; the engine asks for one request's largest verification pass)."""
        super().__init__()
        if fmt not in ("bf16", "int8"):
            raise ValueError(f"StreamedLinear format must be bf16 or int8, got {fmt!r}")
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        with torch.no_grad():
            weight = linear.weight.detach()
            if fmt == "bf16":
                self.weight, self.scales = weight.to(torch.bfloat16).contiguous(), None
            else:
                self.weight, self.scales = quantize_int8(weight)
            self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._kernel = cpu_kernels.extension()
        self.native_rows, self.packed, self.blocks = None, None, None
        if fmt == "bf16" and cpu_has_fast_bf16():
            self.native_rows = NATIVE_BF16_ROWS
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_HINT_ROWS)
            if self._kernel.has_avx512_bf16() and self.out_features % BLOCK_OUTPUTS == 0:
                self.blocks, self.weight = self._kernel.pack_bf16_blocks(self.weight), None
                self.native_rows = max(exact_rows, native_rows(self))

    def weight_elements(self) -> int:
        return self.in_features * self.out_features

    def dense_weight(self) -> torch.Tensor:
        """The weight this linear computes with, in fp32."""
        if self.blocks is not None:
            return self._kernel.unpack_bf16_blocks(self.blocks).float()
        return self.weight.float() if self.scales is None else dequantize_int8(self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_rows is not None and x.numel() >= self.native_rows * self.in_features:
            return self._native_bf16(x)
        if x.dtype == torch.float32 and x.dim() == 2 and len(x) <= PREFILL_ROWS and x.is_contiguous():
            return self._streamed(x)   # the decode-step case, without the reshapes below (121 linears a step)
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = F.linear(rows, self.dense_weight(), self.bias) if len(rows) > PREFILL_ROWS else self._streamed(rows)
        return out.reshape(*shape[:-1], self.out_features).to(dtype)

    def _native_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's bf16 matmul (activations rounded to bf16, fp32 accumulation), back in x's dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "").to(x.dtype)
        out = out if self.bias is None else out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _streamed(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel on contiguous fp32 rows [M, K]: bf16_dot_linear.cpp on the blocked copy (activations
        rounded to bf16; passes of native_rows or more never get here), else streamed_linear.cpp."""
        if self.blocks is not None:
            return self._kernel.linear_bf16_blocks(rows, self.blocks, self.bias)
        if self.scales is None:
            return self._kernel.linear_bf16(rows, self.weight, self.bias)
        return self._kernel.linear_int8(rows, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.fmt}"


def native_rows(layer: StreamedLinear) -> int:
    """From how many rows oneDNN's bf16 matmul beats the blocked kernel on this layer's shape: timed
    once per shape and process, at the rows of ROW_GRID. Where the crossing lies depends on the
    shape: on 2 cores of an AVX512-BF16 EPYC, with the weights cold, the kernel was 1.17-1.38x
    faster than oneDNN at 16-48 rows on SmolLM2-135M's output projection, 1.13x at 16 on its qkv
    projection, level on its down projection and 0.71-0.84x on its gate/up projection and LM head.
    Never below BLOCKED_ROWS, although oneDNN wins on an LM head from about 8 rows: below it a
    row's logits are the same in every pass, so greedy speculation at small batches gives plain
    decoding's tokens exactly."""
    shape = (layer.in_features, layer.out_features)
    if layer.weight_elements() < SMALL_WEIGHTS:
        return BLOCKED_ROWS   # microseconds either way: timing it would cost more than it could save
    if shape not in _native_rows_by_shape:
        # A forward streams every layer's weights from memory; one layer timed alone stays in the
        # caches, where the kernel looked up to 1.9x faster than it is in the model. So cycle
        # through copies of the weight that together outgrow the caches.
        count = min(MAX_COPIES, -(-COLD_BYTES // (2 * layer.weight_elements())))
        copies = [_copy_weights(layer) for _ in range(count)]
        _native_rows_by_shape[shape] = _measure_crossing(
            lambda x: [c._native_bf16(x) for c in copies], lambda x: [c._streamed(x) for c in copies],
            layer.in_features)
    return _native_rows_by_shape[shape]


def _copy_weights(layer: StreamedLinear) -> StreamedLinear:
    twin = copy.copy(layer)
    twin.blocks, twin.packed = layer.blocks.clone(), layer.packed.clone()
    return twin


def _measure_crossing(native, blocked, width: int) -> int:
    """The first grid size from which oneDNN (`native`) is about as fast as the kernel (`blocked`)
    or faster, here and at the next size (one timing can be noise), else the grid's last: past it
    oneDNN's blocking wins on every shape measured. The kernel must win by KERNEL_MARGIN: a shape
    on which the two are level would otherwise flip between runs, and with it the bits of its
    results."""
    faster = []
    for rows in ROW_GRID:
        faster.append(_best_seconds(native, rows, width) <= KERNEL_MARGIN * _best_seconds(blocked, rows, width))
        if faster[-2:] == [True, True]:
            return ROW_GRID[len(faster) - 2]
    return ROW_GRID[-1]


def _best_seconds(linear, rows: int, width: int, repeats: int = 3) -> float:
    """The fastest of a few timings of a linear on `rows` rows, each ~0.5 ms or more of calls."""
    x = torch.randn(rows, width)
    linear(x)   # oneDNN creates its primitive for this row count on the first call
    start = time.perf_counter()
    linear(x)
    calls = max(1, min(50, int(5e-4 / max(time.perf_counter() - start, 1e-7))))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            linear(x)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def streamable(linear: nn.Module) -> bool:
    return isinstance(linear, nn.Linear) and linear.in_features % GROUP == 0


def stream_linears(model: nn.Module, fmt: str, exact_rows: int = BLOCKED_ROWS) -> int:
    """Swap every nn.Linear of `model` whose input width is a multiple of 32 (in place) for a
    StreamedLinear (exact_rows: see there); returns how many. A tied LM head gets its own copy (the
    embedding stays)."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if streamable(child)]
    for parent, name, child in targets:
        setattr(parent, name, StreamedLinear(child, fmt, exact_rows))
    return len(targets)
