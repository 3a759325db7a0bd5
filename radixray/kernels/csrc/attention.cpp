// Attention kernels (AVX2 + FMA, OpenMP): decode straight from the paged KV pool, and
// prefill ("extend") over contiguous keys/values. References: paged_decode_attention_ref
// in radixray/kernels/cpu_ops.py and TorchAttention._attend (SDPA), compared in
// tests/cpu/test_cpu_kernels.py and tests/cpu/test_extend_attention.py.
//
// Decode:
// q [B,H,D] fp32; pools [S,KVH,D] fp32, bf16 or fp8 e5m2; kv_indices [B,Lmax] (the slot of each
// context token); seq_lens [B]. Query head h reads kv head h / (H / KVH).
//
// One work item per request (per (request, kv head) pair when there are fewer than two
// requests per thread). Keys are read row by row in token order, all heads of a row at
// once (each key head widened from bf16 once for the query heads that share it), and 8
// tokens' dot products are reduced together; values are read in blocks of 16
// rows with the query heads that share a kv head (up to 3) accumulating in registers. So
// every key and value row is read from memory once per step, in order. A bf16 pool that
// sits in L3 is read at ~24 GB/s; a real step's 30 layers of pools come from memory at
// ~14.7 GB/s (software prefetching 16-64 tokens ahead, to L1 or L2, and huge pages did
// not change that), about half of what a plain sum reads, as memory and compute overlap
// poorly. The softmax runs on 8 lanes with a
// vectorized exp. The earlier kernel (one dot product and one scalar exp per head and
// token) was compute-bound on bf16 pools: 1.5 vs 0.77 ms for 32 requests x 570 tokens.
//
// Extend: q [n,H,D], k/v [prefix_len + n, KVH, D], fp32; new token i sees keys
// 0 .. prefix_len + i. Work items are (tile of ~12 query rows, kv head), longest first.
// With 16+ new tokens the keys are transposed once and QK runs as a register-blocked
// GEMM (12 query rows x 8 keys per step); fewer tokens use the decode's dot products. The
// value pass runs all rows of a tile together in blocks of 6 rows x 16 columns (pv_rows):
// 1.6x faster over a 512-token prompt than per-token blocks of 3 heads x 32 columns, whose
// 17 live vectors spilled out of the 16 registers; same bits.
// Against the blocked torch GEMMs it replaced: 1.4x faster over a 512-token prompt, 1.8x
// for 128 tokens after a 2,048-token prefix, on par at 2,048 tokens; an int8 prefill of
// 8 x 512 tokens ran 1.20x faster end to end (fp32: 1.09x).
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_avx512.h"
#include "simd.h"

using namespace radixray_simd;

namespace {

constexpr int64_t kHeadBlock = 3;  // query heads per register block

// out[h][0 : 8*ND] = sum_t P[h][t] * v_t[0 : 8*ND] for NH heads, accumulators in registers.
// (Fixed NH and ND keep every array in registers; with run-time bounds the compiler
// copies rows through memory and the kernel runs several times slower.)
template <typename T, int NH, int ND>
void pv_block(const float* P, int64_t Lp, const T* V, const int64_t* idx, int64_t row, int64_t t0,
              int64_t t1, float* out, int64_t D) {
  __m256 acc[NH][ND];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < ND; ++i) acc[h][i] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + h * D + 8 * i);
  for (int64_t t = t0; t < t1; ++t) {
    const T* vt = V + idx[t] * row;
    __m256 vv[ND];
    for (int i = 0; i < ND; ++i) vv[i] = load8(vt + 8 * i);
    for (int h = 0; h < NH; ++h) {
      const __m256 p = _mm256_broadcast_ss(P + h * Lp + t);
      for (int i = 0; i < ND; ++i) acc[h][i] = _mm256_fmadd_ps(p, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < ND; ++i) _mm256_storeu_ps(out + h * D + 8 * i, acc[h][i]);
}

template <typename T, int NH>
void pv_columns(int64_t nd, const float* P, int64_t Lp, const T* V, const int64_t* idx, int64_t row,
                int64_t t0, int64_t t1, float* out, int64_t D) {
  switch (nd) {
    case 4: pv_block<T, NH, 4>(P, Lp, V, idx, row, t0, t1, out, D); break;
    case 3: pv_block<T, NH, 3>(P, Lp, V, idx, row, t0, t1, out, D); break;
    case 2: pv_block<T, NH, 2>(P, Lp, V, idx, row, t0, t1, out, D); break;
    default: pv_block<T, NH, 1>(P, Lp, V, idx, row, t0, t1, out, D); break;
  }
}

// In place over s[0, Lp): softmax of the first L entries, zeros after them.
void softmax_padded(float* s, int64_t L, int64_t Lp) {
  for (int64_t t = L; t < Lp; ++t) s[t] = -INFINITY;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < Lp; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const float m = *std::max_element(lanes, lanes + 8);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < Lp; t += 8) {
    // exp(-inf - m) is 0 after exp8's clamp only approximately: mask the padding exactly.
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    if (t + 8 > L) {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(L - t)), lane));
      e = _mm256_and_ps(e, keep);
    }
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t t = 0; t < Lp; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
}

