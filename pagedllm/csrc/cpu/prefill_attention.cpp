// Prefill (and chunked-prefill / speculative-verify) attention over the paged KV cache (paper
// section 4.1; the decode kernel and the cache layout are described in paged_attention.cpp).
//
// One work item per (sequence, kv head, tile of up to kQueryTile query tokens): its G query heads
// x query tokens form R rows. Keys are walked in the tiles and partitions of attention_common.h
// with an online softmax: the scores of all R rows come from register blocks of 2 rows x 8 keys
// (vec::dot_block, the decode kernel's arithmetic per pair), the causal (and sliding-window)
// mask and the softmax statistics are applied per row, and the probabilities multiply V in a
// register-blocked product; at a partition boundary each row's state is merged as the decode
// kernel merges its partitions. So every query's output equals its decode output bit for bit.
// Query token j of a sequence with q new tokens and context c sits at position c - q + j; with a
// window, a tile walks keys from its first query's window start, so blocks wholly outside every
// query's window are never read. Quantized caches: the K scale multiplies each score, the V
// scale each probability (as in decode). Attention sinks: folded into each query's merged state
// last, as the decode kernel does (attention_common.h fold_sink). bf16 caches on AVX512-BF16
// CPUs: the decode kernel's bf16 tiles (attention_bf16.h) instead of the fp32 loops. Threads:
// OpenMP over work items, longest first.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <numeric>
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

// Scratch of one thread's prefill items: rows R = nq * G query rows padded to a multiple of
// kRowBlock, their online-softmax state (m, l, acc), the merge of their finished partitions
// (M, L, A), the current tile's scores and its K / V row pointers and block scales.
constexpr int kRowBlock = 4;
// Keys per dot_block: 2 rows x 8 keys = 16 accumulators with AVX-512, whose sums hsum_n finds
// in one transposing pass (the reductions cost more than the FMAs at D = 64); 2 x 4 with AVX2.
#if PAGEDLLM_VEC_AVX512
constexpr int kKeyBlock = 8;
#else
constexpr int kKeyBlock = 4;
#endif
struct PrefillScratch {
  std::vector<float> q, m, l, acc, M, L, A, sc;
  std::vector<float> kscale, vscale;
  std::vector<float> kf, vf;  // the tile's K / V rows in fp32 (caches stored in another dtype)
  std::vector<vec::bf16> qb;   // q rounded to bf16 for the bf16 tiles (attention_bf16.h)
  std::vector<uint32_t> pairs;  // their probability pairs
  void reserve(int rows, int D) {
    qb.resize(static_cast<size_t>(rows) * D);
    pairs.resize(static_cast<size_t>(rows) * (kTile / 2 + 1));
    kf.resize(static_cast<size_t>(kTile) * D);
    vf.resize(static_cast<size_t>(kTile) * D);
    q.assign(static_cast<size_t>(rows) * D, 0.f);
    m.resize(rows);
    l.resize(rows);
    acc.resize(static_cast<size_t>(rows) * D);
    M.resize(rows);
    L.resize(rows);
    A.resize(static_cast<size_t>(rows) * D);
    sc.resize(static_cast<size_t>(rows) * kTile);
    kscale.resize(kTile);
    vscale.resize(kTile);
  }
};

// S[r][i] = q[r] . k_i for rows [0, rows) (a multiple of 2) and the tile's n keys, by
// vec::dot_block in blocks of 2 rows x kKeyBlock keys: the decode kernel's arithmetic per pair.
template <typename T>
inline void tile_scores(const float* q, int rows, const T* const* krow, int n, int D, float* sc) {
  float o[2 * kKeyBlock];
  for (int r = 0; r < rows; r += 2) {
    int i = 0;
    for (; i + kKeyBlock <= n; i += kKeyBlock) {
      vec::dot_block<2, kKeyBlock>(q + r * D, D, krow + i, D, o);
      for (int b = 0; b < 2; ++b)
        for (int j = 0; j < kKeyBlock; ++j) sc[(r + b) * kTile + i + j] = o[b * kKeyBlock + j];
    }
    for (; i < n; ++i) {
      vec::dot_block<2, 1>(q + r * D, D, krow + i, D, o);
      sc[r * kTile + i] = o[0];
      sc[(r + 1) * kTile + i] = o[1];
    }
  }
}

