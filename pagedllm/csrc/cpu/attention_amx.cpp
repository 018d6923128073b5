// Attention on AMX tiles (attention_amx.h).
//
// Scores, per call (one tile of up to kTile keys for `rows` query rows of one kv head):
//   - Q^T is laid out as B tiles: for query rows [16 ct, 16 ct + 16) and head dimensions
//     [32 kc, 32 kc + 32), B[p][c] is the bf16 pair (q[16 ct + c][32 kc + 2p], ... + 1) (the
//     columns past the last row are stale and only reach C columns that are never read);
//   - for every 16 keys, their K rows are the A tile of each 32 dimensions (TILELOADD reads them
//     straight from the cache when they are consecutive rows of one block run, else from a copy),
//     and up to 4 C tiles (64 query rows) take S^T[key][row] over the D / 32 steps;
//   - each C tile is stored to a 1 KiB buffer and its columns (query rows) are gathered into sc.
// The vdpbf16ps scores (attention_bf16.cpp) reduce 16 lanes per (row, key) pair horizontally;
// here the tiles sum over the pairs themselves, a few instructions per 16 keys.
//
// p . V, per call: the probabilities rounded to bf16 pairs are the A tiles (16 query rows x 16
// key pairs, one 64-byte chunk per 32 keys), V's key pairs interleaved once per call (for a
// decode's one row tile, a chunk ahead of the products: pv_pipelined) are the B tiles, and the
// fp32 accumulators go through C tiles of 16 rows x 16 dimensions (up to 4 per pass).
// vdpbf16ps re-interleaved V for every 4 query rows and issued one instruction per key pair, 16
// dimensions and row; here one TDPBF16PS covers 16 rows x 32 keys x 16 dimensions.
#include "attention_amx.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "attention_bf16.h"

