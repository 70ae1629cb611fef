// Linears over GGUF's quantized weights, read as stored: y = x @ W^T (+ bias) where W is in Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K or Q6_K blocks.
//
// Why: decoding a small batch reads every weight once per step, so on a CPU its speed is the weights'
// bytes over memory bandwidth. A Q4_K_M file holds ~0.6 bytes a weight; dequantized to bf16 it is 2.
//
// How (the integer path llama.cpp also takes): each row of x is quantized to int8 per 32 inputs (scale
// ax = max |x| / 127), and each 16 outputs x 32 inputs of a weight tile are 512 unsigned integers
// q (0..255) with one scale s and offset m' per output: w = s q - m'. Then
//   sum_k w_k x_k = ax (s sum_k q_k xq_k - m' sum_k xq_k),
// the first sum exact in int32 (AVX512-VNNI's vpdpbusd: 64 u8 x s8 products a cycle, 4 per output lane),
// the rest a few fp32 operations per 32 inputs shared by 16 outputs. Every row's sum runs in the same
// order whatever the other rows of its pass, so a verification row equals the decode row bit for bit.
//
// Layout: the weight is repacked once at load into tiles of TN = 16 outputs, each one sequential stream
// (see the Format table and repack). Per superblock (a GGUF block's inputs): a header with the 16
// outputs' fp16 d (and dmin / m), then per group of G inputs the two-level types' integer scales and
// the values: 4-bit values as nibbles (input quad c in the low nibble, quad c + G/8 in the high) plus
// Q5_0's and Q6_K's high bits as 64-bit masks over the 64 values of a quad, 8-bit values as bytes.
// The 64 values of a quad are [output][4 inputs], vpdpbusd's lane order. The bytes per weight stay
// those of the file (Q4_K 0.578 for 0.5625, Q6_K 0.82, Q5_0 0.69, Q8_0 1.06).
//
// Paths: AVX512-VNNI (AMD Zen 4 and later, Intel Ice Lake / Sapphire Rapids and later), chosen at run
// time; elsewhere a portable C++ loop over the same layout (correct, several times slower).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <sys/mman.h>

#include "ops.h"

namespace {

constexpr int64_t TN = 16;   // outputs per tile: one zmm of int32 sums
constexpr int64_t QK = 32;   // inputs per activation scale
constexpr int MAXR = 6;      // rows per register tile
// Passes of several rows ask for the values this many bytes ahead: their integer work keeps a core
// from issuing the loads that would keep its memory stream busy. (One row is the stream's pace, and
// the hardware prefetcher does better alone: measured on Zen 4 over a 1.5B model's FFN matrices,
// 2 KB ahead is 10-16% faster at 2-5 rows and 5% slower at one row; 1-4 KB all alike.)
constexpr int64_t PREFETCH = 2048;

// GGUF's type ids (ggml.h).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct Format {
  int64_t G;            // inputs per scale
  int64_t GPS;          // groups per superblock (a GGUF block)
  int64_t block_bytes;  // bytes of a GGUF block
  bool nibbles;         // values as 4-bit nibbles (+ hbits planes), else as bytes
  int hbits;            // value bits above the nibble (Q5_0: 1, Q6_K: 2)
  bool two_level;       // K-quants: s = d * sc per group (and m' = dmin * mn)
  bool has_min;         // an own offset (Q4_1's m, Q4_K's dmin * mn); else m' = offset * s
  float offset;         // what the stored unsigned value adds to the signed one

