// Attention scores on Intel AMX tiles for bf16 KV caches (attention_amx.cpp): the same contract
// as attn::tile_scores_bf16, which hands its work here where the tiles run. Both attention
// kernels (decode and prefill) score through that one function, so a query keeps one order of
// arithmetic whichever kernel scores it (attention_common.h).
#pragma once
#include "vec.h"

namespace pagedllm {
namespace attn {

// Whether tile_scores_bf16 scores on AMX tiles: the avx512 kernel variant on a CPU with
// amx_tile and amx_bf16 whose kernel granted the tile state, unless turned off by
// set_amx_scores(false).
bool amx_scores_enabled();
// Turns the AMX scores on or off for the process (a no-op where they cannot run); returns the
// previous setting. For tests and A/B benchmarks of the vdpbf16ps scores on the same CPU.
bool set_amx_scores(bool on);

// The tiles of one attention kernel call in the calling thread: when `on` (the caller read
// amx_scores_enabled() once for the whole call, so that all its threads score alike), loads the
// tile configuration and routes tile_scores_bf16 to tile_scores_amx until destroyed, then
// releases the tiles. One per thread per parallel region, rather than a configuration per
// 128-key tile; other code that configures tiles (the GEMM, oneDNN) never runs inside it.
class AmxScoresScope {
 public:
  explicit AmxScoresScope(bool on);
  ~AmxScoresScope();
  AmxScoresScope(const AmxScoresScope&) = delete;
  AmxScoresScope& operator=(const AmxScoresScope&) = delete;

 private:
  bool active_;
};

// Whether an AmxScoresScope is active in the calling thread.
bool amx_scores_active();

// sc[r * sc_stride + i] = qb[r] . krow[i] for rows r < rows and keys i < n, bf16 operands and
// fp32 sums (D a multiple of 32, at most kMaxHeadDim). Computed as S^T = K Q^T: 16 key rows
// are an A tile (loaded in place when they are consecutive in the cache, else copied), Q^T in
// the B (pair) layout is built once per call, so a score depends only on its key and query
// row. prefetch (nullable, 2n pointers of D bf16): asked into cache before each 16 keys, two
// per key. Only called inside an active AmxScoresScope.
void tile_scores_amx(const vec::bf16* qb, int rows, const vec::bf16* const* krow, int n, int D,
                     float* sc, int sc_stride, const vec::bf16* const* prefetch);

}  // namespace attn
}  // namespace pagedllm
