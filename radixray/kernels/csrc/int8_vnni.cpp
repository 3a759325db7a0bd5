// int8 x int8 -> int32 GEMM with AVX-512 VNNI on prepacked weights, for CPUs that have it
// (checked at run time; the rest of the extension is built for AVX2). torch._int_mm hands
// oneDNN a plain [K, N] weight on every call; here the weight is laid out once, at load
// time, in the order the dot-product instruction reads it, and streamed once per call.
//
// vpdpbusd multiplies unsigned bytes by signed bytes, four at a time into an int32 lane.
// The activations are shifted to unsigned (x + 128) and the shift is taken back per output
// column: sum_k (x + 128) * w = sum_k x * w + 128 * sum_k w, with 128 * sum_k w[n, k]
// computed at pack time. The products cannot overflow (|sum| <= K * 255 * 127), so the
// result is the same integers as torch._int_mm. Reference: tests/cpu/test_int8_vnni.py.
//
// int8_vnni_linear is the whole int8 linear in one call: the rows quantized on the way in
// and the accumulators rescaled to fp32 on the way out, with the same row functions
// (int8_rows.h) as the separate ops, so the result has the same bits.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_amx.h"
#include "int8_gated_amx.h"
#include "int8_rows.h"

namespace {

// Where a tile's int32 results go (acc - comp, `width` valid columns from column n).
struct Int32Out {
  int32_t* y;
  int64_t ldy;
  void row(int64_t m, int64_t n, int64_t width, const int32_t* vals) const {
    std::memcpy(y + m * ldy + n, vals, static_cast<size_t>(width) * sizeof(int32_t));
  }
};

struct RescaledOut {  // y = (acc * x_scale[m]) * w_scale[n] (+ bias[n]), as rescale_int8_acc
  float* y;
  int64_t ldy;
  const float* x_scale;
  const float* w_scale;
  const float* bias;
  void row(int64_t m, int64_t n, int64_t width, const int32_t* vals) const {
    radixray_int8::rescale_row(vals, x_scale[m], w_scale + n, bias ? bias + n : nullptr, y + m * ldy + n, width);
  }
};

constexpr int64_t kCols = 16;  // output columns per packed block (one zmm of int32)
int64_t g_amx_min_rows = 12;  // rows from which AMX tiles run the packed GEMM (where the CPU has them; below, VNNI is faster)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

// acc += per-lane dot products of 4 unsigned bytes of a with 4 signed bytes of w. Written in
// asm: GCC 12 copies the accumulator before every _mm512_dpbusd_epi32 and spills the copies
// to the stack inside the loop, which halved this kernel's speed.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
  return acc;
}

// Rows m0..m0+MT-1 x NB column blocks from column n0. xu: the rows' Kp unsigned bytes each
// (stride Kp); wp: the first of NB packed blocks (stride Kp * 16 bytes); comp: per column.
template <int MT, int NB, class Out>
void vnni_tile(const uint8_t* xu, int64_t Kp, const int8_t* wp, const int32_t* comp, const Out& out,
               int64_t m0, int64_t n0, int64_t N) {
  __m512i acc[MT][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  const int64_t block = Kp * kCols;
  for (int64_t k = 0; k < Kp; k += 4) {
    __m512i w[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_si512(wp + j * block + k * kCols);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      int32_t four;
      std::memcpy(&four, xu + m * Kp + k, 4);
      const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = dpbusd(acc[m][j], a, w[j]);
    }
  }
  alignas(64) int32_t vals[MT][NB * kCols];
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const __m512i c = _mm512_loadu_si512(comp + n0 + j * kCols);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) _mm512_store_si512(vals[m] + j * kCols, _mm512_sub_epi32(acc[m][j], c));
  }
  const int64_t width = std::min<int64_t>(NB * kCols, N - n0);
  for (int m = 0; m < MT; ++m) out.row(m0 + m, n0, width, vals[m]);
}

