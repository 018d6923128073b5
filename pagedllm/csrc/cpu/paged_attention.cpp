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
// Prefill: one work item per (sequence, kv head, tile of query tokens); the same tiled online
// softmax over keys 0 .. position of the tile's last token, with a causal mask per query token
// (query token j of a sequence with q new tokens and context c sits at position c - q + j).
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

#include "kv_quant.h"
#include "paged_attention.h"
#include "vec.h"

namespace pagedllm {
namespace {

constexpr int kTile = 128;           // keys per online-softmax step
constexpr int kQueryTile = 16;       // query tokens per prefill work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using kvq::block_scale;
using kvq::CacheView;
using kvq::dispatch_types;
using kvq::kQuantized;

// The geometry of a [KVH, NB, rows, D] cache of element type C (rows = block_size + 1 when C is
// quantized: the scale row).
template <typename C>
CacheView cache_view(const at::Tensor& cache) {
  const int rows = static_cast<int>(cache.size(2));
  const int D = static_cast<int>(cache.size(3));
  return {cache.size(1) * rows * D, kQuantized<C> ? rows - 1 : rows, rows, D};
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
    // While V is consumed, prefetch the K rows of the next tile.
    const int64_t next_end = std::min<int64_t>(end, t0 + n + kTile);
    int64_t nblk = (t0 + n) / BS;
    int noff = static_cast<int>((t0 + n) % BS);
    int64_t npos = t0 + n;
    float p[G];
    for (int i = 0; i < n; ++i) {
      const T* v = vbase + (table[blk] * cv.rows + off) * D;
      if (npos < next_end) {
        vec::prefetch_row(kbase + (table[nblk] * cv.rows + noff) * D, D);
        ++npos;
        if (++noff == BS) {
          noff = 0;
          ++nblk;
        }
      }
      const float vs = block_scale(vbase, table[blk], cv);
      for (int g = 0; g < G; ++g) p[g] = sc[g * kTile + i] * vs;
      vec::axpy_rows<G>(acc, p, v, D);
      if (++off == BS) {
        off = 0;
        ++blk;
      }
    }
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
  const int H = static_cast<int>(query.size(1));
  const int D = static_cast<int>(query.size(2));
  const int KVH = static_cast<int>(key_cache.size(0));
  const int G = H / KVH;
  const CacheView cv = cache_view<C>(key_cache);
  const int64_t MB = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const T* qp = query.data_ptr<T>();
  const C* kc = static_cast<const C*>(key_cache.data_ptr());
  const C* vc = static_cast<const C*>(value_cache.data_ptr());
  T* op = out.data_ptr<T>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
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
            T* dst = op + s * o_s0 + (kh * G + g) * o_s1;
            for (int d = 0; d < D; ++d) vec::from_float(0.f, dst + d);
          }
        continue;
      }
      for (int g = 0; g < G; ++g)
        vec::load_row_scaled(qp + s * q_s0 + (kh * G + g) * q_s1, static_cast<float>(scale), D,
                             qf.data() + g * D);
      decode_dispatch<C>(G, qf.data(), kc + kh * cv.head_stride, vc + kh * cv.head_stride,
                         bt + s * MB, cv, start, end, mo, lo, ao, sc.data());
      if (parts == 1)
        for (int g = 0; g < G; ++g)
          vec::store_row(ao + g * D, 1.f / lo[g], D, op + s * o_s0 + (kh * G + g) * o_s1);
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
          const float* a = pacc.data() + ((base + p) * G + g) * D;
          for (int d = 0; d < D; ++d) acc[d] += a[d] * w;
        }
        T* dst = op + s * o_s0 + h * o_s1;
        vec::store_row(acc.data(), L > 0.f ? 1.f / L : 0.f, D, dst);
      }
    }
  }
}

