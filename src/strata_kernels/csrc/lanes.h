// Sixteen float32 lanes of SIMD, shared by the CPU kernels (gguf_cpu.cpp,
// decode_cpu.cpp). Plain C++ loops over float reductions do not vectorize
// without -ffast-math (which would break gguf-py's bit-exact rounding), so
// the hot loops say how, through this struct.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace strata_cpu {

constexpr int kLanes = 16;

// Sixteen float lanes in the machine's SIMD: one AVX-512 register, two AVX2
// registers, or a plain array the compiler may vectorize. (Compilers turn
// int8 -> float vector conversions into 16 scalar ones unless told how.)
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes codes(const int8_t* q) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))))};
  }
  static Lanes load(const float* x) { return {_mm512_loadu_ps(x)}; }
  void store(float* o) const { _mm512_storeu_ps(o, v); }
  // this + a * b
  Lanes fma(Lanes a, Lanes b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }
  // this + a * s
  Lanes fma(Lanes a, float s) const { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(s), v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes codes(const int8_t* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  static Lanes load(const float* x) { return {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}; }
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
};
#else
struct Lanes {
  float v[16];
  static Lanes zero() { return Lanes{}; }
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
