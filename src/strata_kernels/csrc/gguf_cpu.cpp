// CPU kernels that read GGUF weight blocks as they lie in the file.
//
//   gemv(x [M, K] float32|bfloat16, [blocks_i [N_i, row_bytes_i] uint8], [qtype_i], K)
//       -> [y_i [M, N_i] in x's dtype], y_i[m, n] = sum_k x[m, k] * w_i[n, k],
//       M <= kMaxM, no w_i ever stored dense. Several weights that read the
//       same x (q/k/v, gate/up) share one pass over x and one parallel region.
//   dequantize(blocks [N, row_bytes] uint8, qtype, K, out [N, K] float32|bfloat16)
//       out[n, k] = w[n, k], bit for bit what gguf-py computes (float32).
//
// Every supported type is decoded one block at a time into small integer
// codes q and one (scale, minv) pair per 16 weights, so that
//     w = scale * q - minv
// with the same float32 operations, in the same order, as gguf-py's
// dequantize (this file is compiled with -ffp-contract=off to keep it so).
// The GEMV folds the offsets out of the inner loop: per 16 weights it adds
// scale * sum(q * x) lane-wise and, when the type has minimums, subtracts
// minv * sum(x) once, with sum(x) precomputed per 16 columns of x.
//
// For bfloat16 x and codes of at most 7 bits, CPUs with AVX512_BF16 take
// another inner loop (gemv_rows_bf16): codes decoded in registers, products
// by the bf16 dot-product instruction. Float32 x always takes the float32 one.
//
// Rows of the weights are split across torch's intra-op threads
// (at::parallel_for), so torch.set_num_threads governs these kernels too.

#include "cpu_kernels.h"
#include "lanes.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace strata_cpu {
namespace {

constexpr int kPrefetchRows = 4;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A block decoded: codes and one (scale, minv) per SG weights.
template <int B, int SG>
struct Decoded {
  alignas(64) int8_t q[B];
  float scale[B / SG];
  float minv[B / SG];
};

// Types are structs with: B (weights per block), BYTES (bytes per block),
// SG (weights sharing one scale), CODE_BITS and CODE_OFFSET (q + CODE_OFFSET
// is the stored unsigned code, below 2^CODE_BITS), HAS_MIN (whether minv
// can be nonzero), Block (their Decoded) and decode(block bytes, Block&).

// The 32 codes of a 32-weight block: q[j] = low nibble of qs[j] (plus 16
// if bit j of qh is set) - offset, q[16 + j] the same with the high nibble
// and bit 16 + j. Written as two 16-byte stores, so that the 16-byte loads
// that follow are forwarded from them (byte stores would stall those loads).
inline void small_block_codes(const uint8_t* qs, uint32_t qh, int8_t offset, int8_t* q) {
#if defined(__SSSE3__)
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  __m128i lo = _mm_and_si128(bytes, nibble);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  if (qh) {
    // Byte j of each half takes byte j/8 of its 16 bits of qh, then tests bit j%8.
    const __m128i spread = _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i bit = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
    const __m128i sixteen = _mm_set1_epi8(16);
    const __m128i lo_bits = _mm_shuffle_epi8(_mm_cvtsi32_si128(int(qh & 0xFFFF)), spread);
    const __m128i hi_bits = _mm_shuffle_epi8(_mm_cvtsi32_si128(int(qh >> 16)), spread);
    lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(lo_bits, bit), bit), sixteen));
    hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hi_bits, bit), bit), sixteen));
  }
  const __m128i off = _mm_set1_epi8(offset);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_sub_epi8(lo, off));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_sub_epi8(hi, off));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = int8_t((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - offset;
    q[j + 16] = int8_t((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset;
  }
#endif
}

#ifdef STRATA_BF16_DOT
// The 32 stored (unsigned) codes of a 32-weight block in one register:
// nibble j of qs (low nibbles first), plus 16 where bit j of qh is set.
inline __m256i small_block_codes32(const uint8_t* qs, uint32_t qh) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
  const __m256i nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  return _mm256_or_si256(nibbles, _mm256_maskz_mov_epi8(__mmask32(qh), _mm256_set1_epi8(16)));
}
#endif

// Each type also has scales(block, scale[], minv[]) (the block's header) and,
// with the bf16 dot product, codes32(block, c): the stored unsigned codes
// (q + CODE_OFFSET) of weights c..c+31 in one register, never in memory.

// The four 32-weight types, one layout: a float16 scale d; with a minimum
// (Q4_1, Q5_1) a float16 m, w = d*q + m, else w = d*(q - 2^(bits-1)); with
// 5-bit codes the 32 fifth bits qh (4 bytes); then 16 bytes of nibbles qs.
template <int BITS, bool WITH_MIN>
struct SmallBlock {
  static constexpr int B = 32, SG = 32;
  static constexpr int CODE_BITS = BITS, CODE_OFFSET = WITH_MIN ? 0 : 1 << (BITS - 1);
  static constexpr bool HAS_MIN = WITH_MIN;
  static constexpr int QH = WITH_MIN ? 4 : 2;         // after d (and m)
  static constexpr int QS = QH + (BITS == 5 ? 4 : 0);  // after qh, if any
  static constexpr int BYTES = QS + 16;
  using Block = Decoded<B, SG>;
  static uint32_t high_bits(const uint8_t* b) { return BITS == 5 ? u32_at(b + QH) : 0; }
  static void scales(const uint8_t* b, float* scale, float* minv) {
    scale[0] = half_at(b);
    minv[0] = WITH_MIN ? -half_at(b + 2) : 0.0f;  // d*q + m == d*q - (-m), exactly
  }
  static void decode(const uint8_t* b, Block& o) {
    small_block_codes(b + QS, high_bits(b), CODE_OFFSET, o.q);
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_BF16_DOT
  static __m256i codes32(const uint8_t* b, int) { return small_block_codes32(b + QS, high_bits(b)); }
#endif
};

using Q4_0 = SmallBlock<4, false>;
using Q4_1 = SmallBlock<4, true>;
using Q5_0 = SmallBlock<5, false>;
using Q5_1 = SmallBlock<5, true>;
static_assert(Q4_0::BYTES == 18 && Q4_1::BYTES == 20 && Q5_0::BYTES == 22 && Q5_1::BYTES == 24,
              "GGUF's block sizes");

struct Q8_0 {  // 8-bit codes: no codes32 (the bf16 trick needs 7 bits at most)
  static constexpr int B = 32, BYTES = 34, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 128;
  using Block = Decoded<B, SG>;
  static constexpr bool HAS_MIN = false;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    scale[0] = half_at(b);
    minv[0] = 0.0f;
  }
  static void decode(const uint8_t* b, Block& o) {
    std::memcpy(o.q, b + 2, 32);
    scales(b, o.scale, o.minv);
  }
};

// The eight (scale, min) pairs of a Q4_K/Q5_K super-block, from its header
// (d, dmin as float16, then 12 bytes of 6-bit scales and minimums).
inline void k_scales_mins(const uint8_t* b, float* scale, float* minv) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale[j] = d * float(sc);
    minv[j] = dmin * float(m);
  }
}