  int64_t block_k() const { return G * GPS; }
  int64_t header_bytes() const { return has_min ? 64 : 32; }             // fp16 d [16] (+ dmin / m [16])
  int64_t group_scale_bytes() const { return two_level ? (has_min ? 32 : 16) : 0; }
  int64_t value_bytes() const { return nibbles ? TN * G / 2 + hbits * TN * G / 8 : TN * G; }
  int64_t superblock_bytes() const { return header_bytes() + GPS * (group_scale_bytes() + value_bytes()); }
  int64_t tile_bytes(int64_t K) const { return K / block_k() * superblock_bytes(); }
};

Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 1, 18, true, 0, false, false, 8.f};
    case Q4_1: return {32, 1, 20, true, 0, false, true, 0.f};
    case Q5_0: return {32, 1, 22, true, 1, false, false, 16.f};
    case Q8_0: return {32, 1, 34, false, 0, false, false, 128.f};
    case Q4_K: return {32, 8, 144, true, 0, true, true, 0.f};
    case Q6_K: return {16, 16, 210, true, 2, true, false, 32.f};
  }
  TORCH_CHECK(false, "GGUF type ", type, " has no kernel (supported: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)");
}

inline uint16_t read16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// One GGUF block of one output row, unpacked: unsigned values q [block_k], fp16 d and dmin / m (bits),
// and the two-level types' per-group sc and mn.
struct Unpacked {
  uint8_t q[256];
  uint16_t d = 0, dm = 0;
  uint8_t sc[16] = {}, mn[16] = {};
};

void unpack_block(int64_t type, const uint8_t* b, Unpacked& u) {
  switch (type) {
    case Q4_0: case Q4_1: {
      u.d = read16(b);
      if (type == Q4_1) u.dm = read16(b + 2);
      const uint8_t* qs = b + (type == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) { u.q[j] = qs[j] & 15; u.q[j + 16] = qs[j] >> 4; }
      break;
    }
    case Q5_0: {
      u.d = read16(b);
      uint32_t qh; std::memcpy(&qh, b + 2, 4);
      for (int j = 0; j < 16; ++j) {
        u.q[j] = (b[6 + j] & 15) | (((qh >> j) & 1) << 4);
        u.q[j + 16] = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case Q8_0:
      u.d = read16(b);
      for (int j = 0; j < 32; ++j) u.q[j] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + j]) + 128);
      break;
    case Q4_K: {   // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
      u.d = read16(b);
      u.dm = read16(b + 2);
      const uint8_t* s = b + 4;
      for (int j = 0; j < 8; ++j) {
        if (j < 4) { u.sc[j] = s[j] & 63; u.mn[j] = s[j + 4] & 63; }
        else {
          u.sc[j] = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
          u.mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
      }
      const uint8_t* qs = b + 16;
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) { u.q[64 * c + l] = qs[32 * c + l] & 15; u.q[64 * c + 32 + l] = qs[32 * c + l] >> 4; }
      break;
    }
    case Q6_K: {   // ql [128], qh [64], scales int8 [16], d
      const uint8_t *ql = b, *qh = b + 128;
      std::memcpy(u.sc, b + 192, 16);
      u.d = read16(b + 208);
      for (int half = 0; half < 2; ++half, ql += 64, qh += 32)
        for (int l = 0; l < 32; ++l) {
          uint8_t* q = u.q + 128 * half;
          q[l] = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4);
          q[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
          q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
      break;
    }
  }
}

// Writes one superblock of a tile from the 16 outputs' unpacked blocks (rows past N: zeros).
void write_superblock(const Format& f, const Unpacked* u, int64_t rows, uint8_t* out) {
  std::memset(out, 0, f.superblock_bytes());
  for (int64_t o = 0; o < rows; ++o) {
    std::memcpy(out + 2 * o, &u[o].d, 2);
    if (f.has_min) std::memcpy(out + 32 + 2 * o, &u[o].dm, 2);
  }
  uint8_t* p = out + f.header_bytes();
  const int64_t KQ = f.G / 4;
  for (int64_t g = 0; g < f.GPS; ++g) {
    if (f.two_level)
      for (int64_t o = 0; o < rows; ++o) {
        p[o] = u[o].sc[g];
        if (f.has_min) p[16 + o] = u[o].mn[g];
      }
    p += f.group_scale_bytes();
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t kq = 0; kq < KQ; ++kq)
        for (int j = 0; j < 4; ++j) {
          const uint8_t q = u[o].q[g * f.G + 4 * kq + j];
          const int64_t lane = o * 4 + j;
          if (!f.nibbles) { p[64 * kq + lane] = q; continue; }
          const int64_t chunk = kq % (KQ / 2);
          p[64 * chunk + lane] |= kq < KQ / 2 ? (q & 15) : (q & 15) << 4;
          for (int h = 0; h < f.hbits; ++h)
            p[TN * f.G / 2 + (kq * f.hbits + h) * 8 + lane / 8] |= ((q >> (4 + h)) & 1) << (lane % 8);
        }
    p += f.value_bytes();
  }
}

