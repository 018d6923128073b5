// Attention on Intel AMX tiles for bf16 KV caches (attention_amx.cpp): the scores and p . V with
// the contracts of attn::tile_scores_bf16 and attn::tile_pv_bf16, which hand their work here
// where the tiles run. Both attention kernels (decode and prefill) go through those two
// functions, so a query keeps one order of arithmetic whichever kernel runs it
// (attention_common.h).
#pragma once
#include <cstdint>

#include "vec.h"

namespace pagedllm {
namespace attn {

// Whether tile_scores_bf16 and tile_pv_bf16 run on AMX tiles: the avx512 kernel variant on a
// CPU with amx_tile and amx_bf16 whose kernel granted the tile state, unless turned off by
// set_amx_attention(false).
bool amx_attention_enabled();
// Turns the AMX tiles of attention on or off for the process (a no-op where they cannot run);
// returns the previous setting. For tests and A/B benchmarks of the vdpbf16ps tiles on the same
// CPU.
bool set_amx_attention(bool on);

// The tiles of one attention kernel call in the calling thread: when `on` (the caller read
// amx_attention_enabled() once for the whole call, so that all its threads sum alike), loads the
// tile configuration and routes tile_scores_bf16 / tile_pv_bf16 to tile_scores_amx /
// tile_pv_amx until destroyed, then releases the tiles. One per thread per parallel region,
// rather than a configuration per 128-key tile; other code that configures tiles (the GEMM,
// oneDNN) never runs inside it.
class AmxAttentionScope {
 public:
  explicit AmxAttentionScope(bool on);
  ~AmxAttentionScope();
  AmxAttentionScope(const AmxAttentionScope&) = delete;
  AmxAttentionScope& operator=(const AmxAttentionScope&) = delete;

 private:
  bool active_;
};

// Whether an AmxAttentionScope is active in the calling thread.
bool amx_attention_active();

// sc[r * sc_stride + i] = qb[r] . krow[i] for rows r < rows and keys i < n, bf16 operands and
// fp32 sums (D a multiple of 32, at most kMaxHeadDim). Computed as S^T = K Q^T: 16 key rows
// are an A tile (loaded in place when they are consecutive in the cache, else copied), Q^T in
// the B (pair) layout is built once per call, so a score depends only on its key and query
// row. prefetch (nullable, 2n pointers of D bf16): asked into cache before each 16 keys, two
// per key; with rows <= 16 and D <= 64 the next 16 keys' K rows are also asked into L1
// (prefetcht0). Only called inside an active AmxAttentionScope.
void tile_scores_amx(const vec::bf16* qb, int rows, const vec::bf16* const* krow, int n, int D,
                     float* sc, int sc_stride, const vec::bf16* const* prefetch);

// acc[r] += P[r] . V for rows r < rows, tile_pv_bf16's contract: P[r] is sc row r (n keys, the
// first at absolute position `first`) rounded to bf16 pairs of keys at even absolute positions;
// v: the np pairs' 2 np V rows in pair order (zero rows for the partners of unpaired keys); acc
// [rows, D] fp32 in tile_pv_bf16's permuted head-dimension order. P is the A tile (16 query
// rows x 16 key pairs, at absolute multiples of 32 keys), V's pairs interleaved as tile_pv_bf16
// interleaves them are the B tiles (16 pairs x 16 dimensions), one TDPBF16PS per 32 keys and 16
// dimensions, so an output row depends only on its own P row and the keys' positions. Only
// called inside an active AmxAttentionScope.
void tile_pv_amx(const float* sc, int rows, int sc_stride, const vec::bf16* const* v, int np,
                 int n, int64_t first, int D, float* acc);

}  // namespace attn
}  // namespace pagedllm
