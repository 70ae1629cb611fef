"""The engine's C++ CPU kernels (engine/csrc), built on first use.

Four families, one extension:
  streamed_linear.cpp  weight-only bf16 / int8 linears computed in fp32 (`quantization`,
                       engine/models/streamed_linear.py);
  bf16_dot_linear.cpp  bf16 linears on AVX512-BF16 dot products, where the CPU has them (compiled for
                       it with function attributes, called only after a runtime check);
  gguf_linear.cpp      linears over GGUF's quantized blocks (Q4_0/1, Q5_0, Q8_0, Q4_K, Q6_K) on int8
                       activations (AVX512-VNNI, else portable C++; engine/models/gguf_linear.py);
  decode_ops.cpp       a decoder layer's small ops fused in fp32: add + RMSNorm, silu * up, and RoPE +
                       cache write + paged attention for decode and verification rows (the layers in
                       engine/models/llama.py and engine/attention.py call them where `fused_ops` says so).

torch's extension loader compiles them on first use (a C++ compiler and ninja are needed; about two
minutes; cached under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions). They need AVX2 and
FMA. The `cpu_kernels` option (EngineConfig) false keeps the fused ops off (torch's ops everywhere;
`quantization` still uses the linears).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("specserve.engine")

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("bindings.cpp", "streamed_linear.cpp", "bf16_dot_linear.cpp",
                                                                       "gguf_linear.cpp", "decode_ops.cpp")]


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (for the error a user sees)."""
    capability = torch.backends.cpu.get_cpu_capability()   # what ATen's own kernels dispatch on
    if capability not in ("AVX2", "AVX512"):
        return f"they need an x86-64 CPU with AVX2 and FMA; torch reports CPU capability {capability}"
    try:
        extension()
    except Exception as exc:   # no compiler, no ninja, a failed build: say so, never fail silently
        last = (str(exc).strip().splitlines() or [""])[-1]
        return f"their C++ code did not build ({type(exc).__name__}: {last})"
    return None


@functools.lru_cache(maxsize=None)
def extension():
    from torch.utils.cpp_extension import load

    verbose = os.environ.get("SPECSERVE_BUILD_VERBOSE") == "1"
    logger.info("loading the CPU kernels (built on first use, about two minutes)")
    return load("specserve_cpu_kernels", [str(s) for s in _SOURCES], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", "-Wno-psabi"],
                extra_ldflags=["-fopenmp"], extra_include_paths=[str(_SOURCES[0].parent)], verbose=verbose)


def fused_ops_usable(device: torch.device, dtype: torch.dtype, enabled: bool = True) -> bool:
    """Whether a model on (device, dtype) should run its layers' small ops through decode_ops.cpp.
    enabled: the `cpu_kernels` option."""
    if not enabled or torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    reason = unavailable_reason()
    if reason:
        _warn_once(f"the fused CPU ops are off, so decoding runs slower: {reason}")
    return reason is None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)
