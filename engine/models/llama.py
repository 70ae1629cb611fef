"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, and the mixtures of experts
Qwen3-MoE, Mixtral and gpt-oss) over the paged KV cache.

One decoder serves the whole family; the differences are flags read from the
Hugging Face config:
    Llama     attention_bias (q/k/v/o), mlp_bias, optional Llama 3 RoPE scaling
    Mistral   no biases; `sliding_window` attention (see below)
    Qwen2     bias on q/k/v only (always), none on o_proj
    Qwen3     RMSNorm on each query/key head before RoPE; attention_bias
    Phi-3     q/k/v and gate/up fused in the checkpoint too; LongRoPE (rope.py); sliding window
    Qwen3-MoE Qwen3's attention; the MLP of most layers a sparse mixture of experts (engine/models/moe.py)
    Mixtral   Mistral's attention (sliding window); every layer's MLP a mixture of experts
    gpt-oss   biases on q/k/v/o, attention sinks, sliding and full layers alternating (layer_types);
              every layer's MLP a mixture of experts with biases and a clamped SwiGLU. (Its RMSNorm
              scales in fp32 before rounding, ours after: the same in fp32, a bf16 rounding apart.)

The model works on a flat ragged batch: T tokens from any number of sequences,
no batch dimension. Positions and the AttentionMetadata say where each token
sits; every layer writes its keys/values into its paged cache and attends
through `rope_paged_attention` (engine/attention.py).

On CPU in fp32 the engine runs the layers' small ops through C++ kernels
(use_fused_cpu_ops below, engine/cpu_kernels.py): add + RMSNorm, silu * up, and
RoPE + cache write + attention for decode and verification rows, one call each
instead of a few dozen torch ops per layer.

Parameter names are Hugging Face's, except that q/k/v are fused into
`self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj` (one GEMM each); the
loader fills the fused weights from the separate checkpoint tensors, guided
by `FusedLinear.shard_names`. A mixture of experts keeps transformers 5's in-memory names
(`mlp.gate`, `mlp.experts.gate_up_proj` / `down_proj`, 3-D) and tells the loader how the hub's
per-expert tensors fill them (SparseMoeBlock.checkpoint_plan).

Sliding window (Mistral, Mixtral; Qwen2/3 with use_sliding_window; gpt-oss): each layer whose
config marks it sliding (`layer_types`; every layer when the config has none)
attends to the last `sliding_window` positions only, as transformers does; the
runner builds the windowed metadata once per pass (engine/attention.py). The KV
cache still keeps every position, so the context is not limited by the window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, rope_paged_attention
from engine.models.moe import moe_block
from engine.models.rope import RotaryEmbedding, rotary_order


class FusedLinear(nn.Linear):
    """A Linear whose output rows are several checkpoint tensors stacked along dim 0.

    shard_names[i] is the Hugging Face sibling module ("q_proj") whose weight
    (and bias) fills rows offsets[i] : offsets[i] + output_sizes[i]."""

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)

    def shards(self):
        """Yield (hf_sibling_name, row_offset, num_rows)."""
        offset = 0
        for name, size in zip(self.shard_names, self.output_sizes):
            yield name, offset, size
            offset += size