// acc[r] += sum_i p[r][i] * v_i for rows [0, rows) (a multiple of kRowBlock) over the tile's n
// V rows, in key order: kRowBlock rows x a chunk of the head dimension stay in registers across
// all rows.
template <typename T>
inline void tile_pv(const float* sc, int rows, const T* const* vrow, int n, int D, float* acc) {
  int d = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  constexpr int W = vec::W;
  for (; d + 2 * W <= D; d += 2 * W)
    for (int r = 0; r < rows; r += kRowBlock) {
      vec::V a0[kRowBlock], a1[kRowBlock];
      for (int b = 0; b < kRowBlock; ++b) {
        a0[b] = vec::load(acc + (r + b) * D + d);
        a1[b] = vec::load(acc + (r + b) * D + d + W);
      }
      for (int i = 0; i < n; ++i) {
        const vec::V v0 = vec::load(vrow[i] + d), v1 = vec::load(vrow[i] + d + W);
        for (int b = 0; b < kRowBlock; ++b) {
          const vec::V p = vec::set1(sc[(r + b) * kTile + i]);
          a0[b] = vec::fmadd(p, v0, a0[b]);
          a1[b] = vec::fmadd(p, v1, a1[b]);
        }
      }
      for (int b = 0; b < kRowBlock; ++b) {
        vec::store(acc + (r + b) * D + d, a0[b]);
        vec::store(acc + (r + b) * D + d + W, a1[b]);
      }
    }
  for (; d + W <= D; d += W)
    for (int r = 0; r < rows; r += kRowBlock) {
      vec::V a[kRowBlock];
      for (int b = 0; b < kRowBlock; ++b) a[b] = vec::load(acc + (r + b) * D + d);
      for (int i = 0; i < n; ++i) {
        const vec::V v = vec::load(vrow[i] + d);
        for (int b = 0; b < kRowBlock; ++b)
          a[b] = vec::fmadd(vec::set1(sc[(r + b) * kTile + i]), v, a[b]);
      }
      for (int b = 0; b < kRowBlock; ++b) vec::store(acc + (r + b) * D + d, a[b]);
    }
#endif
  for (; d < D; ++d)
    for (int r = 0; r < rows; ++r) {
      float a = acc[r * D + d];
      for (int i = 0; i < n; ++i) a = vec::madd(sc[r * kTile + i], vec::to_float(vrow[i][d]), a);
      acc[r * D + d] = a;
    }
}

// Folds every row's current partition state into its merge and starts the next partition.
inline void close_partition(PrefillScratch& ws, int rows, int D) {
  for (int r = 0; r < rows; ++r) {
    merge_partition(ws.m[r], ws.l[r], ws.acc.data() + r * D, ws.M[r], ws.L[r],
                    ws.A.data() + r * D, D);
    ws.m[r] = kNegInf;
    ws.l[r] = 0.f;
  }
  std::fill(ws.acc.begin(), ws.acc.begin() + static_cast<size_t>(rows) * D, 0.f);
}

