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
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kCols = 16;  // output columns per packed block (one zmm of int32)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

// acc += per-lane dot products of 4 unsigned bytes of a with 4 signed bytes of w. Written in
// asm: GCC 12 copies the accumulator before every _mm512_dpbusd_epi32 and spills the copies
// to the stack inside the loop, which halved this kernel's speed.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
  return acc;
}

// MT rows x NB column blocks of Y. xu: MT rows of Kp unsigned bytes (stride Kp); wp: the
// first of NB packed blocks (stride Kp * 16 bytes); comp: their columns' corrections.
template <int MT, int NB>
void vnni_tile(const uint8_t* xu, int64_t Kp, const int8_t* wp, const int32_t* comp, int32_t* y,
               int64_t ldy, int64_t n0, int64_t N) {
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
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j * kCols;
    const __mmask16 mask = n + kCols <= N ? static_cast<__mmask16>(0xffff)
                                          : static_cast<__mmask16>((1u << (N - n)) - 1u);
    const __m512i c = _mm512_loadu_si512(comp + n);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_epi32(y + m * ldy + n, mask, _mm512_sub_epi32(acc[m][j], c));
  }
}

// All rows against NB column blocks starting at block nb: row tiles of MT, then the rest.
template <int MT, int NB>
void vnni_rows(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp, int32_t* y,
               int64_t nb, int64_t N) {
  const int8_t* w = wp + nb * Kp * kCols;
  const int64_t n0 = nb * kCols;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) vnni_tile<MT, NB>(xu + m * Kp, Kp, w, comp, y + m * N, N, n0, N);
  const uint8_t* xr = xu + m * Kp;
  int32_t* yr = y + m * N;
  switch (M - m) {
    case 1: vnni_tile<1, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 2: vnni_tile<2, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 3: vnni_tile<3, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 4: vnni_tile<4, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 5: vnni_tile<5, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 6: vnni_tile<6, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    case 7: vnni_tile<7, NB>(xr, Kp, w, comp, yr, N, n0, N); break;
    default: break;
  }
}

// Groups of NB column blocks spread over the threads; a last partial group one block at a time.
template <int MT, int NB>
void vnni_gemm(const uint8_t* xu, int64_t M, int64_t Kp, const int8_t* wp, const int32_t* comp, int32_t* y,
               int64_t N) {
  const int64_t blocks = (N + kCols - 1) / kCols;
  const int64_t groups = blocks / NB;
  const int64_t tail = blocks - groups * NB;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups + tail; ++g) {
    if (g < groups) vnni_rows<MT, NB>(xu, M, Kp, wp, comp, y, g * NB, N);
    else vnni_rows<MT, 1>(xu, M, Kp, wp, comp, y, groups * NB + (g - groups), N);
  }
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

// x [M, K] int8, (packed, comp) from int8_vnni_pack of a [N, K] weight -> [M, N] int32,
// the same integers as torch._int_mm(x, w.t()).
torch::Tensor int8_vnni_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, int64_t N) {
  TORCH_CHECK(int8_vnni_supported(), "int8_vnni_gemm: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(x.scalar_type() == torch::kInt8 && x.dim() == 2, "int8_vnni_gemm: x must be a 2-D int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 3) / 4 * 4, blocks = (N + kCols - 1) / kCols;
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(0) == blocks && packed.size(1) == Kp * kCols,
              "int8_vnni_gemm: packed weight does not match x's K = ", K, " and N = ", N);
  TORCH_CHECK(comp.scalar_type() == torch::kInt32 && comp.numel() == blocks * kCols, "int8_vnni_gemm: comp size");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  if (M == 0) return y;
  // activations to unsigned (flip the sign bit = add 128), rows padded to Kp with code 0
  std::vector<uint8_t> xu(static_cast<size_t>(M * Kp), 0x80);
  const int8_t* X = x.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xu[m * Kp + k] = static_cast<uint8_t>(X[m * K + k]) ^ 0x80;
  const int8_t* P = packed.data_ptr<int8_t>();
  const int32_t* C = comp.data_ptr<int32_t>();
  int32_t* Y = y.data_ptr<int32_t>();
  // 8 x 3 tiles: 24 accumulators, 3 weight registers and a broadcast of the 32; with at
  // most 4 rows, 4 blocks a group (16 accumulators at most)
  if (M >= 5) vnni_gemm<8, 3>(xu.data(), M, Kp, P, C, Y, N);
  else vnni_gemm<8, 4>(xu.data(), M, Kp, P, C, Y, N);
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("int8_vnni_supported() -> bool", &int8_vnni_supported);  // no tensors: a catch-all kernel
  m.def("int8_vnni_pack(Tensor w) -> Tensor[]");
  m.def("int8_vnni_gemm(Tensor x, Tensor packed, Tensor comp, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("int8_vnni_pack", &int8_vnni_pack);
  m.impl("int8_vnni_gemm", &int8_vnni_gemm);
}
