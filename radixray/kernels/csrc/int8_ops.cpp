// W8A8 int8 linear pieces (AVX2, OpenMP): the quantize and rescale halves around the GEMM,
// the fused middle of a gated int8 MLP, and the GEMM itself for a few rows (larger ones go
// to torch._int_mm). Pure-torch references: radixray/kernels/int8_linear.py, compared in
// tests/cpu/test_int8_linear.py.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <cmath>
#include <vector>

#include "int8_rows.h"
#include "simd.h"

using radixray_int8::quantize_row;
using radixray_int8::rescale_row;

namespace {

// acc[M, N] = x[M, K] . w[N, K]^T in int32 for a few rows (decode), AVX2. Each weight row is
// streamed from memory once and met by every input row: x * w = |x| * (w with x's sign),
// an unsigned x signed byte product that _mm256_maddubs_epi16 sums in pairs without
// saturating (codes are within +-127, so a pair is at most 2 * 127 * 127 < 32767).
template <int M>
void int8_gemm_rows(const int8_t* X, const int8_t* W, int32_t* Y, int64_t K, int64_t N) {
  const int64_t KV = K / 32 * 32;
  const __m256i ones = _mm256_set1_epi16(1);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* w = W + n * K;
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < KV; k += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X + m * K + k));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
      for (int64_t k = KV; k < K; ++k) sum += static_cast<int32_t>(X[m * K + k]) * static_cast<int32_t>(w[k]);
      Y[m * N + n] = sum;
    }
  }
}

}  // namespace

// x [M, K] int8 (M <= 8), w [N, K] int8 -> [M, N] int32, the same integers as torch._int_mm(x, w.t()).
torch::Tensor int8_gemm_small_m(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kInt8 && w.scalar_type() == torch::kInt8 && x.dim() == 2 && w.dim() == 2 &&
              x.size(1) == w.size(1), "int8_gemm_small_m: x [M, K] and w [N, K] must be int8 with the same K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "int8_gemm_small_m: 1 to 8 rows, got ", x.size(0));
  TORCH_CHECK(w.is_contiguous(), "int8_gemm_small_m: w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  const int8_t* X = x.data_ptr<int8_t>();
  const int8_t* W = w.data_ptr<int8_t>();
  int32_t* Y = y.data_ptr<int32_t>();
  switch (M) {
    case 1: int8_gemm_rows<1>(X, W, Y, K, N); break;
    case 2: int8_gemm_rows<2>(X, W, Y, K, N); break;
    case 3: int8_gemm_rows<3>(X, W, Y, K, N); break;
    case 4: int8_gemm_rows<4>(X, W, Y, K, N); break;
    case 5: int8_gemm_rows<5>(X, W, Y, K, N); break;
    case 6: int8_gemm_rows<6>(X, W, Y, K, N); break;
    case 7: int8_gemm_rows<7>(X, W, Y, K, N); break;
    default: int8_gemm_rows<8>(X, W, Y, K, N); break;
  }
  return y;
}

// x [M, K] fp32 -> (q [M, K] int8, scale [M] fp32), symmetric per row.
std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() == 2,
              "quantize_rows_int8: x must be a 2-D float32 CPU tensor");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, x.options());
  const float* X = x.data_ptr<float>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) quantize_row(X + m * K, Q + m * K, S + m, K);
  return {q, s};
}

// acc [M, N] int32 -> y [M, N] fp32 = (acc * x_scale[m]) * w_scale[n] (+ bias[n]).
torch::Tensor rescale_int8_acc(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                               c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(acc.scalar_type() == torch::kInt32 && acc.dim() == 2 && acc.is_contiguous(),
              "rescale_int8_acc: acc must be a contiguous 2-D int32 tensor");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.numel() == M && w_scale.numel() == N, "rescale_int8_acc: scale sizes");
  const bool has_bias = bias.has_value() && bias->defined();
  auto xs = x_scale.contiguous(), ws = w_scale.contiguous();
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  auto y = torch::empty({M, N}, acc.options().dtype(torch::kFloat32));
  const int32_t* A = acc.data_ptr<int32_t>();
  const float* XS = xs.data_ptr<float>();
  const float* WS = ws.data_ptr<float>();
  const float* B = has_bias ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t m = 0; m < M; ++m) rescale_row(A + m * N, XS[m], WS, B, Y + m * N, N);
  return y;
}

// The middle of a gated int8 MLP in one pass per row: acc [M, 2I] int32 (the gate|up GEMM)
// -> rescale as rescale_int8_acc -> silu(gate) * up as silu_mul -> quantize as
// quantize_rows_int8 -> (q [M, I] int8, scale [M]). The same fp32 operations as those three
// ops one after the other, so the codes are identical; the fp32 rows never leave L1.
std::vector<torch::Tensor> rescale_silu_mul_quantize(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                                                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(acc.scalar_type() == torch::kInt32 && acc.dim() == 2 && acc.is_contiguous() && acc.size(1) % 2 == 0,
              "rescale_silu_mul_quantize: acc must be a contiguous 2-D int32 tensor with an even width");
  const int64_t M = acc.size(0), N = acc.size(1), I = N / 2;
  TORCH_CHECK(x_scale.numel() == M && w_scale.numel() == N, "rescale_silu_mul_quantize: scale sizes");
  const bool has_bias = bias.has_value() && bias->defined();
  auto xs = x_scale.contiguous(), ws = w_scale.contiguous();
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  auto q = torch::empty({M, I}, acc.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, acc.options().dtype(torch::kFloat32));
  const int32_t* A = acc.data_ptr<int32_t>();
  const float* XS = xs.data_ptr<float>();
  const float* WS = ws.data_ptr<float>();
  const float* B = has_bias ? b.data_ptr<float>() : nullptr;
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
  radixray_int8::rescale_silu_mul_quantize_rows(A, M, I, XS, WS, B, Q, S);
  return {q, s};
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("quantize_rows_int8(Tensor x) -> Tensor[]");
  m.def("rescale_int8_acc(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias) -> Tensor");
  m.def("rescale_silu_mul_quantize(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias) -> Tensor[]");
  m.def("int8_gemm_small_m(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("rescale_int8_acc", &rescale_int8_acc);
  m.impl("rescale_silu_mul_quantize", &rescale_silu_mul_quantize);
  m.impl("int8_gemm_small_m", &int8_gemm_small_m);
}