// Asks for 2 MiB pages over the buffer (before it is written, so that its pages fault in huge): a
// decode step streams every weight, and with 4 KiB pages the TLB misses cost ~10-25% of the stream.
// Where transparent huge pages are off or "never", a no-op.
void huge_pages(void* data, int64_t bytes) {
  constexpr uintptr_t page = 2 << 20;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
}

// A group's 16 scales s and offsets m' (w = s q - m'), from its superblock's header and group scales.
struct GroupScales { float s[TN], m[TN]; };

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

void group_scales(const Format& f, const uint8_t* header, const uint8_t* gs, GroupScales& out) {
  for (int64_t o = 0; o < TN; ++o) {
    const float d = half_to_float(read16(header + 2 * o)), dm = f.has_min ? half_to_float(read16(header + 32 + 2 * o)) : 0.f;
    float s = d, m = -dm;   // one-level: Q4_1's w = d q + m
    if (f.two_level) {
      s = d * (f.has_min ? static_cast<float>(gs[o]) : static_cast<float>(static_cast<int8_t>(gs[o])));
      m = f.has_min ? dm * static_cast<float>(gs[16 + o]) : 0.f;
    }
    out.s[o] = s;
    out.m[o] = f.has_min ? m : f.offset * s;
  }
}

// fn(k, scales, values) for every group of a tile in order: its first input, its 16 outputs' s and m',
// and its value bytes (see value_at).
template <typename Fn>
void for_each_group(const Format& f, const uint8_t* tile, int64_t K, Fn&& fn) {
  const uint8_t* p = tile;
  GroupScales gsc;
  for (int64_t k0 = 0; k0 < K; k0 += f.block_k()) {
    const uint8_t* header = p;
    p += f.header_bytes();
    for (int64_t g = 0; g < f.GPS; ++g) {
      group_scales(f, header, p, gsc);
      p += f.group_scale_bytes();
      fn(k0 + g * f.G, gsc, p);
      p += f.value_bytes();
    }
  }
}

// The unsigned value of output o, input i of a group's value bytes.
inline int value_at(const Format& f, const uint8_t* v, int64_t o, int64_t i) {
  const int64_t kq = i / 4, lane = o * 4 + i % 4, KQ = f.G / 4;
  if (!f.nibbles) return v[64 * kq + lane];
  const uint8_t byte = v[64 * (kq % (KQ / 2)) + lane];
  int q = kq < KQ / 2 ? byte & 15 : byte >> 4;
  for (int h = 0; h < f.hbits; ++h)
    q |= ((v[TN * f.G / 2 + (kq * f.hbits + h) * 8 + lane / 8] >> (lane % 8)) & 1) << (4 + h);
  return q;
}

// Rows of x quantized per 32 inputs: xq int8 [M, K], ax [M, K / 32], and xs [M, K / 16] = ax times
// the sum of xq over each 16 inputs (the offsets' share).
struct Acts {
  torch::Tensor q_t, ax_t, xs_t;
  const int8_t* q;
  const float *ax, *xs;
  int64_t K;

  float scale(int64_t row, int64_t k) const { return ax[row * (K / QK) + k / QK]; }
  // ax times the sum of xq over the group of G (16 or 32) inputs from k.
  float offset_sum(int64_t row, int64_t k, int64_t G) const {
    const float* s = xs + row * (K / 16) + k / 16;
    return G == 32 ? s[0] + s[1] : s[0];
  }
};

