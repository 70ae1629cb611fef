"""Turns a list of sequences to feed into flat tensors, runs the model, returns logits.

The runner owns the model's paged KV cache (one buffer per layer, indexed by
the block ids of the shared block pool). The target and the draft model each
have a runner; both read the same block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata


@dataclass
class ForwardItem:
    """One sequence in a forward pass."""
    token_ids: list[int]     # tokens fed this pass
    start_pos: int           # absolute position of token_ids[0]
    block_table: list[int]
    num_logits: int          # logits wanted for the last num_logits fed tokens (0: none)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, use_flash: bool = False):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.use_flash = use_flash
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        num_kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * model_config.num_hidden_layers * block_size * num_kv_heads * head_dim * element

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Logits [sum(num_logits), vocab] float32, in item order."""
        query_lens = [len(item.token_ids) for item in items]
        seq_lens = [item.start_pos + n for item, n in zip(items, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, [item.block_table for item in items],
                                       self.block_size, self.device, self.use_flash, self.model.sliding_window)
        input_ids = torch.tensor(np.concatenate([item.token_ids for item in items]), dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate(
            [np.arange(item.start_pos, item.start_pos + n) for item, n in zip(items, query_lens)])).to(self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        ends = np.cumsum(query_lens)
        rows = np.concatenate([np.arange(end - item.num_logits, end) for item, end in zip(items, ends)])
        if len(rows) == 0:
            return hidden.new_zeros(0, self.model.vocab_size, dtype=torch.float32)
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.from_numpy(rows).to(self.device)]
        return self.model.compute_logits(hidden)
