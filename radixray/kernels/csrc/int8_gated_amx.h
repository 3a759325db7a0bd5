// The first half of a gated int8 MLP on AMX tiles, fused end to end: fp32 rows in, the
// down projection's int8 codes out. x [M, K] -> quantize per row -> gate|up GEMM -> rescale
// -> silu(gate) * up -> quantize per row -> (q [M, I], scale [M]). The unfused sequence
// (quantize_rows_int8, int8_vnni_gemm, rescale_silu_mul_quantize) writes the [M, 2I] int32
// accumulator to memory and reads it back; here it never leaves the tile registers.
//
// Each thread owns whole blocks of 32 rows (the row quantization needs a row's every
// column). Per block: its rows quantized into an L1-sized operand, then for each j the
// 16 gate columns j and the 16 up columns j together (packed blocks j and I / 16 + j, one
// 2-block AMX step), rescaled and multiplied into an fp32 row buffer of 32 x I (L2), which
// is quantized at the end. Every element goes through the same fp32 operations as the
// unfused ops (int8_rows.h: rescale_row, silu_mul_row, quantize_row are elementwise or per
// row), here 16 lanes wide, so the codes and scales are identical (tests/cpu/test_int8_vnni.py).
//
// Needs I % 16 == 0 and Kp % 64 == 0, and pays off with several row blocks per thread
// (gated_amx_applies); decode batches keep the unfused path. Included by int8_vnni.cpp.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_amx.h"
#include "int8_rows.h"
#include "simd512.h"

namespace radixray_amx {

// Whether amx_gated_mlp runs for these sizes: AMX usable, whole 16-column blocks in each half,
// K in whole tile steps, and at least two 32-row blocks for every thread.
inline bool gated_amx_applies(int64_t M, int64_t Kp, int64_t I) {
  return amx_int8_usable() && I % kCols == 0 && Kp % kK == 0 && M >= 2 * kRows * omp_get_max_threads();
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl")

// int8_rows.h's quantize_row on 16 lanes at a time, the same fp32 operations (so the same
// codes and scale), with flip = 0x80 writing code + 128.
inline void quantize_row16(const float* x, int8_t* q, float* scale_out, int64_t K, uint8_t flip) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = radixray_simd512::first_lanes(K - k);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)));
  }
  const float scale = std::max(_mm512_reduce_max_ps(vmax), 1e-8f) / 127.0f;
  *scale_out = scale;
  const __m512 vinv = _mm512_set1_ps(1.0f / scale);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m128i vflip = _mm_set1_epi8(static_cast<char>(flip));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = radixray_simd512::first_lanes(K - k);
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), vinv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)));
    _mm_mask_storeu_epi8(q + k, m, _mm_xor_si128(b, vflip));
  }
}

// One int32 accumulator vector -> fp32 as rescale_row: ((acc - comp) * sx) * ws (+ b).
inline __m512 rescale16(const int32_t* acc, __m512i comp, __m512 sx, const float* ws, const float* b) {
  __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(acc), comp));
  v = _mm512_mul_ps(v, sx);
  return b ? _mm512_fmadd_ps(v, _mm512_loadu_ps(ws), _mm512_loadu_ps(b)) : _mm512_mul_ps(v, _mm512_loadu_ps(ws));
}

// x [M, K] fp32 (row stride K); wp / comp from int8_vnni_pack of the [2I, Kp] gate|up weight;
// ws [2I]; bias [2I] or null. Writes q [M, I] codes and scale [M].
inline void amx_gated_mlp(const float* x, int64_t M, int64_t K, int64_t Kp, const int8_t* wp, const int32_t* comp,
                          const float* ws, const float* bias, int64_t I, int8_t* q, float* scale) {
  const int64_t half = I / kCols, mblocks = (M + kRows - 1) / kRows;
#pragma omp parallel
  {
    configure_tiles();
    std::vector<uint8_t> a(static_cast<size_t>(kRows * Kp));
    std::vector<float> h(static_cast<size_t>(kRows * I));
    float x_scale[kRows];
    alignas(64) int32_t acc[kRows * 32];
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      const int64_t m0 = mb * kRows, rows = std::min(kRows, M - m0);
      std::memset(a.data(), 0x80, a.size());  // code 0 in the K padding and the missing rows
      for (int64_t r = 0; r < rows; ++r)
        quantize_row16(x + (m0 + r) * K, reinterpret_cast<int8_t*>(a.data() + r * Kp), x_scale + r, K, 0x80);
      for (int64_t j = 0; j < half; ++j) {
        const int64_t ng = j * kCols, nu = I + j * kCols;
        amx_block<2>(a.data(), Kp, wp + ng * Kp, wp + nu * Kp, Kp, acc);
        const __m512i cg = _mm512_loadu_si512(comp + ng), cu = _mm512_loadu_si512(comp + nu);
        const float* bg = bias ? bias + ng : nullptr;
        const float* bu = bias ? bias + nu : nullptr;
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 sx = _mm512_set1_ps(x_scale[r]);
          const __m512 g = rescale16(acc + r * 32, cg, sx, ws + ng, bg);
          const __m512 u = rescale16(acc + r * 32 + 16, cu, sx, ws + nu, bu);
          _mm512_storeu_ps(h.data() + r * I + ng, radixray_simd512::silu_mul16(g, u));
        }
      }
      for (int64_t r = 0; r < rows; ++r) quantize_row16(h.data() + r * I, q + (m0 + r) * I, scale + m0 + r, I, 0);
    }
    _tile_release();
  }
}

#pragma GCC pop_options

}  // namespace radixray_amx