// One prefill work item: query tokens [j0, j1) of a sequence (positions pos0 + j), kv head kh.
// window > 0: query j sees keys pos0 + j - window + 1 .. pos0 + j only.
template <int G, typename T>
void prefill_tile(const float* q /* nq x G x D */, int nq, int64_t pos0, int64_t window,
                  const T* kbase, const T* vbase, const int64_t* table, const CacheView& cv,
                  float* m, float* l, float* acc, float* sc) {
  const int D = cv.D, BS = cv.block_size;
  const int R = nq * G;
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + R * D, 0.f);
  const int64_t end = pos0 + nq;  // keys up to the last query position
  // Keys from the first query's window start; earlier blocks are never touched.
  const int64_t begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  // Last query token that sees key kp (the window's other edge).
  auto last_query = [&](int64_t kp) {
    return window > 0 ? static_cast<int>(std::min<int64_t>(nq - 1, kp + window - 1 - pos0))
                      : nq - 1;
  };
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - t0));
    int64_t blk = t0 / BS;
    int off = static_cast<int>(t0 % BS);
    float o[G];
    for (int i = 0; i < n; ++i) {
      const int64_t kp = t0 + i;
      const T* k = kbase + (table[blk] * cv.rows + off) * D;
      const float ks = block_scale(kbase, table[blk], cv);
      // query j sees key kp iff kp <= pos0 + j (and kp > pos0 + j - window)
      const int jmin = static_cast<int>(std::max<int64_t>(0, kp - pos0));
      const int jmax = last_query(kp);
      for (int j = 0; j < nq; ++j) {
        if (j < jmin || j > jmax) {
          for (int g = 0; g < G; ++g) sc[(j * G + g) * kTile + i] = kNegInf;
          continue;
        }
        vec::dot_rows<G>(q + j * G * D, k, D, o);
        for (int g = 0; g < G; ++g) sc[(j * G + g) * kTile + i] = o[g] * ks;
      }
      if (++off == BS) {
        off = 0;
        ++blk;
      }
    }
    for (int r = 0; r < R; ++r) {
      float* s = sc + r * kTile;
      const float nm = std::max(m[r], vec::max_row(s, n));
      if (nm > m[r]) {
        const float c = m[r] == kNegInf ? 0.f : std::exp(m[r] - nm);
        l[r] *= c;
        if (c != 0.f) vec::scale_row(acc + r * D, c, D);
        m[r] = nm;
      }
      if (nm == kNegInf) {  // nothing visible yet (cannot happen for key 0, kept for safety)
        std::fill(s, s + n, 0.f);
        continue;
      }
      l[r] += vec::exp_sub_sum(s, n, nm);
    }
    blk = t0 / BS;
    off = static_cast<int>(t0 % BS);
    float p[G];
    for (int i = 0; i < n; ++i) {
      const int64_t kp = t0 + i;
      const T* v = vbase + (table[blk] * cv.rows + off) * D;
      const float vs = block_scale(vbase, table[blk], cv);
      const int jmin = static_cast<int>(std::max<int64_t>(0, kp - pos0));
      const int jmax = last_query(kp);
      for (int j = jmin; j <= jmax; ++j) {
        for (int g = 0; g < G; ++g) p[g] = sc[(j * G + g) * kTile + i] * vs;
        vec::axpy_rows<G>(acc + j * G * D, p, v, D);
      }
      if (++off == BS) {
        off = 0;
        ++blk;
      }
    }
  }
}

template <typename T>
void prefill_tile_dispatch(int G, const float* q, int nq, int64_t pos0, int64_t window,
                           const T* kbase, const T* vbase, const int64_t* table,
                           const CacheView& cv, float* m, float* l, float* acc, float* sc) {
#define PAGEDLLM_CASE(NG) \
  case NG:                \
    return prefill_tile<NG, T>(q, nq, pos0, window, kbase, vbase, table, cv, m, l, acc, sc);
  switch (G) {
    PAGEDLLM_CASE(1)
    PAGEDLLM_CASE(2)
    PAGEDLLM_CASE(3)
    PAGEDLLM_CASE(4)
    PAGEDLLM_CASE(6)
    PAGEDLLM_CASE(8)
    default:
      break;
  }
#undef PAGEDLLM_CASE
  // Generic group size: treat each (token, head) as its own G = 1 query by reordering is not
  // possible in place, so run one head at a time with G = 1 on a gathered copy.
  const int D = cv.D;
  std::vector<float> q1(static_cast<size_t>(nq) * D), a1(static_cast<size_t>(nq) * D);
  std::vector<float> m1(nq), l1(nq);
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < nq; ++j)
      std::memcpy(q1.data() + j * D, q + (j * G + g) * D, D * sizeof(float));
    prefill_tile<1, T>(q1.data(), nq, pos0, window, kbase, vbase, table, cv, m1.data(),
                       l1.data(), a1.data(), sc);
    for (int j = 0; j < nq; ++j) {
      m[j * G + g] = m1[j];
      l[j * G + g] = l1[j];
      std::memcpy(acc + (j * G + g) * D, a1.data() + j * D, D * sizeof(float));
    }
  }
}