namespace pagedllm {
namespace attn {

#if defined(PAGEDLLM_AMX)

namespace {

std::atomic<bool> g_amx_attention{true};

using amx::kTileRows;
using u32_alias = uint32_t __attribute__((may_alias));

thread_local bool t_scope_active = false;

// qt: the B tiles of Q^T, tile (ct, kc) at (ct * KC + kc) * 256 dwords (16 pair rows x 16
// columns). Columns past the last row keep whatever an earlier call left: they only reach C
// columns (query rows) that are never read.
void layout_q(const vec::bf16* qb, int rows, int D, uint32_t* qt) {
  const int KC = D / 32, half = D / 2;
  const auto* q32 = reinterpret_cast<const u32_alias*>(qb);
  for (int r = 0; r < rows; ++r) {
    const int ct = r / kTileRows, c = r % kTileRows;
    for (int kc = 0; kc < KC; ++kc) {
      uint32_t* t = qt + (ct * KC + kc) * 256 + c;
      const u32_alias* q = q32 + r * half + kc * 16;
      for (int p = 0; p < 16; ++p) t[p * 16] = q[p];
    }
  }
}

// C tiles 0 .. NC - 1 <- the 16 keys at a (row stride lda bytes) . the B tiles of column tiles
// ct0 .. ct0 + NC - 1; stored to cbuf (NC x 256 floats, [key][query row]).
template <int NC>
__attribute__((target("amx-tile,amx-bf16"))) void chunk_scores(const char* a, int64_t lda,
                                                               const uint32_t* qt, int ct0,
                                                               int KC, float* cbuf) {
  amx::zero_tile<0>();
  if constexpr (NC > 1) amx::zero_tile<1>();
  if constexpr (NC > 2) amx::zero_tile<2>();
  if constexpr (NC > 3) amx::zero_tile<3>();
  for (int kc = 0; kc < KC; ++kc) {
    amx::load_tile<4>(a + kc * 64, lda);
    const uint32_t* b = qt + (ct0 * KC + kc) * 256;
    amx::load_tile<6>(b, 64);
    amx::dp_tile<0, 4, 6>();
    if constexpr (NC > 1) {
      amx::load_tile<7>(b + KC * 256, 64);
      amx::dp_tile<1, 4, 7>();
    }
    if constexpr (NC > 2) {
      amx::load_tile<6>(b + 2 * KC * 256, 64);
      amx::dp_tile<2, 4, 6>();
    }
    if constexpr (NC > 3) {
      amx::load_tile<7>(b + 3 * KC * 256, 64);
      amx::dp_tile<3, 4, 7>();
    }
  }
  amx::store_tile<0>(cbuf, 64);
  if constexpr (NC > 1) amx::store_tile<1>(cbuf + 256, 64);
  if constexpr (NC > 2) amx::store_tile<2>(cbuf + 512, 64);
  if constexpr (NC > 3) amx::store_tile<3>(cbuf + 768, 64);
}

// Whether the m rows from krow[0] are consecutive rows of D values in memory.
inline bool consecutive(const vec::bf16* const* krow, int m, int D) {
  for (int j = 1; j < m; ++j)
    if (krow[j] != krow[0] + static_cast<int64_t>(j) * D) return false;
  return true;
}

// The A operand of keys [i0, i0 + m): their rows in place when they are 16 consecutive rows,
// else copied to kcopy (rows from several blocks, or a last partial chunk whose other rows are
// ignored).
inline const char* chunk_keys(const vec::bf16* const* krow, int i0, int m, int D,
                              vec::bf16* kcopy) {
  if (m == kTileRows && consecutive(krow + i0, m, D))
    return reinterpret_cast<const char*>(krow[i0]);
  // 64-byte moves (D is a multiple of 32) into the aligned copy; a decode copies the last,
  // partial chunk of every item.
  for (int j = 0; j < m; ++j) {
    const vec::bf16* src = krow[i0 + j];
    vec::bf16* dst = kcopy + static_cast<size_t>(j) * D;
    for (int d = 0; d < D; d += 32) _mm512_store_si512(dst + d, _mm512_loadu_si512(src + d));
  }
  return reinterpret_cast<const char*>(kcopy);
}

// The prefetches of keys [i0, i1) (two rows each; prefetch may be null).
inline void prefetch_keys(const vec::bf16* const* prefetch, int i0, int i1, int D) {
  if (prefetch)
    for (int i = 2 * i0; i < 2 * i1; ++i)
      if (prefetch[i]) vec::prefetch_row(prefetch[i], D);
}

// sc rows [r0, r1) at keys [i0, i0 + m) <- the columns r - c0 of a stored C tile (element i of
// column c at tile[16 i + c]).
inline void gather_columns(const float* tile, int c0, int r0, int r1, int i0, int m, float* sc,
                           int sc_stride) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
  for (int r = r0; r < r1; ++r) {
    const __m512 v =
        _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, column, tile + (r - c0), 4);
    _mm512_mask_storeu_ps(sc + static_cast<int64_t>(r) * sc_stride + i0, mask, v);
  }
}

// One chunk of up to 32 head dimensions' worth of pairs into C tile CT from the resident B tiles
// 6 / 7 (KC <= 2), stored to cbuf. Chunk parity picks C tile and A tiles together (C 0 with A
// 4 / 5, C 1 with A 2 / 3): tiles are not renamed, so with one A pair the next chunk's loads
// waited for this chunk's products to finish reading them. Plain TILELOADD: in a chain of
// dependent tile ops TILELOADDT1 took ~3x as long per chunk with its rows in L1 (46.6 vs 15.0 ns,
// AMX Xeon, session 31), though both stream from memory alike. With the next chunk's K rows
// asked into L1 (scores_resident) the decode kernel ran 4 x 400 keys, one thread, in L2, at
// 18.4-18.7 ns per key and kv head against 21.1-21.5, and a 30-layer step of 64 x 400 keys,
// two threads, at 14.6-16.1 against 16.4-17.8 (with fill_rows in the decode loop).
template <int CT, int KC>
__attribute__((target("amx-tile,amx-bf16"))) inline void resident_chunk(const char* a,
                                                                         int64_t lda,
                                                                         float* cbuf) {
  constexpr int A0 = CT == 0 ? 4 : 2, A1 = A0 + 1;
  amx::zero_tile<CT>();
  amx::load_tile<A0>(a, lda);
  amx::dp_tile<CT, A0, 6>();
  if constexpr (KC > 1) {
    amx::load_tile<A1>(a + 64, lda);
    amx::dp_tile<CT, A1, 7>();
  }
  amx::store_tile<CT>(cbuf, 64);
}

// rows <= 16 and D <= 64 (a decode's G query heads, a short verify): Q^T stays in B tiles 6 / 7
// for the call, and chunks alternate between C tiles 0 and 1 so that one chunk's scores are
// gathered while the tiles compute the next (a gather right after its own TILESTORED waited on
// the store: the decode kernel was 5-10 % slower than with vdpbf16ps).
template <int KC>
__attribute__((target("amx-tile,amx-bf16"))) void scores_resident(
    const uint32_t* qt, int rows, const vec::bf16* const* krow, int n, int D, float* sc,
    int sc_stride, const vec::bf16* const* prefetch, vec::bf16* kcopy) {
  const int64_t lda = static_cast<int64_t>(D) * sizeof(vec::bf16);
  alignas(64) float cbuf[2][256];
  amx::load_tile<6>(qt, 64);
  if constexpr (KC > 1) amx::load_tile<7>(qt + 256, 64);
  int pending = -1;  // the chunk whose scores wait in cbuf[pending / 16 % 2]
  for (int i0 = 0; i0 < n; i0 += kTileRows) {
    const int m = std::min(kTileRows, n - i0);
    // Half the chunk's prefetches before its tiles and half after: all 32 rows at once filled
    // the line-fill buffers, and the tile load then waited behind them.
    prefetch_keys(prefetch, i0, i0 + m / 2, D);
    // The next chunk's K rows into L1: the tile loads wait on every line they miss there.
    for (int j = i0 + kTileRows, e = std::min(n, i0 + 2 * kTileRows); j < e; ++j)
      vec::prefetch_row<3>(krow[j], D);
    const char* a = chunk_keys(krow, i0, m, D, kcopy);
    if (i0 / kTileRows % 2 == 0)
      resident_chunk<0, KC>(a, lda, cbuf[0]);
    else
      resident_chunk<1, KC>(a, lda, cbuf[1]);
    if (pending >= 0)
      gather_columns(cbuf[pending / kTileRows % 2], 0, 0, rows, pending, kTileRows, sc,
                     sc_stride);
    prefetch_keys(prefetch, i0 + m / 2, i0 + m, D);
    pending = i0;
  }
  if (pending >= 0)
    gather_columns(cbuf[pending / kTileRows % 2], 0, 0, rows, pending,
                   std::min(kTileRows, n - pending), sc, sc_stride);
}

// The B tiles of V for tile_pv_amx, chunks [c0, c1): chunk c of 16 key pairs and column group j
// (16 head dimensions in tile_pv_bf16's permuted order) at vt + ((c - c0) * J + j) * 256 dwords;
// row t holds pair T = 16 c + t, the tile's pair u = T - lead, as the (v[2u][x], v[2u + 1][x])
// words that unpacklo / unpackhi_epi16 give (so the C columns land in the accumulators' order).
// The lead pairs before the tile's first and those from np on are zero.
void layout_v(const vec::bf16* const* v, int lead, int np, int c0, int c1, int D, uint32_t* vt) {
  const int J = D / 16;
  for (int T = c0 * kTileRows; T < c1 * kTileRows; ++T) {
    uint32_t* row =
        vt + static_cast<size_t>(T / kTileRows - c0) * J * 256 + (T % kTileRows) * 16;
    const int u = T - lead;
    for (int d = 0; d < D; d += 32) {
      __m512i lo = _mm512_setzero_si512(), hi = lo;
      if (u >= 0 && u < np) {
        const __m512i v0 = _mm512_loadu_si512(v[2 * u] + d);
        const __m512i v1 = _mm512_loadu_si512(v[2 * u + 1] + d);
        lo = _mm512_unpacklo_epi16(v0, v1);
        hi = _mm512_unpackhi_epi16(v0, v1);
      }
      _mm512_store_si512(row + (d / 16) * 256, lo);
      _mm512_store_si512(row + (d / 16 + 1) * 256, hi);
    }
  }
}

// C tiles 0 .. NJ - 1 <-> the accumulators of column groups at c, c + 16, ... (row stride ldc
// bytes).
template <int NJ>
__attribute__((target("amx-tile"))) inline void load_acc(const float* c, int64_t ldc) {
  amx::load_tile<0>(c, ldc);
  if constexpr (NJ > 1) amx::load_tile<1>(c + 16, ldc);
  if constexpr (NJ > 2) amx::load_tile<2>(c + 32, ldc);
  if constexpr (NJ > 3) amx::load_tile<3>(c + 48, ldc);
}

template <int NJ>
__attribute__((target("amx-tile"))) inline void store_acc(float* c, int64_t ldc) {
  amx::store_tile<0>(c, ldc);
  if constexpr (NJ > 1) amx::store_tile<1>(c + 16, ldc);
  if constexpr (NJ > 2) amx::store_tile<2>(c + 32, ldc);
  if constexpr (NJ > 3) amx::store_tile<3>(c + 48, ldc);
}

// C tiles 0 .. NJ - 1 += one chunk of P (A tile 4, from a with row stride lda bytes) . its NJ B
// tiles at b (consecutive 1 KiB tiles, loaded alternately into tiles 6 / 7).
template <int NJ>
__attribute__((target("amx-tile,amx-bf16"))) inline void pv_chunk(const char* a, int64_t lda,
                                                                   const uint32_t* b) {
  amx::load_tile<4>(a, lda);
  amx::load_tile<6>(b, 64);
  amx::dp_tile<0, 4, 6>();
  if constexpr (NJ > 1) {
    amx::load_tile<7>(b + 256, 64);
    amx::dp_tile<1, 4, 7>();
  }
  if constexpr (NJ > 2) {
    amx::load_tile<6>(b + 512, 64);
    amx::dp_tile<2, 4, 6>();
  }
  if constexpr (NJ > 3) {
    amx::load_tile<7>(b + 768, 64);
    amx::dp_tile<3, 4, 7>();
  }
}

// One row tile (rows <= 16) and all J = NJ <= 4 column groups (D <= 64, a decode): the C tiles
// stay resident over the chunks while V is laid out one chunk ahead into two alternating
// buffers (vt: 2 NJ B tiles), so that each chunk's products run while the vector unit lays out
// the next, and its B tiles are loaded from stores made a chunk earlier. The same TDPBF16PS
// sequence per C tile as pv_block, so the same bits.
template <int NJ>
__attribute__((target("amx-tile,amx-bf16"))) void pv_pipelined(
    const char* a, int64_t lda, const vec::bf16* const* v, int lead, int np, int chunks, int D,
    uint32_t* vt, float* c, int64_t ldc) {
  load_acc<NJ>(c, ldc);
  layout_v(v, lead, np, 0, 1, D, vt);
  for (int ch = 0; ch < chunks; ++ch) {
    pv_chunk<NJ>(a + ch * 64, lda, vt + (ch % 2) * NJ * 256);
    if (ch + 1 < chunks) layout_v(v, lead, np, ch + 1, ch + 2, D, vt + ((ch + 1) % 2) * NJ * 256);
  }
  store_acc<NJ>(c, ldc);
}

// 16 accumulator rows at c (row stride ldc bytes), column groups j0 .. j0 + NJ - 1, += the P
// rows at a (row stride lda bytes, 64 bytes per chunk) . V's B tiles vt over `chunks` chunks:
// C tiles 0 .. NJ - 1, A tile 4, B tiles alternating 6 / 7.
template <int NJ>
__attribute__((target("amx-tile,amx-bf16"))) void pv_block(const char* a, int64_t lda,
                                                           const uint32_t* vt, int chunks, int J,
                                                           int j0, float* c, int64_t ldc) {
  load_acc<NJ>(c + j0 * 16, ldc);
  for (int ch = 0; ch < chunks; ++ch)
    pv_chunk<NJ>(a + ch * 64, lda, vt + static_cast<size_t>(ch * J + j0) * 256);
  store_acc<NJ>(c + j0 * 16, ldc);
}

}  // namespace

