// Internals the decode (paged_attention.cpp) and prefill (prefill_attention.cpp) kernels share:
// tile sizes, the cache geometry and the argument checks.
#pragma once
#include <ATen/core/Tensor.h>

#include <limits>

#include "kv_quant.h"

namespace pagedllm {
namespace attn {

constexpr int kTile = 128;      // keys per online-softmax step
constexpr int kQueryTile = 16;  // query tokens per prefill work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using kvq::block_scale;
using kvq::CacheView;
using kvq::dispatch_types;
using kvq::kQuantized;

// The geometry of a [KVH, NB, rows, D] cache of element type C (rows = block_size + 1 when C is
// quantized: the scale row).
template <typename C>
inline CacheView cache_view(const at::Tensor& cache) {
  const int rows = static_cast<int>(cache.size(2));
  const int D = static_cast<int>(cache.size(3));
  return {cache.size(1) * rows * D, kQuantized<C> ? rows - 1 : rows, rows, D};
}

// Shapes, strides and dtypes both attention ops require (TORCH_CHECK errors otherwise).
inline void check_attention_args(const at::Tensor& out, const at::Tensor& query,
                          const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  kvq::check_cache(key_cache, value_cache);
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, H, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0, "num_heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64");
}

}  // namespace attn
}  // namespace pagedllm