// All rows against NB column blocks starting at block nb: row tiles of MT, then the rest.
template <int MT, int NB, class Out>
void vnni_rows(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp, const Out& out,
               int64_t nb, int64_t N) {
  const int8_t* w = wp + nb * Kp * kCols;
  const int64_t n0 = nb * kCols;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) vnni_tile<MT, NB>(xu + m * Kp, Kp, w, comp, out, m, n0, N);
  const uint8_t* xr = xu + m * Kp;
  switch (M - m) {
    case 1: vnni_tile<1, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 2: vnni_tile<2, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 3: vnni_tile<3, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 4: vnni_tile<4, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 5: vnni_tile<5, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 6: vnni_tile<6, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    case 7: vnni_tile<7, NB>(xr, Kp, w, comp, out, m, n0, N); break;
    default: break;
  }
}

// Groups of NB column blocks spread over the threads; a last partial group one block at a time.
template <int MT, int NB, class Out>
void vnni_gemm_blocks(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp,
                      const Out& out, int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols;
  const int64_t groups = blocks / NB;
  const int64_t tail = blocks - groups * NB;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups + tail; ++g) {
    if (g < groups) vnni_rows<MT, NB>(xu, M, Kp, wp, comp, out, g * NB, N);
    else vnni_rows<MT, 1>(xu, M, Kp, wp, comp, out, groups * NB + (g - groups), N);
  }
}

// 8 x 3 tiles: 24 accumulators, 3 weight registers and a broadcast of the 32; with at most
// 4 rows, 4 blocks a group (16 accumulators at most)
template <class Out>
void vnni_gemm(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp, const Out& out,
               int64_t N) {
  if (M >= g_amx_min_rows && Kp % radixray_amx::kK == 0 && radixray_amx::amx_int8_usable())
    radixray_amx::amx_gemm(xu, M, Kp, wp, comp, out, N);
  else if (M >= 5) vnni_gemm_blocks<8, 3>(xu, M, Kp, wp, comp, out, N);
  else vnni_gemm_blocks<8, 4>(xu, M, Kp, wp, comp, out, N);
}

#pragma GCC pop_options

}  // namespace

bool int8_vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// w [N, K] int8 -> (packed [ceil(N/16), Kp * 16] int8, comp [ceil(N/16) * 16] int32), where
// Kp = K rounded up to 4: block b holds columns 16b..16b+15 as [Kp / 4][16][4] bytes (zero
// padding), comp[n] = 128 * sum_k w[n, k].
std::vector<torch::Tensor> int8_vnni_pack(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.dim() == 2, "int8_vnni_pack: w must be a 2-D int8 tensor");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 3) / 4 * 4, blocks = (N + kCols - 1) / kCols;
  auto packed = torch::zeros({blocks, Kp * kCols}, w.options());
  auto comp = torch::zeros({blocks * kCols}, w.options().dtype(torch::kInt32));
  const int8_t* W = w.data_ptr<int8_t>();
  int8_t* P = packed.data_ptr<int8_t>();
  int32_t* C = comp.data_ptr<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    int8_t* block = P + (n / kCols) * Kp * kCols;
    const int64_t col = n % kCols;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      block[(k / 4) * kCols * 4 + col * 4 + k % 4] = W[n * K + k];
      sum += W[n * K + k];
    }
    C[n] = 128 * sum;
  }
  return {packed, comp};
}

namespace {

int64_t check_packed(const torch::Tensor& packed, const torch::Tensor& comp, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(int8_vnni_supported(), op, ": this CPU has no AVX-512 VNNI");
  const int64_t Kp = (K + 3) / 4 * 4, blocks = (N + kCols - 1) / kCols;
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(0) == blocks && packed.size(1) == Kp * kCols,
              op, ": packed weight does not match x's K = ", K, " and N = ", N);
  TORCH_CHECK(comp.scalar_type() == torch::kInt32 && comp.numel() == blocks * kCols, op, ": comp size");
  return Kp;
}

