"""Turns a list of sequences to feed into flat tensors, runs the model, returns logits.

The runner owns the model's paged KV cache (one buffer per layer, indexed by
the block ids of the shared block pool, plus one scratch block that no request
owns: padding rows of a decode grid write there). The target and the draft
model each have a runner; both read the same block tables. With a decode grid
(engine/decode_grid.py), decode-shaped passes run on it: as CUDA graphs, or
through flash_attn_with_kvcache. Attention runs on the runner's backend (engine/attention_backends.py),
chosen once when the runner is built; each pass's metadata is built once, from the pass's PassLayout.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_backends import AttentionBackend, choose_backend
from engine.attention_metadata import PassLayout, fed_positions
from engine.decode_grid import DecodeGrid


@dataclass
class ForwardItem:
    """One sequence in a forward pass."""
    token_ids: list[int]     # tokens fed this pass
    start_pos: int           # absolute position of token_ids[0]
    block_table: list[int]
    num_logits: int          # logits wanted for the last num_logits fed tokens (0: none)
    # A draft tree over the sequence's last `cols` positions, the fed tokens the last n of them (nodes fed
    # in earlier passes before them): bool [n, cols], which tree positions each fed token sees (None:
    # causal). A fed token's position is the tree's first position + (the tree positions it sees) - 1;
    # its KV slot stays start_pos + its index.
    tree_mask: np.ndarray | None = None

    def positions(self) -> np.ndarray:
        """Each fed token's position (attention_metadata.fed_positions)."""
        return fed_positions(self.tree_mask, len(self.token_ids), self.start_pos + len(self.token_ids))


class ModelRunner:
    """keep_features: also keep every fed token's features (its final hidden state, the model's
    output before the LM head, or with CausalLM.set_feature_layers the fused outputs of those layers)
    in a paged buffer beside the KV cache, for proposers that draft from the target's features
    (EAGLE heads). Like KV, a position's feature is written when the position is computed
    and stays valid while the position's block holds it: rollback, preemption and prefix caching
    need no bookkeeping of their own. attention: the backend every pass attends with (default: the one
    attention_backend auto picks for this model, device and dtype)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, attention: AttentionBackend | None = None,
                 keep_features: bool = False):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.attention = attention or choose_backend("auto", model, block_size, device, dtype)
        self.scratch_block = num_blocks
        shape = (2, num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.features = torch.zeros(num_blocks * block_size, model.feature_size, dtype=dtype, device=device) \
            if keep_features else None   # [slots, feature size]
        self.decode_grid: DecodeGrid | None = None
        self.fused_ops = getattr(model, "fused_ops", False)   # models.llama.use_fused_cpu_ops ran on it

    def enable_decode_grid(self, max_seqs: int, max_query_len: int, max_blocks: int, pad: bool = True,
                           capture: bool = False) -> None:
        """Run decode-shaped passes on a DecodeGrid: padded to buckets and captured as CUDA graphs
        (pad, capture), or at their own sizes (flash_attn_with_kvcache for decode rows)."""
        self.decode_grid = DecodeGrid(self.model, self.kv_caches, self.block_size, self.scratch_block, max_seqs,
                                      max_query_len, max_blocks, self.device, self.attention, pad, capture)

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
        if features is None and self.decode_grid is not None and self.decode_grid.fits(items):
            return self._grid_forward(items, return_hidden)
        meta = self.attention.build(self._layout(items), self.model.sliding_window)
        input_ids = torch.tensor(np.concatenate([item.token_ids for item in items]), dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate([item.positions() for item in items])).to(self.device)
        extra = {} if features is None else {"features": features}
        hidden = self.model(input_ids, positions, meta, self.kv_caches, **extra)
        if self.features is not None:
            self.features.index_copy_(0, meta.slot_mapping, self.model.features(hidden))
        return self._logits(items, hidden, return_hidden)

    @staticmethod
    def _layout(items: list[ForwardItem]) -> PassLayout:
        query_lens = [len(item.token_ids) for item in items]
        trees = [item.tree_mask for item in items]
        return PassLayout(query_lens, [item.start_pos + n for item, n in zip(items, query_lens)],
                          [item.block_table for item in items],
                          trees if any(tree is not None for tree in trees) else None)

    def _grid_forward(self, items: list[ForwardItem], return_hidden: bool):
        hidden, slots = self.decode_grid.run(items)   # every fed token's row
        if self.features is not None:
            self.features.index_copy_(0, slots, self.decode_grid.last_features)
        return self._logits(items, hidden, return_hidden)

    def _logits(self, items: list[ForwardItem], hidden: torch.Tensor, return_hidden: bool):
        """Logits (and hidden states) of the rows that want them: each item's last num_logits of
        its fed tokens, whose final hidden states are `hidden`, in item order. (Decode and
        verification rows all want theirs: no index built on that hot path.)"""
        wanted = sum(item.num_logits for item in items)
        if wanted < hidden.shape[0]:
            ends = np.cumsum([len(item.token_ids) for item in items])
            rows = np.concatenate([np.arange(end - item.num_logits, end) for item, end in zip(items, ends)])
            hidden = hidden[torch.from_numpy(rows).to(self.device)]
        logits = self.model.compute_logits(hidden) if wanted else \
            hidden.new_zeros(0, self.model.vocab_size, dtype=torch.float32)
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def move_kv(self, block_table: list[int], sources: list[int], destinations: list[int]) -> None:
        """Copy the keys, values (and kept features) at logical indices `sources` of a sequence to
        `destinations`: after a tree pass, the accepted path's nodes to the consecutive positions
        the next step reads (the rest of the tree is left to be overwritten)."""
        src, dst = (torch.from_numpy(self._slots(block_table, np.asarray(i, dtype=np.int64))).to(self.device)
                    for i in (sources, destinations))
        for cache in self.kv_caches:
            for part in cache:   # keys, values: [blocks, block_size, heads, dim] -> [slots, heads, dim]
                flat = part.view(-1, *part.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))
        if self.features is not None:
            self.features.index_copy_(0, dst, self.features.index_select(0, src))

    def _slots(self, block_table: list[int], indices: np.ndarray) -> np.ndarray:
        """Cache slots of a sequence's logical indices, through its block table."""
        return np.asarray(block_table, dtype=np.int64)[indices // self.block_size] * self.block_size + \
            indices % self.block_size

    def read_features(self, spans: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """The kept features of positions start..end-1 of each (block_table, start, end), concatenated."""
        slots = np.concatenate([self._slots(table, np.arange(start, end)) for table, start, end in spans])
        return self.features[torch.from_numpy(slots).to(self.device)]

