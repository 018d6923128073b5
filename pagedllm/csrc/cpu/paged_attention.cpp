// PagedAttention CPU kernels (paper section 4.1): attention reads K/V in place through the block
// table, with no gather copy.
//
// KV cache layout per layer: key_cache / value_cache [num_kv_heads, num_blocks, block_size, D].
// Token p of a sequence lives in block block_table[p / block_size] at offset p % block_size, so a
// block row of one kv head is D contiguous values and a block is block_size * D contiguous values.
//
// Decode: one work item per (sequence, kv head, context partition). The G query heads of a kv
// head group are handled together so every K/V row is loaded once for all of them. Within an
// item the context is walked in tiles with an online softmax (running max / sum, rescaling the
// accumulator when the max grows). Long contexts with few (sequence, kv head) pairs are split into
// partitions whose partial (max, sum, acc) are merged afterwards (flash-decoding).
//
// Prefill: prefill_attention.cpp (one work item per sequence, kv head and tile of query tokens;
// the same online softmax, with a causal mask per query token).
//
// Sliding window (window > 0; Mistral, Gemma local layers): the query at position p sees keys
// p - window + 1 .. p only. Decode walks just those positions; a prefill tile walks keys from its
// first query's window start, masking per query token. Keys before the window are never read, so
// blocks wholly outside every query's window may hold anything (the block manager frees them and
// leaves a sentinel id in the table).
//
// Query/output fp32 or bf16; caches fp32, bf16, or int8 / fp8 e4m3 with one scale per block and kv
// head (kv_quant.h): codes are widened in registers, the K scale multiplies each score and the V
// scale each probability, so a block's scale costs one multiply per row. Arithmetic and
// accumulation in fp32. Threads: OpenMP, as many as
// torch.get_num_threads(). The ops are registered with the dispatcher in torch_bindings.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_common.h"
#include "paged_attention.h"
#include "vec.h"

