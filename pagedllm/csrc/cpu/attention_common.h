// Internals the decode (paged_attention.cpp) and prefill (prefill_attention.cpp) kernels share:
// tile sizes, the cache geometry, the argument checks, and the pieces of the one order of
// arithmetic both follow for a query.
//
// Why one order: the same query must get the same output bits from either kernel. A token that
// was decoded is prefilled again after recompute preemption, scored with the others in a
// speculative verify pass, and is a decode again when run alone; any last-bit difference there
// turns into a different greedy token sooner or later, and much sooner under int8 / GGUF
// activation quantization, which rounds a last-bit change into a whole quantization step. So
// for a query at position p with visible keys [f, p]:
//   - keys are split at every multiple of partition_size (partitions; 0: none) and, inside a
//     partition, at every multiple of kTile (tiles), counted from position 0, not from f;
//   - a tile's scores are vec::dot_block pairs, its softmax step is the online update below
//     (max, rescale, exp_sub_sum), and V is accumulated over the tile's keys in position order
//     (masked keys of a prefill tile add exact zeros); with the bf16 tiles (attention_bf16.h),
//     scores and V sums are theirs, over keys paired at even absolute positions;
//   - the partitions' (max, sum, acc) states are merged by merge_partition in position order;
//   - with attention sinks (gpt-oss), fold_sink folds the head's sink into the merged state last.
// How the work is split over threads does not enter: decode may run a sequence's partitions on
// different threads, prefill runs them in one work item; both merge the same states.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "kv_quant.h"
#include "vec.h"

namespace pagedllm {
namespace attn {

constexpr int kTile = 128;      // keys per online-softmax step
constexpr int kQueryTile = 16;  // query tokens per prefill work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// How many rows ahead of the row being scored its K row is prefetched (both kernels' bf16 tiles):
// one K row per row scored, a steady trickle. It read bf16 KV 8-15 % faster on Zen 4 (8-256
// sequences x 300-1500 keys, 2 threads) than prefetching the next tile's K rows in one burst
// before summing V, which filled the line-fill buffers and stalled on the prefetches themselves.
constexpr int kPrefetchRows = 32;

using kvq::block_scale;
using kvq::CacheView;
using kvq::dispatch_types;
using kvq::kQuantized;

// The end of the tile that starts at key t0 (keys up to `end`): the next multiple of kTile or of
// partition_size (if > 0), whichever comes first.
inline int64_t tile_end(int64_t t0, int64_t end, int64_t partition_size) {
  int64_t e = std::min(end, (t0 / kTile + 1) * kTile);
  if (partition_size > 0) e = std::min(e, (t0 / partition_size + 1) * partition_size);
  return e;
}

// A context position as (block-table index, row within the block), stepped one key at a time:
// the kernels walk keys in order, and a division per key (a 64-bit idiv, tens of cycles) was a
// visible share of a bf16 decode on an AMX Xeon.
struct KeyCursor {
  int64_t blk;
  int off;
  KeyCursor(int64_t pos, int block_size)
      : blk(pos / block_size), off(static_cast<int>(pos % block_size)) {}
  // The key's row in one kv head's cache, in rows of D values.
  int64_t row(const int64_t* table, const CacheView& cv) const { return table[blk] * cv.rows + off; }
  void next(int block_size) {
    if (++off == block_size) {
      off = 0;
      ++blk;
    }
  }
};

// out[i * stride] = the row of key t0 + i (i < n) in one kv head's cache (base: its K or its V):
// one table lookup per block and one add per key. A KeyCursor step per key (compare, branch,
// table read, multiply) was a sixth of a bf16 decode on an AMX Xeon, G = 3 and D = 64.
template <typename T>
inline void fill_rows(const T* base, const int64_t* table, const CacheView& cv, int64_t t0, int n,
                      const T** out, int stride = 1) {
  const int BS = cv.block_size;
  const int64_t D = cv.D;
  int64_t blk = t0 / BS;
  int off = static_cast<int>(t0 - blk * BS);
  while (n > 0) {
    const int run = std::min(n, BS - off);
    const T* row = base + (table[blk] * cv.rows + off) * D;
    for (int i = 0; i < run; ++i, row += D) out[i * stride] = row;
    out += static_cast<int64_t>(run) * stride;
    n -= run;
    ++blk;
    off = 0;
  }
}

// The K rows ahead of the key being scored, prefetched one per key scored (kPrefetchRows
// ahead): both kernels walk their keys [begin, end) through one of these. The constructor asks
// for the first kPrefetchRows rows; next() gives the following row to ask for, or null past end.
template <typename T>
class KeyPrefetch {
 public:
  KeyPrefetch(const T* kbase, const int64_t* table, const CacheView& cv, int64_t begin,
              int64_t end)
      : kbase_(kbase), table_(table), cv_(cv), ahead_(begin), end_(end),
        key_(begin, cv.block_size) {
    for (int64_t stop = std::min(end, begin + kPrefetchRows); ahead_ < stop;)
      vec::prefetch_row(next(), cv.D);
  }
  const T* next() {
    if (ahead_ >= end_) return nullptr;
    const T* row = kbase_ + key_.row(table_, cv_) * cv_.D;
    ++ahead_;
    key_.next(cv_.block_size);
    return row;
  }
  // pf[2 i] = vrow[i] (the tile's V rows, read right after its scores), pf[2 i + 1] = next():
  // the prefetch list of a tile of n keys for tile_scores_bf16.
  void tile(const T* const* vrow, int n, const T** pf) {
    for (int i = 0; i < n; ++i) pf[2 * i] = vrow[i];
    const int m = static_cast<int>(std::clamp<int64_t>(end_ - ahead_, 0, n));
    fill_rows(kbase_, table_, cv_, ahead_, m, pf + 1, 2);
    for (int i = m; i < n; ++i) pf[2 * i + 1] = nullptr;
    ahead_ += m;
    key_ = KeyCursor(ahead_, cv_.block_size);  // one division per tile keeps next() in step
  }

