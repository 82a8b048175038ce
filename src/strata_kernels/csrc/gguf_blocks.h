// GGUF weight blocks as the CPU kernels read them: each supported type as a
// struct that decodes one block into small integer codes and per-group
// scales (see dequant_cpu.cpp's header for the contract), plus the helpers
// the kernels share (dequant_cpu.cpp: dequantization; qdot_cpu.cpp: the GEMV
// by integer dot products against 16-bit activations).
#pragma once

#include "lanes.h"

#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace strata_cpu {

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

#if defined(__AVX2__)
#define STRATA_CODES32 1
// 0xFF in byte j of the result where bit j of `bits` is set, else 0.
inline __m256i bytes_of_bits(uint32_t bits) {
  // Byte j takes byte j / 8 of bits, then every bit but bit j % 8 is set:
  // all ones exactly where that bit was.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                      0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));
}

// The 32 stored (unsigned) codes of a 32-weight block in one register:
// nibble j of qs (low nibbles first), plus 16 where bit j of qh is set.
inline __m256i small_block_codes32(const uint8_t* qs, uint32_t qh) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
  const __m256i nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  if (!qh) return nibbles;
  return _mm256_or_si256(nibbles, _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(16)));
}
#endif

// Each type also has scales(block, scale[], minv[]) (the block's header) and,
// where the CPU has AVX2 (STRATA_CODES32), codes32(block, c): the stored
// unsigned codes (q + CODE_OFFSET) of weights c..c+31 in one register,
// never in memory. A type of 256-weight super-blocks also has
// scale_vectors(block): its ScaleVectors.

#ifdef STRATA_CODES32
// A super-block's scales and minimums in registers (written to an array and
// read back as vectors, they stall on store forwarding at every block):
// scale j of 8 (one per 32 weights) in lane j of scale_lo, of 16 (one per 16
// weights) in lane j % 8 of scale_lo (j < 8) or scale_hi; minimums alike
// (zero for types without).
struct ScaleVectors {
  __m256 scale_lo, scale_hi, min_lo, min_hi;
};

// ScaleVectors from a type's scalar scales(): for the types whose decode
// costs far more than a store-forwarding stall per 256 weights.
template <class T>
inline ScaleVectors scale_vectors_of(const uint8_t* b) {
  alignas(32) float scale[16] = {}, minv[16] = {};
  T::scales(b, scale, minv);
  return {_mm256_load_ps(scale), _mm256_load_ps(scale + 8), _mm256_load_ps(minv), _mm256_load_ps(minv + 8)};
}
// Bytes 0-7 of `bytes` as eight floats (unsigned).
inline __m256 byte_floats8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
// The low and high nibbles of bytes 0-7 of `packed` interleaved: nibble j (low first), one a byte.
inline __m128i nibbles16(__m128i packed) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
}
#endif

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
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int) { return small_block_codes32(b + QS, high_bits(b)); }
#endif
};

using Q4_0 = SmallBlock<4, false>;
using Q4_1 = SmallBlock<4, true>;
using Q5_0 = SmallBlock<5, false>;
using Q5_1 = SmallBlock<5, true>;
static_assert(Q4_0::BYTES == 18 && Q4_1::BYTES == 20 && Q5_0::BYTES == 22 && Q5_1::BYTES == 24,
              "GGUF's block sizes");

struct Q8_0 {  // codes32: the bytes as stored, plus 128
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
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(-128));
  }
#endif
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

#ifdef STRATA_CODES32
// Nibbles of 32 bytes: the low ones (high == false) or the high ones.
inline __m256i nibbles32(const uint8_t* p, bool high) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(high ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
}
#endif

#ifdef STRATA_CODES32
// k_scales_mins in registers.
inline ScaleVectors k_scale_vectors(const uint8_t* b) {
  const uint8_t* s = b + 4;
  const __m256i sc = _mm256_setr_epi32(s[0] & 63, s[1] & 63, s[2] & 63, s[3] & 63, (s[8] & 15) | ((s[0] >> 6) << 4),
                                       (s[9] & 15) | ((s[1] >> 6) << 4), (s[10] & 15) | ((s[2] >> 6) << 4),
                                       (s[11] & 15) | ((s[3] >> 6) << 4));
  const __m256i m = _mm256_setr_epi32(s[4] & 63, s[5] & 63, s[6] & 63, s[7] & 63, (s[8] >> 4) | ((s[4] >> 6) << 4),
                                      (s[9] >> 4) | ((s[5] >> 6) << 4), (s[10] >> 4) | ((s[6] >> 6) << 4),
                                      (s[11] >> 4) | ((s[7] >> 6) << 4));
  const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(half_at(b)), _mm256_cvtepi32_ps(sc));
  return {scale, scale, _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), _mm256_cvtepi32_ps(m)), _mm256_setzero_ps()};
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
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) { return nibbles32(b + 16 + 32 * (c / 64), (c / 32) & 1); }
  static ScaleVectors scale_vectors(const uint8_t* b) { return k_scale_vectors(b); }
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
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    // Group g = c / 32 takes bit g of each of the 32 qh bytes as its fifth bit.
    // (Shifting 16-bit lanes by g moves bit g of each byte to its bit 0.)
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(qh, c / 32), _mm256_set1_epi8(1));
    return _mm256_or_si256(nibbles32(b + 48 + 32 * (c / 64), (c / 32) & 1), _mm256_slli_epi16(fifth, 4));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) { return k_scale_vectors(b); }
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
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    // Half h = c / 128; within it, quarter j takes low (j < 2) or high
    // nibbles of ql's 32 bytes at 32 * (j % 2), and bits 2j..2j+1 of qh.
    const int h = c / 128, j = (c / 32) % 4;
    const __m256i low4 = nibbles32(b + 64 * h + 32 * (j % 2), j >= 2);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i top2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
    return _mm256_or_si256(low4, _mm256_slli_epi16(top2, 4));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(half_at(b + 208));
    return {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))),
            _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

// Ask for a row a few rows ahead: the hardware prefetcher alone leaves these
// short rows latency-bound when the weight is not in cache.
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

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

}  // namespace strata_cpu
