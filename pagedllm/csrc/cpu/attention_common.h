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

// What both kernels read off their tensors: the head geometry, the cache view, and the rows of
// the query, the output, each kv head's K/V cache and each sequence's block table. query / out
// are [T, H, D] (unit stride over D), caches [KVH, NB, rows, D], block_tables [S, max_blocks].
template <typename T, typename C>
struct AttentionOperands {
  int H, D, KVH, G;  // query heads, head dim, kv heads, query heads per kv head
  CacheView cv;
  const int64_t* seq_lens;

  AttentionOperands(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens_)
      : H(static_cast<int>(query.size(1))),
        D(static_cast<int>(query.size(2))),
        KVH(static_cast<int>(key_cache.size(0))),
        G(H / KVH),
        cv(cache_view<C>(key_cache)),
        seq_lens(seq_lens_.data_ptr<int64_t>()),
        q_(query.data_ptr<T>()),
        o_(out.data_ptr<T>()),
        k_(static_cast<const C*>(key_cache.data_ptr())),
        v_(static_cast<const C*>(value_cache.data_ptr())),
        tables_(block_tables.data_ptr<int64_t>()),
        table_width_(block_tables.size(1)),
        q_s0_(query.stride(0)),
        q_s1_(query.stride(1)),
        o_s0_(out.stride(0)),
        o_s1_(out.stride(1)) {}

  const T* query_row(int64_t token, int head) const { return q_ + token * q_s0_ + head * q_s1_; }
  T* out_row(int64_t token, int head) const { return o_ + token * o_s0_ + head * o_s1_; }
  const C* keys(int kv_head) const { return k_ + kv_head * cv.head_stride; }
  const C* values(int kv_head) const { return v_ + kv_head * cv.head_stride; }
  const int64_t* table(int64_t seq) const { return tables_ + seq * table_width_; }

 private:
  const T* q_;
  T* o_;
  const C* k_;
  const C* v_;
  const int64_t* tables_;
  int64_t table_width_, q_s0_, q_s1_, o_s0_, o_s1_;
};

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
