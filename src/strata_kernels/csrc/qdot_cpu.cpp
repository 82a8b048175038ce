// The GEMV by integer dot products: x quantized once per call to 16-bit
// codes, one float scale per 32 columns; each weight block decoded to its
// signed codes q (gguf_blocks.h) and multiplied with x's codes in integer
// SIMD (vpmaddwd, or AVX512-VNNI's vpdpwssd: 16-bit products summed in
// pairs into int32 lanes), then scaled in float32:
//
//     sum_k w[n,k] x[k] = sum_steps scale_s * dx_s * sum(q * xq) - minv_g * sum(x)
//
// with sum(x) per scale group taken from x itself. Why 16 bits and not 8
// (llama.cpp's Q8 activations): on the reference texts, 8-bit activations
// with one scale per 32 (per 256 too) left SmolLM2's top-1 agreement with
// the exact path at 93.8% and Gemma's mean KL at 0.026 (bar: 95%, 0.03);
// 16-bit codes put the activations' error below bfloat16's, at one more
// widening instruction per 16 weights.
//
// Groups of steps. A 32-weight step has its own scale, so summing its
// products in one register and then scaling costs a conversion, a multiply
// and an add per step and per row of x: with several rows of x (a batch of
// sequences) those, not the weight reads, bounded the GEMV (Gemma's head:
// 2.2 ms a row). So the SIMD builds take kGroupSteps steps at once (4 with
// AVX-512, 2 with AVX2) and transpose their codes in registers: register r
// holds codes 8r..8r+7 of every step of the group, each step in its own
// 128-bit lane, and x's codes are stored in the same order once per call.
// Then every int32 lane sums products of one step only, four registers
// accumulate in integers, and one conversion and one multiply-add with a
// vector of per-step scales finish the group for each row of x. Where K is
// not a whole number of groups (32-weight block types only), the last group
// is padded with zero codes. Without AVX2 each step is its own group, in
// plain C++.
//
// Compiled once per ISA variant (see cpu_kernels.py): the intrinsics below
// follow the -march of the build; the plain C++ branch serves any CPU.