// O[h] (+)= sum_{t0 <= t < t1} P[h][t] v_t over the first DV columns (multiple of 8) for n
// query heads sharing one kv head (V points at it in key row 0; P rows Lp apart, O rows D
// apart). t0 == 0 starts the sums. Call over blocks of 16 rows: they stay in L1 for every
// head and column chunk.
template <typename T>
void pv_heads(const float* P, int64_t Lp, int64_t n, const T* V, const int64_t* idx, int64_t row, int64_t t0,
              int64_t t1, int64_t D, float* O) {
  const int64_t DV = D / 8 * 8;
  for (int64_t h0 = 0; h0 < n; h0 += kHeadBlock) {
    const int64_t nh = std::min(kHeadBlock, n - h0);
    for (int64_t d0 = 0; d0 < DV; d0 += 32) {
      const int64_t nd = std::min<int64_t>(4, (DV - d0) / 8);
      const float* p = P + h0 * Lp;
      float* o = O + h0 * D + d0;
      if (nh == 3) pv_columns<T, 3>(nd, p, Lp, V + d0, idx, row, t0, t1, o, D);
      else if (nh == 2) pv_columns<T, 2>(nd, p, Lp, V + d0, idx, row, t0, t1, o, D);
      else pv_columns<T, 1>(nd, p, Lp, V + d0, idx, row, t0, t1, o, D);
    }
  }
}

// The columns past the last multiple of 8 (head sizes like 70): O[h][d] = sum_{t < L} P[h][t] v_t[d].
template <typename T>
void pv_tail(const float* P, int64_t Lp, int64_t n, const T* V, const int64_t* idx, int64_t row, int64_t L,
             int64_t D, float* O) {
  for (int64_t h = 0; h < n; ++h)
    for (int64_t d = D / 8 * 8; d < D; ++d) {
      float a = 0.f;
      for (int64_t t = 0; t < L; ++t) a += P[h * Lp + t] * widen(V[idx[t] * row + d]);
      O[h * D + d] = a;
    }
}

// Extend's value pass: out[r][0 : DV] = sum_{t < L} P[r][t] v_t for R rows (P rows Lp apart,
// out rows D apart) that share one kv head, in blocks of 6 rows x 16 columns (12 accumulators
// and 2 value vectors: all in the 16 registers, where 3 heads x 32 columns spill one). Rows
// may have zero probabilities past their own length. Each row's sum runs in token order, as
// in pv_heads, so the bits are the same.
constexpr int kRowBlock = 6;

template <int NH>
void pv_row_block(const float* P, int64_t Lp, const float* V, const int64_t* idx, int64_t row, int64_t L,
                  int64_t DV, float* out, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 16 <= DV; d0 += 16) pv_block<float, NH, 2>(P, Lp, V + d0, idx, row, 0, L, out + d0, D);
  if (d0 < DV) pv_block<float, NH, 1>(P, Lp, V + d0, idx, row, 0, L, out + d0, D);
}

