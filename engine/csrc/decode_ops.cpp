// A decoder layer's small ops, fused, in fp32 (the compute dtype on CPUs without native bf16).
//
// Why: one decode step of a small model is ~60 torch ops per layer besides its linears (norms,
// RoPE, the cache write, the per-sequence attention calls and their index_selects, views), each a
// few microseconds of dispatch for far less arithmetic: on the default target (30 layers) that was
// ~20 ms of a 46 ms step at batch 1. Here each is one call:
//
//   add_rms_norm          x + residual, then RMSNorm of it (Hugging Face's: in fp32, times weight)
//   silu_mul              silu(gate) * up of the MLP's fused gate_up projection
//   rope_paged_attention  neox RoPE on queries and keys, keys and values into their cache slots, and
//                         causal attention of every query row over its sequence's pages where they
//                         lie (no gather), the query heads sharing a KV head together; a draft
//                         tree's rows each over the context and their own path (see attend)
//
// The attention is flash-style: keys in chunks of CHUNK, a running max and sum per query row, so
// memory stays small at any context. A row's result does not depend on the other rows of the pass,
// so verification rows match decode rows bit for bit: chunks start at fixed key offsets, a row
// reads only the keys up to its own position (a pass's later keys would move where the vector loops
// end and the scalar tails begin, and so the order of the sums), and every key's score is reduced
// the same way, in a group of eight or in the chunk's tail.
// Needs AVX2 + FMA; head_dim a multiple of 16 (checked by the Python side, which keeps torch's path
// otherwise).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "avx2.h"
#include "ops.h"

namespace {

using specserve::exp256;
using specserve::hsum;
using specserve::hsum8;

constexpr int64_t CHUNK = 64;   // keys per online-softmax step: their K and V rows (at D = 64) fit in L1
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 2 && t.is_contiguous(), name, ": contiguous fp32 [T, H]");
  TORCH_CHECK(t.size(1) % 8 == 0, name, ": width must be a multiple of 8");
}

// Rows in one parallel task: enough work that a thread's start-up cost is small against it.
int64_t grain(int64_t row_width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_width, 1)); }

// x[0..D) rotated (neox style: halves [a, b] -> [a cos - b sin, b cos + a sin], with sin_signed
// holding -sin on the first half) into out, optionally scaled.
inline void rope(const float* x, const float* cos, const float* sin_signed, float* out, int64_t D, float scale) {
  const int64_t half = D / 2;
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(x + d + half);
    const __m256 lo = _mm256_fmadd_ps(b, _mm256_loadu_ps(sin_signed + d), _mm256_mul_ps(a, _mm256_loadu_ps(cos + d)));
    const __m256 hi = _mm256_fmadd_ps(a, _mm256_loadu_ps(sin_signed + d + half),
                                      _mm256_mul_ps(b, _mm256_loadu_ps(cos + d + half)));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(lo, s));
    _mm256_storeu_ps(out + d + half, _mm256_mul_ps(hi, s));
  }
}

// scores[j] = q . keys[j] for 0 < n <= CHUNK keys, eight at a time; a last group of fewer repeats its
// last key and keeps only its own lanes, so that every score is reduced the same way.
inline void dot_keys(const float* q, const float* const* keys, int64_t n, int64_t D, float* scores) {
  for (int64_t j = 0; j < n; j += 8) {
    const float* group[8];
    for (int i = 0; i < 8; ++i) group[i] = keys[std::min(j + i, n - 1)];
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(group[i] + d), acc[i]);
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, hsum8(acc));
    for (int64_t i = 0; i < std::min<int64_t>(8, n - j); ++i) scores[j + i] = sums[i];
  }
}

