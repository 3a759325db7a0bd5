// Fused fp32 CPU kernels for the decode path (AVX2 + FMA, OpenMP).
// Each op has a pure-torch reference in radixray/kernels/cpu_ops.py and a test
// comparing the two. Shapes are checked here; dtypes must be float32.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <cmath>
#include <vector>

#include "simd.h"

using namespace radixray_simd;

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// y[M,N] = x[M,K] @ w[N,K]^T for decode-sized M (the model uses BLAS above 64 rows).
// Every thread streams its share of W rows from memory once.
//
// M >= 4: 4 input rows x 3 weight rows per register block (12 accumulators): for M >= 4
// this is compute-bound, and the 3 W rows are reused from L1 across all M rows.
void linear_4x3(const float* X, const float* W, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / 3;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * 3;
    const float* w0 = W + n0 * K;
    const float* w1 = w0 + K;
    const float* w2 = w1 + K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      const float* x0 = X + m * K;
      const float* x1 = x0 + K;
      const float* x2 = x1 + K;
      const float* x3 = x2 + K;
      __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
      __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
      for (int64_t k = 0; k < K; k += 8) {
        __m256 b0 = _mm256_loadu_ps(w0 + k), b1 = _mm256_loadu_ps(w1 + k), b2 = _mm256_loadu_ps(w2 + k);
        __m256 a = _mm256_loadu_ps(x0 + k);
        c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01); c02 = _mm256_fmadd_ps(a, b2, c02);
        a = _mm256_loadu_ps(x1 + k);
        c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11); c12 = _mm256_fmadd_ps(a, b2, c12);
        a = _mm256_loadu_ps(x2 + k);
        c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21); c22 = _mm256_fmadd_ps(a, b2, c22);
        a = _mm256_loadu_ps(x3 + k);
        c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31); c32 = _mm256_fmadd_ps(a, b2, c32);
      }
      float* y = Y + m * N + n0;
      y[0] = hsum(c00); y[1] = hsum(c01); y[2] = hsum(c02); y += N;
      y[0] = hsum(c10); y[1] = hsum(c11); y[2] = hsum(c12); y += N;
      y[0] = hsum(c20); y[1] = hsum(c21); y[2] = hsum(c22); y += N;
      y[0] = hsum(c30); y[1] = hsum(c31); y[2] = hsum(c32);
    }
    for (; m < M; ++m) {
      const float* xm = X + m * K;
      float* y = Y + m * N + n0;
      y[0] = dot(xm, w0, K); y[1] = dot(xm, w1, K); y[2] = dot(xm, w2, K);
    }
  }
  for (int64_t n = blocks * 3; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) Y[m * N + n] = dot(X + m * K, W + n * K, K);
}

// M < 4: each block of 4 W rows is applied to every input row (2 at a time) while in L1.
torch::Tensor linear_small_m(torch::Tensor x, torch::Tensor w) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "linear: shape mismatch");
  TORCH_CHECK(w.is_contiguous(), "linear: weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  if (M >= 4 && K % 8 == 0) {
    linear_4x3(X, W, Y, M, K, N);
    return y;
  }
  // M < 4: memory-bound; stream each block of 4 W rows once against every input row.
  const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * 4;
    if (n0 + 4 <= N && K % 8 == 0) {
      const float* w0 = W + n0 * K;
      const float* w1 = w0 + K;
      const float* w2 = w1 + K;
      const float* w3 = w2 + K;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) {
        const float* xa = X + m * K;
        const float* xb = xa + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
          __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
          __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
          __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
          a0 = _mm256_fmadd_ps(va, v0, a0); a1 = _mm256_fmadd_ps(va, v1, a1);
          a2 = _mm256_fmadd_ps(va, v2, a2); a3 = _mm256_fmadd_ps(va, v3, a3);
          b0 = _mm256_fmadd_ps(vb, v0, b0); b1 = _mm256_fmadd_ps(vb, v1, b1);
          b2 = _mm256_fmadd_ps(vb, v2, b2); b3 = _mm256_fmadd_ps(vb, v3, b3);
        }
        float* ya = Y + m * N + n0;
        float* yb = ya + N;
        ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
        yb[0] = hsum(b0); yb[1] = hsum(b1); yb[2] = hsum(b2); yb[3] = hsum(b3);
      }
      for (; m < M; ++m) {
        const float* xa = X + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
          __m256 va = _mm256_loadu_ps(xa + k);
          a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + k), a0);
          a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + k), a1);
          a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + k), a2);
          a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + k), a3);
        }
        float* ya = Y + m * N + n0;
        ya[0] = hsum(a0); ya[1] = hsum(a1); ya[2] = hsum(a2); ya[3] = hsum(a3);
      }
    } else {
      for (int64_t n = n0; n < std::min(n0 + 4, N); ++n)
        for (int64_t m = 0; m < M; ++m) Y[m * N + n] = dot(X + m * K, W + n * K, K);
    }
  }
  return y;
}

