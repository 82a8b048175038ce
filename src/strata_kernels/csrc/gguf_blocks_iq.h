// The IQ family as the CPU kernels read it (the contract of a type is
// gguf_blocks.h's): each block's codebook or grid lookups decode to signed
// 8-bit codes (in registers, with AVX2), so the GEMV multiplies them with
// x's 16-bit codes exactly as it does the other types'. Tables: iq_tables.h,
// generated from gguf.quants at build time (cpu_tables.py).
//
// IQ1's weights are d_l * (g + delta) with g in {-1, 0, 1} and delta = +-1/8:
// the codes are 8g +- 1 and the scale d_l / 8 (exact: a power of two), so
// dequantization still rounds once, as gguf-py does.
#pragma once

#include "gguf_blocks.h"
#include "iq_tables.h"

namespace strata_cpu {

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Byte j of a packed grid entry (value j of its weights).
inline int8_t grid_value(uint64_t entry, int j) { return int8_t(uint8_t(entry >> (8 * j))); }

// Weights at q[0..8*n): n grid entries of 8 values, each negated where its sign byte says.
inline void grid8_codes(const uint64_t* entries, const uint8_t* sign_bytes, int n, int8_t* q) {
  for (int l = 0; l < n; ++l)
    for (int j = 0; j < 8; ++j) {
      const int8_t v = grid_value(entries[l], j);
      q[8 * l + j] = (sign_bytes[l] >> j) & 1 ? int8_t(-v) : v;
    }
}

// Four 7-bit sign indices (bits 0-27 of `aux`, as IQ2_XXS and IQ3_XXS store
// them) expanded through kSignsIQ2: byte l of the result signs 8 weights.
inline uint32_t packed_signs(uint32_t aux) {
  uint32_t out = 0;
  for (int l = 0; l < 4; ++l) out |= uint32_t(kSignsIQ2[(aux >> (7 * l)) & 0x7F]) << (8 * l);
  return out;
}

#ifdef STRATA_CODES32
// Byte j of `values` negated where byte j of `negate` is all ones.
inline __m256i negated_where(__m256i values, __m256i negate) {
  return _mm256_sub_epi8(_mm256_xor_si256(values, negate), negate);
}
// Byte j of `values` negated where bit j of `signs` is set.
inline __m256i with_signs(__m256i values, uint32_t signs) { return negated_where(values, bytes_of_bits(signs)); }
// The negation masks of 32 weights from four 7-bit sign indices (int32
// lanes; lane l signs weights 8l..8l+7): one gather in place of four table
// lookups and the shifts that pack them.
inline __m256i sign_masks4(__m128i sign_indices) {
  return _mm256_i32gather_epi64(reinterpret_cast<const long long*>(kSignMasksIQ2), sign_indices, 8);
}
// IQ4's codebook applied to 32 nibbles (16 bytes: low nibbles first, then high).
inline __m256i iq4_codes32(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kValuesIQ4NL)));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
}
#endif

// IQ2_XS and IQ2_S: per 16 weights a 4-bit s in `packed` (two a byte): d * (0.5 + s) * 0.25.
inline void iq2_scales16(const uint8_t* b, const uint8_t* packed, float* scale, float* minv) {
  const float d = half_at(b);
  for (int j = 0; j < 16; ++j) {
    scale[j] = d * (0.5f + float((packed[j / 2] >> (4 * (j % 2))) & 0x0F)) * 0.25f;
    minv[j] = 0.0f;
  }
}
#ifdef STRATA_CODES32
// d * (0.5 + s) * mul for eight s as floats, rounded as the scalar form is.
inline __m256 half_step_scales(float d, __m256 s, float mul) {
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_add_ps(_mm256_set1_ps(0.5f), s)), _mm256_set1_ps(mul));
}
// d * (2s + 1) for eight s (int32 lanes; 2s + 1 exact as an integer): IQ3_S's scales.
inline __m256 odd_scales8(float d, __m256i s) {
  const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1));
  return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(odd));
}
// d * (2s + 1) * 0.125: IQ1's scales with the code's factor 8 taken out.
inline __m256 iq1_scales8(float d, __m256i s) { return _mm256_mul_ps(odd_scales8(d, s), _mm256_set1_ps(0.125f)); }
inline ScaleVectors iq2_scale_vectors16(const uint8_t* b, const uint8_t* packed) {
  const __m128i s = nibbles16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed)));
  const float d = half_at(b);
  return {half_step_scales(d, byte_floats8(s), 0.25f), half_step_scales(d, byte_floats8(_mm_srli_si128(s, 8)), 0.25f),
          _mm256_setzero_ps(), _mm256_setzero_ps()};
}
#endif

