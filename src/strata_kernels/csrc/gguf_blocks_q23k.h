// Q2_K and Q3_K super-blocks as the CPU kernels read them (the contract of
// a type is gguf_blocks.h's): 256 weights with a scale (and, for Q2_K, a
// minimum) per 16, their 2- or 3-bit codes decoded in registers.
#pragma once

#include "gguf_blocks.h"

namespace strata_cpu {

// Q2_K: 16 bytes of (4-bit scale | 4-bit minimum << 4), one per 16 weights;
// 64 bytes of 2-bit codes; d and dmin as float16. w = d*sc*q - dmin*m.
// Weight 128h + 32j + l has bits 2j..2j+1 of qs[32h + l].
struct Q2_K {
  static constexpr int B = 256, BYTES = 84, SG = 16;
  static constexpr int CODE_BITS = 2, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = true;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int j = 0; j < 16; ++j) {
      scale[j] = d * float(b[j] & 0x0F);
      minv[j] = dmin * float(b[j] >> 4);
    }
  }
  static void decode(const uint8_t* b, Block& o) {
    const uint8_t* qs = b + 16;
    for (int w = 0; w < B; ++w) o.q[w] = int8_t((qs[32 * (w / 128) + w % 32] >> (2 * ((w % 128) / 32))) & 3);
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (c / 128)));
    return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * ((c / 32) % 4)), _mm256_set1_epi8(3));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i sc = _mm_and_si128(packed, nibble), m = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    auto floats = [](__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); };
    const __m256 d = _mm256_set1_ps(half_at(b + 80)), dmin = _mm256_set1_ps(half_at(b + 82));
    return {_mm256_mul_ps(d, floats(sc)), _mm256_mul_ps(d, floats(_mm_srli_si128(sc, 8))),
            _mm256_mul_ps(dmin, floats(m)), _mm256_mul_ps(dmin, floats(_mm_srli_si128(m, 8)))};
  }
#endif
};

// Q3_K: 32 bytes of high bits (bit i of hmask[l]: weight 32i + l), 64 bytes
// of 2-bit codes laid out as Q2_K's, 12 bytes of 6-bit scales, d as float16.
// w = d*(sc - 32)*q with q = low 2 bits + 4*high bit - 4.
struct Q3_K {
  static constexpr int B = 256, BYTES = 110, SG = 16;
  static constexpr int CODE_BITS = 3, CODE_OFFSET = 4;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const uint8_t* s = b + 96;
    const float d = half_at(b + 108);
    for (int j = 0; j < 16; ++j) {
      const int low = (s[j % 8] >> (4 * (j / 8))) & 0x0F, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      scale[j] = d * float((low | (high << 4)) - 32);
      minv[j] = 0.0f;
    }
  }
  static void decode(const uint8_t* b, Block& o) {
    const uint8_t *hmask = b, *qs = b + 32;
    for (int w = 0; w < B; ++w) {
      const int i = w / 32, l = w % 32;
      const int low = (qs[32 * (i / 4) + l] >> (2 * (i % 4))) & 3, high = (hmask[l] >> i) & 1;
      o.q[w] = int8_t((low | (high << 2)) - CODE_OFFSET);
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const int i = c / 32;
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * (i / 4)));
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (i % 4)), _mm256_set1_epi8(3));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, i), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {
    // Low four bits: nibbles of s[0..7] (low nibbles for scales 0-7, high for 8-15);
    // high two: s[8 + j % 4] >> 2 * (j / 4), a 32-bit lane per j / 4.
    const uint8_t* s = b + 96;
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(u32_at(s + 8))), _mm_setr_epi32(0, 2, 4, 6)),
                                       _mm_set1_epi8(3));
    const __m128i six = _mm_or_si128(low, _mm_slli_epi16(high, 4));
    const __m256 d = _mm256_set1_ps(half_at(b + 108));
    auto centred = [&](__m128i bytes) {  // d * (sc - 32)
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(32))));
    };
    return {centred(six), centred(_mm_srli_si128(six, 8)), _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

}  // namespace strata_cpu
