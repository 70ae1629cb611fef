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
    """keep_features: also keep every fed token's final hidden state (the model's output before
    the LM head) in a paged buffer beside the KV cache, for proposers that draft from the target's
    features (EAGLE heads). Like KV, a position's feature is written when the position is computed
    and stays valid while the position's block holds it: rollback, preemption and prefix caching
    need no bookkeeping of their own."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, use_flash: bool = False, keep_features: bool = False):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.use_flash = use_flash
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.features = torch.zeros(num_blocks * block_size, model.hidden_size, dtype=dtype, device=device) \
            if keep_features else None   # [slots, hidden]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        num_kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * model_config.num_hidden_layers * block_size * num_kv_heads * head_dim * element

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], features: torch.Tensor | None = None, return_hidden: bool = False):
        """Logits [sum(num_logits), vocab] float32, in item order; with return_hidden, also the
        hidden states of those rows. features [T, hidden]: one per fed token, for models that take
        them (EagleHead)."""
        query_lens = [len(item.token_ids) for item in items]
        seq_lens = [item.start_pos + n for item, n in zip(items, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, [item.block_table for item in items],
                                       self.block_size, self.device, self.use_flash, self.model.sliding_window)
        input_ids = torch.tensor(np.concatenate([item.token_ids for item in items]), dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate(
            [np.arange(item.start_pos, item.start_pos + n) for item, n in zip(items, query_lens)])).to(self.device)
        extra = {} if features is None else {"features": features}
        hidden = self.model(input_ids, positions, meta, self.kv_caches, **extra)
        if self.features is not None:
            self.features.index_copy_(0, meta.slot_mapping, hidden)
        ends = np.cumsum(query_lens)
        rows = np.concatenate([np.arange(end - item.num_logits, end) for item, end in zip(items, ends)])
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.from_numpy(rows).to(self.device)]
        logits = self.model.compute_logits(hidden) if len(rows) else \
            hidden.new_zeros(0, self.model.vocab_size, dtype=torch.float32)
        return (logits, hidden) if return_hidden else logits

    def read_features(self, spans: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """The kept features of positions start..end-1 of each (block_table, start, end), concatenated."""
        slots = np.concatenate([np.asarray(table, dtype=np.int64)[np.arange(start, end) // self.block_size]
                                * self.block_size + np.arange(start, end) % self.block_size
                                for table, start, end in spans])
        return self.features[torch.from_numpy(slots).to(self.device)]