void pv_rows(const float* P, int64_t Lp, int64_t R, const float* V, const int64_t* idx, int64_t row, int64_t L,
             int64_t D, float* out) {
  const int64_t DV = D / 8 * 8;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const float* p = P + r0 * Lp;
    float* o = out + r0 * D;
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 6: pv_row_block<6>(p, Lp, V, idx, row, L, DV, o, D); break;
      case 5: pv_row_block<5>(p, Lp, V, idx, row, L, DV, o, D); break;
      case 4: pv_row_block<4>(p, Lp, V, idx, row, L, DV, o, D); break;
      case 3: pv_row_block<3>(p, Lp, V, idx, row, L, DV, o, D); break;
      case 2: pv_row_block<2>(p, Lp, V, idx, row, L, DV, o, D); break;
      default: pv_row_block<1>(p, Lp, V, idx, row, L, DV, o, D); break;
    }
  }
}

constexpr int64_t kTokenBlock = 16;
constexpr int64_t kTransposeMinTokens = 16;  // extend: fewer new tokens skip the transposed key copy

// part[g * 8 + j] = the 8 partial sums of q_g . k over the first DV columns (a multiple of 8),
// for NG query rows (Q, D apart) that share the key head row kh: each 8 columns of the key
// are loaded (and widened from bf16) once for all NG rows. Fixed NG keeps the sums in registers.
template <typename T, int NG>
inline void qk_group(const float* Q, int64_t D, int64_t DV, const T* kh, __m256* part, int64_t j) {
  __m256 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < DV; d += 8) {
    const __m256 kv = load8(kh + d);
    for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(Q + g * D + d), kv, acc[g]);
  }
  for (int g = 0; g < NG; ++g) part[g * 8 + j] = acc[g];
}

template <typename T>
inline void qk_group_n(int64_t ng, const float* Q, int64_t D, int64_t DV, const T* kh, __m256* part, int64_t j) {
  switch (ng) {
    case 1: qk_group<T, 1>(Q, D, DV, kh, part, j); break;
    case 2: qk_group<T, 2>(Q, D, DV, kh, part, j); break;
    case 3: qk_group<T, 3>(Q, D, DV, kh, part, j); break;
    case 4: qk_group<T, 4>(Q, D, DV, kh, part, j); break;
    case 5: qk_group<T, 5>(Q, D, DV, kh, part, j); break;
    case 6: qk_group<T, 6>(Q, D, DV, kh, part, j); break;
    case 7: qk_group<T, 7>(Q, D, DV, kh, part, j); break;
    default: qk_group<T, 8>(Q, D, DV, kh, part, j); break;
  }
}

// S[r][t] = sc * q_r . k_t for t < L and R query rows (row r at Q + r * D, reading the key
// head at K + (r / G) * kstep of each key row; R a multiple of G). Rows in token order, all
// query rows per key row, each key head widened once for its G rows (in groups of up to 8);
// 8 tokens' sums reduced at once, columns past the last multiple of 8 added after.
// Lanes in [L, Lp) hold garbage (the last valid row repeated) for the softmax to mask.
template <typename T>
void qk_rows(const float* Q, int64_t D, int64_t G, int64_t R, const T* K, int64_t kstep, const int64_t* idx,
             int64_t row, int64_t L, float sc, __m256* part, float* S, int64_t Lp) {
  const int64_t DV = D / 8 * 8;
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    const int64_t nt = std::min<int64_t>(8, L - t0);
    for (int64_t j = 0; j < 8; ++j) {
      const T* kt = K + idx[t0 + std::min(j, nt - 1)] * row;
      for (int64_t r0 = 0; r0 < R; r0 += G)
        for (int64_t g0 = 0; g0 < G; g0 += 8)
          qk_group_n(std::min<int64_t>(8, G - g0), Q + (r0 + g0) * D, D, DV, kt + (r0 / G) * kstep,
                     part + (r0 + g0) * 8, j);
    }
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_ps(S + r * Lp + t0, _mm256_mul_ps(hsum8(part + r * 8), _mm256_set1_ps(sc)));
  }
  if (DV < D)  // head sizes like 70
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < L; ++t) {
        const T* kh = K + idx[t] * row + (r / G) * kstep;
        float tail = 0.f;
        for (int64_t d = DV; d < D; ++d) tail += Q[r * D + d] * widen(kh[d]);
        S[r * Lp + t] += tail * sc;
      }
}