// The rescale's per-column operands, checked: w_scale [N] fp32, bias [N] fp32 or none.
struct Rescale {
  torch::Tensor ws, bias;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

Rescale check_rescale(const torch::Tensor& w_scale, const c10::optional<torch::Tensor>& bias, int64_t N,
                      const char* op) {
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == N, op, ": w_scale must be float32 [N]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == torch::kFloat32 && bias->numel() == N),
              op, ": bias must be float32 [N]");
  return {w_scale.contiguous(), has_bias ? bias->contiguous() : torch::Tensor()};
}

// The GEMMs' operand: rows of Kp unsigned bytes (code + 128; code 0 in the padding), with
// the rows' scales. From int8 codes (x_scale given) the sign bits are flipped; from fp32
// rows (x_scale undefined) each row is quantized as quantize_rows_int8 straight into that
// form. Rows in parallel.
struct Operand {
  std::vector<uint8_t> bytes;
  torch::Tensor scale;  // [M] fp32
};

Operand make_operand(const torch::Tensor& x, const torch::Tensor& x_scale, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1);
  Operand op{std::vector<uint8_t>(static_cast<size_t>(M * Kp)), x_scale};
  uint8_t* U = op.bytes.data();
  const bool codes = x.scalar_type() == torch::kInt8;
  if (!codes) op.scale = torch::empty({M}, x.options());
  const int8_t* Xq = codes ? x.data_ptr<int8_t>() : nullptr;
  const float* Xf = codes ? nullptr : x.data_ptr<float>();
  float* S = codes ? nullptr : op.scale.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* u = U + m * Kp;
    if (codes) {
      for (int64_t k = 0; k < K; ++k) u[k] = static_cast<uint8_t>(Xq[m * K + k]) ^ 0x80;
    } else {
      radixray_int8::quantize_row(Xf + m * K, reinterpret_cast<int8_t*>(u), S + m, K, 0x80);
    }
    std::memset(u + K, 0x80, static_cast<size_t>(Kp - K));
  }
  return op;
}

}  // namespace

// x [M, K] int8, (packed, comp) from int8_vnni_pack of a [N, K] weight -> [M, N] int32,
// the same integers as torch._int_mm(x, w.t()).
torch::Tensor int8_vnni_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, int64_t N) {
  TORCH_CHECK(x.scalar_type() == torch::kInt8 && x.dim() == 2, "int8_vnni_gemm: x must be a 2-D int8 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Kp = check_packed(packed, comp, K, N, "int8_vnni_gemm");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  if (M == 0) return y;
  const Operand xu = make_operand(x, torch::Tensor(), Kp);
  vnni_gemm(xu.bytes.data(), M, Kp, packed.data_ptr<int8_t>(), comp.data_ptr<int32_t>(),
            Int32Out{y.data_ptr<int32_t>(), N}, N);
  return y;
}

// The whole int8 linear -> [M, N] fp32. x is either fp32 [M, K] (quantized here per row, as
// quantize_rows_int8; x_scale None) or int8 codes [M, K] with their x_scale [M]. The
// accumulators are rescaled as rescale_int8_acc with w_scale [N] and bias [N] (optional).
torch::Tensor int8_vnni_linear(torch::Tensor x, c10::optional<torch::Tensor> x_scale, torch::Tensor packed,
                               torch::Tensor comp, torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                               int64_t N) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kInt8),
              "int8_vnni_linear: x must be a 2-D float32 or int8 tensor");
  const bool codes = x.scalar_type() == torch::kInt8;
  const bool has_scale = x_scale.has_value() && x_scale->defined();
  TORCH_CHECK(codes == has_scale, "int8_vnni_linear: x_scale goes with int8 x (and only with it)");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Kp = check_packed(packed, comp, K, N, "int8_vnni_linear");
  const Rescale rs = check_rescale(w_scale, bias, N, "int8_vnni_linear");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  if (M == 0) return y;
  torch::Tensor s;
  if (codes) {
    s = x_scale->contiguous();
    TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.numel() == M, "int8_vnni_linear: x_scale size");
  }
  const Operand xu = make_operand(x, s, Kp);
  const RescaledOut out{y.data_ptr<float>(), N, xu.scale.data_ptr<float>(), rs.ws.data_ptr<float>(), rs.bias_ptr()};
  vnni_gemm(xu.bytes.data(), M, Kp, packed.data_ptr<int8_t>(), comp.data_ptr<int32_t>(), out, N);
  return y;
}

