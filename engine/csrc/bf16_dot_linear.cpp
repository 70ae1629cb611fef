// bf16 linears on AVX512-BF16 dot products, for CPUs that have them (AMD Zen 4 and later, Intel
// Cooper Lake and later): y = bf16(x) @ W^T (+ bias), accumulated in fp32.
//
// Why: on such a CPU one vdpbf16ps multiplies and adds 32 bf16 pairs, twice the fp32 FMA's work, and
// reads the weight as stored. streamed_linear.cpp widens every weight to fp32 first, so from about 3
// rows it is compute-bound (SmolLM2-135M's linears, 2 threads, AVX512-BF16 EPYC: 21 ms a pass at 4
// rows, 29 at 8, against 10 at 1), and oneDNN's bf16 matmul spends ~17 ms on any pass of 1-9 rows.
// Here a pass of up to ~4 rows costs what one row does (the weights' bytes over memory bandwidth)
// and 8 rows ~1.3x: verification and small decode batches at the price of a decode step.
//
// Layout: the weight is repacked once into blocks of NB = 4 outputs; within a block, K / 32 groups of
// 4 x 32 bf16 (the 4 outputs' next 32 weights, 256 bytes), so that a block is one sequential stream
// the prefetcher follows and every input vector loaded serves 4 outputs. Threads split the blocks;
// within a block, rows go in register tiles of up to MAXT (4 x 6 accumulators, 6 inputs and one
// weight vector: 31 of the 32 zmm registers) while the block (4 x K x 2 bytes) stays in L1.
//
// Every output's sum runs in the same order whatever the tile size or thread (K in order, 32 lanes
// per step, one fixed reduction), so a row's result does not depend on the other rows in its pass:
// a verification row equals the decode row bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"

namespace {

constexpr int64_t NB = 4;    // outputs per block
constexpr int64_t KB = 32;   // k per group: one zmm of bf16 pairs
constexpr int MAXT = 6;      // rows per register tile
constexpr int64_t PREFETCH_ROWS = 5;   // from this many rows a pass prefetches the next block (see block_rows);
                                       // at 1-4 rows (memory-bound) it was up to 1.7x slower on most shapes

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

AVX512_BF16 inline __m256 half(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// The sums of four zmm accumulators, as lanes 0..3 of one vector (one fixed order of additions).
AVX512_BF16 inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y[m0 : m0 + MT, n0 : n0 + 4] from one block of the packed weight and MT rows of bf16 inputs; with
// `next`, the next block is prefetched into L2 as the loop goes (see block_rows).
template <int MT>
AVX512_BF16 inline void tile(const uint16_t* block, const uint16_t* x, float* y, const float* bias, int64_t K,
                             int64_t N, int64_t m0, int64_t n0, const uint16_t* next) {
  __m512 acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += KB) {
    const uint16_t* group = block + k * NB;
    if (next)   // the next block's group at this k: 4 cache lines
      for (int line = 0; line < NB; ++line) _mm_prefetch(reinterpret_cast<const char*>(next + k * NB + line * KB), _MM_HINT_T1);
    __m512bh xs[MT];
    for (int i = 0; i < MT; ++i) xs[i] = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(group + j * KB);
      for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xs[i], w);
    }
  }
  const __m128 b = bias ? _mm_loadu_ps(bias + n0) : _mm_setzero_ps();
  for (int i = 0; i < MT; ++i)
    _mm_storeu_ps(y + (m0 + i) * N + n0, _mm_add_ps(sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), b));
}

// All M rows against one block: tiles as even as MAXT allows (8 rows: 4 + 4, not 6 + 2). The first
// tile streams the block from memory, later ones read it from L1 and would leave the memory idle: so
// the last tile prefetches the next block (`next`, null for a thread's last) into L2. Without it, a
// pass of 5-9 rows cost the memory stream plus the later tiles' compute (a 4096 x 1024 weight, 2
// threads, AVX512-BF16 EPYC: 138 us at 1 row, 143 at 4, 214 at 5, 371 at 8).
AVX512_BF16 void block_rows(const uint16_t* block, const uint16_t* x, float* y, const float* bias, int64_t M,
                            int64_t K, int64_t N, int64_t n0, const uint16_t* next) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, tiles = (left + MAXT - 1) / MAXT, rows = (left + tiles - 1) / tiles;
    const uint16_t* ahead = M >= PREFETCH_ROWS && m + rows == M ? next : nullptr;
    switch (rows) {
      case 1: tile<1>(block, x, y, bias, K, N, m, n0, ahead); break;
      case 2: tile<2>(block, x, y, bias, K, N, m, n0, ahead); break;
      case 3: tile<3>(block, x, y, bias, K, N, m, n0, ahead); break;
      case 4: tile<4>(block, x, y, bias, K, N, m, n0, ahead); break;
      case 5: tile<5>(block, x, y, bias, K, N, m, n0, ahead); break;
      default: tile<6>(block, x, y, bias, K, N, m, n0, ahead); break;
    }
    m += rows;
  }
}

// fp32 -> bf16, round to nearest even (what torch's .bfloat16() does), 32 at a time.
AVX512_BF16 void to_bf16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, (__m512i)v);
  }
}

}  // namespace

namespace specserve {

bool has_avx512_bf16() {   // asked once: linear_bf16_blocks checks it on every call
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
}

torch::Tensor pack_bf16_blocks(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "weight: bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % NB == 0 && K % KB == 0, "bf16 blocks need N % 4 == 0 and K % 32 == 0");
  return w.contiguous().view({N / NB, NB, K / KB, KB}).permute({0, 2, 1, 3}).contiguous().view({N, K});
}

torch::Tensor unpack_bf16_blocks(const torch::Tensor& blocks) {
  const int64_t N = blocks.size(0), K = blocks.size(1);
  return blocks.view({N / NB, K / KB, NB, KB}).permute({0, 2, 1, 3}).contiguous().view({N, K});
}

torch::Tensor linear_bf16_blocks(const torch::Tensor& x, const torch::Tensor& blocks,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(has_avx512_bf16(), "linear_bf16_blocks needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kBFloat16 && blocks.is_contiguous() &&
                  blocks.size(1) == x.size(1) && blocks.size(0) % NB == 0 && x.size(1) % KB == 0,
              "weight: bf16 blocks [N, K] from pack_bf16_blocks");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == blocks.size(0), "bias: fp32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  auto xb = torch::empty({M, K}, x.options().dtype(torch::kBFloat16));
  auto* xs = reinterpret_cast<uint16_t*>(xb.data_ptr());
  to_bf16(x.data_ptr<float>(), xs, M * K);
  auto y = torch::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(blocks.data_ptr());
  float* out = y.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, N / NB, 4, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk)
      block_rows(w + blk * NB * K, xs, out, b, M, K, N, blk * NB, blk + 1 < end ? w + (blk + 1) * NB * K : nullptr);
  });
  return y;
}

}  // namespace specserve
