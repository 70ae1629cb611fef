"""Tensor parallelism over torch.distributed (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Qwen3-MoE, Mixtral).

Each of the N ranks of a process group holds a shard of every layer (Megatron's split):
    q/k/v, gate/up   column-parallel: each rank computes its heads / its part of the intermediate
    o_proj, down     row-parallel: each rank's partial product, summed by one all-reduce
    experts          each expert's gate/up and down split like a dense MLP's, the router replicated:
                     one all-reduce of the block's output (SparseMoeBlock.reduce)
    embed_tokens     vocabulary-parallel: each rank embeds the ids in its rows, the sum is the embedding
    lm_head          vocabulary-parallel: each rank's logits over its rows, gathered on rank 0
Query heads split evenly; KV heads too, or, with fewer KV heads than ranks, each KV head is
replicated on the N / num_kv_heads ranks whose query heads read it. Norms, RoPE and biases of the
row-parallel linears (added once, after the sum) are replicated.

The sharded model is the ordinary CausalLM built from a config with the local head, intermediate and
vocabulary sizes, its o_proj / down_proj / embed_tokens / lm_head swapped for the parallel modules
below; the paged attention code sees only the local heads. Each rank's KV cache holds its own KV
heads, under the same block tables. The loader reads each rank's slice of a checkpoint tensor
only (shard_plan: which rows or columns of which tensor).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.llama import CausalLM

# The families whose checkpoints hold q/k/v and gate/up apart (Phi-3's are fused: a rank would read
# three slices of one tensor). Mixtures of experts shard each expert's intermediate like a dense MLP's
# (from per-expert checkpoint tensors); gpt-oss's interleaved experts are not sharded yet.
SHARDABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (group None: the default group)."""
    rank: int
    world_size: int
    group: object = None


def check_shardable(config, world_size: int) -> None:
    """ValueError unless this config's model splits over world_size ranks."""
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture not in SHARDABLE:
        raise ValueError(f"tensor parallelism supports {', '.join(SHARDABLE)}; got {architecture}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the {heads} attention heads")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} and the {kv_heads} KV heads must divide one another")
    for key in ("intermediate_size", "moe_intermediate_size"):
        size = getattr(config, key, None)
        if size is not None and size % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide {key} {size}")


def local_config(config, world_size: int):
    """The config of one rank's shard: its heads, KV heads, intermediate size and vocabulary rows
    (the vocabulary padded to a multiple of world_size; the last rank's padding rows are never read)."""
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local.num_attention_heads = config.num_attention_heads // world_size
    local.num_key_value_heads = max(1, config.num_key_value_heads // world_size)
    local.intermediate_size = config.intermediate_size // world_size
    if getattr(config, "moe_intermediate_size", None) is not None:   # Qwen3-MoE's experts
        local.moe_intermediate_size = config.moe_intermediate_size // world_size
    local.vocab_size = -(-config.vocab_size // world_size)
    return local


def build_sharded(config, tp: TensorParallel, model_cls: type[CausalLM] = CausalLM) -> CausalLM:
    """One rank's shard of a model of class model_cls (built on the current default device, e.g. meta)."""
    check_shardable(config, tp.world_size)
    model = model_cls(local_config(config, tp.world_size))
    model.config, model.vocab_size = config, config.vocab_size   # the runner's logits cover the whole vocabulary
    hidden = config.hidden_size
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.o_proj = RowParallelLinear(attention.q_size, hidden, attention.o_proj.bias is not None, tp)
        if hasattr(mlp, "experts"):   # each expert's down projection is row-parallel: one all-reduce a block
            mlp.reduce = lambda out, tp=tp: _all_reduced(out, tp)
        else:
            mlp.down_proj = RowParallelLinear(mlp.intermediate, hidden, mlp.down_proj.bias is not None, tp)
    rows = model.model.embed_tokens.num_embeddings
    model.model.embed_tokens = VocabParallelEmbedding(rows, hidden, tp)
    model.lm_head = ParallelLMHead(hidden, rows, config.vocab_size, tp)
    model.tie_weights()
    model.tensor_parallel = tp
    return model


def _all_reduced(out: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    dist.all_reduce(out, group=tp.group)
    return out


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r^T, + bias once: x_r is this rank's slice of the input
    features (its heads' attention output, its part of the intermediate), W_r the matching columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows rank * rows .. (rank + 1) * rows of the embedding table: ids outside them embed to zero
    here, and the all-reduce sums the one rank's row that holds each id."""

    def __init__(self, rows: int, hidden: int, tp: TensorParallel):
        super().__init__(rows, hidden)
        self.tp = tp
        self.first = tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.tp.group)
        return out


class ParallelLMHead(nn.Linear):
    """Each rank's logits over its vocabulary rows; rank 0 gathers them into [N, vocab_size].
    The other ranks return their own part (their runner's logits are never sampled from)."""

    def __init__(self, hidden: int, rows: int, vocab_size: int, tp: TensorParallel):
        super().__init__(hidden, rows, bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = F.linear(hidden, self.weight).contiguous()   # [N, rows]
        parts = [torch.empty_like(part) for _ in range(self.tp.world_size)] if self.tp.rank == 0 else None
        dist.gather(part, parts, dst=_global_rank(self.tp, 0), group=self.tp.group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size] if self.tp.rank == 0 else part


def _global_rank(tp: TensorParallel, group_rank: int) -> int:
    return group_rank if tp.group is None else dist.get_global_rank(tp.group, group_rank)


# Checkpoint sibling -> the dimension each rank takes its slice of (0: output rows, 1: input columns);
# w1 / w3 / w2 are Mixtral's experts' gate / up / down.
_ROW_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "embed_tokens", "lm_head")
_COLUMN_SHARDED = ("o_proj.weight", "down_proj.weight", "w2.weight")
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")   # both projections of all experts in one tensor


def shard_plan(model: CausalLM, plan: dict) -> tuple[dict, dict]:
    """The loader's plan (checkpoint name -> (parameter, row offset, rows)) for one rank's shard, and
    the slice of each sharded checkpoint tensor it reads: name -> (dim, start, length)."""
    tp, config = model.tensor_parallel, model.config
    head_dim = model.head_dim
    local_kv = model.num_kv_heads
    first_kv_head = tp.rank * config.num_key_value_heads // tp.world_size   # replicated heads: the one it reads
    plan, slices = dict(plan), {}
    for key, (name, offset, rows) in plan.items():
        parts = key.split(".")
        if key.endswith(_FUSED_EXPERTS):
            raise ValueError(f"tensor parallelism reads an MoE checkpoint's per-expert tensors; {key!r} holds "
                             "every expert at once")
        if key.endswith(_COLUMN_SHARDED):
            width = model.get_parameter(name).shape[-1]   # [out, in], or an expert tensor's [E, out, in]
            slices[key] = (1, tp.rank * width, width)
        elif parts[-2] in ("k_proj", "v_proj"):
            slices[key] = (0, first_kv_head * head_dim, local_kv * head_dim)
        elif parts[-2] in ("embed_tokens", "lm_head"):
            size = model.get_parameter(name).shape[0]
            start = tp.rank * size
            length = max(0, min(size, config.vocab_size - start))   # the last rank's padding rows stay unread
            slices[key] = (0, start, length)
            plan[key] = (name, 0, length)
        elif parts[-2] in _ROW_SHARDED:   # q_proj, gate_proj, up_proj: as many rows as the fused slot's
            slices[key] = (0, tp.rank * rows, rows)
    return plan, slices