// The types whose 32 weights are four grid entries of 8 values and four sign
// bytes: IQ2_XXS, IQ2_XS, IQ2_S. T::index(block, sub-block, l) is entry l's
// index in T::grid(), T::signs4(block, sub-block) the four sign bytes (byte l:
// entry l's weights) in one word.
template <class T, class Block>
inline void decode_grid8(const uint8_t* b, Block& o) {
  for (int ib = 0; ib < 8; ++ib) {
    uint64_t grid[4];
    uint8_t signs[4];
    const uint32_t sign_word = T::signs4(b, ib);
    std::memcpy(signs, &sign_word, 4);
    for (int l = 0; l < 4; ++l) grid[l] = T::grid()[T::index(b, ib, l)];
    grid8_codes(grid, signs, 4, o.q + 32 * ib);
  }
  T::scales(b, o.scale, o.minv);
}
#ifdef STRATA_CODES32
// The same in a register: T::indices4(block, sub-block) the four indices as
// int32 lanes, gathered from the grid (a gather beats four scalar lookups and
// inserts), negated where T::negate4(block, sub-block) says.
template <class T>
inline __m256i grid8_codes32(const uint8_t* b, int c) {
  const __m256i values = _mm256_i32gather_epi64(reinterpret_cast<const long long*>(T::grid()),
                                                T::indices4(b, c / 32), 8);
  return negated_where(values, T::negate4(b, c / 32));
}
// Lanes of `word` shifted right by (s0, s1, s2, s3), masked: the high index bits packed in one word.
inline __m128i fields4(uint32_t word, __m128i shifts, int mask) {
  return _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(word)), shifts), _mm_set1_epi32(mask));
}
// The four 7-bit sign indices of `aux` (bits 0-27, as IQ2_XXS and IQ3_XXS store them) as lanes.
inline __m128i sign_fields4(uint32_t aux) { return fields4(aux, _mm_setr_epi32(0, 7, 14, 21), 0x7F); }
inline __m128i bytes4(const uint8_t* p) { return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(int(u32_at(p)))); }
#endif

// IQ4_NL: a float16 d, then 16 bytes of nibbles (low nibbles: weights 0..15)
// indexing the 16-value codebook. w = d * value.
struct IQ4_NL {
  static constexpr int B = 32, BYTES = 18, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    scale[0] = half_at(b);
    minv[0] = 0.0f;
  }
  static void decode(const uint8_t* b, Block& o) {
    for (int j = 0; j < 16; ++j) {
      o.q[j] = kValuesIQ4NL[b[2 + j] & 0x0F];
      o.q[j + 16] = kValuesIQ4NL[b[2 + j] >> 4];
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int) { return iq4_codes32(b + 2); }
#endif
};

