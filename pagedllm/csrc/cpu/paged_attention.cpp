// PagedAttention CPU kernels (paper section 4.1): attention reads K/V in place through the block
// table, with no gather copy.
//
// KV cache layout per layer: key_cache / value_cache [num_kv_heads, num_blocks, block_size, D].
// Token p of a sequence lives in block block_table[p / block_size] at offset p % block_size, so a
// block row of one kv head is D contiguous values and a block is block_size * D contiguous values.
//
// Decode: one work item per (sequence, kv head), or per (sequence, kv head, context partition)
// when the pairs alone cannot keep the threads busy. The G query heads of a kv head group are
// handled together so every K/V row is loaded once for all of them. The context is cut into
// partitions at the multiples of partition_size and walked in tiles with an online softmax
// (running max / sum, rescaling the accumulator when the max grows); the partitions' partial
// (max, sum, acc) are merged in position order, inside the item or afterwards when split
// (flash-decoding). The tiles, partitions and merge are those of attention_common.h, shared with
// the prefill kernel.
//
// Prefill: prefill_attention.cpp (one work item per sequence, kv head and tile of query tokens;
// the same arithmetic per query, with a causal mask per query token).
//
// Sliding window (window > 0; Mistral, Gemma local layers): the query at position p sees keys
// p - window + 1 .. p only. Decode walks just those positions; a prefill tile walks keys from its
// first query's window start, masking per query token. Keys before the window are never read, so
// blocks wholly outside every query's window may hold anything (the block manager frees them and
// leaves a sentinel id in the table).
//
// Attention sinks (gpt-oss): an optional logit per query head joins each query's softmax
// denominator as a key of value zero (attention_common.h fold_sink), folded into the merged
// state once, after every partition and whichever tiles (fp32, bf16, AMX) summed it.
//
// Query/output fp32 or bf16; caches fp32, bf16, or int8 / fp8 e4m3 with one scale per block and kv
// head (kv_quant.h): codes are widened in registers, the K scale multiplies each score and the V
// scale each probability, so a block's scale costs one multiply per row. Arithmetic and
// accumulation in fp32, except on bf16 caches where the CPU has AVX512-BF16: bf16 dot products
// with fp32 sums there (attention_bf16.h). Threads: OpenMP, as many as
// torch.get_num_threads(). The ops are registered with the dispatcher in torch_bindings.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_bf16.h"
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
      for (int i = 0; i < n; ++i) a = vec::madd(sc[g * kTile + i], vec::to_float(vrow[i][d]), a);
      acc[g * D + d] = a;
    }
}

// Online softmax over context positions [start, end) of one sequence (one partition: no multiple
// of partition_size strictly inside), for the G query heads of one kv head, in the tiles of
// attention_common.h. q: G x D (pre-scaled fp32); qb: q rounded to bf16 when the bf16 tiles run
// (attention_bf16.h; T is bf16), else null; pairs: their scratch. Leaves unnormalised results in
// m[G], l[G], acc[G x D] (in the bf16 tiles' permuted order when qb is given).
template <int G, typename T>
void decode_range(const float* q, const vec::bf16* qb, const T* kbase, const T* vbase,
                  const int64_t* table, const CacheView& cv, int64_t start, int64_t end,
                  int64_t partition_size, float* m, float* l, float* acc, float* sc,
                  uint32_t* pairs) {
  const int D = cv.D, BS = cv.block_size;
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  KeyPrefetch<T> ahead(kbase, table, cv, start, end);
  const T* krow[kTile];
  const T* vrow[kTile];
  for (int64_t t0 = start, t1; t0 < end; t0 = t1) {
    t1 = tile_end(t0, end, partition_size);
    const int n = static_cast<int>(t1 - t0);
    fill_rows(kbase, table, cv, t0, n, krow);
    fill_rows(vbase, table, cv, t0, n, vrow);
    if constexpr (std::is_same_v<T, vec::bf16>) {
      if (qb) {
        // The same prefetches as below, two per key: its V row and the K row kPrefetchRows on.
        const vec::bf16* pf[2 * kTile];
        ahead.tile(vrow, n, pf);
        tile_scores_bf16(qb, G, krow, n, D, sc, kTile, pf);
        for (int g = 0; g < G; ++g) softmax_step(sc + g * kTile, n, m[g], l[g], acc + g * D, D);
        tile_pv_bf16(sc, G, kTile, vrow, n, t0, D, acc, pairs);
        continue;
      }
    }
    KeyCursor key(t0, BS);  // key i's block, for the scales of a quantized cache
    float o[G];
    for (int i = 0; i < n; ++i) {
      vec::prefetch_row(vrow[i], D);  // V of this tile is read right after the scores
      if (const T* k = ahead.next()) vec::prefetch_row(k, D);
      vec::dot_block<G, 1>(q, D, krow + i, D, o);
      if constexpr (kQuantized<T>) {
        const float ks = block_scale(kbase, table[key.blk], cv);
        for (int g = 0; g < G; ++g) o[g] *= ks;
        key.next(BS);
      }
      for (int g = 0; g < G; ++g) sc[g * kTile + i] = o[g];
    }
    for (int g = 0; g < G; ++g) softmax_step(sc + g * kTile, n, m[g], l[g], acc + g * D, D);
    // Each V row's block scale folded into its probabilities.
    if constexpr (kQuantized<T>) {
      key = KeyCursor(t0, BS);
      for (int i = 0; i < n; ++i, key.next(BS)) {
        const float vs = block_scale(vbase, table[key.blk], cv);
        for (int g = 0; g < G; ++g) sc[g * kTile + i] *= vs;
      }
    }
    accumulate_pv<G, T>(acc, sc, vrow, n, D);
  }
}