// y = w * x / sqrt(mean(x^2) + eps) for one row of D values.
inline void norm_row(const float* x, const float* w, float* y, int64_t D, double eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t k = 0; k < D; ++k) y[k] = w[k] * (x[k] * inv);
}

// RMSNorm over the last dim, in fp32: w * x / sqrt(mean(x^2) + eps).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  x = x.contiguous();
  const int64_t D = x.size(-1), R = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "rms_norm: weight size mismatch");
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* Wt = w.contiguous().data_ptr<float>();
  float* Y = y.data_ptr<float>();
#pragma omp parallel for schedule(static) if (R > 64)
  for (int64_t r = 0; r < R; ++r) norm_row(X + r * D, Wt, Y + r * D, D, eps);
  return y;
}

// h = residual + x and y = rms_norm(h) * w in one pass over each row (the decoder's residual
// stream: one read of both inputs instead of an add, then a norm reading h back). h holds the
// same bits as torch's residual + x, y the same as rms_norm(h).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(w, "w");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  x = x.contiguous();
  residual = residual.contiguous();
  const int64_t D = x.size(-1), R = x.numel() / D;
  TORCH_CHECK(w.numel() == D, "add_rms_norm: weight size mismatch");
  auto h = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* Res = residual.data_ptr<float>();
  const float* Wt = w.contiguous().data_ptr<float>();
  float* H = h.data_ptr<float>();
  float* Y = y.data_ptr<float>();
#pragma omp parallel for schedule(static) if (R > 64)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = X + r * D;
    const float* rr = Res + r * D;
    float* hr = H + r * D;
    for (int64_t k = 0; k < D; ++k) hr[k] = rr[k] + xr[k];
    norm_row(hr, Wt, Y + r * D, D, eps);
  }
  return {h, y};
}

// silu(a) * b where gate_up = [a | b] along the last dim.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  const int64_t D2 = gate_up.size(-1), D = D2 / 2, R = gate_up.numel() / D2;
  auto y = torch::empty({R, D}, gate_up.options());
  const float* G = gate_up.data_ptr<float>();
  float* Y = y.data_ptr<float>();
#pragma omp parallel for schedule(static) if (R > 16)
  for (int64_t r = 0; r < R; ++r) {
    const float* a = G + r * D2;
    silu_mul_row(a, a + D, Y + r * D, D);
  }
  return y;
}

// Rotary embedding, rotate-half layout: out = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = [-x2, x1]. x is [T, n, D] with any row stride (a view into the
// fused qkv output); cos/sin are [P, D] tables indexed by positions [T].
torch::Tensor rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x must be [T, n, D] with dense heads");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "rotary: positions must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary: tables must be contiguous");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
  auto out = torch::empty({T, NH, D}, x.options());
  const float* X = x.data_ptr<float>();
  const int64_t* P = positions.contiguous().data_ptr<int64_t>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  float* O = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (T > 16)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = C + P[t] * D;
    const float* s = S + P[t] * D;
    for (int64_t h = 0; h < NH; ++h) {
      const float* xi = X + t * row + h * D;
      float* o = O + (t * NH + h) * D;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {  // x * cos + rotate_half(x) * sin, 8 lanes of each half
        const __m256 x1 = _mm256_loadu_ps(xi + i), x2 = _mm256_loadu_ps(xi + i + half);
        _mm256_storeu_ps(o + i, _mm256_fnmadd_ps(x2, _mm256_loadu_ps(s + i), _mm256_mul_ps(x1, _mm256_loadu_ps(c + i))));
        _mm256_storeu_ps(o + i + half,
                         _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + i + half), _mm256_mul_ps(x2, _mm256_loadu_ps(c + i + half))));
      }
      for (; i < half; ++i) {
        const float a = xi[i] * c[i];
        const float b = -xi[i + half] * s[i];
        o[i] = a + b;
        const float a2 = xi[i + half] * c[i + half];
        const float b2 = xi[i] * s[i + half];
        o[i + half] = a2 + b2;
      }
    }
  }
  return out;
}

// Registered as dispatcher ops (torch.ops.radixray.*) so profilers see them by name.
TORCH_LIBRARY(radixray, m) {
  m.def("linear_small_m(Tensor x, Tensor w) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> Tensor[]");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