bool amx_attention_enabled() {
  return g_amx_attention.load(std::memory_order_relaxed) && amx::tiles_usable();
}

bool set_amx_attention(bool on) { return g_amx_attention.exchange(on); }

AmxAttentionScope::AmxAttentionScope(bool on) : active_(on && amx::tiles_usable()) {
  if (!active_) return;
  amx::load_tile_config();
  t_scope_active = true;
}

AmxAttentionScope::~AmxAttentionScope() {
  if (!active_) return;
  t_scope_active = false;
  amx::release_tiles();
}

bool amx_attention_active() { return t_scope_active; }

__attribute__((target("amx-tile,amx-bf16"))) void tile_scores_amx(
    const vec::bf16* qb, int rows, const vec::bf16* const* krow, int n, int D, float* sc,
    int sc_stride, const vec::bf16* const* prefetch) {
  const int KC = D / 32, CT = (rows + kTileRows - 1) / kTileRows;
  thread_local std::vector<uint32_t> qt_buffer;
  thread_local std::vector<vec::bf16> kcopy_buffer;
  uint32_t* const qt = amx::aligned_scratch(qt_buffer, static_cast<size_t>(CT) * KC * 256);
  vec::bf16* const kcopy =
      amx::aligned_scratch(kcopy_buffer, static_cast<size_t>(kTileRows) * kMaxHeadDim);
  layout_q(qb, rows, D, qt);
  if (CT == 1 && KC <= 2) {
    if (KC == 1)
      scores_resident<1>(qt, rows, krow, n, D, sc, sc_stride, prefetch, kcopy);
    else
      scores_resident<2>(qt, rows, krow, n, D, sc, sc_stride, prefetch, kcopy);
    return;
  }
  const int64_t lda = static_cast<int64_t>(D) * sizeof(vec::bf16);
  alignas(64) float cbuf[4 * 256];
  for (int i0 = 0; i0 < n; i0 += kTileRows) {
    const int m = std::min(kTileRows, n - i0);
    prefetch_keys(prefetch, i0, i0 + m, D);
    const char* a = chunk_keys(krow, i0, m, D, kcopy);
    for (int ct0 = 0; ct0 < CT; ct0 += 4) {
      const int nc = std::min(4, CT - ct0);
      switch (nc) {
        case 1: chunk_scores<1>(a, lda, qt, ct0, KC, cbuf); break;
        case 2: chunk_scores<2>(a, lda, qt, ct0, KC, cbuf); break;
        case 3: chunk_scores<3>(a, lda, qt, ct0, KC, cbuf); break;
        default: chunk_scores<4>(a, lda, qt, ct0, KC, cbuf); break;
      }
      for (int t = 0; t < nc; ++t) {
        const int c0 = (ct0 + t) * kTileRows;
        gather_columns(cbuf + t * 256, c0, c0, std::min(rows, c0 + kTileRows), i0, m, sc,
                       sc_stride);
      }
    }
  }
}