// One online-softmax step of one query row over a chunk: p = e^(scores - new max) in place, the
// row's output rescaled and p . values added; nothing while every key so far is masked.
inline void absorb(float* scores, int64_t n, const float* const* values, int64_t D, float* out, float& max,
                   float& sum) {
  float chunk_max = NEG_INF;
  for (int64_t j = 0; j < n; ++j) chunk_max = std::max(chunk_max, scores[j]);
  const float new_max = std::max(max, chunk_max);
  if (new_max == NEG_INF) return;
  const float rescale = max == NEG_INF ? 0.f : std::exp(max - new_max);
  const __m256 m = _mm256_set1_ps(new_max);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    _mm256_storeu_ps(scores + j, p);
    total = _mm256_add_ps(total, p);
  }
  float chunk_sum = hsum(total);
  for (; j < n; ++j) {
    scores[j] = scores[j] == NEG_INF ? 0.f : std::exp(scores[j] - new_max);
    chunk_sum += scores[j];
  }
  sum = sum * rescale + chunk_sum;
  max = new_max;
  // out = out * rescale + p . values, 64 columns at a time: eight independent sums per key (one sum
  // per column block, a chain of dependent FMAs, ran at a quarter of the FMA units' rate). Each column
  // still adds the keys in order, so the result is the same.
  const __m256 r = _mm256_set1_ps(rescale);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t blocks = std::min<int64_t>(64, D - d0) / 8;
    __m256 acc[8];
    for (int64_t v = 0; v < blocks; ++v) acc[v] = _mm256_mul_ps(_mm256_loadu_ps(out + d0 + 8 * v), r);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 p = _mm256_set1_ps(scores[k]);
      for (int64_t v = 0; v < blocks; ++v) acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(values[k] + d0 + 8 * v), acc[v]);
    }
    for (int64_t v = 0; v < blocks; ++v) _mm256_storeu_ps(out + d0 + 8 * v, acc[v]);
  }
}

struct PagedCache {
  float* keys;     // [NB, BS, H_kv, D]
  float* values;
  int64_t block_size, num_kv_heads, head_dim;
  inline int64_t offset(int64_t slot, int64_t head) const { return (slot * num_kv_heads + head) * head_dim; }
};

inline const float* slot_row(const float* base, const PagedCache& cache, const int32_t* table, int64_t pos,
                             int64_t head) {
  return base + cache.offset(int64_t(table[pos / cache.block_size]) * cache.block_size + pos % cache.block_size, head);
}

