// int8 x int8 -> int32 GEMM on Intel AMX tiles (Sapphire Rapids and later), on the weight
// layout int8_vnni_pack already makes: a packed block of 16 columns is [Kp / 4][16][4] bytes,
// which is exactly a TDPBUSD B tile (16 rows of 64 bytes per 64 values of K). The
// activations are the same unsigned bytes (code + 128) as the VNNI kernel's and the same
// 128 * sum_k w correction is taken back, so the integers equal torch._int_mm's.
//
// Tiles: C 0-3 (a 32 x 32 int32 block), A 4-5 (two 16-row slices of 64 bytes), B 6-7 (two
// 16-column blocks). Per 64 values of K: 4 tile loads, 4 TDPBUSD (16 x 16 x 64 each). Each
// thread owns a range of column groups, so its weight slice stays in L2 while row blocks
// of 32 pass through it (their 32 x Kp bytes stay in L1).
//
// AMX needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, once per process) and
// a tile configuration in every thread that uses the tiles (amx.h). Included by int8_vnni.cpp.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"

namespace radixray_amx {

constexpr int64_t kCols = 16;     // columns per packed block (one B tile)
constexpr int64_t kK = 64;        // K bytes per tile step
constexpr int64_t kRows = 32;     // rows per block (two A tiles)

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f")

// C[32 x 16 * NB] = A (32 rows of Kp unsigned bytes, stride lda) x packed blocks w0 (and w1
// when NB == 2), into acc (int32, row stride 32: w0's 16 columns, then w1's).
template <int NB>
inline void amx_block(const uint8_t* a, int64_t lda, const int8_t* w0, const int8_t* w1, int64_t Kp, int32_t* acc) {
  _tile_zero(0);
  _tile_zero(1);
  if (NB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < Kp; k += kK) {
    _tile_loadd(4, a + k, lda);
    _tile_loadd(5, a + 16 * lda + k, lda);
    _tile_loadd(6, w0 + k * kCols, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 5, 6);
    if (NB == 2) {
      _tile_loadd(7, w1 + k * kCols, 64);
      _tile_dpbusd(2, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  constexpr int64_t ld = 32 * sizeof(int32_t);
  _tile_stored(0, acc, ld);
  _tile_stored(1, acc + 16 * 32, ld);
  if (NB == 2) {
    _tile_stored(2, acc + 16, ld);
    _tile_stored(3, acc + 16 * 32 + 16, ld);
  }
}

// xu [M, Kp] unsigned bytes (Kp a multiple of 64); wp from int8_vnni_pack; comp[n] =
// 128 * sum_k w[n, k]. out.row(m, n0, width, vals) receives acc - comp for row m, columns
// n0 .. n0 + width.
template <class Out>
void amx_gemm(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp, const Out& out,
              int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols;
  const int64_t groups = (blocks + 1) / 2;  // pairs of blocks; the last may be single
#pragma omp parallel
  {
    configure_tiles();
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    alignas(64) int32_t acc[kRows * 32];
    std::vector<uint8_t> tail;  // the last rows, padded to a whole block
    for (int64_t m0 = 0; m0 < M && g0 < g1; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
      const uint8_t* a = xu + m0 * Kp;
      if (rows < kRows) {
        tail.assign(static_cast<size_t>(kRows * Kp), 0x80);
        std::memcpy(tail.data(), a, static_cast<size_t>(rows * Kp));
        a = tail.data();
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t nb = 2 * g, n0 = nb * kCols;
        const int8_t* w = wp + nb * Kp * kCols;
        const bool pair = nb + 1 < blocks;
        if (pair) amx_block<2>(a, Kp, w, w + Kp * kCols, Kp, acc);
        else amx_block<1>(a, Kp, w, nullptr, Kp, acc);
        const int64_t width = std::min<int64_t>(pair ? 32 : 16, N - n0);
        const __m512i c0 = _mm512_loadu_si512(comp + n0);
        const __m512i c1 = pair ? _mm512_loadu_si512(comp + n0 + 16) : _mm512_setzero_si512();
        for (int64_t r = 0; r < rows; ++r) {
          int32_t* v = acc + r * 32;
          _mm512_store_si512(v, _mm512_sub_epi32(_mm512_load_si512(v), c0));
          _mm512_store_si512(v + 16, _mm512_sub_epi32(_mm512_load_si512(v + 16), c1));
          out.row(m0 + r, n0, width, v);
        }
      }
    }
    _tile_release();
  }
}

#pragma GCC pop_options

}  // namespace radixray_amx