struct Scratch {  // one per thread
  std::vector<float> scores;  // [H, L rounded up to 8]
  std::vector<__m256> part;   // [H, 8]: unreduced dot products of a block of 8 tokens
  std::vector<float> q;       // extend: the query rows of a tile, contiguous
  std::vector<float> out;     // extend: the tile's output rows, contiguous
};

// One request, kv heads [k0, k1): its query heads Q [H, D] over L context tokens -> O [H, D].
// Both passes walk the context in token order; the value pass in blocks of rows that are
// read from memory once and reused from L1 by every kv head and head block.
template <typename T>
void attend_request(const float* Q, const T* KP, const T* VP, const int64_t* idx, int64_t KVH, int64_t k0,
                    int64_t k1, int64_t L, int64_t G, int64_t D, float sc, Scratch& scratch, float* O) {
  const int64_t Lp = (L + 7) / 8 * 8, row = KVH * D, H = KVH * G;
  scratch.scores.resize(static_cast<size_t>(H * Lp));
  scratch.part.resize(static_cast<size_t>(H * 8));
  float* S = scratch.scores.data();
  __m256* part = scratch.part.data();
  qk_rows(Q + k0 * G * D, D, G, (k1 - k0) * G, KP + k0 * D, D, idx, row, L, sc, part, S + k0 * G * Lp, Lp);
  for (int64_t h = k0 * G; h < k1 * G; ++h) softmax_padded(S + h * Lp, L, Lp);
  for (int64_t t0 = 0; t0 < L; t0 += kTokenBlock) {  // blocks outer: each block's rows read once, in order
    for (int64_t kh = k0; kh < k1; ++kh)
      pv_heads(S + kh * G * Lp, Lp, G, VP + kh * D, idx, row, t0, std::min(L, t0 + kTokenBlock), D, O + kh * G * D);
  }
  for (int64_t kh = k0; kh < k1; ++kh) pv_tail(S + kh * G * Lp, Lp, G, VP + kh * D, idx, row, L, D, O + kh * G * D);
}

template <typename T>
void paged_decode_attention_impl(const float* Q, const T* KP, const T* VP, const int64_t* IDX,
                                 const int64_t* LEN, float* O, int64_t B, int64_t H, int64_t D,
                                 int64_t KVH, int64_t Lmax, float sc) {
  if (paged_decode_attention_avx512<T>({Q, KP, VP, IDX, LEN, O, B, H, D, KVH, Lmax, sc})) return;
  const int64_t G = H / KVH;
  // A request per work item; with fewer than 2 requests per thread, a (request, kv head) pair.
  const int64_t split = B < 2 * omp_get_max_threads() ? KVH : 1;
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * split; ++item) {
      const int64_t b = item / split;
      const int64_t k0 = split == 1 ? 0 : item % split, k1 = split == 1 ? KVH : k0 + 1;
      attend_request(Q + b * H * D, KP, VP, IDX + b * Lmax, KVH, k0, k1, LEN[b], G, D, sc, scratch,
                     O + b * H * D);
    }
  }
}

// Extend QK as a small GEMM over transposed keys: S[r][t] = sc * sum_d Q[r][d] * KT[d][t]
// for R rows (Q rows D apart) and t < L; KT is [D, ldk] with ldk >= L rounded up to 8.
// Per d, one vector of 8 keys meets R broadcast query elements: R FMAs for R + 1 loads and
// no horizontal reduction. (Two key vectors x 6 rows measured slower here.)
template <int R>
void qk_transposed(const float* Q, int64_t D, const float* KT, int64_t ldk, int64_t L, float sc, float* S,
                   int64_t Lp) {
  const __m256 scale = _mm256_set1_ps(sc);
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 kt = _mm256_loadu_ps(KT + d * ldk + t0);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(Q + r * D + d), kt, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(S + r * Lp + t0, _mm256_mul_ps(acc[r], scale));
  }
}