#include "cpu_kernels.h"
#include "gguf_types.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace strata_cpu {
namespace {

constexpr int kXBlock = 32;        // columns of x sharing one scale
constexpr float kXMax = 32767.0f;  // |code| <= 32767: no pair of products overflows int32

// x [M, K] float32 -> codes [M, K] int16, scales [M, K / 32]: x ~= scale * code.
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* codes, float* scales) {
  for (int64_t b = 0; b < M * K / kXBlock; ++b) {
    const float* v = x + b * kXBlock;
    float amax = 0.0f;
    for (int i = 0; i < kXBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = amax > 0.0f ? kXMax / amax : 0.0f;
    scales[b] = amax / kXMax;
    for (int i = 0; i < kXBlock; ++i) codes[b * kXBlock + i] = int16_t(std::nearbyint(v[i] * inv));
  }
}


// ---- groups of steps (see the header) ----
#if defined(STRATA_CODES32)
#if !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 build of the GEMV needs FMA and F16C too (-march=haswell or later)"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kGroupSteps = 4;
using GroupCodes = __m512i;  // 32 codes: 8 of each of the 4 steps
using GroupAcc = __m512;     // 4 float lanes per step
inline GroupAcc group_zero() { return _mm512_setzero_ps(); }
inline float group_sum(GroupAcc a) { return _mm512_reduce_add_ps(a); }
inline GroupAcc group_load(const float* p) { return _mm512_loadu_ps(p); }
inline GroupCodes codes_load(const int16_t* p) { return _mm512_loadu_si512(p); }
// Register r holds codes 8r..8r+7 of step i in 128-bit lane i, widened to 16 bits.
inline void transpose_steps(const __m256i* s, GroupCodes* out) {
  const __m256i a = _mm256_unpacklo_epi64(s[0], s[1]);  // s0 q0, s1 q0 | s0 q2, s1 q2 (q: 8 codes)
  const __m256i b = _mm256_unpackhi_epi64(s[0], s[1]);  // s0 q1, s1 q1 | s0 q3, s1 q3
  const __m256i c = _mm256_unpacklo_epi64(s[2], s[3]);
  const __m256i d = _mm256_unpackhi_epi64(s[2], s[3]);
  out[0] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x20));
  out[1] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(b, d, 0x20));
  out[2] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x31));
  out[3] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(b, d, 0x31));
}
// acc + the pairwise products of a and b, in int32 lanes.
inline __m512i dot_add(__m512i acc, GroupCodes a, GroupCodes b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline __m512i dot_first(GroupCodes a, GroupCodes b) { return _mm512_madd_epi16(a, b); }
inline GroupAcc group_fma(__m512i dots, GroupAcc scale, GroupAcc dx, GroupAcc acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale, dx), acc);
}
// Each of the steps' scales s[i] in lanes 4i..4i+3; with two scales per step
// (16 weights per scale), the first (even) or second (odd) of each pair.
inline GroupAcc spread_scales(__m128 s) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(s));
}
// A super-block's scales (up to 16) in one register: lanes first..first+3
// each four times, or (16 weights per scale) the even or odd ones of lanes
// first..first+7.
using ScaleLanes = __m512;
inline ScaleLanes scale_lanes(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }
inline GroupAcc spread_lanes(ScaleLanes v, int first) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(first)), v);
}
inline GroupAcc spread_pairs(ScaleLanes v, int first, bool odd) {
  const __m512i idx = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(first + odd)), v);
}
#else  // AVX2
constexpr int kGroupSteps = 2;
using GroupCodes = __m256i;
using GroupAcc = __m256;
inline GroupAcc group_zero() { return _mm256_setzero_ps(); }
inline float group_sum(GroupAcc a) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  r = _mm_hadd_ps(r, r);
  r = _mm_hadd_ps(r, r);
  return _mm_cvtss_f32(r);
}
inline GroupAcc group_load(const float* p) { return _mm256_loadu_ps(p); }
inline GroupCodes codes_load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void transpose_steps(const __m256i* s, GroupCodes* out) {
  const __m256i a = _mm256_unpacklo_epi64(s[0], s[1]);  // s0 q0, s1 q0 | s0 q2, s1 q2
  const __m256i b = _mm256_unpackhi_epi64(s[0], s[1]);  // s0 q1, s1 q1 | s0 q3, s1 q3
  out[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a));
  out[1] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
  out[2] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1));
  out[3] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
}
inline __m256i dot_add(__m256i acc, GroupCodes a, GroupCodes b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline __m256i dot_first(GroupCodes a, GroupCodes b) { return _mm256_madd_epi16(a, b); }
inline GroupAcc group_fma(__m256i dots, GroupAcc scale, GroupAcc dx, GroupAcc acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, dx), acc);
}
inline GroupAcc spread_scales(__m128 s) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}
struct ScaleLanes {
  __m256 lo, hi;  // scales 0..7, 8..15
};
inline ScaleLanes scale_lanes(__m256 lo, __m256 hi) { return {lo, hi}; }
inline GroupAcc spread_lanes(ScaleLanes v, int first) {  // first + 1 < 8
  return _mm256_permutevar8x32_ps(v.lo, _mm256_add_epi32(_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), _mm256_set1_epi32(first)));
}
inline GroupAcc spread_pairs(ScaleLanes v, int first, bool odd) {
  const __m256i idx = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  return _mm256_permutevar8x32_ps(first < 8 ? v.lo : v.hi, _mm256_add_epi32(idx, _mm256_set1_epi32(first % 8 + odd)));
}
#endif
// Two floats into lanes 0 and 1 (through __m128i, which may alias anything:
// a double* load of a float array is undefined and GCC drops the stores).
inline __m128 load_two(const float* p) { return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
#else
constexpr int kGroupSteps = 1;  // no SIMD: one step at a time, in plain C++
#endif
constexpr int kGroupCols = kGroupSteps * kXBlock;

inline uint16_t half_bits(const uint8_t* p) {  // a float16 as stored
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// x for one call, shared by every weight row: its codes in the groups'
// transposed order (the last group padded with zero codes), their scales, and
// sums of x. Invariant, for S = kGroupSteps, C = kGroupCols, G = ceil(K / C):
// grouped[(m*G + g)*C + (r*S + i)*8 + j] * dx of that step ~= x[m, g*C + 32i + 8r + j]
// (0 past K); dxv[(m*G + g)*4S + 4i + l] == dx of step i of group g (l < 4; 0
// past K); xsum[m*K/32 + i] = sum of x over columns 32i..32i+31 (padded by 4
// zeros, which a partial group's vector loads may reach): the types with a
// minimum (Q4_1, Q5_1, Q4_K, Q5_K) have one per 32 weights; xsum16 the same
// per 16 columns (Q2_K's minimums).
struct XCodes;

// Rows m0.. of an XCodes, as the GEMV reads them (row m of the view is row
// m0 + m of the call).
struct XRows {
  const int16_t* grouped;
  const float *dxv, *xsum, *xsum16;
  int64_t K, groups;
};

struct XCodes {
  int64_t K = 0, groups = 0;
  std::vector<int16_t> grouped;
  std::vector<float> dxv, xsum, xsum16;

  XRows rows(int64_t m0) const {
    return {grouped.data() + m0 * groups * kGroupCols, dxv.data() + m0 * groups * 4 * kGroupSteps,
            xsum.data() + m0 * (K / kXBlock), xsum16.data() + m0 * (K / 16), K, groups};
  }
};

// x (float32 or bfloat16 [M, K]) as float32, row after row.
std::vector<float> float_rows(const torch::Tensor& x) {
  const torch::Tensor c = x.contiguous();
  const int64_t n = c.numel();
  std::vector<float> out(n);
  if (c.scalar_type() == torch::kFloat32) {
    std::memcpy(out.data(), c.data_ptr<float>(), n * sizeof(float));
  } else {
    const c10::BFloat16* xb = c.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) out[i] = float(xb[i]);
  }
  return out;
}

XCodes prepare_x(const std::vector<float>& x32, int64_t M, int64_t K) {
  XCodes x;
  x.K = K;
  std::vector<int16_t> codes(M * K);
  std::vector<float> dx(M * K / kXBlock);
  quantize_rows(x32.data(), M, K, codes.data(), dx.data());
  x.xsum = group_sums(x32, M, K, kXBlock);
  x.xsum.resize(x.xsum.size() + 4, 0.0f);
  x.xsum16 = group_sums(x32, M, K, 16);
  const int64_t steps = K / kXBlock, G = (steps + kGroupSteps - 1) / kGroupSteps, C = kGroupCols;
  x.groups = G;
  x.grouped.assign(M * G * C, 0);
  x.dxv.assign(M * G * 4 * kGroupSteps, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int valid = int(std::min<int64_t>(kGroupSteps, steps - g * kGroupSteps));
      const int16_t* from = codes.data() + m * K + g * C;
      int16_t* to = x.grouped.data() + (m * G + g) * C;
      for (int i = 0; i < valid; ++i) {
        for (int r = 0; r < 4; ++r) std::memcpy(to + (r * kGroupSteps + i) * 8, from + i * kXBlock + r * 8, 16);
        for (int l = 0; l < 4; ++l) x.dxv[(m * G + g) * 4 * kGroupSteps + 4 * i + l] = dx[m * steps + g * kGroupSteps + i];
      }
    }
  return x;
}

#if defined(STRATA_CODES32)
// Rows n0..n1-1 of one weight for M rows of x; y [M, N] float32.
template <class T, int M>
void qgemv_rows(const uint8_t* w, int64_t row_bytes, const XRows& x, float* y, int64_t N, int64_t n0, int64_t n1) {
  static_assert(T::B % kXBlock == 0 && (T::SG == 16 || T::SG == 32), "32-weight steps, 16 or 32 per scale");
  static_assert(T::B == kXBlock || T::B % kGroupCols == 0, "a group lies within a block, or covers whole blocks");
  constexpr int G = T::B / T::SG;
  static_assert(!T::HAS_MIN || T::SG == kXBlock || T::B == 256, "a minimum per 32 weights, or per 16 in a super-block");
  const int64_t K = x.K, steps = K / kXBlock;
  const float *xsum = x.xsum, *xsum16 = x.xsum16;
  static_assert(T::B == kXBlock || G == 8 || G == 16, "super-blocks: 8 or 16 scales (and minimums)");
  ScaleLanes block_scales;  // of the super-block being read (several groups per block)
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (n + kPrefetchRows < n1) prefetch(row + kPrefetchRows * row_bytes, row_bytes);
    GroupAcc acc[M];
    __m128 mins[M];  // sum of minv * sum(x), subtracted at the end
    for (int m = 0; m < M; ++m) {
      acc[m] = group_zero();
      mins[m] = _mm_setzero_ps();
    }
    // One group of `valid` steps (all but a last one of 32-weight blocks: kGroupSteps).
    auto group = [&](int64_t g, int valid) {
      const int64_t col = g * kGroupCols;
      __m256i steps_codes[kGroupSteps];
      GroupAcc lo, hi;  // per-step scales (hi: the second of each pair, SG == 16)
      if constexpr (T::B == kXBlock) {  // one block per step
        const uint8_t* first = row + (col / kXBlock) * T::BYTES;
        // The float16 scales straight into a register (stored one by one and
        // loaded as a vector, they stall on store forwarding); 0 past K.
        auto halves = [&](int at) {
          int h[4] = {0, 0, 0, 0};
          for (int i = 0; i < kGroupSteps; ++i)
            if (i < valid) h[i] = half_bits(first + i * T::BYTES + at);
          return _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0));
        };
        for (int i = 0; i < kGroupSteps; ++i)
          steps_codes[i] = i < valid ? signed_codes32<T>(first + i * T::BYTES, 0) : _mm256_setzero_si256();
        lo = hi = spread_scales(halves(0));
        if constexpr (T::HAS_MIN) {  // minv = -m, per block: the next kGroupSteps sums of x
          const __m128 mv = halves(2);
          for (int m = 0; m < M; ++m) {
            const float* s = xsum + m * steps + col / kXBlock;
            mins[m] = _mm_fnmadd_ps(mv, kGroupSteps == 4 ? _mm_loadu_ps(s) : load_two(s), mins[m]);
          }
        }
      } else {  // several groups per block
        const int64_t b = col / T::B;
        const int c0 = int(col % T::B);
        const uint8_t* block = row + b * T::BYTES;
        if (c0 == 0) {
          const ScaleVectors v = T::scale_vectors(block);
          block_scales = scale_lanes(v.scale_lo, G == 16 ? v.scale_hi : v.scale_lo);
          if constexpr (T::HAS_MIN) {  // G minimums, each times its columns' sum of x
            const __m128 m0 = _mm256_castps256_ps128(v.min_lo), m1 = _mm256_extractf128_ps(v.min_lo, 1);
            for (int m = 0; m < M; ++m) {
              const float* xs = (G == 8 ? xsum + m * steps : xsum16 + m * (K / 16)) + b * G;
              mins[m] = _mm_fmadd_ps(m1, _mm_loadu_ps(xs + 4), _mm_fmadd_ps(m0, _mm_loadu_ps(xs), mins[m]));
              if constexpr (G == 16) {
                const __m128 m2 = _mm256_castps256_ps128(v.min_hi), m3 = _mm256_extractf128_ps(v.min_hi, 1);
                mins[m] = _mm_fmadd_ps(m3, _mm_loadu_ps(xs + 12), _mm_fmadd_ps(m2, _mm_loadu_ps(xs + 8), mins[m]));
              }
            }
          }
        }
        for (int i = 0; i < kGroupSteps; ++i) steps_codes[i] = signed_codes32<T>(block, c0 + kXBlock * i);
        if constexpr (T::SG == 32) {
          lo = hi = spread_lanes(block_scales, c0 / 32);
        } else {
          lo = spread_pairs(block_scales, c0 / 16, false);
          hi = spread_pairs(block_scales, c0 / 16, true);
        }
      }
      GroupCodes cw[4];
      transpose_steps(steps_codes, cw);
      constexpr int W = kGroupCols / 4;  // codes per register
      for (int m = 0; m < M; ++m) {
        const int16_t* xg = x.grouped + (m * x.groups + g) * kGroupCols;
        const GroupAcc dxm = group_load(x.dxv + (m * x.groups + g) * 4 * kGroupSteps);
        if constexpr (T::SG == 32) {
          auto p = dot_first(cw[0], codes_load(xg));
          p = dot_add(p, cw[1], codes_load(xg + W));
          p = dot_add(p, cw[2], codes_load(xg + 2 * W));
          p = dot_add(p, cw[3], codes_load(xg + 3 * W));
          acc[m] = group_fma(p, lo, dxm, acc[m]);
        } else {  // registers 0, 1: codes 0..15 of each step; 2, 3: codes 16..31
          const auto plo = dot_add(dot_first(cw[0], codes_load(xg)), cw[1], codes_load(xg + W));
          const auto phi = dot_add(dot_first(cw[2], codes_load(xg + 2 * W)), cw[3], codes_load(xg + 3 * W));
          acc[m] = group_fma(plo, lo, dxm, acc[m]);
          acc[m] = group_fma(phi, hi, dxm, acc[m]);
        }
      }
    };
    const int64_t whole = steps / kGroupSteps;
    for (int64_t g = 0; g < whole; ++g) group(g, kGroupSteps);
    if (whole < x.groups) group(whole, int(steps - whole * kGroupSteps));
    for (int m = 0; m < M; ++m) {
      float total = group_sum(acc[m]);
      if constexpr (T::HAS_MIN) {
        __m128 s = _mm_hadd_ps(mins[m], mins[m]);
        s = _mm_hadd_ps(s, s);
        total -= _mm_cvtss_f32(s);
      }
      y[m * N + n] = total;
    }
  }
}
#else
// No SIMD: each block decoded to codes in memory, one 32-weight step at a
// time, the integer sums left to the compiler. (x.grouped is in natural
// order here: one step per group.)
template <class T, int M>
void qgemv_rows(const uint8_t* w, int64_t row_bytes, const XRows& x, float* y, int64_t N, int64_t n0, int64_t n1) {
  static_assert(T::B % kXBlock == 0 && (T::SG == 16 || T::SG == 32), "32-weight steps, 16 or 32 per scale");
  constexpr int G = T::B / T::SG;
  const int64_t K = x.K, blocks = K / T::B, per_row = K / T::SG;
  const float* xsum = T::SG == kXBlock ? x.xsum : x.xsum16;  // sums of x per scale group
  typename T::Block d;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[M], mins[M];
    for (int m = 0; m < M; ++m) acc[m] = mins[m] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      T::decode(row + b * T::BYTES, d);
      for (int c = 0; c < T::B; c += kXBlock) {
        const int64_t step = (b * T::B + c) / kXBlock;
        for (int m = 0; m < M; ++m) {
          const int16_t* xq = x.grouped + (m * x.groups + step) * kXBlock;
          int32_t lo = 0, hi = 0;
          for (int i = 0; i < 16; ++i) lo += int32_t(d.q[c + i]) * int32_t(xq[i]);
          for (int i = 16; i < 32; ++i) hi += int32_t(d.q[c + i]) * int32_t(xq[i]);
          const float dxm = x.dxv[(m * x.groups + step) * 4];
          acc[m] += float(lo) * (d.scale[c / T::SG] * dxm) + float(hi) * (d.scale[(c + 16) / T::SG] * dxm);
        }
      }
      if constexpr (T::HAS_MIN)
        for (int g = 0; g < G; ++g)
          for (int m = 0; m < M; ++m) mins[m] += d.minv[g] * xsum[m * per_row + b * G + g];
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = acc[m] - mins[m];
  }
}
#endif

}  // namespace

