"""Shared pieces of the benchmark scripts: random checkpoints, timing, memory bandwidth."""
from __future__ import annotations

import os
import time

import torch

BIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)   # ~270M parameters
SMALL_DRAFT = dict(BIG, num_hidden_layers=1, intermediate_size=1024)   # one layer: its cost is mostly lm_head


def random_llama(path: str, seed: int = 0, **overrides) -> str:
    """A random Llama checkpoint in bf16 (weights scaled so greedy continuations are not degenerate)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(**{**BIG, **overrides}, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def checkpoint_param_counts(path: str) -> tuple[int, int]:
    """(all parameters, parameters a decode step streams: all but the input embedding, of which
    one row is read per token) of a single-file checkpoint."""
    import math

    from safetensors import safe_open

    total = streamed = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in f.keys():
            n = math.prod(f.get_slice(name).get_shape())
            total += n
            streamed += 0 if "embed_tokens" in name else n
    return total, streamed


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device="cpu") -> float:
    """Bytes/s of summing a large bf16 tensor: what streaming weights can reach on this device."""
    x = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    x.sum().item()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum().item()   # .item() waits for the device
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def timed(fn, repeats: int = 1) -> float:
    """Best wall time of fn() over repeats (after fn has run once to warm up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
