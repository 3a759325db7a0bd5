// Paged decode attention in AVX-512, for CPUs that have it (checked at run time; the AVX2
// kernel in attention.cpp is the rest). Same contract as paged_decode_attention_impl there,
// for head sizes that are multiples of 16 and G query heads per kv head with G * D / 16 <= 16
// (SmolLM2: G = 3, D = 64): the G query rows of a kv head sit in registers while a block of
// 16 tokens passes, so the key pass loads each key once, widens it once and runs G fused
// multiply-adds per 16 columns; the 16 tokens' sums are reduced together (a transpose-add
// tree). The value pass keeps a head's G x D sums in registers over the block. SmolLM2's 30
// layers at batch 32 x 576 tokens on a Sapphire Rapids VM, against the AVX2 kernel: fp8
// pools 1.55x from memory (25.5 vs 39.4 ms), 2.2x from L3 (18.8 vs 41.9 ms); bf16 1.3x / 1.8x.
// Reference: paged_decode_attention_ref (cpu_ops.py), compared in tests/cpu/test_cpu_kernels.py.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_avx512.h"
#include "simd512.h"

using radixray_simd512::exp16;
using radixray_simd512::first_lanes;

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16: the high half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const uint8_t* p) {  // fp8 e5m2: the high byte of an fp16
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  return _mm512_cvtph_ps(h);
}

// 16 vectors -> one vector of their 16 horizontal sums, in order.
inline __m512 hsum16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // w[i]'s 128-bit lane l holds lane l's partial sums of vectors 4i .. 4i + 3
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xdd));
}

// In place over s[0, Lp) (Lp a multiple of 16): softmax of the first L entries, zeros after.
inline void softmax16(float* s, int64_t L, int64_t Lp) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; t += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(L - t), s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < Lp; t += 16) {
    const __mmask16 live = first_lanes(L - t);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m)));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < Lp; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
}

struct Scratch {  // one per thread
  std::vector<float> q;       // [NH * G, D] scaled queries
  std::vector<float> scores;  // [NH * G, Lp]
  std::vector<float> out;     // [NH * G, D] value sums between token blocks
};

// One request, NH kv heads from the one Q, KP and VP point at: its NH * G query rows Q (D
// apart) over L tokens -> O. Both passes walk the tokens in blocks of 16 and, inside a
// block, every kv head in turn, so each key and value row (all heads' lines) is used
// within a short window: reading one head's lines per pass over the context measured
// ~15% slower from memory (fp8), and prefetching 16-128 tokens ahead changed nothing
// measurable (fp8) or ~5% (bf16), so it is not done. The query rows of a head and its G x D value sums are reloaded per
// block (from L1).
template <typename T, int G, int ND>
void attend_request(const float* Q, const T* KP, const T* VP, const int64_t* idx, int64_t row, int64_t NH,
                    int64_t L, float sc, Scratch& w, float* O) {
  constexpr int64_t D = 16 * ND;
  const int64_t Lp = (L + 15) / 16 * 16, R = NH * G;
  w.q.resize(static_cast<size_t>(R * D));
  w.scores.resize(static_cast<size_t>(R * Lp));
  w.out.assign(static_cast<size_t>(R * D), 0.f);
  for (int64_t i = 0; i < R * D; i += 16)
    _mm512_storeu_ps(w.q.data() + i, _mm512_mul_ps(_mm512_loadu_ps(Q + i), _mm512_set1_ps(sc)));
  float* S = w.scores.data();
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, L - t0);
    for (int64_t h = 0; h < NH; ++h) {
      __m512 q[G][ND];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < ND; ++c) q[g][c] = _mm512_loadu_ps(w.q.data() + (h * G + g) * D + 16 * c);
      __m512 part[G][16];
      for (int64_t j = 0; j < 16; ++j) {
        const T* kt = KP + idx[t0 + std::min(j, nt - 1)] * row + h * D;  // past L: the last token again
        __m512 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int c = 0; c < ND; ++c) {
          const __m512 kv = load16(kt + 16 * c);
          for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(q[g][c], kv, acc[g]);
        }
        for (int g = 0; g < G; ++g) part[g][j] = acc[g];
      }
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(S + (h * G + g) * Lp + t0, hsum16(part[g]));
    }
  }
  for (int64_t r = 0; r < R; ++r) softmax16(S + r * Lp, L, Lp);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t t1 = std::min(L, t0 + 16);
    for (int64_t h = 0; h < NH; ++h) {
      float* oh = w.out.data() + h * G * D;
      __m512 o[G][ND];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < ND; ++c) o[g][c] = _mm512_loadu_ps(oh + g * D + 16 * c);
      for (int64_t t = t0; t < t1; ++t) {
        const T* vt = VP + idx[t] * row + h * D;
        __m512 vv[ND];
        for (int c = 0; c < ND; ++c) vv[c] = load16(vt + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(S[(h * G + g) * Lp + t]);
          for (int c = 0; c < ND; ++c) o[g][c] = _mm512_fmadd_ps(p, vv[c], o[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < ND; ++c) _mm512_storeu_ps(oh + g * D + 16 * c, o[g][c]);
    }
  }
  std::memcpy(O, w.out.data(), static_cast<size_t>(R * D) * sizeof(float));
}

