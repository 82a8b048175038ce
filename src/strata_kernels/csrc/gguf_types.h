// Every GGUF type the CPU kernels read, by GGML type id: with_type calls a
// function with the type's struct (gguf_blocks.h states their contract).
#pragma once

#include "gguf_blocks.h"
#include "gguf_blocks_iq.h"
#include "gguf_blocks_q23k.h"

namespace strata_cpu {

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ2_XXS = 16, kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19, kIQ4_NL = 20, kIQ3_S = 21, kIQ2_S = 22, kIQ4_XS = 23,
  kIQ1_M = 29
};

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
    case kQ2_K: return f(Q2_K{});
    case kQ3_K: return f(Q3_K{});
    case kIQ4_NL: return f(IQ4_NL{});
    case kIQ4_XS: return f(IQ4_XS{});
    case kIQ2_XXS: return f(IQ2_XXS{});
    case kIQ2_XS: return f(IQ2_XS{});
    case kIQ2_S: return f(IQ2_S{});
    case kIQ3_XXS: return f(IQ3_XXS{});
    case kIQ3_S: return f(IQ3_S{});
    case kIQ1_S: return f(IQ1_S{});
    case kIQ1_M: return f(IQ1_M{});
  }
  TORCH_CHECK(false, "no CPU kernel for GGML type ", qtype);
}

#ifdef STRATA_CODES32
// The signed codes q of weights c..c+31 of a block, decoded in a register.
template <class T>
inline __m256i signed_codes32(const uint8_t* block, int c) {
  const __m256i stored = T::codes32(block, c);
  return T::CODE_OFFSET == 0 ? stored : _mm256_sub_epi8(stored, _mm256_set1_epi8(char(T::CODE_OFFSET)));
}
#endif

// What T::decode gives (the same integer codes, the same scales), the codes
// 32 at a time in a register where the CPU has AVX2: T::decode's byte-wise
// loops made a prompt's dequantization of the grid and 3-bit types a third
// of the Q4_K one's speed.
template <class T>
inline void decode_block(const uint8_t* b, typename T::Block& d) {
#ifdef STRATA_CODES32
  for (int c = 0; c < T::B; c += 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d.q + c), signed_codes32<T>(b, c));
  T::scales(b, d.scale, d.minv);
#else
  T::decode(b, d);
#endif
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
inline std::vector<float> group_sums(const std::vector<float>& x, int64_t M, int64_t K, int group) {
  std::vector<float> sums(M * (K / group), 0.0f);
  for (size_t i = 0; i < sums.size(); ++i)
    for (int l = 0; l < group; ++l) sums[i] += x[i * group + l];
  return sums;
}

}  // namespace strata_cpu
