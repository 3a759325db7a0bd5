// Writing a layer's new keys and values into the paged KV pool in one call: the cast to the
// pool's element type (fp32, bf16, fp8 e5m2) and the scatter to the tokens' slots, for K and
// V together. The same values as KVPool's torch path (to_pool_dtype, then index_copy_):
// the casts are c10's own, fp8 saturating at +-57,344 first. Reference and comparison:
// radixray/engine/memory.py, tests/cpu/test_kv_cache_dtype.py.
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>

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

// rows [n, row] of src -> buf rows slots[i]
template <typename T>
void store_rows(T* buf, const int64_t* slots, const float* src, int64_t n, int64_t row) {
#pragma omp parallel for schedule(static) if (n * row > 65536)
  for (int64_t i = 0; i < n; ++i) {
    T* dst = buf + slots[i] * row;
    const float* s = src + i * row;
    for (int64_t d = 0; d < row; ++d) dst[d] = to_pool<T>(s[d]);
  }
}

template <typename T>
void store_kv(torch::Tensor& kb, torch::Tensor& vb, const int64_t* slots, const torch::Tensor& k,
              const torch::Tensor& v, int64_t n, int64_t row) {
  store_rows(kb.data_ptr<T>(), slots, k.data_ptr<float>(), n, row);
  store_rows(vb.data_ptr<T>(), slots, v.data_ptr<float>(), n, row);
}

}  // namespace

// k_buf / v_buf [S, KVH, D] (fp32, bf16 or fp8 e5m2, one dtype), slots [n] int64 in [0, S),
// k / v [n, KVH, D] fp32: buf[slots[i]] = cast(k[i]) (and v).
void kv_store(torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
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
  if (t == torch::kFloat32) store_kv<float>(k_buf, v_buf, sl, k, v, n, row);
  else if (t == torch::kBFloat16) store_kv<c10::BFloat16>(k_buf, v_buf, sl, k, v, n, row);
  else if (t == torch::kFloat8_e5m2) store_kv<c10::Float8_e5m2>(k_buf, v_buf, sl, k, v, n, row);
  else TORCH_CHECK(false, "kv_store: pool dtype must be float32, bfloat16 or float8_e5m2, got ", t);
}

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("kv_store(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("kv_store", &kv_store);
}