// Fallback for group sizes without a specialisation: one head at a time.
template <typename T>
void decode_range_any(int G, const float* q, const vec::bf16* qb, const T* kbase, const T* vbase,
                      const int64_t* table, const CacheView& cv, int64_t start, int64_t end,
                      int64_t partition_size, float* m, float* l, float* acc, float* sc,
                      uint32_t* pairs) {
  for (int g = 0; g < G; ++g)
    decode_range<1, T>(q + g * cv.D, qb ? qb + g * cv.D : nullptr, kbase, vbase, table, cv, start,
                       end, partition_size, m + g, l + g, acc + g * cv.D, sc, pairs);
}

template <typename T>
void decode_dispatch(int G, const float* q, const vec::bf16* qb, const T* kbase, const T* vbase,
                     const int64_t* table, const CacheView& cv, int64_t start, int64_t end,
                     int64_t partition_size, float* m, float* l, float* acc, float* sc,
                     uint32_t* pairs) {
#define PAGEDLLM_CASE(NG)                                                                   \
  case NG:                                                                                  \
    return decode_range<NG, T>(q, qb, kbase, vbase, table, cv, start, end, partition_size, m, \
                               l, acc, sc, pairs);
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
      return decode_range_any<T>(G, q, qb, kbase, vbase, table, cv, start, end, partition_size, m,
                                 l, acc, sc, pairs);
  }
#undef PAGEDLLM_CASE
}

// A sequence's visible keys [first, len) cut at the multiples of partition_size (0: not cut):
// partition k is [start(k), end(k)).
struct Partitions {
  int64_t first, len, size;
  int64_t count() const {
    if (len <= first) return 0;
    return size > 0 ? (len - 1) / size - first / size + 1 : 1;
  }
  int64_t start(int64_t k) const { return k == 0 ? first : (first / size + k) * size; }
  int64_t end(int64_t k) const {
    return size > 0 ? std::min(len, (first / size + k + 1) * size) : len;
  }
};