// Attention of sequence b's rows for KV head `head`: rows r = i * G + g (query i, head head * G + g),
// query i at position seq_len - q_len + i sees keys (position - window, position].
//
// With tree_bits, the sequence's last tree_cols positions hold a draft tree (its fed tokens the last
// q_len of them): query i reads the context before the tree, then the tree positions whose bits are
// set in tree_bits[q_begin + i] (its ancestors and itself, in depth order), as if they lay at the
// positions after the context; so it is the same computation, key for key and chunk for chunk, as a
// causal row at its depth's position over the context and its path: a tree row equals the decode
// row bit for bit, as a chain's verification rows do.
void attend(const PagedCache& cache, const float* queries, float* out, const int32_t* table, int64_t q_begin,
            int64_t q_len, int64_t seq_len, int64_t head, int64_t group, int64_t num_heads, int64_t window,
            const int64_t* tree_bits, int64_t tree_cols) {
  const int64_t D = cache.head_dim, rows = q_len * group, first_pos = seq_len - q_len, tree_pos = seq_len - tree_cols;
  std::vector<float> acc(rows * D, 0.f), scores(CHUNK), max(rows, NEG_INF), sum(rows, 0.f);
  const float* keys[CHUNK];
  const float* values[CHUNK];
  const float* path_keys[CHUNK];
  const float* path_values[CHUNK];
  // A tree's queries: each one's tree positions in depth order, and the last key position it reads.
  std::vector<int64_t> paths(tree_bits != nullptr ? q_len * 64 : 0), last(q_len);
  for (int64_t i = 0; i < q_len; ++i) {
    last[i] = first_pos + i;
    if (tree_bits == nullptr) continue;
    const uint64_t bits = uint64_t(tree_bits[q_begin + i]);
    int64_t depth = 0;
    for (int64_t j = 0; j < tree_cols; ++j)
      if ((bits >> j) & 1) paths[i * 64 + depth++] = tree_pos + j;
    last[i] = tree_pos + depth - 1;
  }
  // With a window, the first chunk starts where the earliest row's window does (a tree row's position is
  // its depth's, so the earliest may lie before first_pos).
  const int64_t earliest = *std::min_element(last.begin(), last.end());
  const int64_t lo = window > 0 ? std::max<int64_t>(0, earliest - window + 1) : 0;
  for (int64_t c0 = lo; c0 < seq_len; c0 += CHUNK) {
    const int64_t n = std::min(CHUNK, seq_len - c0);
    for (int64_t j = 0; j < n; ++j) {
      keys[j] = slot_row(cache.keys, cache, table, c0 + j, head);
      values[j] = slot_row(cache.values, cache, table, c0 + j, head);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / group, position = last[i];   // the last key position it reads (its own)
      const float* const* row_keys = keys;
      const float* const* row_values = values;
      if (tree_bits != nullptr && c0 <= position && c0 + n > tree_pos) {   // the chunk reaches the tree:
        // this row's own keys there
        const int64_t* path = paths.data() + i * 64;
        for (int64_t j = 0; j < std::min<int64_t>(n, position + 1 - c0); ++j) {
          const int64_t pos = c0 + j < tree_pos ? c0 + j : path[c0 + j - tree_pos];
          path_keys[j] = pos == c0 + j ? keys[j] : slot_row(cache.keys, cache, table, pos, head);
          path_values[j] = pos == c0 + j ? values[j] : slot_row(cache.values, cache, table, pos, head);
        }
        row_keys = path_keys;
        row_values = path_values;
      }
      if (c0 > position) continue;   // the whole chunk lies after this query
      const float* q = queries + ((q_begin + i) * num_heads + head * group + r % group) * D;
      const int64_t visible = std::min<int64_t>(n, position + 1 - c0);   // keys up to its own position
      dot_keys(q, row_keys, visible, D, scores.data());
      if (window > 0)
        for (int64_t j = 0; j < std::min<int64_t>(visible, position - window + 1 - c0); ++j) scores[j] = NEG_INF;
      absorb(scores.data(), visible, row_values, D, acc.data() + r * D, max[r], sum[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group;
    float* o = out + ((q_begin + i) * num_heads + head * group + r % group) * D;
    const __m256 inv = _mm256_set1_ps(1.f / sum[r]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * D + d), inv));
  }
}

}  // namespace

namespace specserve {

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                        const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual: the shape of x");
  }
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.is_contiguous() && weight.numel() == H, "weight: fp32 [H]");
  torch::Tensor total = residual ? torch::empty_like(x) : x;
  torch::Tensor out = torch::empty_like(x);
  const float *xs = x.data_ptr<float>(), *rs = residual ? residual->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float *ts = total.data_ptr<float>(), *os = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *xr = xs + t * H, *rr = rs ? rs + t * H : nullptr;
      float *tr = ts + t * H, *orow = os + t * H;
      __m256 squares = _mm256_setzero_ps();
      for (int64_t d = 0; d < H; d += 8) {
        __m256 v = _mm256_loadu_ps(xr + d);
        if (rr) {
          v = _mm256_add_ps(v, _mm256_loadu_ps(rr + d));
          _mm256_storeu_ps(tr + d, v);
        }
        squares = _mm256_fmadd_ps(v, v, squares);
      }
      const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum(squares) / float(H) + float(eps)));
      for (int64_t d = 0; d < H; d += 8)
        _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(tr + d), inv)));
    }
  });
  return {out, total};
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 8 == 0, "gate_up: width must be a multiple of 16");
  auto out = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t d = 0; d < I; d += 8) {
        const __m256 gate = _mm256_loadu_ps(g + t * 2 * I + d), up = _mm256_loadu_ps(g + t * 2 * I + I + d);
        const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gate))));
        _mm256_storeu_ps(o + t * I + d, _mm256_mul_ps(silu, up));
      }
  });
  return out;
}

