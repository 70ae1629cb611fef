"""Sparse mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral, gpt-oss).

A router (a linear to num_experts logits) picks top_k experts per token and weighs them; each
expert is a SwiGLU MLP. The experts are stored as two 3-D tensors, as transformers 5 holds them
in memory:
    experts.gate_up_proj  [E, 2 * I, H]   rows 0:I are gate_proj, I:2I up_proj
    experts.down_proj     [E, H, I]
(gpt-oss: [E, H, 2I] with gate and up interleaved, and [E, I, H], each with a bias), so a batch's
(token, expert) pairs can run grouped by expert, one GEMM per selected expert (or one grouped GEMM
on CUDA), instead of per token: a pass over R rows reads each selected expert's weights once however
many rows chose it. On a CPU, where a pass costs the bytes of weights it reads, that is the whole
gain: at most (token, expert) pairs / distinct experts hit (bench/moe_bench.py).

Routing, as each family defines it:
    Qwen3-MoE  softmax over all experts in fp32, top-k, renormalised if norm_topk_prob; the weights
               are rounded to the model's dtype before they scale the expert outputs
    Mixtral    softmax in fp32, top-k, always renormalised; the weights stay fp32, so each expert's
               output is scaled in fp32 and then rounded to the model's dtype
    gpt-oss    router with a bias; top-k of the logits, then a softmax over those k (model dtype)
Which layers are sparse: Mixtral's and gpt-oss's every layer; Qwen3-MoE's those not in
mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step (the others keep a dense MLP).

Qwen3-MoE and Mixtral checkpoints come in two layouts (SparseMoeBlock.checkpoint_plan): the hub's
per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`; what transformers' save_pretrained writes too), or the
fused 3-D tensors under our own names. gpt-oss's bf16 checkpoints hold the 3-D tensors under ours.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Per family: (module name of the block in hub checkpoints, hub names of gate, up and down).
HUB_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def is_sparse_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` of this config has a mixture of experts as its feed-forward."""
    model_type = config.model_type
    if model_type in ("mixtral", "gpt_oss"):
        return True
    if model_type == "qwen3_moe":
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (layer not in (getattr(config, "mlp_only_layers", None) or [])
                and config.num_experts > 0 and (layer + 1) % step == 0)
    return False


def moe_block(config, layer: int) -> nn.Module | None:
    """The layer's sparse block, or None where the layer (or the family) is dense."""
    if not is_sparse_layer(config, layer):
        return None
    if config.model_type == "gpt_oss":
        return GptOssMoeBlock(config)
    if config.model_type == "mixtral":
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, fp32_weights=True, family="mixtral")
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                          fp32_weights=False, family="qwen3_moe")


def route(logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool):
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]): softmax over all experts in fp32,
    top-k, optionally renormalised to sum to 1. The weights are fp32 with fp32_weights (Mixtral),
    else in the logits' dtype (Qwen3-MoE), as each family rounds them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), ids