def scatter_draft_logits(small: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary [n, len(token_ids)] -> [n, vocab_size] float32, -inf elsewhere
    (the proposal gives the tokens outside it no mass). A draft model's vocabulary (CausalLM.output_tokens)
    and the EAGLE heads' use it."""
    logits = small.new_full((len(small), vocab_size), float("-inf"), dtype=torch.float32)
    return logits.index_copy_(1, token_ids, small.float())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, inv_size: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, round to x's dtype, then scale by weight.

    mean(x^2) is taken as |x|^2 / n from one vector_norm, and eps is a 0-dim fp32
    tensor so that `|x|^2 / n + eps` is one addcmul: at decode sizes on CPU,
    where dispatch overhead dominates, this costs about half of F.rms_norm."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv_rms = torch.rsqrt(torch.addcmul(eps, norm, norm, value=inv_size))
    return weight * (x * inv_rms).to(x.dtype)  # x * (fp32 [..., 1]) is computed in fp32


class RMSNorm(nn.Module):
    """With `residual`, first adds it (the pre-norm residual stream) and returns
    (normed, new_residual), saving the decoder layer a separate step."""
    kernels = None   # the CPU kernels' module once use_fused_cpu_ops has run: the add and the norm in one call

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.inv_size = 1.0 / size
        self.register_buffer("eps_tensor", torch.full((), eps, dtype=torch.float32), persistent=False)

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        self.eps_tensor = torch.full((), self.eps, dtype=torch.float32, device=device)  # fp32 whatever dtype is

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernels is not None:
            normed, total = self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, total)
        if residual is None:
            return rms_norm(x, self.weight, self.eps_tensor, self.inv_size)
        x = x + residual
        return rms_norm(x, self.weight, self.eps_tensor, self.inv_size), x


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, sinks: bool = False, fused_checkpoint: bool = False):
        super().__init__()
        hidden = config.hidden_size
        self.sliding_window = sliding_window   # None: full attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        # Phi-3's checkpoints hold q/k/v already fused, as one tensor in our layout
        sizes, names = ([self.q_size + 2 * self.kv_size], ["qkv_proj"]) if fused_checkpoint else \
            ([self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"])
        self.qkv_proj = FusedLinear(hidden, sizes, names, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        # gpt-oss: a learned logit per query head in every softmax's denominator (engine/attention.py)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk, value = qkv.split([num_qk_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:  # Qwen3: per-head RMSNorm, q_norm on query heads, k_norm on key heads, in one call
            weight = torch.cat((self.q_norm.weight.expand(self.num_heads, self.head_dim),
                                self.k_norm.weight.expand(self.num_kv_heads, self.head_dim)))
            qk = self.norm_heads(qk, weight)
        out = rope_paged_attention(qk, value, cos, sin, kv_cache, meta, self.num_heads, self.scale,
                                   self.sliding_window, softcap=self.softcap, sinks=self.sinks)   # [T, H_q, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    softcap: float | None = None   # score soft-capping (Gemma 2's attention)

    def reorder_rotary_dims(self, order: torch.Tensor) -> None:
        """Keep each query and key head's dimensions in `order` (rope.rotary_order: partial RoPE on
        the full-head kernels): the rows of q and k in qkv_proj, and q/k norm weights."""
        if type(self.qkv_proj) is not FusedLinear:
            raise ValueError("partial RoPE reorders the q/k rows of plain linears: load this model without "
                             "GGUF-served blocks (quantization none or bf16)")
        D, qk_heads = self.head_dim, self.num_heads + self.num_kv_heads
        rows = torch.cat([order + h * D for h in range(qk_heads)] + [torch.arange(qk_heads * D, qk_heads * D
                                                                                  + self.kv_size)])
        rows = rows.to(self.qkv_proj.weight.device)
        for param in (self.qkv_proj.weight, self.qkv_proj.bias):
            if param is not None:
                param.data = param.data.index_select(0, rows)
        if self.qk_norm:
            for norm in (self.q_norm, self.k_norm):
                norm.weight.data = norm.weight.data.index_select(0, order.to(norm.weight.device))

    def norm_heads(self, qk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The q/k heads [T, H_q + H_kv, D] normed, weight [H_q + H_kv, D] (q_norm's rows, then k_norm's)."""
        return rms_norm(qk, weight, self.q_norm.eps_tensor, self.q_norm.inv_size)


class MLP(nn.Module):
    kernels = None   # as RMSNorm's: silu(gate) * up in one call

    def __init__(self, hidden: int, intermediate: int, bias: bool, fused_checkpoint: bool = False):
        super().__init__()
        sizes, names = ([2 * intermediate], ["gate_up_proj"]) if fused_checkpoint else \
            ([intermediate, intermediate], ["gate_proj", "up_proj"])   # Phi-3's checkpoints: gate/up fused
        self.gate_up_proj = FusedLinear(hidden, sizes, names, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:])


def feed_forward(config, layer: int, flags: dict) -> nn.Module:
    """Decoder layer `layer`'s feed-forward: the family's mixture of experts where it has one, else the dense MLP."""
    sparse = moe_block(config, layer)
    return sparse if sparse is not None else \
        MLP(config.hidden_size, config.intermediate_size, flags["mlp_bias"], flags.get("fused_checkpoint", False))


class DecoderLayer(nn.Module):
    """mlp: the layer's feed-forward (feed_forward below); None, a dense MLP (EAGLE heads' layers are dense
    whatever their config's family)."""

    def __init__(self, config, head_dim: int, flags: dict, sliding_window: int | None = None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(config, head_dim, flags["qkv_bias"], flags["o_bias"], flags["qk_norm"],
                                   sliding_window, flags.get("sinks", False), flags.get("fused_checkpoint", False))
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta):
        """Pre-norm block on the (hidden, residual) pair; residual is None before the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, head_dim: int, flags: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, head_dim, flags, window, feed_forward(config, layer, flags))
                                    for layer, window in enumerate(layer_sliding_windows(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim, config.max_position_embeddings)
        # EAGLE-3-style fused features: the residual stream after these layers, concatenated, is
        # left in self.captured by every forward (CausalLM.set_feature_layers); none by default.
        self.feature_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(self, input_ids, positions, meta, kv_caches):
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual, captured = None, []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
            if index in self.feature_layers:
                captured.append(hidden + residual)   # the layer's output: the pre-norm residual stream
        if captured:
            self.captured = torch.cat(captured, dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def architecture_flags(config) -> dict:
    """Which optional pieces this family member has, from config.model_type."""
    model_type = config.model_type
    with_bias_flag = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
    attention_bias = bool(getattr(config, "attention_bias", False)) if model_type in with_bias_flag else False
    return {
        "qkv_bias": True if model_type == "qwen2" else attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(getattr(config, "mlp_bias", False)) if model_type == "llama" else False,
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        "sinks": model_type == "gpt_oss",
        "fused_checkpoint": model_type == "phi3",   # qkv_proj and gate_up_proj stored fused
    }


def layer_sliding_windows(config) -> list[int | None]:
    """Per layer, the sliding window it attends within (None: full attention). Qwen2/3 configs
    list `layer_types` (sliding only with use_sliding_window, from layer max_window_layers on);
    Mistral's has none, and its window applies to every layer."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [int(window)] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def _sliding_window(config) -> int | None:
    """The window of the sliding layers, if any layer slides."""
    return next((w for w in layer_sliding_windows(config) if w is not None), None)


def arrange_rotary_dims(model: nn.Module) -> None:
    """Once a model's (or an EAGLE head's) weights are in: with partial RoPE (Phi-4-mini), each
    attention's q/k dimensions reordered so that the full-head RoPE of every attention path serves
    it (rope.rotary_order)."""
    rope = next((m for m in model.modules() if isinstance(m, RotaryEmbedding)), None)
    order = None if rope is None else rotary_order(rope.config, rope.head_dim)
    if order is not None:
        for module in model.modules():
            if isinstance(module, Attention):
                module.reorder_rotary_dims(order)


class CausalLM(nn.Module):
    """Decoder + LM head. forward returns final hidden states; compute_logits applies
    the head only to the rows the caller selected (e.g. the last token of each sequence)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.sliding_window = _sliding_window(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", self.tied_by_default))
        self.model = self.build_decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        weight = self.lm_head.weight
        if not weight.is_meta:  # built on the meta device, the loader calls init_buffers after loading
            self.init_buffers(weight.device, weight.dtype)

    tied_by_default = False   # whether the LM head is the embedding when the config does not say

    def build_decoder(self, config) -> nn.Module:
        """The decoder stack (embedding, layers, final norm): the Llama family's; other families override."""
        return LlamaModel(config, self.head_dim, architecture_flags(config))

    def init_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        """(Re)build the derived, non-checkpoint buffers (RoPE cache, norm eps) on device."""
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device, dtype)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):   # not a GGUFLinear over its own blocks
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size]; writes this pass's K/V into kv_caches."""
        if len(kv_caches) != self.num_layers:  # zip() in the layer loop would silently skip layers
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        return self.model(input_ids, positions, meta, kv_caches)

    output_tokens: torch.Tensor | None = None   # an LM head over these token ids only (a draft vocabulary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32 (-inf outside output_tokens)."""
        logits = self.lm_head(hidden).float()
        return logits if self.output_tokens is None else scatter_draft_logits(logits, self.output_tokens, self.vocab_size)

    def set_feature_layers(self, layers: list[int]) -> None:
        """Make every forward also capture the outputs of these decoder layers (EAGLE-3's low, middle
        and high features) for `features`."""
        if not layers:
            raise ValueError("set_feature_layers needs at least one decoder layer")
        self.model.feature_layers = check_feature_layers(layers, self.num_layers)

    @property
    def feature_size(self) -> int:
        """Width of the features a proposer reads (features): the final hidden state, or the fused layers."""
        return self.hidden_size * max(1, len(self.model.feature_layers))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The features of the last forward's rows: its final hidden states (`hidden`), or with
        feature layers, their fused outputs."""
        return self.model.captured if self.model.feature_layers else hidden


def check_feature_layers(layers, num_layers: int) -> tuple[int, ...]:
    """Fused-feature layers, sorted (the order their outputs are concatenated in): distinct decoder
    layers below the last, whose output is the final hidden state's input. ValueError otherwise.
    The engine and the trainer (train/eagle_head.py) hold heads to this one rule."""
    layers = tuple(sorted(int(i) for i in layers))
    if any(not 0 <= i < num_layers - 1 for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"feature layers must be distinct decoder layers in [0, {num_layers - 1}) of this "
                         f"{num_layers}-layer target (the last one's output is the final hidden state); "
                         f"got {list(layers)}")
    return layers


def use_fused_cpu_ops(model: nn.Module) -> None:
    """Run the model's norms, MLP activations and decode-shaped attention through the fused CPU ops
    (engine/cpu_kernels.py; fp32 on CPU, where cpu_kernels.fused_ops_usable says so). The model's
    runner reads `fused_ops` and attends with the kernel's backend (attention_backends.KernelBackend)."""
    from engine import cpu_kernels

    kernels = cpu_kernels.extension()
    for module in model.modules():   # the kernels read rows in steps of 8 floats
        if isinstance(module, RMSNorm) and module.weight.numel() % 8 == 0 or \
                isinstance(module, MLP) and module.intermediate % 8 == 0:
            module.kernels = kernels
    model.fused_ops = model.head_dim % 16 == 0   # RoPE takes each half of a head in steps of 8
