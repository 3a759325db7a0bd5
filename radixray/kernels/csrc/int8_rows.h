// The per-row halves of a W8A8 int8 linear (AVX2, header-only): quantize an fp32 row to
// int8 codes and a scale, and rescale an int32 accumulator row back to fp32; and the middle
// of a gated MLP (rescale, silu-mul, quantize). Shared by the unfused ops (int8_ops.cpp) and
// the packed-weight kernels (int8_vnni.cpp, int8_gated_amx.h) so all give the same bits.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace radixray_int8 {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One row: scale = max(max|x|, 1e-8) / 127, q = round_half_even(x * (1 / scale)).
// The same fp32 operations, in the same order, as quantize_per_token's torch code.
// flip = 0x80 writes each code with its sign bit flipped, i.e. code + 128 as an unsigned
// byte: the operand form of the VNNI / AMX GEMMs.
inline void quantize_row(const float* x, int8_t* q, float* scale_out, int64_t K, uint8_t flip = 0) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  float amax = hmax(vmax);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = std::max(amax, 1e-8f) / 127.0f;
  const float inv = 1.0f / scale;
  *scale_out = scale;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256i i[4];
    for (int j = 0; j < 4; ++j) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * j), vinv);
      v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    }
    // packs work per 128-bit lane: undo the lane interleave with one dword permute
    __m256i w01 = _mm256_packs_epi32(i[0], i[1]), w23 = _mm256_packs_epi32(i[2], i[3]);
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    b = _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(flip)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), b);
  }
  for (; k < K; ++k) {
    float v = std::nearbyint(x[k] * inv);
    q[k] = static_cast<int8_t>(static_cast<int8_t>(std::min(std::max(v, -127.0f), 127.0f)) ^ flip);
  }
}

// One row of an int32 accumulator -> fp32: (a[n] * sx) * ws[n] (+ b[n]), the bias added in
// the same fused multiply-add (written out: every kernel that rescales must round alike,
// whatever the compiler would contract on its own).
inline void rescale_row(const int32_t* a, float sx, const float* ws, const float* b, float* y, int64_t N) {
  const __m256 vsx = _mm256_set1_ps(sx);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + n)));
    v = _mm256_mul_ps(v, vsx);
    v = b ? _mm256_fmadd_ps(v, _mm256_loadu_ps(ws + n), _mm256_loadu_ps(b + n)) : _mm256_mul_ps(v, _mm256_loadu_ps(ws + n));
    _mm256_storeu_ps(y + n, v);
  }
  for (; n < N; ++n) {
    const float v = static_cast<float>(a[n]) * sx;
    y[n] = b ? std::fma(v, ws[n], b[n]) : v * ws[n];
  }
}

// The middle of a gated int8 MLP for one row: acc [2I] int32 (gate | up accumulators) ->
// rescale as rescale_row -> silu(gate) * up -> quantize_row -> q [I], *scale. scratch: 2I floats.
inline void rescale_silu_mul_quantize_row(const int32_t* acc, float sx, const float* ws, const float* b,
                                          float* scratch, int8_t* q, float* scale, int64_t I) {
  rescale_row(acc, sx, ws, b, scratch, 2 * I);
  radixray_simd::silu_mul_row(scratch, scratch + I, scratch, I);
  quantize_row(scratch, q, scale, I);
}

// rescale_silu_mul_quantize_row for each of M rows of acc [M, 2I], rows in parallel.
inline void rescale_silu_mul_quantize_rows(const int32_t* acc, int64_t M, int64_t I, const float* x_scale,
                                           const float* ws, const float* b, int8_t* q, float* scale) {
  const int64_t N = 2 * I;
#pragma omp parallel if (M * N > 65536)
  {
    std::vector<float> row(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      rescale_silu_mul_quantize_row(acc + m * N, x_scale[m], ws, b, row.data(), q + m * I, scale + m, I);
  }
}

}  // namespace radixray_int8
