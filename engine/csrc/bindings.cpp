#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace specserve;
  m.def("linear_bf16", &linear_bf16, "x fp32 [M, K] @ bf16 [N, K]^T (+ bias)");
  m.def("linear_int8", &linear_int8, "x fp32 [M, K] @ (int8 [N, K] * scales per 32)^T (+ bias)");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs linear_bf16_blocks");
  m.def("pack_bf16_blocks", &pack_bf16_blocks, "bf16 [N, K] -> the blocked layout of linear_bf16_blocks");
  m.def("unpack_bf16_blocks", &unpack_bf16_blocks, "the blocked layout -> bf16 [N, K]");
  m.def("linear_bf16_blocks", &linear_bf16_blocks, "bf16(x fp32 [M, K]) @ bf16 blocks^T (+ bias), fp32 sums");
  m.def("has_avx512_vnni", &has_avx512_vnni, "whether this CPU runs gguf_linear's AVX512-VNNI path");
  m.def("gguf_repack", &gguf_repack, "GGUF blocks uint8 [N, row bytes] -> gguf_linear's tiles");
  m.def("gguf_dequantize_tiles", &gguf_dequantize_tiles, "tiles -> the fp32 weight [N, K] they hold");
  m.def("gguf_linear", &gguf_linear, "int8(x fp32 [M, K]) @ tiles^T (+ bias), parts side by side -> fp32 [M, N]");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual) * weight, x + residual), fp32 [T, H]");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up fp32 [T, 2I] -> [T, I]");
  m.def("rope_paged_attention", &rope_paged_attention,
        "RoPE, keys and values into the paged cache, causal (or tree) attention over each sequence's pages (fp32)",
        py::arg("qk"), py::arg("value"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slot_mapping"),
        py::arg("query_start"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("num_heads"), py::arg("scale"),
        py::arg("window"), py::arg("tree_bits") = py::none(), py::arg("tree_cols") = py::none());
}