// One prefill work item: query tokens j = 0 .. nq - 1 of a sequence (positions pos0 + j), the G
// query heads of one kv head; row r = j * G + g of q (pre-scaled fp32, rows padded with zeros to
// a multiple of kRowBlock). Keys are walked in the tiles and partitions of attention_common.h;
// per tile the scores of all rows come from tile_scores, the causal / window mask and the
// online softmax run per row on its visible keys, and the probabilities multiply V in tile_pv
// (masked entries are exact zeros there). window > 0: query j sees keys pos0 + j - window + 1
// .. pos0 + j only. bf16_dot (T is bf16): the scores and p . V are the bf16 tiles of
// attention_bf16.h on ws.qb, the decode kernel's. Leaves each row's merged state in ws.m /
// ws.l / ws.acc (unnormalised; in the bf16 tiles' permuted order with bf16_dot).
template <typename T>
void prefill_tile(PrefillScratch& ws, int G, int nq, int64_t pos0, int64_t window,
                  int64_t partition_size, const T* kbase, const T* vbase, const int64_t* table,
                  const CacheView& cv, bool bf16_dot) {
  const int D = cv.D, BS = cv.block_size;
  const int R = nq * G;
  const int rows = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  float *m = ws.m.data(), *l = ws.l.data(), *acc = ws.acc.data(), *sc = ws.sc.data();
  for (int r = 0; r < rows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
    ws.M[r] = kNegInf;
    ws.L[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<size_t>(rows) * D, 0.f);
  const int64_t end = pos0 + nq;  // keys up to the last query position
  // Keys from the first query's window start; earlier blocks are never touched.
  const int64_t begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  bool split = false;  // a partition was closed: the result is the merge
  const T* krow[kTile];
  const T* vrow[kTile];
  constexpr bool kBf16 = std::is_same_v<T, vec::bf16>;
  // The bf16 tiles prefetch as the decode kernel does: each tile's V rows, and K rows
  // kPrefetchRows ahead of the key being scored. Without them a verify of 8 sequences x 9 tokens
  // waited on its V loads (10 % slower, AMX Xeon). (The fp32 loops do not prefetch.)
  KeyPrefetch<T> ahead(kbase, table, cv, begin, kBf16 && bf16_dot ? end : begin);
  for (int64_t t0 = begin, t1; t0 < end; t0 = t1) {
    t1 = tile_end(t0, end, partition_size);
    const int n = static_cast<int>(t1 - t0);
    if (t0 > begin && partition_size > 0 && t0 % partition_size == 0) {
      close_partition(ws, rows, D);
      split = true;
    }
    // One table lookup per block (a KeyCursor step per key was a fifth of a verify's
    // prefill_tile on an AMX Xeon); the per-key block scales only where the cache has them.
    fill_rows(kbase, table, cv, t0, n, krow);
    fill_rows(vbase, table, cv, t0, n, vrow);
    if constexpr (kQuantized<T>) {
      KeyCursor key(t0, BS);
      for (int i = 0; i < n; ++i, key.next(BS)) {
        ws.kscale[i] = block_scale(kbase, table[key.blk], cv);
        ws.vscale[i] = block_scale(vbase, table[key.blk], cv);
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      tile_scores(ws.q.data(), rows, krow, n, D, sc);
    } else if (kBf16 && bf16_dot) {
      if constexpr (kBf16) {  // (krow is bf16 only here)
        const vec::bf16* pf[2 * kTile];  // two per key: its V row, the K row ahead (or null)
        ahead.tile(vrow, n, pf);
        tile_scores_bf16(ws.qb.data(), R, krow, n, D, sc, kTile, pf);
      }
    } else {
      // Every row pair and row block would convert the same K / V rows again: convert the tile
      // once (exactly: bf16, int8 and fp8 values are all fp32 values), then run the fp32 loops.
      const float* krow32[kTile];
      for (int i = 0; i < n; ++i) {
        float* dk = ws.kf.data() + static_cast<size_t>(i) * D;
        float* dv = ws.vf.data() + static_cast<size_t>(i) * D;
        vec::to_float_row(krow[i], D, dk);
        vec::to_float_row(vrow[i], D, dv);
        krow32[i] = dk;
      }
      tile_scores(ws.q.data(), rows, krow32, n, D, sc);
    }
    if constexpr (kQuantized<T>)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < n; ++i) sc[r * kTile + i] *= ws.kscale[i];
    for (int r = 0; r < R; ++r) {
      float* s = sc + r * kTile;
      const int64_t j = r / G;
      // Visible keys of query j in tile coordinates: [lo, hi).
      const int64_t last = pos0 + j;
      const int lo = static_cast<int>(
          std::clamp<int64_t>((window > 0 ? last - window + 1 : 0) - t0, 0, n));
      const int hi = static_cast<int>(std::clamp<int64_t>(last + 1 - t0, 0, n));
      if (lo >= hi) {  // nothing visible in this tile: the row keeps its state
        std::fill(s, s + n, 0.f);
        continue;
      }
      softmax_step(s + lo, hi - lo, m[r], l[r], acc + r * D, D);
      std::fill(s, s + lo, 0.f);
      std::fill(s + hi, s + n, 0.f);
      if constexpr (kQuantized<T>)
        for (int i = lo; i < hi; ++i) s[i] *= ws.vscale[i];
    }
    for (int r = R; r < rows; ++r) std::fill(sc + r * kTile, sc + r * kTile + n, 0.f);
    if constexpr (std::is_same_v<T, float>) {
      tile_pv<T>(sc, rows, vrow, n, D, acc);
    } else if (kBf16 && bf16_dot) {
      if constexpr (kBf16)
        tile_pv_bf16(sc, R, kTile, vrow, n, t0, D, acc, ws.pairs.data());
    } else {
      const float* vrow32[kTile];
      for (int i = 0; i < n; ++i) vrow32[i] = ws.vf.data() + static_cast<size_t>(i) * D;
      tile_pv<float>(sc, rows, vrow32, n, D, acc);
    }
  }
  if (split) {  // the last partition too, then the merge is the result
    close_partition(ws, rows, D);
    std::copy(ws.M.begin(), ws.M.begin() + rows, ws.m.begin());
    std::copy(ws.L.begin(), ws.L.begin() + rows, ws.l.begin());
    std::copy(ws.A.begin(), ws.A.begin() + static_cast<size_t>(rows) * D, ws.acc.begin());
  }
}

template <typename T, typename C>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  int64_t seq_begin, int64_t seq_end, double scale, int64_t partition_size,
                  int64_t window, const float* sinks) {
  const AttentionOperands<T, C> a(out, query, key_cache, value_cache, block_tables, seq_lens);
  const int D = a.D, KVH = a.KVH, G = a.G;
  const int64_t* sl = a.seq_lens;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int nthreads = at::get_num_threads();
  const bool bf16_dot = std::is_same_v<C, vec::bf16> && use_bf16_dot(D);
  // Read once for the call: every thread takes the same tiles even if the switch flips meanwhile.
  const bool amx_tiles = bf16_dot && amx_attention_enabled();

  // Work items: (sequence, query tile, kv head).
  struct Item {
    int64_t seq, tok0;
    int nq, kh;
  };
  // Few items (a short verify: 9 query tokens x 3 kv heads are 3 items for 2 threads) would
  // leave threads idle: then each sequence's tokens are cut into `split` times as many tiles, for
  // about 4 items per thread, of a token count whose rows (tokens x G) fill whole row blocks. A
  // query's output does not depend on its tile. Every tile of a sequence reads all its keys, and
  // on AMX tiles extra rows cost almost nothing (16 rows per TDPBF16PS), so there the tokens are
  // cut only while items are fewer than threads: a verify of 1 sequence x 9 tokens over 300 keys
  // took 43-44 us per layer against 52 (2 items per thread) and 56 (4), 30 cold layers on an
  // AMX Xeon (benchmarks/attention_score_paths.py); vdpbf16ps stays at 4 (76 against 84 us).
  int64_t full_items = 0;
  for (int64_t s = seq_begin; s < seq_end; ++s)
    full_items += (qsl[s + 1] - qsl[s] + kQueryTile - 1) / kQueryTile * KVH;
  const int64_t want = (amx_tiles ? 1 : 4) * static_cast<int64_t>(nthreads);
  const int64_t split =
      full_items >= want || full_items == 0 ? 1 : (want + full_items - 1) / full_items;
  const int64_t token_unit = kRowBlock / std::gcd(G, kRowBlock);
  std::vector<Item> items;
  for (int64_t s = seq_begin; s < seq_end; ++s) {
    const int64_t lo = qsl[s], hi = qsl[s + 1];
    int64_t tile = kQueryTile;
    if (split > 1 && hi > lo) {
      const int64_t tiles = (hi - lo + kQueryTile - 1) / kQueryTile * split;
      tile = ((hi - lo + tiles - 1) / tiles + token_unit - 1) / token_unit * token_unit;
      tile = std::clamp<int64_t>(tile, 1, kQueryTile);
    }
    for (int64_t t = lo; t < hi; t += tile)
      for (int kh = 0; kh < KVH; ++kh)
        items.push_back({s, t, static_cast<int>(std::min<int64_t>(tile, hi - t)), kh});
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
    const AmxAttentionScope tiles(amx_tiles);
    const int rows = (kQueryTile * G + kRowBlock - 1) / kRowBlock * kRowBlock;
    thread_local PrefillScratch ws;
    ws.reserve(rows, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t s = w.seq;
      const int64_t qlen = qsl[s + 1] - qsl[s];
      const int64_t pos0 = sl[s] - qlen + (w.tok0 - qsl[s]);
      // The rows padding the item's R = nq G rows to whole row blocks are zeros.
      const int R = w.nq * G, padded = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
      std::fill(ws.q.begin() + static_cast<size_t>(R) * D,
                ws.q.begin() + static_cast<size_t>(padded) * D, 0.f);
      for (int j = 0; j < w.nq; ++j)
        for (int g = 0; g < G; ++g)
          vec::load_row_scaled(a.query_row(w.tok0 + j, w.kh * G + g), static_cast<float>(scale),
                               D, ws.q.data() + (j * G + g) * D);
      if (bf16_dot) round_rows_bf16(ws.q.data(), w.nq * G, D, ws.qb.data());
      prefill_tile<C>(ws, G, w.nq, pos0, window, partition_size, a.keys(w.kh), a.values(w.kh),
                      a.table(s), a.cv, bf16_dot);
      for (int j = 0; j < w.nq; ++j)
        for (int g = 0; g < G; ++g) {
          const int r = j * G + g;
          const int h = w.kh * G + g;
          T* dst = a.out_row(w.tok0 + j, h);
          // The decode kernel's last steps, on the same state: the sink, then 1 / l.
          if (sinks) fold_sink(sinks[h], ws.m[r], ws.l[r], ws.acc.data() + r * D, D);
          if (bf16_dot) unpermute_row(ws.acc.data() + r * D, D);
          vec::store_row(ws.acc.data() + r * D, 1.f / ws.l[r], D, dst);
        }
    }
  }
}

}  // namespace

// Causal attention for sequences [seq_begin, seq_end) whose new tokens are
// query[query_start_loc[s] : query_start_loc[s + 1]], the last ones of seq_lens[s] tokens;
// window > 0: token at position p sees keys p - window + 1 .. p; sinks: one logit per query
// head (fold_sink).
void paged_attention_prefill(at::Tensor out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t seq_begin,
                             int64_t seq_end, double scale, int64_t partition_size,
                             int64_t window, const std::optional<at::Tensor>& sinks) {
  check_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int64");
  const float* sink = sink_logits(sinks, query);
  if (seq_end <= seq_begin) return;
  dispatch_types(query, key_cache, "paged_attention_prefill", [&](auto t, auto c) {
    prefill_impl<decltype(t), decltype(c)>(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, seq_begin, seq_end, scale,
                                           partition_size, window, sink);
  });
}

}  // namespace pagedllm