Acts quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  Acts a;
  a.q_t = torch::empty({M, K}, x.options().dtype(torch::kChar));
  a.ax_t = torch::empty({M, K / QK}, x.options());
  a.xs_t = torch::empty({M, K / 16}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* q = a.q_t.data_ptr<int8_t>();
  float *ax = a.ax_t.data_ptr<float>(), *xs = a.xs_t.data_ptr<float>();
  at::parallel_for(0, M * K / QK, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = xp + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sums[2] = {0, 0};
      for (int i = 0; i < QK; ++i) {
        const int r = static_cast<int>(std::nearbyint(v[i] * inv));
        q[b * QK + i] = static_cast<int8_t>(r);
        sums[i / 16] += r;
      }
      ax[b] = scale;
      xs[2 * b] = scale * static_cast<float>(sums[0]);
      xs[2 * b + 1] = scale * static_cast<float>(sums[1]);
    }
  });
  a.q = q; a.ax = ax; a.xs = xs; a.K = K;
  return a;
}

// ---- AVX512-VNNI ----

typedef int32_t int32u __attribute__((may_alias, aligned(1)));

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

// The group's values as G / 4 vectors of 64 unsigned bytes (input quad c: [output][4 inputs]).
template <int64_t G, bool NIB, int HB>
VNNI inline void load_values(const uint8_t* p, __m512i* v) {
  constexpr int64_t KQ = G / 4;
  if constexpr (!NIB) {
    for (int64_t c = 0; c < KQ; ++c) v[c] = _mm512_loadu_si512(p + 64 * c);
  } else {
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t c = 0; c < KQ / 2; ++c) {
      const __m512i raw = _mm512_loadu_si512(p + 64 * c);
      v[c] = _mm512_and_si512(raw, low);
      v[c + KQ / 2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const uint8_t* planes = p + TN * G / 2;
    for (int64_t c = 0; c < KQ; ++c)
      for (int h = 0; h < HB; ++h) {
        uint64_t bits; std::memcpy(&bits, planes + (c * HB + h) * 8, 8);
        v[c] = _mm512_or_si512(v[c], _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(static_cast<char>(16 << h))));
      }
  }
}

template <int R, int64_t G, int64_t GPS, bool NIB, int HB, bool TWO, bool MIN>
VNNI void tile_rows(const Format& f, const uint8_t* tile, const Acts& a, int64_t m0, float* y, int64_t ldy,
                    int64_t n_valid, const float* bias, bool prefetch) {
  constexpr int64_t KQ = G / 4;
  const int64_t K = a.K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* p = tile;
  for (int64_t k0 = 0; k0 < K; k0 += G * GPS) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dm = MIN ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))) : d;
    p += MIN ? 64 : 32;
    for (int64_t g = 0; g < GPS; ++g) {
      __m512 s = d, m;
      if constexpr (TWO) {
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(MIN ? _mm512_cvtepu8_epi32(sc) : _mm512_cvtepi8_epi32(sc)));
        if constexpr (MIN) {
          m = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))));
          p += 32;
        } else {
          m = _mm512_mul_ps(s, _mm512_set1_ps(f.offset));
          p += 16;
        }
      } else {
        m = MIN ? _mm512_sub_ps(_mm512_setzero_ps(), dm) : _mm512_mul_ps(d, _mm512_set1_ps(f.offset));
      }
      constexpr int64_t VB = NIB ? TN * G / 2 + HB * TN * G / 8 : TN * G;   // the group's value bytes
      if (prefetch)
        for (int64_t line = 0; line < VB; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + line), _MM_HINT_T0);
      __m512i v[KQ];
      load_values<G, NIB, HB>(p, v);
      p += VB;
      const int64_t k = k0 + g * G;
      __m512i sum[R];   // the rows' integer sums, interleaved: R independent vpdpbusd chains
      for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < KQ; ++c)
        for (int r = 0; r < R; ++r) {
          const int32u* xq = reinterpret_cast<const int32u*>(a.q + (m0 + r) * K + k);   // four inputs a lane
          sum[r] = _mm512_dpbusd_epi32(sum[r], v[c], _mm512_set1_epi32(xq[c]));
        }
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(s, _mm512_set1_ps(a.scale(row, k))), acc[r]);
        acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(a.offset_sum(row, k, G)), acc[r]);
      }
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n_valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * ldy, valid, _mm512_add_ps(acc[r], b));
}