def grouped_mm_usable(device: torch.device, dtype: torch.dtype, column_major: bool = True) -> bool:
    """Whether torch._grouped_mm runs here for this dtype and weight layout ([E, in, out] views of
    [E, out, in] tensors: column_major): tried once on a tiny problem, since its support depends on
    the torch build, the GPU generation and the dtype (bf16 on Hopper for sure)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
        out = torch._grouped_mm(a, b.transpose(1, 2) if column_major else b, offs=offsets)
        return bool(torch.all(out == 16).item())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Experts(nn.Module):
    """E SwiGLU experts held as two 3-D tensors, run over a batch's (token, expert) pairs grouped by
    expert. `grouped` (decided on the device by init_buffers: CUDA with a working torch._grouped_mm)
    runs all experts as one grouped GEMM per projection with no host sync, so it can be captured in
    a CUDA graph; otherwise each selected expert's rows run as one GEMM in a Python loop over the
    experts (not the tokens): the CPU path.

    Subclasses change the layout and the activation through in_out, biases and activation
    (GptOssExperts)."""

    column_major = True   # in_out() are transposed views

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.grouped = False

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        self.grouped = device.type == "cuda" and grouped_mm_usable(device, dtype, self.column_major)

    def in_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections as [E, in, out] (views): gate_up [E, H, 2I], down [E, I, H]."""
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] -> [N, I]: silu(gate) * up, gate the first half."""
        return F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> sum over each token's k experts of weight * expert(x), [T, H]."""
        num_tokens, top_k = ids.shape
        flat = ids.flatten()                                   # [T * k]: pair p is token p // k
        order = torch.argsort(flat, stable=True)               # pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))      # pairs per expert (bincount syncs on CUDA)
        # index_select, not x[...] or index_add_: on small CPU tensors, advanced indexing and index_add_
        # with repeated indices cost milliseconds (tens of them at one token and 2 threads).
        rows = x.index_select(0, order // top_k)               # [T * k, H], expert-major
        if self.grouped:
            out = self._grouped(rows, counts, flat.index_select(0, order))
        else:
            out = self._looped(rows, counts)
        out = out.index_select(0, torch.argsort(order)).view(num_tokens, top_k, -1)   # back to token-major
        # Each expert's output scaled by its weight in the weights' dtype and rounded to x's, as transformers
        # does, then the token's k summed (in bf16 transformers rounds after each add: equal for k = 2).
        return (out * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)

    def _looped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One GEMM per selected expert over its contiguous block of rows (one host sync for the counts)."""
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():   # a clear error, not a failed sync
            raise RuntimeError("an MoE layer without torch._grouped_mm for this dtype and GPU cannot be captured "
                               "in a CUDA graph (its per-expert loop reads the counts on the host): turn "
                               "cuda_graphs off, or serve in bf16 on a GPU whose torch has grouped GEMMs")
        (gate_up, down), (gate_up_bias, down_bias) = self.in_out(), self.biases()
        out = rows.new_empty(len(rows), self.hidden)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if n:
                hidden = rows[start:start + n] @ gate_up[expert]
                if gate_up_bias is not None:
                    hidden = hidden + gate_up_bias[expert]
                hidden = self.activation(hidden) @ down[expert]
                out[start:start + n] = hidden if down_bias is None else hidden + down_bias[expert]
                start += n
        return out

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
        """Both projections as grouped GEMMs: group e is rows offsets[e-1]:offsets[e] (int32 end offsets;
        an expert with no rows is an empty group). row_experts [N]: each row's expert, for the biases."""
        (gate_up, down), (gate_up_bias, down_bias) = self.in_out(), self.biases()
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        hidden = torch._grouped_mm(rows, gate_up, offs=offsets)   # [N, 2I]
        if gate_up_bias is not None:
            hidden = hidden + gate_up_bias.index_select(0, row_experts)
        out = torch._grouped_mm(self.activation(hidden), down, offs=offsets)   # [N, H]
        return out if down_bias is None else out + down_bias.index_select(0, row_experts)


class SparseMoeBlock(nn.Module):
    """Router + experts: the feed-forward of a sparse layer. x [T, H] -> [T, H]."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 fp32_weights: bool, family: str):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.fp32_weights = fp32_weights
        self.family = family
        self.gate = nn.Linear(hidden, num_experts, bias=False)   # the router
        self.experts = Experts(num_experts, hidden, intermediate)
        # Under tensor parallelism each rank's experts hold a slice of their intermediate: the sum of
        # the ranks' partial outputs (parallel.build_sharded sets it); None: the output is whole.
        self.reduce = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.fp32_weights)
        out = self.experts(x, weights, ids)
        return out if self.reduce is None else self.reduce(out)

    def checkpoint_plan(self, prefix: str, names) -> dict[str, tuple[str, int | None, int | None]]:
        """For the strict loader: checkpoint tensor -> (our parameter, row offset, rows), the rows counted
        in the parameter's [E * rows_per_expert, cols] view (offset None: the whole tensor). Fused
        3-D tensors under our names when the checkpoint has them, else the hub's per-expert tensors
        (prefix: this block's module name, e.g. "model.layers.3.mlp")."""
        gate_up, down, router = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj", f"{prefix}.gate.weight"
        # A router the loader already serves from GGUF blocks (a re-quantized draft) has no weight to fill.
        own_router = isinstance(self.gate, nn.Linear)
        if gate_up in names or down in names:
            return {gate_up: (gate_up, None, None), down: (down, None, None)} | \
                ({router: (router, None, None)} if own_router else {})
        block, (gate_name, up_name, down_name) = HUB_NAMES[self.family]
        hub = f"{prefix.rpartition('.')[0]}.{block}"
        inter, hidden = self.experts.intermediate, self.experts.hidden
        plan = {f"{hub}.gate.weight": (router, None, None)} if own_router else {}
        for e in range(self.experts.num_experts):
            plan[f"{hub}.experts.{e}.{gate_name}.weight"] = (gate_up, 2 * e * inter, inter)
            plan[f"{hub}.experts.{e}.{up_name}.weight"] = (gate_up, (2 * e + 1) * inter, inter)
            plan[f"{hub}.experts.{e}.{down_name}.weight"] = (down, e * hidden, hidden)
        return plan


class GptOssExperts(Experts):
    """gpt-oss's experts, in its own layout (what its bf16 checkpoints and transformers hold):
    gate_up_proj [E, H, 2I] with gate and up interleaved (columns 0, 2, 4, ... gate), down_proj [E, I, H],
    a bias on each projection, and a clamped SwiGLU: gate clamped above at `limit`, up to +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    column_major = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float):
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.grouped = False

    def in_out(self):
        return self.gate_up_proj, self.down_proj

    def biases(self):
        return self.gate_up_proj_bias, self.down_proj_bias

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssMoeBlock(nn.Module):
    """gpt-oss's feed-forward: a router with a bias; top-k of its logits, then a softmax over those k
    only (in the logits' dtype); the experts above. Names are the checkpoint's (`mlp.router`,
    `mlp.experts.*`), so the loader needs no plan of its own. MXFP4 checkpoints (the hub's originals,
    `*_blocks` / `*_scales`) are refused: dequantize them to bf16 first."""

    def __init__(self, config):
        super().__init__()
        quantization = getattr(config, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        if method is not None:
            raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported: use a bf16 one")
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1, dtype=top.dtype), ids)