void tile_pv_amx(const float* sc, int rows, int sc_stride, const vec::bf16* const* v, int np,
                 int n, int64_t first, int D, float* acc) {
  // Chunks sit at absolute multiples of 32 keys, whatever key the tile starts at: a decode tile
  // starting at a query's window start and the prefill tile of the same keys starting earlier
  // (its extra keys masked to zero) then sum every key in the same chunk and lane, as the bit
  // identity of the two kernels needs (a TDPBF16PS result depends on where its zeros sit).
  const bool odd = first % 2 != 0;
  const int lead = static_cast<int>(first / 2 % kTileRows);  // zero pairs before the first
  const int chunks = (lead + np + kTileRows - 1) / kTileRows, J = D / 16;
  const int row_tiles = (rows + kTileRows - 1) / kTileRows;
  // P rows: chunks x 16 pairs, then 16 spare dwords for the zero round_pairs_bf16 writes past
  // an unpaired last key (a row stays a whole number of 64-byte lines).
  const int pstride = (chunks + 1) * kTileRows;
  thread_local std::vector<uint32_t> p_buffer, v_buffer;
  thread_local std::vector<float> c_buffer;
  uint32_t* const P =
      amx::aligned_scratch(p_buffer, static_cast<size_t>(row_tiles) * kTileRows * pstride);
  uint32_t* const vt = amx::aligned_scratch(v_buffer, static_cast<size_t>(chunks) * J * 256);
  // (P rows past the last, and the C rows they reach, keep whatever they hold: a C row depends
  // only on its own P row, and those rows are never copied out.)
  for (int r = 0; r < rows; ++r) {
    uint32_t* row = P + static_cast<size_t>(r) * pstride;
    std::fill(row, row + lead, 0u);
    round_pairs_bf16(sc + static_cast<int64_t>(r) * sc_stride, n, odd, row + lead);
    std::fill(row + lead + np, row + chunks * kTileRows, 0u);  // the last chunk's missing pairs
  }
  const int64_t lda = static_cast<int64_t>(pstride) * 4;
  // A decode's one row tile lays V out a chunk ahead of its products (pv_pipelined; vt holds
  // both of its buffers whenever chunks >= 2); more rows lay all of V out once for every tile.
  const bool pipelined = row_tiles == 1 && J <= 4;
  if (!pipelined) layout_v(v, lead, np, 0, chunks, D, vt);
  const int64_t ldc = int64_t{D} * 4;
  for (int rt = 0; rt < row_tiles; ++rt) {
    const int r0 = rt * kTileRows, valid = std::min(kTileRows, rows - r0);
    float* c = acc + static_cast<int64_t>(r0) * D;
    if (valid < kTileRows) {  // a partial row tile goes through 16 rows of scratch
      float* buf = amx::aligned_scratch(c_buffer, static_cast<size_t>(kTileRows) * D);
      std::memcpy(buf, c, sizeof(float) * valid * D);
      c = buf;
    }
    const char* a = reinterpret_cast<const char*>(P + static_cast<size_t>(r0) * pstride);
    if (pipelined) {
      switch (J) {
        case 1: pv_pipelined<1>(a, lda, v, lead, np, chunks, D, vt, c, ldc); break;
        case 2: pv_pipelined<2>(a, lda, v, lead, np, chunks, D, vt, c, ldc); break;
        case 3: pv_pipelined<3>(a, lda, v, lead, np, chunks, D, vt, c, ldc); break;
        default: pv_pipelined<4>(a, lda, v, lead, np, chunks, D, vt, c, ldc); break;
      }
    } else {
      for (int j0 = 0; j0 < J; j0 += 4) {
        switch (std::min(4, J - j0)) {
          case 1: pv_block<1>(a, lda, vt, chunks, J, j0, c, ldc); break;
          case 2: pv_block<2>(a, lda, vt, chunks, J, j0, c, ldc); break;
          case 3: pv_block<3>(a, lda, vt, chunks, J, j0, c, ldc); break;
          default: pv_block<4>(a, lda, vt, chunks, J, j0, c, ldc); break;
        }
      }
    }
    if (valid < kTileRows)
      std::memcpy(acc + static_cast<int64_t>(r0) * D, c, sizeof(float) * valid * D);
  }
}

#else  // no AMX in this kernel variant: never enabled

bool amx_attention_enabled() { return false; }
bool set_amx_attention(bool) { return false; }
AmxAttentionScope::AmxAttentionScope(bool) : active_(false) {}
AmxAttentionScope::~AmxAttentionScope() {}
bool amx_attention_active() { return false; }
void tile_scores_amx(const vec::bf16*, int, const vec::bf16* const*, int, int, float*, int,
                     const vec::bf16* const*) {}
void tile_pv_amx(const float*, int, int, const vec::bf16* const*, int, int, int64_t, int, float*) {}

#endif

}  // namespace attn
}  // namespace pagedllm