#ifdef STRATA_BF16_DOT
// Nibbles of 32 bytes: the low ones (high == false) or the high ones.
inline __m256i nibbles32(const uint8_t* p, bool high) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(high ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
}
#endif

struct Q4_K {
  static constexpr int B = 256, BYTES = 144, SG = 32;
  static constexpr int CODE_BITS = 4, CODE_OFFSET = 0;
  using Block = Decoded<B, SG>;
  static constexpr bool HAS_MIN = true;
  static void scales(const uint8_t* b, float* scale, float* minv) { k_scales_mins(b, scale, minv); }
  static void decode(const uint8_t* b, Block& o) {
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {  // 64 weights: low nibbles, then high
      for (int l = 0; l < 32; ++l) {
        o.q[64 * c + l] = int8_t(qs[32 * c + l] & 0x0F);
        o.q[64 * c + 32 + l] = int8_t(qs[32 * c + l] >> 4);
      }
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_BF16_DOT
  static __m256i codes32(const uint8_t* b, int c) { return nibbles32(b + 16 + 32 * (c / 64), (c / 32) & 1); }
#endif
};

struct Q5_K {
  static constexpr int B = 256, BYTES = 176, SG = 32;
  static constexpr int CODE_BITS = 5, CODE_OFFSET = 0;
  using Block = Decoded<B, SG>;
  static constexpr bool HAS_MIN = true;
  static void scales(const uint8_t* b, float* scale, float* minv) { k_scales_mins(b, scale, minv); }
  static void decode(const uint8_t* b, Block& o) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        o.q[64 * c + l] = int8_t((qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4));
        o.q[64 * c + 32 + l] = int8_t((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
      }
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_BF16_DOT
  static __m256i codes32(const uint8_t* b, int c) {
    // Group g = c / 32 takes bit g of each of the 32 qh bytes as its fifth bit.
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << (c / 32))));
    return _mm256_or_si256(nibbles32(b + 48 + 32 * (c / 64), (c / 32) & 1),
                           _mm256_maskz_mov_epi8(fifth, _mm256_set1_epi8(16)));
  }
#endif
};