std::vector<torch::Tensor> gemv(torch::Tensor x, std::vector<torch::Tensor> blocks, std::vector<int64_t> qtypes,
                                int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K=", K);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size(), "one qtype per weight");
  TORCH_CHECK(K % kXBlock == 0, "K=", K, " is not a multiple of ", kXBlock);
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxM, "gemv takes 1 to ", kMaxM, " rows of x, got ", M);
  const XCodes xc = prepare_x(float_rows(x), M, K);

  struct Part {
    const uint8_t* w;
    int64_t row_bytes, qtype, first, N;
    torch::Tensor y;  // [M, N] float32
  };
  std::vector<Part> parts;
  int64_t total = 0, widest = 1;
  for (size_t i = 0; i < blocks.size(); ++i) {
    with_type(qtypes[i], [&](auto t) { check_blocks<decltype(t)>(blocks[i], K); });
    const int64_t N = blocks[i].size(0);
    parts.push_back({blocks[i].data_ptr<uint8_t>(), blocks[i].size(1), qtypes[i], total, N,
                     torch::empty({M, N}, torch::kFloat32)});
    total += N;
    widest = std::max(widest, blocks[i].size(1));
  }
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / widest);
  at::parallel_for(0, total, grain, [&](int64_t r0, int64_t r1) {
    for (Part& p : parts) {
      const int64_t lo = std::max(r0, p.first), hi = std::min(r1, p.first + p.N);
      if (lo >= hi) continue;
      with_type(p.qtype, [&](auto t) {
        using T = decltype(t);
        with_rows(int(M), [&](auto rows) {
          qgemv_rows<T, decltype(rows)::value>(p.w, p.row_bytes, xc.rows(0), p.y.data_ptr<float>(), p.N, lo - p.first,
                                               hi - p.first);
        });
      });
    }
  });

  std::vector<torch::Tensor> outputs;
  for (const Part& p : parts) outputs.push_back(x.scalar_type() == torch::kFloat32 ? p.y : p.y.to(x.scalar_type()));
  return outputs;
}

