// AVX2 building blocks shared by the radixray CPU kernels (header-only, inlined).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cmath>
#include <cstring>

namespace radixray_simd {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// Eight vectors -> one vector holding their eight horizontal sums, in order.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

// Pool elements: fp32, bf16 stored as its 16 raw bits (widened by a 16-bit shift), or fp8
// e5m2 stored as its 8 raw bits (the high byte of an fp16: widened by F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
}
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(uint8_t x) { return _cvtsh_ss(static_cast<unsigned short>(x << 8)); }

// a . b over n elements; b is fp32 or bf16 (a pool row).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), load8(b + k), acc);
  float s = hsum(acc);
  for (; k < n; ++k) s += a[k] * widen(b[k]);
  return s;
}

// exp(x) on 8 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for exactness),
// e^r by a degree-6 polynomial, 2^n through the exponent bits. Within ~1.2e-7 relative
// error of exp over [-87, 88.37] (tests/cpu/test_cpu_kernels.py); below about -87.3 the
// result is 0, from 88.38 up it is inf (true exp overflows float from 88.72).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// silu(a) * b on 8 lanes: a / (1 + e^-a) * b.
inline __m256 silu_mul8(__m256 a, __m256 b) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
  return _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), b);
}

// y[k] = silu(a[k]) * b[k] for k < n; y may be a (each element is read before it is written).
inline void silu_mul_row(const float* a, const float* b, float* y, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(y + k, silu_mul8(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k)));
  for (; k < n; ++k) y[k] = a[k] / (1.0f + std::exp(-a[k])) * b[k];
}

}  // namespace radixray_simd