struct Q6_K {
  static constexpr int B = 256, BYTES = 210, SG = 16;
  static constexpr int CODE_BITS = 6, CODE_OFFSET = 32;
  using Block = Decoded<B, SG>;
  static constexpr bool HAS_MIN = false;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int j = 0; j < 16; ++j) {
      scale[j] = d * float(sc[j]);
      minv[j] = 0.0f;
    }
  }
  static void decode(const uint8_t* b, Block& o) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int h = 0; h < 2; ++h) {  // two halves of 128 weights
      const uint8_t* l4 = ql + 64 * h;
      const uint8_t* h2 = qh + 32 * h;
      int8_t* q = o.q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        q[l] = int8_t((l4[l] & 0x0F) | ((h2[l] & 3) << 4)) - 32;
        q[l + 32] = int8_t((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4)) - 32;
        q[l + 64] = int8_t((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
        q[l + 96] = int8_t((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
      }
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_BF16_DOT
  static __m256i codes32(const uint8_t* b, int c) {
    // Half h = c / 128; within it, quarter j takes low (j < 2) or high
    // nibbles of ql's 32 bytes at 32 * (j % 2), and bits 2j..2j+1 of qh.
    const int h = c / 128, j = (c / 32) % 4;
    const __m256i low4 = nibbles32(b + 64 * h + 32 * (j % 2), j >= 2);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i top2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
    return _mm256_or_si256(low4, _mm256_slli_epi16(top2, 4));
  }
#endif
};

static_assert(kLanes == 16, "Lanes holds sixteen weights");

// x: [M, K] float32; xsum: [M, K / T::SG] (sum of x over each scale group);
// y: [M, N]. Per scale group: dot = sum(q * x) in lanes, then
// acc += dot * scale; the minimums come off once per row.
// Ask for a row a few rows ahead: the hardware prefetcher alone leaves these
// short rows latency-bound when the weight is not in cache.
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

template <class T, int M>
void gemv_rows(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xsum,
               float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int G = T::B / T::SG;
  const int64_t blocks = K / T::B;
  const int64_t groups = K / T::SG;
  typename T::Block d;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1) prefetch(row + kPrefetchRows * row_bytes, row_bytes);
    Lanes acc[M];
    float acc_min[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = Lanes::zero();
      acc_min[m] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      T::decode(row + b * T::BYTES, d);
      for (int g = 0; g < G; ++g) {
        Lanes dot[M];
        for (int m = 0; m < M; ++m) dot[m] = Lanes::zero();
        for (int l = 0; l < T::SG; l += kLanes) {
          const Lanes q = Lanes::codes(d.q + g * T::SG + l);
          for (int m = 0; m < M; ++m) dot[m] = dot[m].fma(q, Lanes::load(x + m * K + b * T::B + g * T::SG + l));
        }
        for (int m = 0; m < M; ++m) {
          acc[m] = acc[m].fma(dot[m], d.scale[g]);
          if constexpr (T::HAS_MIN) acc_min[m] += d.minv[g] * xsum[m * groups + b * G + g];
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = acc[m].sum() - acc_min[m];
  }
}

#ifdef STRATA_BF16_DOT
// For bfloat16 x and codes of at most 7 bits: the bf16 dot-product
// instruction (32 products per instruction, summed in pairs into 16 float32
// lanes). A code u below 128 becomes a bfloat16 with bits 0x4300 | u, which
// is exactly 128 + u, so no conversion instruction is needed:
//     sum(x * q) = sum(x * (128 + u)) - (128 + CODE_OFFSET) * sum(x),
// and the second term joins the minimums, subtracted once per row. (The
// products are exact in float32; the 128 * x terms cost about 2^-12 of
// relative precision in a sum that x's own bfloat16 rounding, 2^-9, bounds.)
template <class T>
constexpr bool kBf16Dot = T::CODE_BITS <= 7;  // and so the type has codes32

template <class T, int M>
void gemv_rows_bf16(const uint8_t* w, int64_t row_bytes, int64_t K, const c10::BFloat16* x, const float* xsum,
                    float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int G = T::B / T::SG;
  const int64_t blocks = K / T::B;
  const int64_t groups = K / T::SG;
  const __m512i magic = _mm512_set1_epi16(0x4300);
  float scale[G], minv[G];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1) prefetch(row + kPrefetchRows * row_bytes, row_bytes);
    __m512 acc[M];
    float acc_min[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_setzero_ps();
      acc_min[m] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * T::BYTES;
      T::scales(block, scale, minv);
      for (int c = 0; c < T::B; c += 32) {
        const __m512bh codes = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(T::codes32(block, c)), magic);
        // Lanes 0-7 hold codes c..c+15, lanes 8-15 codes c+16..c+31.
        const __m512 sv = T::SG == 32 ? _mm512_set1_ps(scale[c / 32])
                                      : _mm512_insertf32x8(_mm512_set1_ps(scale[c / 16]),
                                                           _mm256_set1_ps(scale[c / 16 + 1]), 1);
        for (int m = 0; m < M; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + b * T::B + c);
          acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), codes, xv), sv, acc[m]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const float shift = scale[g] * float(128 + T::CODE_OFFSET) + minv[g];
        for (int m = 0; m < M; ++m) acc_min[m] += shift * xsum[m * groups + b * G + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) - acc_min[m];
  }
}
#endif

// f(std::integral_constant<int, M>) for M in 1..kMaxM: the row count as a
// template argument, so that the per-row accumulators live in registers.
template <class F>
void with_rows(int M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
  }
}

