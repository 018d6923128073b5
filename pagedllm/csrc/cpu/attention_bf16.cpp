// bf16 dot-product attention tiles (attention_bf16.h): vdpbf16ps for the scores and for p . V.
// Compiled with target("avx512bf16") inside the avx512 variant only; the other variants get
// stubs that are never reached (bf16_dot_enabled() is false there).
#include "attention_bf16.h"

#include <algorithm>
#include <atomic>

#include "amx_tiles.h"
#include "attention_amx.h"
#include "attention_common.h"

namespace pagedllm {
namespace attn {

#if PAGEDLLM_VEC_AVX512

namespace {

// -1 until set_bf16_dot, then its choice. By default on, except where vdpbf16ps is slow (Intel
// CPUs) and no AMX tiles run the dot products: a batch-64 SmolLM2 decode step on a Xeon without
// AMX (family 6 model 207, 2 cores) took 96.9 ms with these tiles and 89.3 ms with fp32 FMAs.
std::atomic<int> g_bf16_dot{-1};

bool bf16_dot_setting() {
  const int on = g_bf16_dot.load(std::memory_order_relaxed);
  return on < 0 ? !vec::vdpbf16ps_slow() || amx::tiles_usable() : on == 1;
}

bool cpu_has_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
}

#define PAGEDLLM_BF16_TARGET __attribute__((target("avx512bf16")))

// out[b * KB + j] = qb[b] . k[j] over D (a multiple of 32): one vdpbf16ps per 32 dimensions into
// a 16-lane accumulator per pair, then the lanes summed (vec::hsum_n, the order of
// _mm512_reduce_add_ps). Every pair gets the same operations whatever RB and KB are.
template <int RB, int KB>
PAGEDLLM_BF16_TARGET inline void dot_block_bf16(const vec::bf16* qb, int D,
                                                const vec::bf16* const* k, float* out) {
  // The first 32 dimensions start from zero in the instruction itself: a zeroing loop over the
  // array (which hsum_n takes by address) became a slow `rep stos`.
  __m512 acc[RB * KB];
  for (int d = 0; d < D; d += 32) {
    __m512bh kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(k[j] + d);
    for (int b = 0; b < RB; ++b) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + b * D + d);
      for (int j = 0; j < KB; ++j)
        acc[b * KB + j] =
            _mm512_dpbf16_ps(d == 0 ? _mm512_setzero_ps() : acc[b * KB + j], qv, kv[j]);
    }
  }
  vec::hsum_n<RB * KB>(acc, out);
}

// The scores of rows [r, r + RB) for keys [i0, i0 + kb), kb <= 8.
template <int RB>
PAGEDLLM_BF16_TARGET inline void score_rows(const vec::bf16* qb, int r, const vec::bf16* const* k,
                                            int i0, int kb, int D, float* sc, int stride) {
  float o[RB * 8];
  if (kb == 8) {
    dot_block_bf16<RB, 8>(qb + r * D, D, k + i0, o);
    for (int b = 0; b < RB; ++b)
      for (int j = 0; j < 8; ++j) sc[(r + b) * stride + i0 + j] = o[b * 8 + j];
    return;
  }
  for (int j = 0; j < kb; ++j) {
    dot_block_bf16<RB, 1>(qb + r * D, D, k + i0 + j, o);
    for (int b = 0; b < RB; ++b) sc[(r + b) * stride + i0 + j] = o[b];
  }
}

// acc rows [r, r + RB), dimensions [d, d + 32): += the tile's np key pairs. Pair t's V rows
// (v[2t], v[2t + 1]) are interleaved by unpacklo / unpackhi_epi16 into (v[2t][x], v[2t + 1][x])
// words; vdpbf16ps with the broadcast (p[2t], p[2t + 1]) adds both products to lane x.
template <int RB>
PAGEDLLM_BF16_TARGET inline void pv_rows(const uint32_t* pairs, int pair_stride, int r,
                                         const vec::bf16* const* v, int np, int d, int D,
                                         float* acc) {
  __m512 lo[RB], hi[RB];
  for (int b = 0; b < RB; ++b) {
    lo[b] = _mm512_loadu_ps(acc + (r + b) * D + d);
    hi[b] = _mm512_loadu_ps(acc + (r + b) * D + d + 16);
  }
  for (int t = 0; t < np; ++t) {
    const __m512i v0 = _mm512_loadu_si512(v[2 * t] + d), v1 = _mm512_loadu_si512(v[2 * t + 1] + d);
    const __m512bh il = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
    const __m512bh ih = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
    for (int b = 0; b < RB; ++b) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[(r + b) * pair_stride + t]);
      lo[b] = _mm512_dpbf16_ps(lo[b], il, p);
      hi[b] = _mm512_dpbf16_ps(hi[b], ih, p);
    }
  }
  for (int b = 0; b < RB; ++b) {
    _mm512_storeu_ps(acc + (r + b) * D + d, lo[b]);
    _mm512_storeu_ps(acc + (r + b) * D + d + 16, hi[b]);
  }
}