template <typename T, int G, int ND>
void decode_all(const DecodeArgs<T>& a) {
  const int64_t H = a.KVH * G, row = a.KVH * a.D;
  // A request per work item; with fewer than 2 requests per thread, a (request, kv head) pair.
  const int64_t split = a.B < 2 * omp_get_max_threads() ? a.KVH : 1;
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < a.B * split; ++item) {
      const int64_t b = item / split;
      const int64_t k0 = split == 1 ? 0 : item % split, nh = split == 1 ? a.KVH : 1;
      const int64_t off = (b * H + k0 * G) * a.D;
      attend_request<T, G, ND>(a.Q + off, a.KP + k0 * a.D, a.VP + k0 * a.D, a.IDX + b * a.Lmax, row, nh,
                               a.LEN[b], a.sc, scratch, a.O + off);
    }
  }
}

// Runs when the G x ND query vectors fit in 16 of the 32 registers.
template <typename T, int G, int ND>
bool decode_if_fits(const DecodeArgs<T>& a) {
  if constexpr (G * ND <= 16) {
    decode_all<T, G, ND>(a);
    return true;
  }
  return false;
}

template <typename T, int ND>
bool decode_nd(const DecodeArgs<T>& a, int64_t G) {
  switch (G) {
    case 1: return decode_if_fits<T, 1, ND>(a);
    case 2: return decode_if_fits<T, 2, ND>(a);
    case 3: return decode_if_fits<T, 3, ND>(a);
    case 4: return decode_if_fits<T, 4, ND>(a);
    default: return false;
  }
}

#pragma GCC pop_options

}  // namespace

bool decode_avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool& decode_avx512_enabled() {
  static bool enabled = true;
  return enabled;
}

template <typename T>
bool paged_decode_attention_avx512(const DecodeArgs<T>& a) {
  static const bool ok = decode_avx512_supported();
  if (!ok || !decode_avx512_enabled() || a.D % 16 != 0 || a.H % a.KVH != 0) return false;
  const int64_t G = a.H / a.KVH;
  switch (a.D / 16) {
    case 2: return decode_nd<T, 2>(a, G);
    case 4: return decode_nd<T, 4>(a, G);
    case 8: return decode_nd<T, 8>(a, G);
    default: return false;
  }
}

template bool paged_decode_attention_avx512<float>(const DecodeArgs<float>&);
template bool paged_decode_attention_avx512<uint16_t>(const DecodeArgs<uint16_t>&);
template bool paged_decode_attention_avx512<uint8_t>(const DecodeArgs<uint8_t>&);
