// Weight-streaming linears for CPUs without native bf16: y = x @ W^T (+ bias), x in fp32,
// W kept in bf16 or in int8 with one fp32 scale per 32 weights of a row (Q8_0's grouping).
//
// Why: decoding at small batch reads every weight once per step, so its speed is the bytes of the
// weights over memory bandwidth. oneDNN's fp32 linear reads 4 bytes a weight and its bf16 linear is
// emulated (slow) on AVX2-only CPUs; here a weight is read as 2 or 1 bytes and widened in registers.
// The same weights serve a few rows (verification, batched decode) for little more than one row's
// cost: each weight tile is widened once per 4 rows and stays in L1 while the rows use it.
// Past BLOCK_ROWS rows (wide verification passes, prefill chunks) the matmul is compute-bound and
// runs in register blocks over L2-sized chunks of the weight, still never writing an fp32 copy of it.
//
// Layout of the loops: threads split the output features in blocks of BLOCK_N; each output's weight
// row is streamed once and used by every row of x (see tile); run_blocks for many rows.
// Needs AVX2 + FMA (checked by the Python side); K must be a multiple of 32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2.h"
#include "ops.h"

namespace {

constexpr int64_t GROUP = 32;     // int8 weights per scale
constexpr int64_t BLOCK_N = 16;   // output features per work item

using specserve::hsum;

// 8 weights of one row, widened to fp32.
struct Bf16Weights {
  const uint16_t* w;
  int64_t K;
  inline __m256 load(int64_t n, int64_t k) const {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  inline void prefetch(int64_t n, int64_t k) const { _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k), _MM_HINT_T1); }
};

struct Int8Weights {
  const int8_t* q;
  const float* scales;   // [N, K / GROUP]
  int64_t K;
  inline __m256 load(int64_t n, int64_t k) const {
    __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + n * K + k));
    __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    return _mm256_mul_ps(w, _mm256_set1_ps(scales[n * (K / GROUP) + k / GROUP]));
  }
  inline void prefetch(int64_t n, int64_t k) const { _mm_prefetch(reinterpret_cast<const char*>(q + n * K + k), _MM_HINT_T1); }
};

// y[m0 : m0 + MT, n] for MT <= 4 rows: output n's weight row is read front to back (one stream the
// hardware prefetcher follows; interleaving several rows' streams measured ~2x slower), widened once
// per 8 weights for all MT rows, with U partial sums per row over K so that MT * U (8 or so) FMA
// chains hide the FMA latency. With `ahead` (>= 0), output `ahead`'s weight row is prefetched into L2
// as the loop goes (see output).
template <int MT, int U, typename W>
inline void tile(const W& weights, const float* x, float* y, const float* bias, int64_t K, int64_t N,
                 int64_t m0, int64_t n, int64_t ahead = -1) {
  __m256 acc[MT][U];
  for (int i = 0; i < MT; ++i)
    for (int u = 0; u < U; ++u) acc[i][u] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8 * U) {
    if (ahead >= 0) weights.prefetch(ahead, k);   // a line holds 32-64 weights: some prefetches repeat
    for (int u = 0; u < U; ++u) {
      const __m256 w = weights.load(n, k + 8 * u);
      for (int i = 0; i < MT; ++i)
        acc[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + i) * K + k + 8 * u), w, acc[i][u]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    __m256 total = acc[i][0];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[i][u]);
    y[(m0 + i) * N + n] = hsum(total) + (bias ? bias[n] : 0.f);
  }
}

// All M rows against output n: tiles of 4 rows, then the tail. The weight row (K * 1 or 2 bytes)
// stays in L1 while the row tiles after the first use it; those leave the memory idle, so with more
// than one tile the last prefetches output `next`'s row into L2 (-1: none).
template <typename W>
inline void output(const W& weights, const float* x, float* y, const float* bias, int64_t M, int64_t K, int64_t N,
                   int64_t n, int64_t next) {
  const int64_t ahead = M > 4 ? next : -1;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, 2>(weights, x, y, bias, K, N, m, n, m + 4 == M ? ahead : -1);
  switch (M - m) {
    case 3: tile<3, 2>(weights, x, y, bias, K, N, m, n, ahead); break;
    case 2: tile<2, 4>(weights, x, y, bias, K, N, m, n, ahead); break;
    case 1: tile<1, 4>(weights, x, y, bias, K, N, m, n, ahead); break;
  }
}