void qk_transposed_rows(const float* Q, int64_t D, int64_t R, const float* KT, int64_t ldk, int64_t L, float sc,
                        float* S, int64_t Lp) {
  for (int64_t r0 = 0; r0 < R;) {
    const int64_t left = R - r0;
    const float* q = Q + r0 * D;
    float* s = S + r0 * Lp;
    if (left >= 12) { qk_transposed<12>(q, D, KT, ldk, L, sc, s, Lp); r0 += 12; }
    else if (left >= 6) { qk_transposed<6>(q, D, KT, ldk, L, sc, s, Lp); r0 += 6; }
    else if (left >= 4) { qk_transposed<4>(q, D, KT, ldk, L, sc, s, Lp); r0 += 4; }
    else if (left >= 2) { qk_transposed<2>(q, D, KT, ldk, L, sc, s, Lp); r0 += 2; }
    else { qk_transposed<1>(q, D, KT, ldk, L, sc, s, Lp); r0 += 1; }
  }
}

// Extend: one tile of nq new tokens [qs, qs + nq) and one kv head. Token i (absolute
// position plen + i) sees keys 0 .. plen + i; the tile's G * nq query rows share each key
// row read, and value blocks are reused by every query of the tile.
void extend_tile(const float* Q, const float* K, const float* KT, int64_t ldk, const float* V,
                 const int64_t* idx, int64_t H, int64_t KVH, int64_t D, int64_t plen, int64_t qs, int64_t nq,
                 int64_t kh, float sc, Scratch& scratch, float* O) {
  const int64_t G = H / KVH, R = nq * G, row = KVH * D;
  const int64_t L = plen + qs + nq, Lp = (L + 7) / 8 * 8;
  scratch.q.resize(static_cast<size_t>(R * D));
  scratch.scores.resize(static_cast<size_t>(R * Lp));
  float* q = scratch.q.data();
  float* S = scratch.scores.data();
  for (int64_t qi = 0; qi < nq; ++qi)
    std::memcpy(q + qi * G * D, Q + ((qs + qi) * H + kh * G) * D, static_cast<size_t>(G * D) * sizeof(float));
  const float* Vh = V + kh * D;
  if (KT != nullptr) {
    qk_transposed_rows(q, D, R, KT + kh * D * ldk, ldk, L, sc, S, Lp);
  } else {  // a few new tokens: dot products over key rows, no transposed copy
    scratch.part.resize(static_cast<size_t>(R * 8));
    qk_rows(q, D, R, R, K + kh * D, 0, idx, row, L, sc, scratch.part.data(), S, Lp);
  }
  for (int64_t r = 0; r < R; ++r) softmax_padded(S + r * Lp, plen + qs + r / G + 1, Lp);  // hides future keys
  // All R rows of the tile at once over its L keys (a row's future keys weigh zero).
  scratch.out.resize(static_cast<size_t>(R * D));
  float* out = scratch.out.data();
  pv_rows(S, Lp, R, Vh, idx, row, L, D, out);
  for (int64_t qi = 0; qi < nq; ++qi) {
    float* o = O + ((qs + qi) * H + kh * G) * D;
    std::memcpy(o, out + qi * G * D, static_cast<size_t>(G * D) * sizeof(float));
    pv_tail(S + qi * G * Lp, Lp, G, Vh, idx, row, plen + qs + qi + 1, D, o);
  }
}

}  // namespace

