"""Model code (the Llama family in llama.py, Gemma 2 / 3 in gemma.py) and its strict checkpoint loader."""
from engine.models.llama import CausalLM
from engine.models.loader import SUPPORTED_ARCHITECTURES, load_hf_config, load_model

__all__ = ["CausalLM", "SUPPORTED_ARCHITECTURES", "load_hf_config", "load_model"]
