// AVX-512 building blocks shared by the AVX-512 and AMX kernels (header-only; compiled for
// AVX-512 whatever the file's flags, so callers must be AVX-512 code themselves).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace radixray_simd512 {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")

// exp(x) on 16 lanes: simd.h's exp8 (range reduction and degree-6 polynomial), 512 bits wide.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// silu(a) * b on 16 lanes: the operations of simd.h's silu_mul8, so the same bits.
inline __m512 silu_mul16(__m512 a, __m512 b) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
  return _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), b);
}

// The lanes below n (n may be past 16 or below 0).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

#pragma GCC pop_options

}  // namespace radixray_simd512