// Few rows: each output's weight row is streamed once, front to back, for all of them.
template <typename W>
void run_rows(const W& weights, const float* x, float* y, const float* bias, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = (N + BLOCK_N - 1) / BLOCK_N;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(N, end * BLOCK_N);
    for (int64_t n = begin * BLOCK_N; n < last; ++n) output(weights, x, y, bias, M, K, N, n, n + 1 < last ? n + 1 : -1);
  });
}

// y[m0 : m0 + MT, n0 : n0 + NT]: MT rows against NT outputs, each 8 weights widened once for the MT
// rows and each 8 inputs loaded once for the NT outputs. MT = 3, NT = 4 is the largest block whose
// 12 accumulators, 3 inputs and 1 weight vector fit AVX2's 16 registers.
template <int MT, int NT, typename W>
inline void block(const W& weights, const float* x, float* y, const float* bias, int64_t K, int64_t N, int64_t m0,
                  int64_t n0) {
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xs[MT];
    for (int i = 0; i < MT; ++i) xs[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int j = 0; j < NT; ++j) {
      const __m256 w = weights.load(n0 + j, k);
      for (int i = 0; i < MT; ++i) acc[i][j] = _mm256_fmadd_ps(xs[i], w, acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <int MT, typename W>
inline void block_row(const W& weights, const float* x, float* y, const float* bias, int64_t K, int64_t N, int64_t m0,
                      int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) block<MT, 4>(weights, x, y, bias, K, N, m0, n);
  for (; n < n_end; ++n) block<MT, 1>(weights, x, y, bias, K, N, m0, n);
}

// Many rows (prefill chunks, wide verification passes): a GEMM in register blocks. Threads split the
// outputs in chunks of CHUNK_N whose weights (CHUNK_N * K * 1 or 2 bytes, 37-98 KiB) stay in L2 while
// every 3-row tile of x (in L1) passes over them, so the weights are read from memory once per pass,
// in their 1- or 2-byte form: no fp32 copy of W is ever written.
constexpr int64_t CHUNK_N = 32;

template <typename W>
void run_blocks(const W& weights, const float* x, float* y, const float* bias, int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n_begin = c * CHUNK_N, n_end = std::min(N, n_begin + CHUNK_N);
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) block_row<3>(weights, x, y, bias, K, N, m, n_begin, n_end);
      switch (M - m) {
        case 2: block_row<2>(weights, x, y, bias, K, N, m, n_begin, n_end); break;
        case 1: block_row<1>(weights, x, y, bias, K, N, m, n_begin, n_end); break;
      }
    }
  });
}

// From this many rows the register blocks beat streaming each weight row for all rows at once. Measured
// over SmolLM2-135M's 30 layers of bf16 weights (far past the caches), 2 threads, AVX2 EPYC: at 8 rows
// 26 ms a pass streamed against 34 blocked, level at 14, and at 33 rows 108 against 82.
constexpr int64_t BLOCK_ROWS = 14;

template <typename W>
void run(const W& weights, const float* x, float* y, const float* bias, int64_t M, int64_t K, int64_t N) {
  if (M >= BLOCK_ROWS) {
    run_blocks(weights, x, y, bias, M, K, N);
  } else {
    run_rows(weights, x, y, bias, M, K, N);
  }
}

void check(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "weight: contiguous [N, K]");
  TORCH_CHECK(x.size(1) % GROUP == 0, "K must be a multiple of 32");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == w.size(0), "bias: fp32 [N]");
}

}  // namespace

namespace specserve {

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check(x, w, bias);
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "weight: bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  Bf16Weights weights{reinterpret_cast<const uint16_t*>(w.data_ptr()), K};
  run(weights, x.data_ptr<float>(), y.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, M, K, N);
  return y;
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias) {
  check(x, q, bias);
  TORCH_CHECK(q.scalar_type() == torch::kChar, "weight: int8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == q.size(0) && scales.size(1) == q.size(1) / GROUP,
              "scales: contiguous fp32 [N, K / 32]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = torch::empty({M, N}, x.options());
  Int8Weights weights{q.data_ptr<int8_t>(), scales.data_ptr<float>(), K};
  run(weights, x.data_ptr<float>(), y.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, M, K, N);
  return y;
}

}  // namespace specserve
