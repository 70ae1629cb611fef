"""specserve's engine: batched draft-then-verify decoding over a paged KV cache."""
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