torch::Tensor rope_paged_attention(const torch::Tensor& qk, const torch::Tensor& value, const torch::Tensor& cos,
                                   const torch::Tensor& sin, torch::Tensor& kv_cache,
                                   const torch::Tensor& slot_mapping, const torch::Tensor& query_start,
                                   const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
                                   int64_t num_heads, double scale, int64_t window,
                                   const c10::optional<torch::Tensor>& tree_bits,
                                   const c10::optional<torch::Tensor>& tree_cols) {
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat && kv_cache.dim() == 5 && kv_cache.is_contiguous() &&
                  kv_cache.size(0) == 2, "kv_cache: contiguous fp32 [2, blocks, block_size, H_kv, D]");
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t T = qk.size(0), B = seq_lens.size(0);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(qk.scalar_type() == torch::kFloat && qk.dim() == 3 && qk.size(1) == num_heads + num_kv_heads &&
                  qk.size(2) == D && qk.stride(2) == 1 && qk.stride(1) == D, "qk: fp32 [T, H_q + H_kv, D], heads contiguous");
  TORCH_CHECK(value.scalar_type() == torch::kFloat && value.dim() == 3 && value.size(0) == T &&
                  value.size(1) == num_kv_heads && value.stride(2) == 1 && value.stride(1) == D,
              "value: fp32 [T, H_kv, D], heads contiguous");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->size(0) == T && t->size(-1) == D && t->stride(-1) == 1,
                "cos / sin: fp32 [T, ..., D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == T, "slot_mapping: int64 [T]");
  TORCH_CHECK(query_start.scalar_type() == torch::kInt && query_start.numel() == B + 1 &&
                  seq_lens.scalar_type() == torch::kInt && block_tables.scalar_type() == torch::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.is_contiguous(),
              "query_start int32 [B + 1], seq_lens int32 [B], block_tables contiguous int32 [B, blocks]");
  if (tree_bits) {
    TORCH_CHECK(tree_bits->scalar_type() == torch::kLong && tree_bits->numel() == T && tree_bits->is_contiguous(),
                "tree_bits: contiguous int64 [T]");
    TORCH_CHECK(tree_cols && tree_cols->scalar_type() == torch::kInt && tree_cols->numel() == B &&
                    tree_cols->is_contiguous(), "tree_cols: contiguous int32 [B] with tree_bits");
  }
  const int64_t* bits = tree_bits ? tree_bits->data_ptr<int64_t>() : nullptr;
  const int32_t* cols = tree_bits ? tree_cols->data_ptr<int32_t>() : nullptr;
  auto out = torch::empty({T, num_heads, D}, qk.options());
  PagedCache cache{kv_cache.data_ptr<float>(), kv_cache.data_ptr<float>() + kv_cache.stride(0), block_size,
                   num_kv_heads, D};
  const float *qks = qk.data_ptr<float>(), *vs = value.data_ptr<float>();
  const float *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
  const int64_t *slots = slot_mapping.data_ptr<int64_t>();
  float* queries = out.data_ptr<float>();   // rotated, scaled queries; each task overwrites its own with outputs
  const int64_t qk_row = qk.stride(0), v_row = value.stride(0), cs_row = cos.stride(0), ss_row = sin.stride(0);
  const float s = float(scale);
  at::parallel_for(0, T, grain(2 * (num_heads + num_kv_heads) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cs + t * cs_row, *sn = ss + t * ss_row;
      for (int64_t h = 0; h < num_heads; ++h) rope(qks + t * qk_row + h * D, c, sn, queries + (t * num_heads + h) * D, D, s);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rope(qks + t * qk_row + (num_heads + h) * D, c, sn, cache.keys + cache.offset(slots[t], h), D, 1.f);
        std::memcpy(cache.values + cache.offset(slots[t], h), vs + t * v_row + h * D, D * sizeof(float));
      }
    }
  });
  const int32_t *starts = query_start.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1), group = num_heads / num_kv_heads;
  at::parallel_for(0, B * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, head = item % num_kv_heads;
      attend(cache, queries, queries, tables + b * width, starts[b], starts[b + 1] - starts[b], lens[b], head, group,
             num_heads, window, bits, cols ? cols[b] : 0);
    }
  });
  return out;
}

}  // namespace specserve
