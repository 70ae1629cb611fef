// The CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace specserve {

// streamed_linear.cpp: weight-only bf16 / int8 linears computed in fp32.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias);

// bf16_dot_linear.cpp: bf16 linears on AVX512-BF16 dot products over a blocked copy of the weight.
bool has_avx512_bf16();
torch::Tensor pack_bf16_blocks(const torch::Tensor& w);
torch::Tensor unpack_bf16_blocks(const torch::Tensor& blocks);
torch::Tensor linear_bf16_blocks(const torch::Tensor& x, const torch::Tensor& blocks,
                                 const c10::optional<torch::Tensor>& bias);

// gguf_linear.cpp: linears over GGUF's quantized blocks, repacked once into 16-output tiles.
bool has_avx512_vnni();
torch::Tensor gguf_repack(const torch::Tensor& raw, int64_t type, int64_t K);
torch::Tensor gguf_dequantize_tiles(const torch::Tensor& tiles, int64_t type, int64_t N, int64_t K);
torch::Tensor gguf_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& tiles,
                          const std::vector<int64_t>& types, const std::vector<int64_t>& sizes,
                          const c10::optional<torch::Tensor>& bias, bool portable);

// decode_ops.cpp: a decoder layer's small ops, fused, in fp32.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                        const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor rope_paged_attention(const torch::Tensor& qk, const torch::Tensor& value, const torch::Tensor& cos,
                                   const torch::Tensor& sin, torch::Tensor& kv_cache,
                                   const torch::Tensor& slot_mapping, const torch::Tensor& query_start,
                                   const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
                                   int64_t num_heads, double scale, int64_t window,
                                   const c10::optional<torch::Tensor>& tree_bits,
                                   const c10::optional<torch::Tensor>& tree_cols);

}  // namespace specserve