// The first half of a gated int8 MLP: x [M, K] fp32, (packed, comp, w_scale, bias) the
// gate|up layer ([N = 2I, K] weight) -> (q [M, I] int8, scale [M]), the same codes as
// quantize_rows_int8 -> int8_vnni_gemm -> rescale_silu_mul_quantize. Fused on AMX tiles
// where gated_amx_applies (int8_gated_amx.h); otherwise those three steps, here in one call.
std::vector<torch::Tensor> int8_vnni_gated_codes(torch::Tensor x, torch::Tensor packed, torch::Tensor comp,
                                                 torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                                                 int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "int8_vnni_gated_codes: x must be 2-D float32");
  TORCH_CHECK(N % 2 == 0, "int8_vnni_gated_codes: N (gate | up columns) must be even, got ", N);
  const int64_t M = x.size(0), K = x.size(1), I = N / 2;
  const int64_t Kp = check_packed(packed, comp, K, N, "int8_vnni_gated_codes");
  const Rescale rs = check_rescale(w_scale, bias, N, "int8_vnni_gated_codes");
  x = x.contiguous();
  auto q = torch::empty({M, I}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, x.options());
  if (M == 0) return {q, s};
  const float* ws = rs.ws.data_ptr<float>();
  const float* b = rs.bias_ptr();
  int8_t* Q = q.data_ptr<int8_t>();
  float* S = s.data_ptr<float>();
  if (M >= g_amx_min_rows && radixray_amx::gated_amx_applies(M, Kp, I)) {
    radixray_amx::amx_gated_mlp(x.data_ptr<float>(), M, K, Kp, packed.data_ptr<int8_t>(), comp.data_ptr<int32_t>(),
                                ws, b, I, Q, S);
    return {q, s};
  }
  const Operand xu = make_operand(x, torch::Tensor(), Kp);
  std::vector<int32_t> acc(static_cast<size_t>(M * N));
  vnni_gemm(xu.bytes.data(), M, Kp, packed.data_ptr<int8_t>(), comp.data_ptr<int32_t>(), Int32Out{acc.data(), N}, N);
  radixray_int8::rescale_silu_mul_quantize_rows(acc.data(), M, I, xu.scale.data_ptr<float>(), ws, b, Q, S);
  return {q, s};
}

bool int8_amx_supported() { return radixray_amx::amx_int8_usable(); }
int64_t int8_set_amx_min_rows(int64_t rows) {
  const int64_t old = g_amx_min_rows;
  g_amx_min_rows = rows;
  return old;
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  // No tensors in these three: each is a catch-all kernel.
  m.def("int8_vnni_supported() -> bool", &int8_vnni_supported);
  m.def("int8_amx_supported() -> bool", &int8_amx_supported);
  m.def("int8_set_amx_min_rows(int rows) -> int", &int8_set_amx_min_rows);
  m.def("int8_vnni_pack(Tensor w) -> Tensor[]");
  m.def("int8_vnni_gemm(Tensor x, Tensor packed, Tensor comp, int N) -> Tensor");
  m.def("int8_vnni_linear(Tensor x, Tensor? x_scale, Tensor packed, Tensor comp, Tensor w_scale, Tensor? bias, "
        "int N) -> Tensor");
  m.def("int8_vnni_gated_codes(Tensor x, Tensor packed, Tensor comp, Tensor w_scale, Tensor? bias, int N) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("int8_vnni_pack", &int8_vnni_pack);
  m.impl("int8_vnni_gemm", &int8_vnni_gemm);
  m.impl("int8_vnni_linear", &int8_vnni_linear);
  m.impl("int8_vnni_gated_codes", &int8_vnni_gated_codes);
}