// IQ4_XS: d; 2 + 4 bytes of 6-bit scales (low nibbles in scales_l, high
// pairs in scales_h); per 32 weights 16 bytes of IQ4_NL's nibbles.
// w = d * (ls - 32) * value.
struct IQ4_XS {
  static constexpr int B = 256, BYTES = 136, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b);
    const uint16_t high = u16_at(b + 2);
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((high >> (2 * ib)) & 3) << 4);
      scale[ib] = d * float(ls - 32);
      minv[ib] = 0.0f;
    }
  }
  static void decode(const uint8_t* b, Block& o) {
    for (int ib = 0; ib < 8; ++ib)
      for (int j = 0; j < 16; ++j) {
        o.q[32 * ib + j] = kValuesIQ4NL[b[8 + 16 * ib + j] & 0x0F];
        o.q[32 * ib + 16 + j] = kValuesIQ4NL[b[8 + 16 * ib + j] >> 4];
      }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) { return iq4_codes32(b + 8 + 16 * (c / 32)); }
  static ScaleVectors scale_vectors(const uint8_t* b) { return scale_vectors_of<IQ4_XS>(b); }
#endif
};

// IQ2_XXS: d; per 32 weights two 32-bit words: four grid indices (bytes),
// then four 7-bit sign indices (into kSignsIQ2) and a 4-bit scale on top.
// w = d * (0.5 + s) * 0.25 * (+-grid value).
struct IQ2_XXS {
  static constexpr int B = 256, BYTES = 66, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b);
    for (int ib = 0; ib < 8; ++ib) {
      scale[ib] = d * (0.5f + float(u32_at(b + 6 + 8 * ib) >> 28)) * 0.25f;
      minv[ib] = 0.0f;
    }
  }
  static const uint64_t* grid() { return kIQ2XXSGrid; }
  static int index(const uint8_t* b, int ib, int l) { return b[2 + 8 * ib + l]; }
  static uint32_t signs4(const uint8_t* b, int ib) { return packed_signs(u32_at(b + 6 + 8 * ib)); }
  static void decode(const uint8_t* b, Block& o) { decode_grid8<IQ2_XXS>(b, o); }
#ifdef STRATA_CODES32
  static __m128i indices4(const uint8_t* b, int ib) { return bytes4(b + 2 + 8 * ib); }
  static __m256i negate4(const uint8_t* b, int ib) { return sign_masks4(sign_fields4(u32_at(b + 6 + 8 * ib))); }
  static __m256i codes32(const uint8_t* b, int c) { return grid8_codes32<IQ2_XXS>(b, c); }
  static ScaleVectors scale_vectors(const uint8_t* b) {  // the top nibbles of the odd words of b[2..66)
    const __m256 lo = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 34)));
    // Odd words of each 128-bit half, then the halves' pairs put in order.
    const __m256 odd_words = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    const __m256i odd = _mm256_permute4x64_epi64(_mm256_castps_si256(odd_words), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256 s = half_step_scales(half_at(b), _mm256_cvtepi32_ps(_mm256_srli_epi32(odd, 28)), 0.25f);
    return {s, s, _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

// IQ2_XS: d; per 32 weights four 16-bit words (a 9-bit grid index, a 7-bit
// sign index); then 8 bytes of two 4-bit scales (one per 16 weights).
// w = d * (0.5 + s) * 0.25 * (+-grid value).
struct IQ2_XS {
  static constexpr int B = 256, BYTES = 74, SG = 16;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) { iq2_scales16(b, b + 66, scale, minv); }
  static const uint64_t* grid() { return kIQ2XSGrid; }
  static int index(const uint8_t* b, int ib, int l) { return u16_at(b + 2 + 2 * (4 * ib + l)) & 511; }
  static uint32_t signs4(const uint8_t* b, int ib) {
    uint32_t out = 0;
    for (int l = 0; l < 4; ++l) out |= uint32_t(kSignsIQ2[u16_at(b + 2 + 2 * (4 * ib + l)) >> 9]) << (8 * l);
    return out;
  }
  static void decode(const uint8_t* b, Block& o) { decode_grid8<IQ2_XS>(b, o); }
#ifdef STRATA_CODES32
  // Sub-block ib's four 16-bit words as int32 lanes: a 9-bit grid index, a 7-bit sign index on top.
  static __m128i words4(const uint8_t* b, int ib) {
    return _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * ib)));
  }
  static __m128i indices4(const uint8_t* b, int ib) { return _mm_and_si128(words4(b, ib), _mm_set1_epi32(511)); }
  static __m256i negate4(const uint8_t* b, int ib) { return sign_masks4(_mm_srli_epi32(words4(b, ib), 9)); }
  static __m256i codes32(const uint8_t* b, int c) { return grid8_codes32<IQ2_XS>(b, c); }
  static ScaleVectors scale_vectors(const uint8_t* b) { return iq2_scale_vectors16(b, b + 66); }