// Rows n0..n1-1 of one weight for M rows of x: x_bf16 (x's bfloat16 values,
// or null when x is float32) chooses the bf16 dot product where it applies.
template <class T>
void gemv_rows_m(int M, const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const c10::BFloat16* x_bf16,
                 const float* xsum, float* y, int64_t N, int64_t n0, int64_t n1) {
  with_rows(M, [&](auto rows) {
    constexpr int kM = decltype(rows)::value;
#ifdef STRATA_BF16_DOT
    if constexpr (kBf16Dot<T>) {
      if (x_bf16 != nullptr) return gemv_rows_bf16<T, kM>(w, row_bytes, K, x_bf16, xsum, y, N, n0, n1);
    }
#endif
    gemv_rows<T, kM>(w, row_bytes, K, x, xsum, y, N, n0, n1);
  });
}

// float -> bfloat16 bits, rounding to nearest even as torch does (NaN stays
// a quiet NaN). Plain integer arithmetic, so loops over it vectorize.
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline void store(float* o, const float* v, int n) { std::memcpy(o, v, n * sizeof(float)); }
inline void store(c10::BFloat16* o, const float* v, int n) {
  uint16_t bits[256];
  for (int i = 0; i < n; ++i) bits[i] = bf16_bits(v[i]);
  std::memcpy(o, bits, n * sizeof(uint16_t));
}

template <class T, class Out>
void dequantize_typed(const uint8_t* w, int64_t row_bytes, int64_t K, Out* out, int64_t N) {
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    typename T::Block d;
    alignas(64) float values[T::B];
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < K / T::B; ++b) {
        T::decode(w + n * row_bytes + b * T::BYTES, d);
        for (int g = 0; g < T::B / T::SG; ++g) {
          const float scale = d.scale[g], minv = d.minv[g];
          for (int i = 0; i < T::SG; ++i) values[g * T::SG + i] = scale * float(d.q[g * T::SG + i]) - minv;
        }
        store(out + n * K + b * T::B, values, T::B);
      }
    }
  });
}

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

template <class F>
void with_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(Q4_0{});
    case kQ4_1: return f(Q4_1{});
    case kQ5_0: return f(Q5_0{});
    case kQ5_1: return f(Q5_1{});
    case kQ8_0: return f(Q8_0{});
    case kQ4_K: return f(Q4_K{});
    case kQ5_K: return f(Q5_K{});
    case kQ6_K: return f(Q6_K{});
  }
  TORCH_CHECK(false, "no CPU kernel for GGML type ", qtype);
}

template <class T>
void check_blocks(const torch::Tensor& blocks, int64_t K) {
  TORCH_CHECK(blocks.dtype() == torch::kUInt8 && blocks.dim() == 2, "blocks must be 2-D uint8");
  TORCH_CHECK(blocks.is_contiguous(), "blocks must be contiguous");
  TORCH_CHECK(K % T::B == 0, "K=", K, " is not a multiple of the block size ", T::B);
  TORCH_CHECK(blocks.size(1) == K / T::B * T::BYTES, "a row of blocks has ", blocks.size(1),
              " bytes, K=", K, " needs ", K / T::B * T::BYTES);
}