// q [n, H, D], k/v [prefix_len + n, KVH, D] (cached prefix first), all fp32 -> [n, H, D].
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t prefix_len, double scale) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->dim() == 3,
                "extend_attention: q, k, v must be 3-D float32 CPU tensors");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == prefix_len + n && k.size(2) == D && H % KVH == 0,
              "extend_attention: k/v must be [prefix_len + n, kv_heads, head_dim] with heads % kv_heads == 0");
  auto out = torch::empty_like(q);
  std::vector<int64_t> idx(static_cast<size_t>(prefix_len + n));
  for (size_t t = 0; t < idx.size(); ++t) idx[t] = static_cast<int64_t>(t);
  // With enough new tokens to amortize it, keys are transposed once per call into
  // [KVH, D, ldk] (ldk a multiple of 8, zero padded) for the GEMM-shaped QK.
  const int64_t total = prefix_len + n, ldk = (total + 7) / 8 * 8;
  const float* K = k.data_ptr<float>();
  std::vector<float> kt;
  if (n >= kTransposeMinTokens) {
    kt.assign(static_cast<size_t>(KVH * D * ldk), 0.f);
#pragma omp parallel for schedule(static) if (total * KVH * D > 65536)
    for (int64_t hd = 0; hd < KVH * D; ++hd)
      for (int64_t t = 0; t < total; ++t) kt[hd * ldk + t] = K[t * KVH * D + hd];
  }
  const int64_t G = H / KVH, tile = std::max<int64_t>(1, 12 / G);  // ~12 query rows per tile
  const int64_t tiles = (n + tile - 1) / tile;
  const float* Q = q.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tiles * KVH; ++item) {
      const int64_t qs = (tiles - 1 - item / KVH) * tile;  // the longest tiles first
      extend_tile(Q, K, kt.empty() ? nullptr : kt.data(), ldk, V, idx.data(), H, KVH, D, prefix_len, qs,
                  std::min(tile, n - qs), item % KVH, sc, scratch, O);
    }
  }
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor kv_indices, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.device().is_cpu(), "q must be a float32 CPU tensor");
  const auto pool_type = k_pool.scalar_type();
  TORCH_CHECK((pool_type == torch::kFloat32 || pool_type == torch::kBFloat16 ||
               pool_type == torch::kFloat8_e5m2) &&
              v_pool.scalar_type() == pool_type && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_decode_attention: pools must be float32, bfloat16 or float8_e5m2 CPU tensors of one dtype");
  TORCH_CHECK(kv_indices.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "indices must be int64");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  q = q.contiguous();
  kv_indices = kv_indices.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_pool.size(1), Lmax = kv_indices.size(1);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "attention: head shape mismatch");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= Lmax, "paged_decode_attention: seq_lens[", b, "]=", lens[b],
                " outside [1, ", Lmax, "]");
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (pool_type == torch::kFloat32) {
    paged_decode_attention_impl(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                kv_indices.data_ptr<int64_t>(), lens, out.data_ptr<float>(), B, H, D, KVH,
                                Lmax, sc);
  } else if (pool_type == torch::kFloat8_e5m2) {
    paged_decode_attention_impl(q.data_ptr<float>(), reinterpret_cast<const uint8_t*>(k_pool.data_ptr()),
                                reinterpret_cast<const uint8_t*>(v_pool.data_ptr()),
                                kv_indices.data_ptr<int64_t>(), lens, out.data_ptr<float>(), B, H, D, KVH,
                                Lmax, sc);
  } else {
    paged_decode_attention_impl(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                                reinterpret_cast<const uint16_t*>(v_pool.data_ptr()),
                                kv_indices.data_ptr<int64_t>(), lens, out.data_ptr<float>(), B, H, D, KVH,
                                Lmax, sc);
  }
  return out;
}

// Turns the AVX-512 decode kernel on or off (where the CPU has it); returns the old setting.
bool set_decode_avx512(bool enabled) {
  const bool old = decode_avx512_enabled();
  decode_avx512_enabled() = enabled;
  return old;
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("decode_avx512_supported() -> bool", &decode_avx512_supported);
  m.def("set_decode_avx512(bool enabled) -> bool", &set_decode_avx512);
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_indices, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("extend_attention(Tensor q, Tensor k, Tensor v, int prefix_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("extend_attention", &extend_attention);
}