#endif
};

// IQ2_S: d; 32 bytes of grid index low bits; 32 bytes of signs (byte k:
// weights 8k..8k+7); 8 bytes of index high bits (2 per index); 8 bytes of
// two 4-bit scales. w = d * (0.5 + s) * 0.25 * (+-grid value).
struct IQ2_S {
  static constexpr int B = 256, BYTES = 82, SG = 16;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) { iq2_scales16(b, b + 74, scale, minv); }
  static const uint64_t* grid() { return kIQ2SGrid; }
  static int index(const uint8_t* b, int ib, int l) { return b[2 + 4 * ib + l] | (((b[66 + ib] >> (2 * l)) & 3) << 8); }
  static uint32_t signs4(const uint8_t* b, int ib) { return u32_at(b + 34 + 4 * ib); }
  static void decode(const uint8_t* b, Block& o) { decode_grid8<IQ2_S>(b, o); }
#ifdef STRATA_CODES32
  static __m128i indices4(const uint8_t* b, int ib) {
    const __m128i high = fields4(b[66 + ib], _mm_setr_epi32(0, 2, 4, 6), 3);
    return _mm_or_si128(bytes4(b + 2 + 4 * ib), _mm_slli_epi32(high, 8));
  }
  static __m256i negate4(const uint8_t* b, int ib) { return bytes_of_bits(signs4(b, ib)); }
  static __m256i codes32(const uint8_t* b, int c) { return grid8_codes32<IQ2_S>(b, c); }
  static ScaleVectors scale_vectors(const uint8_t* b) { return iq2_scale_vectors16(b, b + 74); }
#endif
};