// sum(x) over each group of `group` columns, per row: [M, K / group].
std::vector<float> group_sums(const std::vector<float>& x, int64_t M, int64_t K, int group) {
  std::vector<float> sums(M * (K / group), 0.0f);
  for (size_t i = 0; i < sums.size(); ++i)
    for (int l = 0; l < group; ++l) sums[i] += x[i * group + l];
  return sums;
}

}  // namespace

// The float32 copy of x and its group sums are made here, in plain loops: at
// decode sizes the dispatch of a few torch ops would cost as much as the product.
std::vector<torch::Tensor> gemv(torch::Tensor x, std::vector<torch::Tensor> blocks, std::vector<int64_t> qtypes,
                                int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K=", K);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "one qtype per weight");
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxM, "gemv takes 1 to ", kMaxM, " rows of x, got ", M);
  x = x.contiguous();
  std::vector<float> x32(M * K);
  if (x.scalar_type() == torch::kFloat32) {
    std::memcpy(x32.data(), x.data_ptr<float>(), M * K * sizeof(float));
  } else {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) x32[i] = float(xb[i]);
  }
  const c10::BFloat16* x_bf16 = x.scalar_type() == torch::kBFloat16 ? x.data_ptr<c10::BFloat16>() : nullptr;
  // sum(x) per scale group (16 or 32 columns): the minimums' share of every dot.
  const std::vector<float> xsum16 = group_sums(x32, M, K, 16), xsum32 = group_sums(x32, M, K, 32);

  // The weights' rows, end to end, are one index space split across threads.
  struct Part {
    const uint8_t* w;
    int64_t row_bytes, qtype, first, N;
    std::vector<float> y;
  };
  std::vector<Part> parts;
  int64_t total = 0, widest = 1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    with_type(qtypes[i], [&](auto t) { check_blocks<decltype(t)>(blocks[i], K); });
    const int64_t N = blocks[i].size(0);
    parts.push_back({blocks[i].data_ptr<uint8_t>(), blocks[i].size(1), qtypes[i], total, N,
                     std::vector<float>(M * N)});
    total += N;
    widest = std::max(widest, blocks[i].size(1));
  }
  // About 32 KB of weight per task: small enough to spread even a 256-row
  // matrix over the threads, large enough that scheduling is noise.
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / widest);
  at::parallel_for(0, total, grain, [&](int64_t r0, int64_t r1) {
    for (Part& p : parts) {
      const int64_t lo = std::max(r0, p.first), hi = std::min(r1, p.first + p.N);
      if (lo >= hi) continue;
      with_type(p.qtype, [&](auto t) {
        using T = decltype(t);
        const float* xsum = T::SG == 16 ? xsum16.data() : xsum32.data();
        gemv_rows_m<T>(int(M), p.w, p.row_bytes, K, x32.data(), x_bf16, xsum, p.y.data(), p.N, lo - p.first,
                       hi - p.first);
      });
    }
  });

  std::vector<torch::Tensor> outputs;
  for (const Part& p : parts) {
    torch::Tensor y = torch::empty({M, p.N}, x.options());
    if (x.scalar_type() == torch::kFloat32) {
      std::memcpy(y.data_ptr<float>(), p.y.data(), M * p.N * sizeof(float));
    } else {
      c10::BFloat16* yb = y.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < M * p.N; ++i) yb[i] = c10::BFloat16(p.y[i]);
    }
    outputs.push_back(y);
  }
  return outputs;
}

void dequantize(torch::Tensor blocks, int64_t qtype, int64_t K, torch::Tensor out) {
  const int64_t N = blocks.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "out must be a contiguous [N, K] tensor");
  with_type(qtype, [&](auto t) {
    using T = decltype(t);
    check_blocks<T>(blocks, K);
    if (out.scalar_type() == torch::kFloat32) {
      dequantize_typed<T>(blocks.data_ptr<uint8_t>(), blocks.size(1), K, out.data_ptr<float>(), N);
    } else if (out.scalar_type() == torch::kBFloat16) {
      dequantize_typed<T>(blocks.data_ptr<uint8_t>(), blocks.size(1), K, out.data_ptr<c10::BFloat16>(), N);
    } else {
      TORCH_CHECK(false, "out must be float32 or bfloat16, got ", out.scalar_type());
    }
  });
}

}  // namespace strata_cpu