template <int64_t G, int64_t GPS, bool NIB, int HB, bool TWO, bool MIN>
VNNI void tile_all_rows(const Format& f, const uint8_t* tile, const Acts& a, int64_t M, float* y, int64_t ldy,
                        int64_t n_valid, const float* bias) {
  for (int64_t m = 0; m < M;) {   // register tiles as even as MAXR allows (8 rows: 4 + 4)
    const int64_t left = M - m, tiles = (left + MAXR - 1) / MAXR, rows = (left + tiles - 1) / tiles;
    const bool prefetch = m == 0 && M > 1;   // later register tiles find the values in the cache
    switch (rows) {
      case 1: tile_rows<1, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
      case 2: tile_rows<2, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
      case 3: tile_rows<3, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
      case 4: tile_rows<4, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
      case 5: tile_rows<5, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
      default: tile_rows<6, G, GPS, NIB, HB, TWO, MIN>(f, tile, a, m, y, ldy, n_valid, bias, prefetch); break;
    }
    m += rows;
  }
}

VNNI void tile_vnni(int64_t type, const Format& f, const uint8_t* tile, const Acts& a, int64_t M, float* y,
                    int64_t ldy, int64_t n_valid, const float* bias) {
  switch (type) {
    case Q4_0: tile_all_rows<32, 1, true, 0, false, false>(f, tile, a, M, y, ldy, n_valid, bias); break;
    case Q4_1: tile_all_rows<32, 1, true, 0, false, true>(f, tile, a, M, y, ldy, n_valid, bias); break;
    case Q5_0: tile_all_rows<32, 1, true, 1, false, false>(f, tile, a, M, y, ldy, n_valid, bias); break;
    case Q8_0: tile_all_rows<32, 1, false, 0, false, false>(f, tile, a, M, y, ldy, n_valid, bias); break;
    case Q4_K: tile_all_rows<32, 8, true, 0, true, true>(f, tile, a, M, y, ldy, n_valid, bias); break;
    case Q6_K: tile_all_rows<16, 16, true, 2, true, false>(f, tile, a, M, y, ldy, n_valid, bias); break;
  }
}

// ---- portable: the same sums, one output at a time ----

void tile_portable(const Format& f, const uint8_t* tile, const Acts& a, int64_t M, float* y, int64_t ldy,
                   int64_t n_valid, const float* bias) {
  const int64_t K = a.K;
  std::vector<float> acc(M * TN, 0.f);
  for_each_group(f, tile, K, [&](int64_t k, const GroupScales& gsc, const uint8_t* values) {
    for (int64_t o = 0; o < TN; ++o) {
      int q[32];
      for (int64_t i = 0; i < f.G; ++i) q[i] = value_at(f, values, o, i);
      for (int64_t row = 0; row < M; ++row) {
        const int8_t* xq = a.q + row * K + k;
        int32_t sum = 0;
        for (int64_t i = 0; i < f.G; ++i) sum += q[i] * xq[i];
        float& out = acc[row * TN + o];
        out = std::fma(static_cast<float>(sum), gsc.s[o] * a.scale(row, k), out);
        out = std::fma(-gsc.m[o], a.offset_sum(row, k, f.G), out);
      }
    }
  });
  for (int64_t row = 0; row < M; ++row)
    for (int64_t o = 0; o < n_valid; ++o) y[row * ldy + o] = acc[row * TN + o] + (bias ? bias[o] : 0.f);
}

}  // namespace

namespace specserve {

bool has_avx512_vnni() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
}

