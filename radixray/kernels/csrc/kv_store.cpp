// Writing a layer's new keys and values into the paged KV pool in one call: the cast to the
// pool's element type (fp32, bf16, fp8 e5m2) and the scatter to the tokens' slots, for K and
// V together. The same values as KVPool's torch path (to_pool_dtype, then index_copy_):
// c10's casts (fp8 saturating at +-57,344 first), 8 lanes at a time in AVX2 integer code
// that follows c10's bit recipes, the row tails through c10 itself. Reference and comparison:
// radixray/engine/mem_cache/pool.py, tests/cpu/test_kv_cache_dtype.py.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr float kFp8E5m2Max = 57344.0f;

template <typename T>
inline T to_pool(float x) {
  return T(x);
}

template <>
inline c10::Float8_e5m2 to_pool<c10::Float8_e5m2>(float x) {
  return c10::Float8_e5m2(std::min(std::max(x, -kFp8E5m2Max), kFp8E5m2Max));
}

// c10's float -> Float8_e5m2 on 8 lanes, x already clamped to +-57,344 (NaN kept): the bit
// code of each lane in its low byte. Rounds to nearest even as c10::Float8_e5m2 does.
inline __m256i fp8_codes(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i denorm_mask = _mm256_set1_epi32(134 << 23);
  const __m256i denorm = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
  __m256i normal = _mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>((15u - 127u) << 23) + 0xFFFFF));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, _mm256_and_si256(_mm256_srli_epi32(a, 21), _mm256_set1_epi32(1))), 21);
  __m256i r = _mm256_blendv_epi8(normal, denorm, _mm256_cmpgt_epi32(_mm256_set1_epi32(113 << 23), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_and_si256(_mm256_or_si256(r, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xFF));
}

// c10's float -> BFloat16 on 8 lanes (round to nearest even, NaN -> 0x7FC0): the bits in the low half.
inline __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// 8 int32 lanes (each < 65,536) -> 8 uint16 in order.
inline __m128i narrow16(__m256i v) {
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  return _mm256_castsi256_si128(p);
}

// One row of n values into the pool's type at dst; `rounded` (or null) receives the stored
// values widened back to fp32. 8 lanes at a time, the rest through c10's casts: same bits.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n, float* rounded) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    const __m256 lo = _mm256_set1_ps(-kFp8E5m2Max), hi = _mm256_set1_ps(kFp8E5m2Max);
    for (; d + 8 <= n; d += 8) {
      // max/min return their second operand when one is NaN: NaN stays NaN, as in to_pool
      const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + d)));
      const __m128i halves = narrow16(_mm256_slli_epi32(fp8_codes(x), 8));  // e5m2 is an fp16's high byte
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packus_epi16(_mm_srli_epi16(halves, 8), halves));
      if (rounded) _mm256_storeu_ps(rounded + d, _mm256_cvtph_ps(halves));
    }
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; d + 8 <= n; d += 8) {
      const __m256i b = bf16_bits(_mm256_loadu_ps(src + d));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), narrow16(b));
      if (rounded) _mm256_storeu_ps(rounded + d, _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    }
  }
  for (; d < n; ++d) {
    dst[d] = to_pool<T>(src[d]);
    if (rounded) rounded[d] = static_cast<float>(dst[d]);
  }
}

// rows [n, row] of src -> buf rows slots[i] (and their stored values into rounded [n, row], or null)
template <typename T>
void store_rows(T* buf, const int64_t* slots, const float* src, int64_t n, int64_t row, float* rounded) {
#pragma omp parallel for schedule(static) if (n * row > 65536)
  for (int64_t i = 0; i < n; ++i) store_row(buf + slots[i] * row, src + i * row, row, rounded ? rounded + i * row : nullptr);
}

template <typename T>
void store_kv(torch::Tensor& kb, torch::Tensor& vb, const int64_t* slots, const torch::Tensor& k,
              const torch::Tensor& v, int64_t n, int64_t row, float* k_rounded, float* v_rounded) {
  store_rows(kb.data_ptr<T>(), slots, k.data_ptr<float>(), n, row, k_rounded);
  store_rows(vb.data_ptr<T>(), slots, v.data_ptr<float>(), n, row, v_rounded);
}

// Checks the arguments, then stores; k_rounded / v_rounded as store_rows (or null).
void store_checked(torch::Tensor& k_buf, torch::Tensor& v_buf, torch::Tensor slots, torch::Tensor k, torch::Tensor v,
                   torch::Tensor* k_rounded, torch::Tensor* v_rounded) {
  const auto t = k_buf.scalar_type();
  TORCH_CHECK(v_buf.scalar_type() == t && k_buf.is_contiguous() && v_buf.is_contiguous() &&
              k_buf.sizes() == v_buf.sizes() && k_buf.dim() == 3,
              "kv_store: k_buf and v_buf must be contiguous [S, KVH, D] tensors of one dtype");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "kv_store: k and v must be float32");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1, "kv_store: slots must be 1-D int64");
  const int64_t n = slots.size(0), S = k_buf.size(0), row = k_buf.size(1) * k_buf.size(2);
  TORCH_CHECK(k.numel() == n * row && v.numel() == n * row,
              "kv_store: k and v must hold ", n, " rows of ", row, " values");
  slots = slots.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sl[i] >= 0 && sl[i] < S, "kv_store: slots[", i, "]=", sl[i], " outside [0, ", S, ")");
  if (k_rounded) {
    *k_rounded = torch::empty(k.sizes(), k.options());
    *v_rounded = torch::empty(v.sizes(), v.options());
  }
  float* kr = k_rounded ? k_rounded->data_ptr<float>() : nullptr;
  float* vr = v_rounded ? v_rounded->data_ptr<float>() : nullptr;
  if (t == torch::kFloat32) store_kv<float>(k_buf, v_buf, sl, k, v, n, row, kr, vr);
  else if (t == torch::kBFloat16) store_kv<c10::BFloat16>(k_buf, v_buf, sl, k, v, n, row, kr, vr);
  else if (t == torch::kFloat8_e5m2) store_kv<c10::Float8_e5m2>(k_buf, v_buf, sl, k, v, n, row, kr, vr);
  else TORCH_CHECK(false, "kv_store: pool dtype must be float32, bfloat16 or float8_e5m2, got ", t);
}

}  // namespace

// k_buf / v_buf [S, KVH, D] (fp32, bf16 or fp8 e5m2, one dtype), slots [n] int64 in [0, S),
// k / v [n, KVH, D] fp32: buf[slots[i]] = cast(k[i]) (and v).
void kv_store(torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  store_checked(k_buf, v_buf, slots, k, v, nullptr, nullptr);
}

// kv_store, and the stored keys and values back as fp32 [n, KVH, D] (what attention over the
// pool will read): the extend path's round trip through the pool's dtype in one pass.
std::vector<torch::Tensor> kv_store_rounded(torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                                            torch::Tensor k, torch::Tensor v) {
  torch::Tensor kr, vr;
  store_checked(k_buf, v_buf, slots, k, v, &kr, &vr);
  return {kr, vr};
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("kv_store(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("kv_store_rounded(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("kv_store", &kv_store);
  m.impl("kv_store_rounded", &kv_store_rounded);
}