namespace pagedllm {
namespace {

using namespace attn;

// acc[g] += sum_i p[g][i] * v_i over a tile's n V rows (p[g][i] = sc[g * kTile + i]). With SIMD
// the head dimension is walked in chunks whose G accumulators stay in registers across all n
// rows (two vectors per head while 2G of them fit the register file, else one): no accumulator
// load/store per row. Each element still sums the rows in order.
template <int G, typename T>
inline void accumulate_pv(float* acc, const float* sc, const T* const* vrow, int n, int D) {
  int d = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  constexpr int W = vec::W;
  if constexpr (G <= 4) {
    for (; d + 2 * W <= D; d += 2 * W) {
      vec::V a0[G], a1[G];
      for (int g = 0; g < G; ++g) {
        a0[g] = vec::load(acc + g * D + d);
        a1[g] = vec::load(acc + g * D + d + W);
      }
      for (int i = 0; i < n; ++i) {
        const vec::V v0 = vec::load(vrow[i] + d), v1 = vec::load(vrow[i] + d + W);
        for (int g = 0; g < G; ++g) {
          const vec::V p = vec::set1(sc[g * kTile + i]);
          a0[g] = vec::fmadd(p, v0, a0[g]);
          a1[g] = vec::fmadd(p, v1, a1[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        vec::store(acc + g * D + d, a0[g]);
        vec::store(acc + g * D + d + W, a1[g]);
      }
    }
  }
  for (; d + W <= D; d += W) {
    vec::V a[G];
    for (int g = 0; g < G; ++g) a[g] = vec::load(acc + g * D + d);
    for (int i = 0; i < n; ++i) {
      const vec::V v = vec::load(vrow[i] + d);
      for (int g = 0; g < G; ++g) a[g] = vec::fmadd(vec::set1(sc[g * kTile + i]), v, a[g]);
    }
    for (int g = 0; g < G; ++g) vec::store(acc + g * D + d, a[g]);
  }
#endif
  for (; d < D; ++d)
    for (int g = 0; g < G; ++g) {
      float a = acc[g * D + d];
      for (int i = 0; i < n; ++i) a += sc[g * kTile + i] * vec::to_float(vrow[i][d]);
      acc[g * D + d] = a;
    }
}

// Online softmax over context positions [start, end) of one sequence, for the G query heads of
// one kv head. q: G x D (pre-scaled fp32). Leaves unnormalised results in m[G], l[G], acc[G x D].
template <int G, typename T>
void decode_range(const float* q, const T* kbase, const T* vbase, const int64_t* table,
                  const CacheView& cv, int64_t start, int64_t end, float* m, float* l, float* acc,
                  float* sc) {
  const int D = cv.D, BS = cv.block_size;
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = start; t0 < end; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - t0));
    int64_t blk = t0 / BS;
    int off = static_cast<int>(t0 % BS);
    float o[G];
    for (int i = 0; i < n; ++i) {
      const int64_t row = (table[blk] * cv.rows + off) * D;
      const T* k = kbase + row;
      vec::prefetch_row(vbase + row, D);  // V of this tile is read right after the scores
      vec::dot_rows<G>(q, k, D, o);
      if constexpr (kQuantized<T>) {
        const float ks = block_scale(kbase, table[blk], cv);
        for (int g = 0; g < G; ++g) o[g] *= ks;
      }
      for (int g = 0; g < G; ++g) sc[g * kTile + i] = o[g];
      if (++off == BS) {
        off = 0;
        ++blk;
      }
    }
    for (int g = 0; g < G; ++g) {
      float* s = sc + g * kTile;
      const float nm = std::max(m[g], vec::max_row(s, n));
      if (nm > m[g]) {
        const float c = m[g] == kNegInf ? 0.f : std::exp(m[g] - nm);
        l[g] *= c;
        if (c != 0.f) vec::scale_row(acc + g * D, c, D);
        m[g] = nm;
      }
      l[g] += vec::exp_sub_sum(s, n, nm);
    }
    blk = t0 / BS;
    off = static_cast<int>(t0 % BS);
    // The tile's V rows, with each row's block scale folded into its probabilities; while they
    // are gathered, prefetch the K rows of the next tile.
    const T* vrow[kTile];
    const int64_t next_end = std::min<int64_t>(end, t0 + n + kTile);
    int64_t nblk = (t0 + n) / BS;
    int noff = static_cast<int>((t0 + n) % BS);
    int64_t npos = t0 + n;
    for (int i = 0; i < n; ++i) {
      vrow[i] = vbase + (table[blk] * cv.rows + off) * D;
      if (npos < next_end) {
        vec::prefetch_row(kbase + (table[nblk] * cv.rows + noff) * D, D);
        ++npos;
        if (++noff == BS) {
          noff = 0;
          ++nblk;
        }
      }
      if constexpr (kQuantized<T>) {
        const float vs = block_scale(vbase, table[blk], cv);
        for (int g = 0; g < G; ++g) sc[g * kTile + i] *= vs;
      }
      if (++off == BS) {
        off = 0;
        ++blk;
      }
    }
    accumulate_pv<G, T>(acc, sc, vrow, n, D);
  }
}

// Fallback for group sizes without a specialisation: one head at a time.
template <typename T>
void decode_range_any(int G, const float* q, const T* kbase, const T* vbase,
                      const int64_t* table, const CacheView& cv, int64_t start, int64_t end,
                      float* m, float* l, float* acc, float* sc) {
  for (int g = 0; g < G; ++g)
    decode_range<1, T>(q + g * cv.D, kbase, vbase, table, cv, start, end, m + g, l + g,
                       acc + g * cv.D, sc);
}

template <typename T>
void decode_dispatch(int G, const float* q, const T* kbase, const T* vbase, const int64_t* table,
                     const CacheView& cv, int64_t start, int64_t end, float* m, float* l,
                     float* acc, float* sc) {
#define PAGEDLLM_CASE(NG) \
  case NG:                \
    return decode_range<NG, T>(q, kbase, vbase, table, cv, start, end, m, l, acc, sc);
  switch (G) {
    PAGEDLLM_CASE(1)
    PAGEDLLM_CASE(2)
    PAGEDLLM_CASE(3)
    PAGEDLLM_CASE(4)
    PAGEDLLM_CASE(5)
    PAGEDLLM_CASE(6)
    PAGEDLLM_CASE(7)
    PAGEDLLM_CASE(8)
    default:
      return decode_range_any<T>(G, q, kbase, vbase, table, cv, start, end, m, l, acc, sc);
  }
#undef PAGEDLLM_CASE
}


template <typename T, typename C>
void decode_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, int64_t num_seqs, double scale,
                 int64_t partition_size, int64_t window) {
  const AttentionOperands<T, C> a(out, query, key_cache, value_cache, block_tables, seq_lens);
  const int H = a.H, D = a.D, KVH = a.KVH, G = a.G;
  const int64_t* sl = a.seq_lens;
  const int nthreads = at::get_num_threads();

  // First key position a sequence's query sees (its window start; 0 without a window).
  auto first_key = [&](int64_t s) {
    return window > 0 ? std::max<int64_t>(0, sl[s] - window) : int64_t{0};
  };
  int64_t max_len = 0;  // longest span of keys read, which sets the partition count
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max(max_len, sl[s] - first_key(s));
  // Split the context only when (sequence, kv head) pairs alone cannot keep the threads busy.
  int64_t parts = 1;
  if (partition_size > 0 && num_seqs * KVH < 4 * nthreads && max_len > partition_size)
    parts = (max_len + partition_size - 1) / partition_size;
  const int64_t psize = parts == 1 ? std::max<int64_t>(max_len, 1) : partition_size;
  const int64_t items = num_seqs * KVH * parts;

  // Partial results when split: [items, G] max and sum, [items, G, D] accumulators.
  std::vector<float> pm, pl, pacc;
  if (parts > 1) {
    pm.resize(items * G);
    pl.resize(items * G);
    pacc.resize(items * G * D);
  }

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf(G * D), m(G), l(G), acc(G * D), sc(static_cast<size_t>(G) * kTile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t part = it % parts;
      const int kh = static_cast<int>((it / parts) % KVH);
      const int64_t s = it / (parts * KVH);
      const int64_t len = sl[s];
      const int64_t start = first_key(s) + part * psize, end = std::min(len, start + psize);
      float* mo = parts > 1 ? pm.data() + it * G : m.data();
      float* lo = parts > 1 ? pl.data() + it * G : l.data();
      float* ao = parts > 1 ? pacc.data() + it * G * D : acc.data();
      if (start >= end) {  // empty partition of a shorter sequence
        for (int g = 0; g < G; ++g) {
          mo[g] = kNegInf;
          lo[g] = 0.f;
        }
        if (parts == 1)  // a zero-length sequence: output zeros
          for (int g = 0; g < G; ++g) {
            T* dst = a.out_row(s, kh * G + g);
            for (int d = 0; d < D; ++d) vec::from_float(0.f, dst + d);
          }
        continue;
      }
      for (int g = 0; g < G; ++g)
        vec::load_row_scaled(a.query_row(s, kh * G + g), static_cast<float>(scale), D,
                             qf.data() + g * D);
      decode_dispatch<C>(G, qf.data(), a.keys(kh), a.values(kh), a.table(s), a.cv, start, end,
                         mo, lo, ao, sc.data());
      if (parts == 1)
        for (int g = 0; g < G; ++g)
          vec::store_row(ao + g * D, 1.f / lo[g], D, a.out_row(s, kh * G + g));
    }
    if (parts > 1) {
      // Merge partitions: out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M).
#pragma omp for schedule(static)
      for (int64_t sh = 0; sh < num_seqs * H; ++sh) {
        const int64_t s = sh / H;
        const int h = static_cast<int>(sh % H);
        const int kh = h / G, g = h % G;
        const int64_t base = (s * KVH + kh) * parts;
        float M = kNegInf;
        for (int64_t p = 0; p < parts; ++p) M = std::max(M, pm[(base + p) * G + g]);
        float L = 0.f;
        std::fill(acc.begin(), acc.begin() + D, 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float mp = pm[(base + p) * G + g];
          if (mp == kNegInf) continue;
          const float w = std::exp(mp - M);
          L += pl[(base + p) * G + g] * w;
          const float* part_acc = pacc.data() + ((base + p) * G + g) * D;
          for (int d = 0; d < D; ++d) acc[d] += part_acc[d] * w;
        }
        vec::store_row(acc.data(), L > 0.f ? 1.f / L : 0.f, D, a.out_row(s, h));
      }
    }
  }
}

}  // namespace

// Decode attention for sequences [0, num_seqs): sequence s's single query is query[s];
// window > 0: only its last `window` positions.
void paged_attention_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t num_seqs, double scale,
                            int64_t partition_size, int64_t window) {
  check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query.size(0) >= num_seqs, "fewer queries than decode sequences");
  if (num_seqs == 0) return;
  dispatch_types(query, key_cache, "paged_attention_decode", [&](auto t, auto c) {
    decode_impl<decltype(t), decltype(c)>(out, query, key_cache, value_cache, block_tables,
                                          seq_lens, num_seqs, scale, partition_size, window);
  });
}

std::string simd_level() {
#if defined(PAGEDLLM_VEC_AVX512)
  return "avx512";
#elif defined(PAGEDLLM_VEC_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace pagedllm