torch::Tensor gguf_repack(const torch::Tensor& raw, int64_t type, int64_t K) {
  const Format f = format_of(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kByte && raw.is_contiguous(), "raw: uint8 [N, row bytes]");
  TORCH_CHECK(K % f.block_k() == 0 && raw.size(1) == K / f.block_k() * f.block_bytes,
              "raw rows of ", raw.size(1), " bytes do not hold ", K, " inputs of GGUF type ", type);
  const int64_t N = raw.size(0), tiles = (N + TN - 1) / TN, blocks = K / f.block_k();
  auto out = torch::empty({tiles, f.tile_bytes(K)}, raw.options());
  huge_pages(out.data_ptr(), out.numel());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<Unpacked> u(TN);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = std::min(TN, N - t * TN);
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t o = 0; o < rows; ++o) unpack_block(type, src + (t * TN + o) * raw.size(1) + b * f.block_bytes, u[o]);
        write_superblock(f, u.data(), rows, dst + t * f.tile_bytes(K) + b * f.superblock_bytes());
      }
    }
  });
  return out;
}

torch::Tensor gguf_dequantize_tiles(const torch::Tensor& tiles, int64_t type, int64_t N, int64_t K) {
  const Format f = format_of(type);
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(0) == (N + TN - 1) / TN && tiles.size(1) == f.tile_bytes(K),
              "tiles do not hold a [", N, ", ", K, "] weight of GGUF type ", type);
  auto w = torch::empty({N, K}, tiles.options().dtype(torch::kFloat));
  float* out = w.data_ptr<float>();
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = std::min(TN, N - t * TN);
      for_each_group(f, tiles.data_ptr<uint8_t>() + t * f.tile_bytes(K), K,
                     [&](int64_t k, const GroupScales& gsc, const uint8_t* values) {
        for (int64_t o = 0; o < rows; ++o)
          for (int64_t i = 0; i < f.G; ++i)
            out[(t * TN + o) * K + k + i] = gsc.s[o] * static_cast<float>(value_at(f, values, o, i)) - gsc.m[o];
      });
    }
  });
  return w;
}

torch::Tensor gguf_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& tiles,
                          const std::vector<int64_t>& types, const std::vector<int64_t>& sizes,
                          const c10::optional<torch::Tensor>& bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(tiles.size() == types.size() && tiles.size() == sizes.size(), "one type and size per part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  // One parallel region over every part's tiles (a fused q/k/v's small k and v parts would leave a
  // thread idle in regions of their own): tile t of the pass is tile t - first[i] of part i, whose
  // outputs start at column offsets[i].
  std::vector<int64_t> first(tiles.size() + 1, 0), offsets(tiles.size() + 1, 0);
  std::vector<Format> formats;
  for (size_t i = 0; i < tiles.size(); ++i) {
    formats.push_back(format_of(types[i]));
    TORCH_CHECK(tiles[i].size(0) == (sizes[i] + TN - 1) / TN && tiles[i].size(1) == formats[i].tile_bytes(K) &&
                    tiles[i].is_contiguous(), "part ", i, ": tiles do not match [", sizes[i], ", ", K, "]");
    first[i + 1] = first[i] + tiles[i].size(0);
    offsets[i + 1] = offsets[i] + sizes[i];
  }
  const int64_t N = offsets.back();
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N, "bias: fp32 [N]");
  const bool vnni = !portable && has_avx512_vnni();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const Acts a = quantize_rows(x);
  float* out = y.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t pass_tile = begin; pass_tile < end; ++pass_tile) {
      while (pass_tile >= first[i + 1]) ++i;
      const Format& f = formats[i];
      const int64_t t = pass_tile - first[i], n0 = offsets[i] + t * TN, valid = std::min(TN, sizes[i] - t * TN);
      const uint8_t* w = tiles[i].data_ptr<uint8_t>() + t * f.tile_bytes(K);
      if (vnni) tile_vnni(types[i], f, w, a, M, out + n0, N, valid, b ? b + n0 : nullptr);
      else tile_portable(f, w, a, M, out + n0, N, valid, b ? b + n0 : nullptr);
    }
  });
  return y;
}

}  // namespace specserve