// IQ3_XXS: d; 64 bytes of grid indices (4 values each); per 32 weights a
// 32-bit word of four 7-bit sign indices and a 4-bit scale on top.
// w = d * (0.5 + s) * 0.5 * (+-grid value).
struct IQ3_XXS {
  static constexpr int B = 256, BYTES = 98, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b);
    for (int ib = 0; ib < 8; ++ib) {
      scale[ib] = d * (0.5f + float(u32_at(b + 66 + 4 * ib) >> 28)) * 0.5f;
      minv[ib] = 0.0f;
    }
  }
  // The sign bits of weights 0..31 of sub-block ib (bit j: weight j negative).
  static uint32_t signs(const uint8_t* b, int ib) { return packed_signs(u32_at(b + 66 + 4 * ib)); }
  static void decode(const uint8_t* b, Block& o) {
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t sign = signs(b, ib);
      for (int k = 0; k < 8; ++k)
        for (int j = 0; j < 4; ++j) {
          const int w = 4 * k + j;
          const int8_t v = grid_value(kIQ3XXSGrid[b[2 + 8 * ib + k]], j);
          o.q[32 * ib + w] = (sign >> w) & 1 ? int8_t(-v) : v;
        }
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * (c / 32)));
    const __m256i values =
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(kIQ3XXSGrid), _mm256_cvtepu8_epi32(qs), 4);
    return negated_where(values, sign_masks4(sign_fields4(u32_at(b + 66 + 4 * (c / 32)))));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {  // the top nibbles of the eight sign words
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 66));
    const __m256 s = half_step_scales(half_at(b), _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 28)), 0.5f);
    return {s, s, _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

// IQ3_S: d; 64 bytes of grid index low bits; 8 bytes of index high bits (one
// per index); 32 bytes of signs (bit j of the sub-block's word: weight j);
// 4 bytes of two 4-bit scales. w = d * (1 + 2s) * (+-grid value).
struct IQ3_S {
  static constexpr int B = 256, BYTES = 110, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b);
    for (int ib = 0; ib < 8; ++ib) {
      scale[ib] = d * float(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F));
      minv[ib] = 0.0f;
    }
  }
  static uint32_t entry(const uint8_t* b, int ib, int k) {
    return kIQ3SGrid[b[2 + 8 * ib + k] | (((b[66 + ib] >> k) & 1) << 8)];
  }
  static void decode(const uint8_t* b, Block& o) {
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t sign = u32_at(b + 74 + 4 * ib);
      for (int k = 0; k < 8; ++k)
        for (int j = 0; j < 4; ++j) {
          const int w = 4 * k + j;
          const int8_t v = grid_value(entry(b, ib, k), j);
          o.q[32 * ib + w] = (sign >> w) & 1 ? int8_t(-v) : v;
        }
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const int ib = c / 32;
    const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * ib));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i high =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[66 + ib]), lanes), _mm256_set1_epi32(1));
    const __m256i index = _mm256_or_si256(_mm256_cvtepu8_epi32(qs), _mm256_slli_epi32(high, 8));
    const __m256i values = _mm256_i32gather_epi32(reinterpret_cast<const int*>(kIQ3SGrid), index, 4);
    return with_signs(values, u32_at(b + 74 + 4 * ib));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {
    // The block's last 4 bytes (a wider load would read past the block).
    const __m128i packed = _mm_cvtsi32_si128(int(u32_at(b + 106)));
    const __m256 scale = odd_scales8(half_at(b), _mm256_cvtepu8_epi32(nibbles16(packed)));
    return {scale, scale, _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

// IQ1_S: d; 32 bytes of grid index low bits; per 32 weights a 16-bit word:
// 3 high bits per index, a 3-bit scale and the delta's sign on top.
// w = d * (2s + 1) * (g + delta).
struct IQ1_S {
  static constexpr int B = 256, BYTES = 50, SG = 32;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  static void scales(const uint8_t* b, float* scale, float* minv) {
    const float d = half_at(b);
    for (int ib = 0; ib < 8; ++ib) {
      scale[ib] = d * float(2 * ((u16_at(b + 34 + 2 * ib) >> 12) & 7) + 1) * 0.125f;
      minv[ib] = 0.0f;
    }
  }
  static uint64_t entry(const uint8_t* b, int ib, int l) {
    return kIQ1SGrid[b[2 + 4 * ib + l] | (((u16_at(b + 34 + 2 * ib) >> (3 * l)) & 7) << 8)];
  }
  static void decode(const uint8_t* b, Block& o) {
    for (int ib = 0; ib < 8; ++ib) {
      const int delta = u16_at(b + 34 + 2 * ib) & 0x8000 ? -1 : 1;
      for (int l = 0; l < 4; ++l)
        for (int j = 0; j < 8; ++j) o.q[32 * ib + 8 * l + j] = int8_t(8 * grid_value(entry(b, ib, l), j) + delta);
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const int ib = c / 32;
    const uint16_t qh = u16_at(b + 34 + 2 * ib);
    const __m128i high = fields4(qh, _mm_setr_epi32(0, 3, 6, 9), 7);
    const __m128i index = _mm_or_si128(bytes4(b + 2 + 4 * ib), _mm_slli_epi32(high, 8));
    const __m256i g = _mm256_i32gather_epi64(reinterpret_cast<const long long*>(kIQ1SGrid), index, 8);
    return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {  // bits 12-14 of the eight words at b + 34
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 34)));
    const __m256 s = iq1_scales8(half_at(b), _mm256_and_si256(_mm256_srli_epi32(words, 12), _mm256_set1_epi32(7)));
    return {s, s, _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

// IQ1_M: 32 bytes of grid index low bits; 16 bytes of nibbles (per index: 3
// high bits, and the delta's sign of its 8 weights); four 16-bit words of
// 3-bit scales (one per 16 weights) whose top nibbles together are the
// float16 d. w = d * (2s + 1) * (g + delta).
struct IQ1_M {
  static constexpr int B = 256, BYTES = 56, SG = 16;
  static constexpr int CODE_BITS = 8, CODE_OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  using Block = Decoded<B, SG>;
  // d, from the top nibbles of the four scale words w.
  static float d_of(const uint16_t* w) {
    const uint16_t bits = uint16_t((w[0] >> 12) | ((w[1] >> 8) & 0x00F0) | ((w[2] >> 4) & 0x0F00) | (w[3] & 0xF000));
    uint8_t d_bytes[2];
    std::memcpy(d_bytes, &bits, 2);
    return half_at(d_bytes);
  }
  static void scales(const uint8_t* b, float* scale, float* minv) {
    uint16_t w[4];
    std::memcpy(w, b + 48, 8);
    const float d = d_of(w);
    for (int j = 0; j < 16; ++j) {  // sub-block j / 2, its half j % 2
      const int s = (w[j / 4] >> (3 * (j % 4))) & 7;
      scale[j] = d * float(2 * s + 1) * 0.125f;
      minv[j] = 0.0f;
    }
  }
  // Index i's nibble (i = 4 * sub-block + l): 3 high index bits, then the delta's sign.
  static int nibble(const uint8_t* b, int i) { return (b[32 + i / 2] >> (4 * (i % 2))) & 0x0F; }
  static uint64_t entry(const uint8_t* b, int i) { return kIQ1SGrid[b[i] | ((nibble(b, i) & 7) << 8)]; }
  static void decode(const uint8_t* b, Block& o) {
    for (int i = 0; i < 32; ++i) {
      const int delta = nibble(b, i) & 8 ? -1 : 1;
      for (int j = 0; j < 8; ++j) o.q[8 * i + j] = int8_t(8 * grid_value(entry(b, i), j) + delta);
    }
    scales(b, o.scale, o.minv);
  }
#ifdef STRATA_CODES32
  static __m256i codes32(const uint8_t* b, int c) {
    const int i = 4 * (c / 32);
    const __m128i nibbles = fields4(u16_at(b + 32 + i / 2), _mm_setr_epi32(0, 4, 8, 12), 0x0F);
    const __m128i index = _mm_or_si128(bytes4(b + i), _mm_slli_epi32(_mm_and_si128(nibbles, _mm_set1_epi32(7)), 8));
    const __m256i g = _mm256_i32gather_epi64(reinterpret_cast<const long long*>(kIQ1SGrid), index, 8);
    // Each index's 8 weights: delta -1 (all bytes 0xFF) where its nibble's bit 3 is set, else +1.
    const __m128i negative = _mm_cmpeq_epi32(_mm_and_si128(nibbles, _mm_set1_epi32(8)), _mm_set1_epi32(8));
    const __m256i delta = _mm256_or_si256(_mm256_cvtepi32_epi64(negative), _mm256_set1_epi8(1));
    return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), delta);
  }
  static ScaleVectors scale_vectors(const uint8_t* b) {  // scale j: bits 3(j % 4).. of word j / 4
    uint16_t w[4];
    std::memcpy(w, b + 48, 8);
    const float d = d_of(w);
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9), three = _mm256_set1_epi32(7);
    auto eight = [&](int first) {  // scales 8 * first .. 8 * first + 7: words 2 * first and 2 * first + 1
      const __m256i words = _mm256_setr_epi32(w[2 * first], w[2 * first], w[2 * first], w[2 * first],
                                              w[2 * first + 1], w[2 * first + 1], w[2 * first + 1], w[2 * first + 1]);
      return iq1_scales8(d, _mm256_and_si256(_mm256_srlv_epi32(words, shifts), three));
    };
    return {eight(0), eight(1), _mm256_setzero_ps(), _mm256_setzero_ps()};
  }
#endif
};

}  // namespace strata_cpu
