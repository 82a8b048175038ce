// Dequantization of GGUF weight blocks on the CPU:
//
//   dequantize(blocks [N, row_bytes] uint8, qtype, K, out [N, K] float32|bfloat16)
//       out[n, k] = w[n, k], bit for bit what gguf-py computes (float32).
//
// Every supported type is decoded one block at a time into small integer
// codes q and one (scale, minv) pair per 16 or 32 weights (gguf_blocks.h),
// so that
//     w = scale * q - minv
// with the same float32 operations, in the same order, as gguf-py's
// dequantize (this file is compiled with -ffp-contract=off to keep it so).
// A prompt's matmul dequantizes slabs of weight rows with it for torch's
// GEMM (cpu_kernels.qmatmul_cpu); a decode step's GEMV is qdot_cpu.cpp's.
//
// Rows are split across torch's intra-op threads (at::parallel_for), so
// torch.set_num_threads governs these kernels too.

#include "cpu_kernels.h"
#include "gguf_types.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace strata_cpu {
namespace {

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
        decode_block<T>(w + n * row_bytes + b * T::BYTES, d);
        for (int g = 0; g < T::B / T::SG; ++g) {
          const float scale = d.scale[g], minv = d.minv[g];
          for (int i = 0; i < T::SG; ++i) values[g * T::SG + i] = scale * float(d.q[g * T::SG + i]) - minv;
        }
        store(out + n * K + b * T::B, values, T::B);
      }
    }
  });
}

}  // namespace

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