template <typename T, typename C>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  int64_t seq_begin, int64_t seq_end, double scale, int64_t window) {
  const int H = static_cast<int>(query.size(1));
  const int D = static_cast<int>(query.size(2));
  const int KVH = static_cast<int>(key_cache.size(0));
  const int G = H / KVH;
  const CacheView cv = cache_view<C>(key_cache);
  const int64_t MB = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const T* qp = query.data_ptr<T>();
  const C* kc = static_cast<const C*>(key_cache.data_ptr());
  const C* vc = static_cast<const C*>(value_cache.data_ptr());
  T* op = out.data_ptr<T>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int nthreads = at::get_num_threads();

  // Work items: (sequence, query tile, kv head).
  struct Item {
    int64_t seq, tok0;
    int nq, kh;
  };
  std::vector<Item> items;
  for (int64_t s = seq_begin; s < seq_end; ++s) {
    const int64_t lo = qsl[s], hi = qsl[s + 1];
    for (int64_t t = lo; t < hi; t += kQueryTile)
      for (int kh = 0; kh < KVH; ++kh)
        items.push_back({s, t, static_cast<int>(std::min<int64_t>(kQueryTile, hi - t)), kh});
  }
  // Longest items first (they see the most keys) for a better dynamic schedule.
  // (With a window every tile sees about as many keys; the order then does not matter.)
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t pa = sl[a.seq] - (qsl[a.seq + 1] - a.tok0);
    const int64_t pb = sl[b.seq] - (qsl[b.seq + 1] - b.tok0);
    return pa > pb;
  });
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(nthreads)
  {
    const size_t R = static_cast<size_t>(kQueryTile) * G;
    std::vector<float> qf(R * D), m(R), l(R), acc(R * D), sc(R * kTile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t s = w.seq;
      const int64_t qlen = qsl[s + 1] - qsl[s];
      const int64_t pos0 = sl[s] - qlen + (w.tok0 - qsl[s]);
      for (int j = 0; j < w.nq; ++j)
        for (int g = 0; g < G; ++g)
          vec::load_row_scaled(qp + (w.tok0 + j) * q_s0 + (w.kh * G + g) * q_s1,
                               static_cast<float>(scale), D, qf.data() + (j * G + g) * D);
      prefill_tile_dispatch<C>(G, qf.data(), w.nq, pos0, window, kc + w.kh * cv.head_stride,
                               vc + w.kh * cv.head_stride, bt + s * MB, cv, m.data(), l.data(),
                               acc.data(), sc.data());
      for (int j = 0; j < w.nq; ++j)
        for (int g = 0; g < G; ++g) {
          const int r = j * G + g;
          vec::store_row(acc.data() + r * D, 1.f / l[r], D,
                         op + (w.tok0 + j) * o_s0 + (w.kh * G + g) * o_s1);
        }
    }
  }
}

void check_attention_args(const at::Tensor& out, const at::Tensor& query,
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

// Causal attention for sequences [seq_begin, seq_end) whose new tokens are
// query[query_start_loc[s] : query_start_loc[s + 1]], the last ones of seq_lens[s] tokens;
// window > 0: token at position p sees keys p - window + 1 .. p.
void paged_attention_prefill(at::Tensor out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t seq_begin,
                             int64_t seq_end, double scale, int64_t window) {
  check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int64");
  if (seq_end <= seq_begin) return;
  dispatch_types(query, key_cache, "paged_attention_prefill", [&](auto t, auto c) {
    prefill_impl<decltype(t), decltype(c)>(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, seq_begin, seq_end, scale,
                                           window);
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