 private:
  const T* kbase_;
  const int64_t* table_;
  CacheView cv_;
  int64_t ahead_, end_;
  KeyCursor key_;
};

// Folds one partition's unnormalised softmax state (max m, sum l, acc[D]) into a running merge
// (M, L, A[D]); partitions come in position order, an empty one (m = -inf) is skipped, and the
// first is copied (so one partition alone is its own result, bit for bit). Flash-decoding's
// merge, sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M), done as a running rescale.
inline void merge_partition(float m, float l, const float* acc, float& M, float& L, float* A,
                            int D) {
  if (m == kNegInf) return;
  if (M == kNegInf) {
    M = m;
    L = l;
    std::copy(acc, acc + D, A);
  } else if (m > M) {
    const float c = std::exp(M - m);
    L = vec::madd(L, c, l);
    for (int d = 0; d < D; ++d) A[d] = vec::madd(A[d], c, acc[d]);
    M = m;
  } else {
    const float w = std::exp(m - M);
    L = vec::madd(l, w, L);
    for (int d = 0; d < D; ++d) A[d] = vec::madd(acc[d], w, A[d]);
  }
}

// An attention sink (gpt-oss; Xiao et al. 2023): a learned logit per query head that joins the
// softmax's denominator as one more key of score `sink` (in the units of the scaled scores) and
// value zero, so it takes probability from the real keys and adds nothing to the output. Folded
// into a query's finished (max m, sum l, acc[D]) state as merge_partition folds one more
// partition (m = sink, l = 1, acc = 0), once, after every partition, right before the output is
// normalised by 1 / l: the decode kernel (whichever partition path it took) and the prefill
// kernel call it on the same state, so a query keeps one order of arithmetic. The acc rescale is
// elementwise, so it may run on the bf16 tiles' permuted accumulator order too. sink = -inf adds
// nothing (e^-inf = 0).
inline void fold_sink(float sink, float m, float& l, float* acc, int D) {
  if (sink > m) {  // the sink is the new max: rescale what the keys summed
    const float c = std::exp(m - sink);
    l = vec::madd(l, c, 1.f);
    vec::scale_row(acc, c, D);
  } else {
    l += std::exp(sink - m);
  }
}

// The sink logits of a call: null, or sinks [H] float32 contiguous on the CPU (one per query
// head of `query` [T, H, D]; TORCH_CHECK errors otherwise).
inline const float* sink_logits(const std::optional<at::Tensor>& sinks, const at::Tensor& query) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& s = *sinks;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 1 &&
                  s.size(0) == query.size(1) && s.device().is_cpu(),
              "sinks must be a contiguous float32 CPU tensor [num_heads]");
  return s.data_ptr<float>();
}

// One online-softmax step of a query row over a tile (Milakov & Gimelshein 2018): s[0, n) are
// the row's visible scores; turns them into e^(s - m'), folds their sum into l and rescales acc
// [D] when the running max m grows. The caller then adds the tile's p * V into acc.
inline void softmax_step(float* s, int n, float& m, float& l, float* acc, int D) {
  const float nm = std::max(m, vec::max_row(s, n));
  if (nm > m) {
    if (m != kNegInf) {  // else nothing is accumulated yet: l and acc are zero
      // c underflows to 0 when the max jumps by more than ~104: the earlier keys' weights
      // then vanish, so acc must be scaled too (skipping it at c == 0 kept their V rows).
      const float c = std::exp(m - nm);
      l *= c;
      vec::scale_row(acc, c, D);
    }
    m = nm;
  }
  l += vec::exp_sub_sum(s, n, nm);
}

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
