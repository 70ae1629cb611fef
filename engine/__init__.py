"""specserve's engine: batched draft-then-verify decoding over a paged KV cache."""
import os

# Big CPU tensors (weights, KV caches, activations of 2 MiB and more) in transparent huge pages:
# torch reads this once, at its first allocation, so it must be set before torch is imported (the
# engine core and the benchmarks import engine first; child processes inherit it). Streaming weights
# through 4 KiB pages misses the TLB often, which slows decoding and makes identical engines in one
# process decode at different speeds (docs/benchmarks.md, "Figures behind design choices"). Set it
# to 0 to turn huge pages off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from engine.config import EngineConfig, SpeculativeConfig
from engine.sampling_params import SamplingParams


def __getattr__(name):  # keep `import engine` light: torch and models load on first use
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "Engine":
        from engine.engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["LLM", "Engine", "EngineConfig", "SpeculativeConfig", "SamplingParams"]