torch::Tensor gemv_experts(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t N,
                           std::vector<int64_t> experts, std::vector<int64_t> starts, std::vector<int64_t> counts) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be float32 or bfloat16 [P, K]");
  const int64_t P = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kXBlock == 0, "K=", K, " is not a multiple of ", kXBlock);
  TORCH_CHECK(N >= 1 && blocks.dim() == 2 && blocks.size(0) % N == 0, "blocks must be [experts * N, row bytes]");
  with_type(qtype, [&](auto t) { check_blocks<decltype(t)>(blocks, K); });
  TORCH_CHECK(experts.size() == starts.size() && starts.size() == counts.size(), "one start and count per expert");
  const int64_t n_experts = blocks.size(0) / N;
  for (size_t i = 0; i < experts.size(); ++i) {
    TORCH_CHECK(experts[i] >= 0 && experts[i] < n_experts, "expert ", experts[i], " of ", n_experts);
    TORCH_CHECK(counts[i] >= 1 && counts[i] <= kMaxM && starts[i] >= 0 && starts[i] + counts[i] <= P,
                "each expert takes 1 to ", kMaxM, " consecutive rows of x");
  }
  const XCodes xc = prepare_x(float_rows(x), P, K);
  torch::Tensor y = torch::empty({P, N}, torch::kFloat32);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), tasks = int64_t(experts.size());
  // One parallel region over every expert's rows of weights: (task, row) pairs.
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / row_bytes);
  at::parallel_for(0, tasks * N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0 / N; t < tasks && t * N < r1; ++t) {
      const int64_t lo = std::max(r0, t * N) - t * N, hi = std::min(r1, (t + 1) * N) - t * N;
      with_type(qtype, [&](auto tp) {
        using T = decltype(tp);
        with_rows(int(counts[t]), [&](auto rows) {
          qgemv_rows<T, decltype(rows)::value>(w + experts[t] * N * row_bytes, row_bytes, xc.rows(starts[t]),
                                               y.data_ptr<float>() + starts[t] * N, N, lo, hi);
        });
      });
    }
  });
  return y;
}

}  // namespace strata_cpu