alignas(64) const vec::bf16 kZeroRow[kMaxHeadDim] = {};

}  // namespace

bool bf16_dot_enabled() { return cpu_has_bf16() && bf16_dot_setting(); }

bool set_bf16_dot(bool on) {
  const bool was = bf16_dot_setting();
  g_bf16_dot.store(on ? 1 : 0, std::memory_order_relaxed);
  return was;
}

void round_rows_bf16(const float* q, int rows, int D, vec::bf16* qb) {
  const int n = rows * D;
  int i = 0;
  for (; i + vec::W <= n; i += vec::W) vec::store(qb + i, vec::load(q + i));
  for (; i < n; ++i) vec::from_float(q[i], qb + i);
}

PAGEDLLM_BF16_TARGET void tile_scores_bf16(const vec::bf16* qb, int rows,
                                           const vec::bf16* const* krow, int n, int D, float* sc,
                                           int sc_stride, const vec::bf16* const* prefetch) {
  if (amx_attention_active()) {  // the same scores, summed by the tiles (attention_amx.h)
    tile_scores_amx(qb, rows, krow, n, D, sc, sc_stride, prefetch);
    return;
  }
  for (int i0 = 0; i0 < n; i0 += 8) {
    const int kb = std::min(8, n - i0);
    if (prefetch)
      for (int i = 2 * i0; i < 2 * (i0 + kb); ++i)
        if (prefetch[i]) vec::prefetch_row(prefetch[i], D);
    int r = 0;
    for (; r + 2 <= rows; r += 2) score_rows<2>(qb, r, krow, i0, kb, D, sc, sc_stride);
    if (r < rows) score_rows<1>(qb, r, krow, i0, kb, D, sc, sc_stride);
  }
}

PAGEDLLM_BF16_TARGET void round_pairs_bf16(const float* p, int n, bool odd, uint32_t* pairs) {
  auto* e = reinterpret_cast<uint16_t*>(pairs);
  const int start = odd ? 1 : 0;
  e[0] = 0;
  e[start + n] = 0;  // the partner of an unpaired last key (or unused)
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + i));
    _mm256_mask_storeu_epi16(e + start + i, m, (__m256i)b);
  }
}

PAGEDLLM_BF16_TARGET void tile_pv_bf16(const float* sc, int rows, int sc_stride,
                                       const vec::bf16* const* vrow, int n, int64_t first, int D,
                                       float* acc, uint32_t* pairs) {
  constexpr int kPairStride = kTile / 2 + 1;
  const bool odd = first % 2 != 0;
  const int np = (n + (odd ? 1 : 0) + 1) / 2;
  // The tile's V rows in pair order, zero rows for the partners of unpaired keys.
  const vec::bf16* v[kTile + 2];
  v[0] = v[2 * np - 1] = kZeroRow;
  std::copy(vrow, vrow + n, v + (odd ? 1 : 0));
  if (amx_attention_active()) {  // the same sums on the tiles (attention_amx.h)
    tile_pv_amx(sc, rows, sc_stride, v, np, n, first, D, acc);
    return;
  }
  for (int r = 0; r < rows; ++r)
    round_pairs_bf16(sc + r * sc_stride, n, odd, pairs + r * kPairStride);
  for (int d = 0; d < D; d += 32) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) pv_rows<4>(pairs, kPairStride, r, v, np, d, D, acc);
    switch (rows - r) {  // the last rows in one pass over V
      case 3: pv_rows<3>(pairs, kPairStride, r, v, np, d, D, acc); break;
      case 2: pv_rows<2>(pairs, kPairStride, r, v, np, d, D, acc); break;
      case 1: pv_rows<1>(pairs, kPairStride, r, v, np, d, D, acc); break;
      default: break;
    }
  }
}

#else  // not the avx512 variant: never enabled

bool bf16_dot_enabled() { return false; }
bool set_bf16_dot(bool) { return false; }
void round_rows_bf16(const float*, int, int, vec::bf16*) {}
void tile_scores_bf16(const vec::bf16*, int, const vec::bf16* const*, int, int, float*, int,
                      const vec::bf16* const*) {}
void tile_pv_bf16(const float*, int, int, const vec::bf16* const*, int, int64_t, int, float*,
                  uint32_t*) {}
void round_pairs_bf16(const float*, int, bool, uint32_t*) {}

#endif

void unpermute_row(float* row, int D) {
  float t[32];
  for (int d = 0; d < D; d += 32) {
    for (int l = 0; l < 4; ++l)
      for (int m = 0; m < 4; ++m) {
        t[8 * l + m] = row[d + 4 * l + m];
        t[8 * l + 4 + m] = row[d + 16 + 4 * l + m];
      }
    std::copy(t, t + 32, row + d);
  }
}

}  // namespace attn
}  // namespace pagedllm
