// bf16 dot-product tiles for the attention kernels on bf16 KV caches (AVX512-BF16's vdpbf16ps),
// used by both the decode and the prefill kernel so that a query keeps one order of arithmetic
// (attention_common.h). Where they apply (bf16_dot_enabled() and head_dim a multiple of 32, at
// most kMaxHeadDim), a tile's
//   - scores are q . k with q rounded to bf16 (exact products, fp32 sums: per pair of head
//     dimensions by vdpbf16ps, 16 lanes per 32 dimensions, then the lanes summed as vec::hsum),
//     and no bf16 -> fp32 conversion of K;
//   - probabilities are rounded to bf16 and multiply V by vdpbf16ps over pairs of keys at even
//     absolute positions (an unpaired key's partner is a zero), so V is not converted
//     either; the accumulators hold the head dimension in the permuted order of the pair
//     interleave (unpermute_row restores it before the output is written).
// This is the precision of bf16 attention on GPUs such as FlashAttention's (bf16 operands, fp32
// accumulation) and halves the multiply-adds per (query, key) pair; elsewhere the kernels keep
// their fp32 arithmetic. The functions are compiled for AVX512-BF16 inside the avx512 variant and
// must only be called where bf16_dot_enabled() is true.
#pragma once
#include <cstdint>

#include "vec.h"

namespace pagedllm {
namespace attn {

constexpr int kMaxHeadDim = 512;

// Whether the kernels use the bf16 tiles for bf16 caches: the avx512 variant on a CPU with
// avx512_bf16, unless turned off by set_bf16_dot(false); off by default where vdpbf16ps is slow
// (vec::vdpbf16ps_slow: Intel CPUs) unless AMX tiles run them (amx::tiles_usable).
bool bf16_dot_enabled();
// Turns the bf16 tiles on or off for the whole process (a no-op where they cannot run); returns
// the previous setting. For tests and A/B benchmarks of the fp32 path on the same CPU.
bool set_bf16_dot(bool on);
// Whether the kernels take the bf16 tiles for a bf16 cache of head dimension D.
inline bool use_bf16_dot(int D) { return D % 32 == 0 && D <= kMaxHeadDim && bf16_dot_enabled(); }

// q [rows, D] fp32 -> qb [rows, D] bf16, round to nearest even.
void round_rows_bf16(const float* q, int rows, int D, vec::bf16* qb);

// sc[r * sc_stride + i] = qb[r] . krow[i] for rows r < rows and the tile's keys i < n.
// prefetch (nullable, 2n pointers): rows of D bf16 asked into cache, two per key, just before
// that key's scores.
void tile_scores_bf16(const vec::bf16* qb, int rows, const vec::bf16* const* krow, int n, int D,
                      float* sc, int sc_stride, const vec::bf16* const* prefetch);

// acc[r] += sum_i p[r][i] * vrow[i] for rows r < rows, p[r][i] = sc[r * sc_stride + i] rounded
// to bf16, keys i < n of a tile whose first key sits at absolute position `first`; acc [rows,
// D] in the permuted order. pairs: scratch of rows * (kTile / 2 + 1) words.
void tile_pv_bf16(const float* sc, int rows, int sc_stride, const vec::bf16* const* vrow, int n,
                  int64_t first, int D, float* acc, uint32_t* pairs);

// One row's probabilities p[0, n) of a tile as bf16 pairs of keys at even absolute positions
// (round to nearest even): element odd + i of `pairs` is p_i, element 0 and element odd + n are
// zeros (the partners of unpaired keys); writes up to element n + 1.
void round_pairs_bf16(const float* p, int n, bool odd, uint32_t* pairs);

// row [D] from the permuted accumulator order of tile_pv_bf16 back to head-dimension order.
void unpermute_row(float* row, int D);

}  // namespace attn
}  // namespace pagedllm
