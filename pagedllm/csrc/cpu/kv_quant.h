// Quantized KV cache blocks (int8, fp8 e4m3): layout, scales and the quantize rule, shared by the
// attention kernels (paged_attention.cpp) and the cache write (kv_cache_ops.cpp).
//
// A quantized cache is [KVH, NB, block_size + 1, D]: rows 0 .. block_size - 1 hold token codes,
// row block_size holds the block-head's float32 scale in its first 4 bytes (so a block copy moves
// its scale with it). Value = code * scale; scale = running absmax / qmax (127 int8, 448 fp8).
// The Python twin is pagedllm/attention/kv_quant.py; both produce the same bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace pagedllm {
namespace kvq {

template <typename C>
constexpr bool kQuantized = std::is_same_v<C, int8_t> || std::is_same_v<C, vec::fp8>;

template <typename C>
constexpr float kQmax = std::is_same_v<C, int8_t> ? 127.0f : 448.0f;

// Cache geometry of one layer: rows per block include the scale row when quantized.
struct CacheView {
  int64_t head_stride;  // num_blocks * rows * D
  int block_size;       // tokens per block
  int rows;             // block_size, or block_size + 1 with a scale row
  int D;
};

template <typename C>
inline float block_scale(const C* head_base, int64_t block, const CacheView& cv) {
  if constexpr (kQuantized<C>) {
    float s;
    std::memcpy(&s, head_base + (block * cv.rows + cv.block_size) * cv.D, sizeof(float));
    return s;
  } else {
    return 1.0f;
  }
}

// Code for v (already divided by the scale): clamp to +-qmax, round to nearest even.
template <typename C>
inline C quantize(float v) {
  v = std::min(std::max(v, -kQmax<C>), kQmax<C>);
  if constexpr (std::is_same_v<C, int8_t>)
    return static_cast<int8_t>(std::nearbyint(v));
  else
    return C(v);
}

inline bool is_quantized(at::ScalarType t) {
  return t == at::kChar || t == at::ScalarType::Float8_e4m3fn;
}

// Both caches [KVH, NB, rows, D], contiguous, same dtype, on the CPU; a quantized cache has a
// scale row (rows >= 2) and D % 4 == 0 (the float32 scale is read from the row's first 4 bytes).
inline void check_cache(const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes(), "caches must be [KVH, NB, BS, D]");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "key/value cache dtypes differ");
  TORCH_CHECK(kc.device().is_cpu() && vc.device().is_cpu(), "caches must be on the CPU");
  if (is_quantized(kc.scalar_type()))
    TORCH_CHECK(kc.size(2) >= 2 && kc.size(3) % 4 == 0,
                "quantized caches need a scale row and head_dim % 4 == 0");
}

// Calls f(T{}, C{}) with T the element type of `query` (float, bf16) and C that of `cache`
// (float, bf16, int8, fp8 e4m3).
template <typename F>
void dispatch_types(const at::Tensor& query, const at::Tensor& cache, const char* op, F&& f) {
  auto with_cache = [&](auto t) {
    switch (cache.scalar_type()) {
      case at::kFloat:
        return f(t, float{});
      case at::kBFloat16:
        return f(t, vec::bf16{});
      case at::kChar:
        return f(t, int8_t{});
      case at::ScalarType::Float8_e4m3fn:
        return f(t, vec::fp8{});
      default:
        TORCH_CHECK(false, op, ": unsupported KV cache dtype ", cache.scalar_type());
    }
  };
  if (query.scalar_type() == at::kFloat)
    with_cache(float{});
  else if (query.scalar_type() == at::kBFloat16)
    with_cache(vec::bf16{});
  else
    TORCH_CHECK(false, op, ": only float32 and bfloat16 activations");
}

}  // namespace kvq
}  // namespace pagedllm
