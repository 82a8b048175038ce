// Sixteen float32 lanes of SIMD, shared by the CPU kernels (dequant_cpu.cpp,
// decode_cpu.cpp). Plain C++ loops over float reductions do not vectorize
// without -ffast-math (which would break gguf-py's bit-exact rounding), so
// the hot loops say how, through this struct.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace strata_cpu {

constexpr int kLanes = 16;

// e^x lane by lane through std::exp, where no SIMD exp is written.
template <class L>
L exp_each(const L& x) {
  alignas(64) float t[16];
  x.store(t);
  for (float& e : t) e = std::exp(e);
  return L::load(t);
}

// Sixteen float lanes in the machine's SIMD: one AVX-512 register, two AVX2
// registers, or a plain array the compiler may vectorize. (Compilers turn
// int8 -> float vector conversions into 16 scalar ones unless told how.)
#if defined(__AVX512F__)
constexpr const char* kSimd = "avx512";
constexpr int kRegistersPerLanes = 1;  // of 32 zmm
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes fill(float s) { return {_mm512_set1_ps(s)}; }
  Lanes add(Lanes b) const { return {_mm512_add_ps(v, b.v)}; }
  static Lanes codes(const int8_t* q) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))))};
  }
  static Lanes load(const float* x) { return {_mm512_loadu_ps(x)}; }
  static Lanes load(const c10::BFloat16* x) {  // bfloat16 -> float32: the bits, 16 places up
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  void store(float* o) const { _mm512_storeu_ps(o, v); }
  // this + a * b
  Lanes fma(Lanes a, Lanes b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
  // this + a * s
  Lanes fma(Lanes a, float s) const { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(s), v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  // e^v to about 2 ulp (v finite or -inf): 2^n * 2^f, n = round(v / ln 2),
  // |f| <= 1/2, 2^f by its Taylor series to degree 6 (error below 2e-7).
  Lanes exp() const {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(v, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return {_mm512_scalef_ps(p, n)};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kSimd = "avx2";
constexpr int kRegistersPerLanes = 2;  // of 16 ymm
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes fill(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
  Lanes add(Lanes b) const { return {_mm256_add_ps(lo, b.lo), _mm256_add_ps(hi, b.hi)}; }
  static Lanes codes(const int8_t* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  static Lanes load(const float* x) { return {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}; }
  static Lanes load(const c10::BFloat16* x) {  // bfloat16 -> float32: the bits, 16 places up
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i lo32 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits)), 16);
    const __m256i hi32 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1)), 16);
    return {_mm256_castsi256_ps(lo32), _mm256_castsi256_ps(hi32)};
  }
  void store(float* o) const {
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
  }
  Lanes fma(Lanes a, Lanes b) const { return {_mm256_fmadd_ps(a.lo, b.lo, lo), _mm256_fmadd_ps(a.hi, b.hi, hi)}; }
  Lanes fma(Lanes a, float s) const {
    const __m256 sv = _mm256_set1_ps(s);
    return {_mm256_fmadd_ps(a.lo, sv, lo), _mm256_fmadd_ps(a.hi, sv, hi)};
  }
  float sum() const {
    const __m256 t = _mm256_add_ps(lo, hi);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    return _mm_cvtss_f32(r);
  }
  // e^v as the AVX-512 Lanes computes it, with 2^n built in the exponent
  // bits: v is clamped to [-87, 88] so that n stays a normal exponent
  // (e^-87 ~ 1.6e-38 stands for 0, e^88 ~ 1.7e38 for overflow; softmax and
  // the gated activations cannot tell).
  static __m256 exp8(__m256 v) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  }
  Lanes exp() const { return {exp8(lo), exp8(hi)}; }
};
#else
constexpr const char* kSimd = "scalar";
constexpr int kRegistersPerLanes = 1;  // the compiler decides
struct Lanes {
  float v[16];
  static Lanes zero() { return Lanes{}; }
  static Lanes fill(float s) {
    Lanes o;
    for (float& e : o.v) e = s;
    return o;
  }
  Lanes add(Lanes b) const {
    Lanes o;
    for (int i = 0; i < 16; ++i) o.v[i] = v[i] + b.v[i];
    return o;
  }
  static Lanes codes(const int8_t* q) {
    Lanes o;
    for (int i = 0; i < 16; ++i) o.v[i] = float(q[i]);
    return o;
  }
  static Lanes load(const float* x) {
    Lanes o;
    std::memcpy(o.v, x, sizeof o.v);
    return o;
  }
  static Lanes load(const c10::BFloat16* x) {
    alignas(64) float t[16];
    for (int i = 0; i < 16; ++i) t[i] = float(x[i]);
    return load(t);
  }
  void store(float* o) const { std::memcpy(o, v, sizeof v); }
  Lanes fma(Lanes a, Lanes b) const {
    Lanes o;
    for (int i = 0; i < 16; ++i) o.v[i] = v[i] + a.v[i] * b.v[i];
    return o;
  }
  Lanes fma(Lanes a, float s) const {
    Lanes o;
    for (int i = 0; i < 16; ++i) o.v[i] = v[i] + a.v[i] * s;
    return o;
  }
  float sum() const {
    float t = 0.0f;
    for (int i = 0; i < 16; ++i) t += v[i];
    return t;
  }
  Lanes exp() const { return exp_each(*this); }
};
#endif
static_assert(kLanes == 16, "Lanes holds sixteen floats");

// sum(a[i] * b[i]) for i < n, n a multiple of kLanes.
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes acc = Lanes::zero();
  for (int64_t i = 0; i < n; i += kLanes) acc = acc.fma(Lanes::load(a + i), Lanes::load(b + i));
  return acc.sum();
}

}  // namespace strata_cpu