template <typename T, typename C>
void decode_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, int64_t num_seqs, double scale,
                 int64_t partition_size, int64_t window, const float* sinks) {
  const AttentionOperands<T, C> a(out, query, key_cache, value_cache, block_tables, seq_lens);
  const int H = a.H, D = a.D, KVH = a.KVH, G = a.G;
  const int64_t* sl = a.seq_lens;
  const int nthreads = at::get_num_threads();
  const bool bf16_dot = std::is_same_v<C, vec::bf16> && use_bf16_dot(D);
  // Read once for the call: every thread takes the same tiles even if the switch flips meanwhile.
  const bool amx_tiles = bf16_dot && amx_attention_enabled();
  auto partitions = [&](int64_t s) {
    const int64_t len = sl[s], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return Partitions{first, len, partition_size};
  };

  // Work items: (sequence, kv head) with all its partitions merged in the item, or -- when
  // those pairs alone cannot keep the threads busy -- one item per partition, whose partial
  // (max, sum, acc) go to a slot and are merged afterwards (flash-decoding). Either way the
  // same partition states are merged in the same order (attention_common.h).
  bool split = false;
  if (num_seqs * KVH < 4 * nthreads)
    for (int64_t s = 0; s < num_seqs && !split; ++s) split = partitions(s).count() > 1;
  struct Item {
    int64_t seq, part, slot;  // part: the one partition of a split item, else -1
    int kh;
  };
  std::vector<Item> items;
  std::vector<int64_t> first_slot(num_seqs, -1);
  int64_t slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t parts = partitions(s).count();
    const bool cut = split && parts > 1;
    if (cut) first_slot[s] = slots;
    for (int kh = 0; kh < KVH; ++kh) {
      if (!cut) {
        items.push_back({s, -1, -1, kh});
        continue;
      }
      for (int64_t p = 0; p < parts; ++p) items.push_back({s, p, slots++, kh});
    }
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Partial results of split items: [slots, G] max and sum, [slots, G, D] accumulators.
  std::vector<float> pm(slots * G), pl(slots * G), pacc(slots * G * D);

#pragma omp parallel num_threads(nthreads)
  {
    const AmxAttentionScope tiles(amx_tiles);
    std::vector<float> qf(G * D), m(G), l(G), acc(G * D), sc(static_cast<size_t>(G) * kTile);
    std::vector<float> M(G), L(G), A(G * D);
    std::vector<vec::bf16> qb(bf16_dot ? G * D : 0);
    std::vector<uint32_t> pairs(bf16_dot ? static_cast<size_t>(G) * (kTile / 2 + 1) : 0);
    // The output row of head h from its merged state: max m, sum l, unnormalised accumulator.
    auto store_out = [&](int64_t s, int h, float m, float* acc_row, float l) {
      if (sinks) fold_sink(sinks[h], m, l, acc_row, D);
      if (bf16_dot) unpermute_row(acc_row, D);
      vec::store_row(acc_row, 1.f / l, D, a.out_row(s, h));
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t s = w.seq;
      const int kh = w.kh;
      const Partitions parts = partitions(s);
      if (parts.count() == 0) {  // a zero-length sequence: output zeros
        for (int g = 0; g < G; ++g) {
          T* dst = a.out_row(s, kh * G + g);
          for (int d = 0; d < D; ++d) vec::from_float(0.f, dst + d);
        }
        continue;
      }
      for (int g = 0; g < G; ++g)
        vec::load_row_scaled(a.query_row(s, kh * G + g), static_cast<float>(scale), D,
                             qf.data() + g * D);
      if (bf16_dot) round_rows_bf16(qf.data(), G, D, qb.data());
      auto run = [&](int64_t p, float* mo, float* lo, float* ao) {
        decode_dispatch<C>(G, qf.data(), bf16_dot ? qb.data() : nullptr, a.keys(kh),
                           a.values(kh), a.table(s), a.cv, parts.start(p), parts.end(p),
                           partition_size, mo, lo, ao, sc.data(), pairs.data());
      };
      if (w.slot >= 0) {
        run(w.part, pm.data() + w.slot * G, pl.data() + w.slot * G,
            pacc.data() + w.slot * G * D);
        continue;
      }
      run(0, m.data(), l.data(), acc.data());
      float *mo = m.data(), *lo = l.data(), *ao = acc.data();
      if (parts.count() > 1) {
        std::fill(M.begin(), M.end(), kNegInf);
        for (int64_t p = 0;;) {
          for (int g = 0; g < G; ++g)
            merge_partition(m[g], l[g], acc.data() + g * D, M[g], L[g], A.data() + g * D, D);
          if (++p == parts.count()) break;
          run(p, m.data(), l.data(), acc.data());
        }
        mo = M.data();
        lo = L.data();
        ao = A.data();
      }
      for (int g = 0; g < G; ++g) store_out(s, kh * G + g, mo[g], ao + g * D, lo[g]);
    }
    if (slots > 0) {
#pragma omp for schedule(static)
      for (int64_t sh = 0; sh < num_seqs * H; ++sh) {
        const int64_t s = sh / H;
        if (first_slot[s] < 0) continue;
        const int64_t parts = partitions(s).count();
        const int h = static_cast<int>(sh % H);
        const int kh = h / G, g = h % G;
        float Ms = kNegInf, Ls = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t slot = first_slot[s] + kh * parts + p;
          merge_partition(pm[slot * G + g], pl[slot * G + g], pacc.data() + (slot * G + g) * D,
                          Ms, Ls, A.data(), D);
        }
        store_out(s, h, Ms, A.data(), Ls);
      }
    }
  }
}

}  // namespace

// Decode attention for sequences [0, num_seqs): sequence s's single query is query[s];
// window > 0: only its last `window` positions; sinks: one logit per query head (fold_sink).
void paged_attention_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t num_seqs, double scale,
                            int64_t partition_size, int64_t window,
                            const std::optional<at::Tensor>& sinks) {
  check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query.size(0) >= num_seqs, "fewer queries than decode sequences");
  const float* sink = sink_logits(sinks, query);
  if (num_seqs == 0) return;
  dispatch_types(query, key_cache, "paged_attention_decode", [&](auto t, auto c) {
    decode_impl<decltype(t), decltype(c)>(out, query, key_cache, value_cache, block_tables,
                                          seq_lens, num_seqs, scale, partition_size, window,
                                          sink);
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
