// The tile blocks of the AMX bf16 GEMM (gemm_amx.cpp, which alone includes this header): 2 x 2
// tile blocks (tile_block / run_block), wide blocks of 1 x 6, 2 x 3 and 3 x 2 C tiles for decode
// sizes (run_wide_block / run_tall_block), the edge buffer between a block's tiles and c
// (buffer_block), and the prefetches they issue. How the driver picks and orders the blocks is
// in gemm_amx.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx_tiles.h"
#include "gemm_amx.h"
#include "vec.h"

#if defined(PAGEDLLM_AMX)
namespace pagedllm {
namespace amx_blocks {

using namespace amx;
constexpr int kPanelCols = 16;                // columns of a panel (a B or C tile's width)
constexpr int64_t kBTileBytes = 16 * 64;      // one B tile: 16 k pairs x 16 columns x 4 bytes

// Which operand's tile loads stream past L1 (TILELOADDT1): the one each pass of a block reads
// once, so that the reused one stays there. The panel split reuses each panel pair (B) over all
// row blocks and reads x (A) once per pair; the row split reuses a row block's A tiles over a
// group of panels and reads each panel once per row block. Measured on an AMX Xeon (docs/dtype.md,
// session 27), the four linears x 30 layers with the engine's epilogues: 7-10 % faster at
// 512-2048 rows with B streamed, 2-3.5 % at 128-256 rows with A streamed (within 1.5 % either
// way at 64-96); A streamed in the row split undid most of what B streamed gained.
enum class Stream { kNone, kA, kB };

// Tile numbers: C(m, n) = m NT + n (MT NT <= 4), A rows alternate between tiles 4 and 5, B(n)
// = 6 + n. C(m, n) sits at rows 16m, columns 16n of its destination (row stride ld bytes): the
// output c itself, or a [32][32] buffer for partial tiles and the SwiGLU epilogue.
inline float* c_tile(float* dst, int64_t ld, int m, int n) {
  return dst + m * kTileRows * (ld / 4) + n * kPanelCols;
}

// A store-only block asks for its destination rows while its k loop runs: rows [0, rows) of dst
// (row stride ld bytes, `lines` 64-byte lines each), spread evenly over the k_tiles steps, step
// kt's share by PREFETCHW (the lines come in owned, as the tile stores need them). Without it
// the tile stores at the end waited for their lines from memory: on an AMX Xeon the LM head
// (49152 x 576, 12.6-50 MB of fp32 logits) 1.2-1.5x faster at 64-256 rows (docs/dtype.md,
// session 32). The caller's target must include prfchw too, or GCC turns the hint into a
// PREFETCHT0 or drops it.
__attribute__((target("prfchw"))) inline void prefetch_store_rows(float* dst, int64_t ld,
                                                                  int64_t rows, int lines,
                                                                  int64_t kt, int64_t k_tiles) {
  const int64_t per_step = (rows + k_tiles - 1) / k_tiles;
  const int64_t r1 = std::min(rows, (kt + 1) * per_step);
  for (int64_t r = kt * per_step; r < r1; ++r) {
    char* row = reinterpret_cast<char*>(dst) + r * ld;
    for (int l = 0; l < lines; ++l) _m_prefetchw(row + 64 * l);
  }
}

// C tiles start from the destination's values (LOAD: the accumulate epilogue, x W^T added to c
// inside the tiles without another pass) or from zero.
template <int MT, int NT, bool LOAD, int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void init_c(float* dst, int64_t ld) {
  if constexpr (I < MT * NT) {
    if constexpr (LOAD)
      load_tile<I>(c_tile(dst, ld, I / NT, I % NT), ld);
    else
      zero_tile<I>();
    init_c<MT, NT, LOAD, I + 1>(dst, ld);
  }
}

template <int MT, int NT, int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void store_c(float* dst, int64_t ld) {
  if constexpr (I < MT * NT) {
    store_tile<I>(c_tile(dst, ld, I / NT, I % NT), ld);
    store_c<MT, NT, I + 1>(dst, ld);
  }
}

// One 32-wide k step of row tiles M.. of the block: A(m) . B(n) into C(m, n).
template <int MT, int NT, Stream S, int M = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void dp_rows(const char* ak, int64_t lda) {
  if constexpr (M < MT) {
    constexpr int A = 4 + M % 2;
    load_tile_as<A, S == Stream::kA>(ak + M * lda, 64);
    dp_tile<M * NT, A, 6>();
    if constexpr (NT > 1) dp_tile<M * NT + 1, A, 7>();
    dp_rows<MT, NT, S, M + 1>(ak, lda);
  }
}

// The B tiles kBPrefetchSteps k steps ahead of bk in each of NP panels, into L1 (PREFETCHT0), for
// tile blocks, 2 x 3 and 3 x 2 blocks whose panels come from memory (a group's first row block).
// It matters for blocks of several row tiles: they issue several TDPBF16PS per B tile, and a
// tile load that misses L1 holds up the tile instructions behind it, so the second row tile's
// work added to the weight stream's time instead of hiding under it. One thread, 18 KiB panels streamed from a 192 MiB buffer, ns per
// KiB of B (a plain read of the same bytes 68-83, 1 x 6 blocks 68-81): 2 x 3 blocks 88-98 ->
// 70-82 with the prefetch 2 k steps ahead (4 steps 70-78, 8 steps 75-84, 16 steps 82-91;
// PREFETCHT1 2-8 worse than T0), 2 x 2 blocks 93 -> 86. With the panels in L2 (a later row
// block) it only costs: 2 x 3 18.5 -> 20.9, 1 x 6 12.1 -> 15.1. An AMX Xeon's decode step (8
// sequences, 200-token contexts, 1-9 tokens each): 24 / 32 / 40 rows 33.1 / 34.5 / 42.2 ->
// 29.6 / 30.0 / 37.9 ms (docs/spec_decode.md, session 34). Past the last panel the addresses are
// read-ahead only: a prefetch never faults.
constexpr int64_t kBPrefetchSteps = 2;
template <int NP>
inline void prefetch_b_ahead(const char* bk, int64_t panel_bytes) {
  const char* ahead = bk + kBPrefetchSteps * kBTileBytes;
  for (int n = 0; n < NP; ++n)
    for (int line = 0; line < 16; ++line)
      _mm_prefetch(ahead + n * panel_bytes + 64 * line, _MM_HINT_T0);
}

// C tiles [MT][NT] of dst (row stride ld bytes) (+)= x rows a[0 : 16 MT] in tile order (A tile
// (m, kt) at a + 16 m lda + kt KiB; lda = K bf16 values in bytes) . the NT panels from b (panel
// stride panel_bytes) over k_tiles 32-wide k steps (MT NT <= 4); with streamed_b (the panels
// come from memory) each k step prefetches B ahead (prefetch_b_ahead).
template <int MT, int NT, bool LOAD, Stream S>
__attribute__((target("amx-tile,amx-bf16,prfchw"))) void tile_block(
    const char* a, int64_t lda, const char* b, int64_t panel_bytes, int64_t k_tiles, float* dst,
    int64_t ld, bool streamed_b) {
  static_assert(MT * NT <= 4 && NT <= 2, "8 tiles: up to 4 C, 2 A and 2 B");
  init_c<MT, NT, LOAD>(dst, ld);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* bk = b + kt * kBTileBytes;
    if constexpr (!LOAD) prefetch_store_rows(dst, ld, MT * kTileRows, NT, kt, k_tiles);
    if (streamed_b) prefetch_b_ahead<NT>(bk, panel_bytes);
    load_tile_as<6, S == Stream::kB>(bk, 64);
    if constexpr (NT > 1) load_tile_as<7, S == Stream::kB>(bk + panel_bytes, 64);
    dp_rows<MT, NT, S>(a + kt * kBTileBytes, kTileRows * lda);
  }
  store_c<MT, NT>(dst, ld);
}

constexpr int kBufCols = 2 * kPanelCols;  // the [32][32] fp32 buffer of a block's tiles

// Between a block's buffer (rows [row0, row0 + buf_rows) x the NT panels from p, buf_cols floats
// per buffer row) and c: the part below M rows and N columns. TO_BUFFER copies c in (zeros past
// its edge); otherwise epilogue E writes the buffer out (out_per_panel columns per panel: 16, or
// 8 for SwiGLU).
template <bool TO_BUFFER>
void buffer_block(float* buf, int64_t row0, int64_t M, int NT, int64_t p, int64_t N,
                  int64_t out_per_panel, GemmEpilogue E, float* c, int64_t ldc,
                  int64_t buf_rows = 2 * kTileRows, int64_t buf_cols = kBufCols) {
  const int64_t rows = std::min(buf_rows, M - row0);
  int ni = 0;
  if (!TO_BUFFER && E == kSwiGlu) {
    // Two panels per SiLU: their 8 gate columns side by side in one vector, their 8 up columns
    // in another, 16 adjacent outputs; one panel per vector computed 8 lanes that were thrown
    // away. Each lane's arithmetic is unchanged, so are the bits.
    const __m512i gates =
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i ups = _mm512_add_epi32(gates, _mm512_set1_epi32(8));
    for (; ni + 1 < NT && (p + ni + 2) * out_per_panel <= N; ni += 2) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* t = buf + r * buf_cols + ni * kPanelCols;
        const __m512 v0 = _mm512_loadu_ps(t), v1 = _mm512_loadu_ps(t + kPanelCols);
        _mm512_storeu_ps(c + (row0 + r) * ldc + (p + ni) * out_per_panel,
                         vec::silu_mul(_mm512_permutex2var_ps(v0, gates, v1),
                                       _mm512_permutex2var_ps(v0, ups, v1)));
      }
    }
  }
  for (; ni < NT; ++ni) {
    const int64_t col0 = (p + ni) * out_per_panel;
    const int cols = static_cast<int>(std::clamp<int64_t>(N - col0, 0, out_per_panel));
    const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    for (int64_t r = 0; r < buf_rows; ++r) {
      float* t = buf + r * buf_cols + ni * kPanelCols;
      float* dst = c + (row0 + r) * ldc + col0;
      if (TO_BUFFER) {
        _mm512_storeu_ps(t, r < rows ? _mm512_maskz_loadu_ps(mask, dst) : _mm512_setzero_ps());
        continue;
      }
      if (r >= rows || cols == 0) continue;
      const __m512 v = _mm512_loadu_ps(t);
      if (E != kSwiGlu) {
        _mm512_mask_storeu_ps(dst, mask, v);
      } else {  // 8 gate then 8 up columns
        const __m512 y = vec::silu_mul(v, _mm512_shuffle_f32x4(v, v, 0xEE));
        _mm256_storeu_ps(dst, _mm512_castps512_ps256(y));
      }
    }
  }
}

// One block of MT x NT tiles at rows row0 and panel p. Whole tiles go straight between the tiles
// and c; edge tiles and SwiGLU go through buf. An accumulate's edge tiles start from c's values
// too, so every row gets the same bits whether its tile is whole or not (a row's output never
// depends on the batch it is in).
template <int MT, int NT, Stream S>
void run_block(const char* a, int64_t lda, const char* b, int64_t panel_bytes, int64_t k_tiles,
               bool whole, int64_t row0, int64_t M, int64_t p, int64_t N, int64_t out_per_panel,
               GemmEpilogue E, float* c, int64_t ldc, float* buf, bool streamed_b) {
  constexpr int64_t buf_ld = kBufCols * 4;
  if (whole && E != kSwiGlu) {
    float* dst = c + row0 * ldc + p * kPanelCols;
    if (E == kAccumulate)
      tile_block<MT, NT, true, S>(a, lda, b, panel_bytes, k_tiles, dst, ldc * 4, streamed_b);
    else
      tile_block<MT, NT, false, S>(a, lda, b, panel_bytes, k_tiles, dst, ldc * 4, streamed_b);
    return;
  }
  if (E == kAccumulate) {
    buffer_block<true>(buf, row0, M, NT, p, N, out_per_panel, E, c, ldc);
    tile_block<MT, NT, true, S>(a, lda, b, panel_bytes, k_tiles, buf, buf_ld, streamed_b);
  } else {
    tile_block<MT, NT, false, S>(a, lda, b, panel_bytes, k_tiles, buf, buf_ld, streamed_b);
  }
  buffer_block<false>(buf, row0, M, NT, p, N, out_per_panel, E, c, ldc);
}

// Wide blocks, for decode sizes (up to kWideRows rows): more panels per block than the 2 x 2
// blocks, a tile register re-filled once its TDPBF16PS has issued. 1 row tile x 6 panels: C 0-5,
// A 6, B 7; 2 row tiles x 3 panels: C(m, n) = 3 m + n, A and B one register each (each A tile
// loaded twice per k step, from L1). Every C tile gets the same TDPBF16PS sequence over k as in a
// 2 x 2 block, so the bits do not change. The four linears x 30 layers on an AMX Xeon with the
// engine's epilogues (weights from memory): 10.1 -> 8.4 ms at 1 row, 11.2 -> 9.6 at 16, 13.8 ->
// 12.8 at 17 and 14.4 -> 13.5 at 32 (docs/dtype.md, session 28). Plain tile loads: A is reused
// within the block and B is read once either way.

// C tiles 0-5 of a wide block at t[0..5] (row strides ld[0..5] bytes): loaded (LOAD) or zeroed,
// and stored back; with one stride ld for all, init_six / store_six.
template <bool LOAD, int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void init_six_at(float* const* t,
                                                                     const int64_t* ld) {
  if constexpr (I < 6) {
    if constexpr (LOAD)
      load_tile<I>(t[I], ld[I]);
    else
      zero_tile<I>();
    init_six_at<LOAD, I + 1>(t, ld);
  }
}

template <int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void store_six_at(float* const* t,
                                                                      const int64_t* ld) {
  if constexpr (I < 6) {
    store_tile<I>(t[I], ld[I]);
    store_six_at<I + 1>(t, ld);
  }
}

template <bool LOAD>
__attribute__((target("amx-tile,amx-bf16"))) inline void init_six(float* const* t, int64_t ld) {
  const int64_t lds[6] = {ld, ld, ld, ld, ld, ld};
  init_six_at<LOAD>(t, lds);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void store_six(float* const* t, int64_t ld) {
  const int64_t lds[6] = {ld, ld, ld, ld, ld, ld};
  store_six_at(t, lds);
}

template <bool LOAD>
__attribute__((target("amx-tile,amx-bf16,prfchw"))) void wide_block_1x6(
    const char* a, const char* b, int64_t panel_bytes, int64_t k_tiles, float* dst, int64_t ld) {
  float* const t[6] = {dst, dst + 16, dst + 32, dst + 48, dst + 64, dst + 80};
  init_six<LOAD>(t, ld);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* bk = b + kt * kBTileBytes;
    if constexpr (!LOAD) prefetch_store_rows(dst, ld, kTileRows, 6, kt, k_tiles);
    _tile_loadd(6, a + kt * kBTileBytes, 64);
    _tile_loadd(7, bk, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, bk + panel_bytes, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, bk + 2 * panel_bytes, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, bk + 3 * panel_bytes, 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, bk + 4 * panel_bytes, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, bk + 5 * panel_bytes, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  store_six(t, ld);
}

// a_tiles: bytes from a row tile's A tiles to the next row tile's; streamed_b as in tile_block.
template <bool LOAD>
__attribute__((target("amx-tile,amx-bf16,prfchw"))) void wide_block_2x3(
    const char* a, int64_t a_tiles, const char* b, int64_t panel_bytes, int64_t k_tiles,
    float* dst, int64_t ld, bool streamed_b) {
  float* lower = dst + kTileRows * (ld / 4);
  float* const t[6] = {dst, dst + 16, dst + 32, lower, lower + 16, lower + 32};
  const char* a1 = a + a_tiles;
  init_six<LOAD>(t, ld);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* bk = b + kt * kBTileBytes;
    if constexpr (!LOAD) prefetch_store_rows(dst, ld, 2 * kTileRows, 3, kt, k_tiles);
    if (streamed_b) prefetch_b_ahead<3>(bk, panel_bytes);
    const int64_t o = kt * kBTileBytes;
    _tile_loadd(6, a + o, 64);
    _tile_loadd(7, bk, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, a1 + o, 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, bk + panel_bytes, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, a + o, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, bk + 2 * panel_bytes, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, a1 + o, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  store_six(t, ld);
}

// 3 row tiles x 2 panels, for steps of 33-48 rows (a speculative verify of 8 sequences): C(m, n)
// = 2 m + n, A and B one register each; each B tile is loaded once and feeds three TDPBF16PS, the
// A tiles come from L1 (five loads per k step). Before it, those rows ran a 2 x 3 pass over a
// group of panels from memory and then a 1 x 6 pass over the same panels from L2, which the
// weight stream did not overlap. t[i] / ld[i]: C tile i's destination and row stride (bytes), so
// that whole row tiles go straight to c while a partial third one goes through a buffer;
// store_rows rows from t[0] (stride ld[0]) are prefetched for writing by a store.
template <bool LOAD>
__attribute__((target("amx-tile,amx-bf16,prfchw"))) void wide_block_3x2(
    const char* a, int64_t a_tiles, const char* b, int64_t panel_bytes, int64_t k_tiles,
    float* const* t, const int64_t* ld, int64_t store_rows) {
  const char* a1 = a + a_tiles;
  const char* a2 = a1 + a_tiles;
  init_six_at<LOAD>(t, ld);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* bk = b + kt * kBTileBytes;
    if constexpr (!LOAD) prefetch_store_rows(t[0], ld[0], store_rows, 2, kt, k_tiles);
    prefetch_b_ahead<2>(bk, panel_bytes);
    const int64_t o = kt * kBTileBytes;
    _tile_loadd(7, bk, 64);
    _tile_loadd(6, a + o, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, a1 + o, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, a2 + o, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, bk + panel_bytes, 64);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(6, a1 + o, 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(6, a + o, 64);
    _tile_dpbf16ps(1, 6, 7);
  }
  store_six_at(t, ld);
}

// The 3 x 2 block at rows row0 (3 row tiles, the third possibly partial: M > row0 + 32) and
// panels p, p + 1, both of whose output columns exist. A store or an accumulate writes its two
// whole row tiles straight to c and the third through a buffer when partial (an accumulate's
// buffer starts from c's values); SwiGLU goes through a buffer whole.
inline void run_tall_block(const char* a, int64_t lda, const char* b, int64_t panel_bytes,
                           int64_t k_tiles, int64_t row0, int64_t M, int64_t p, int64_t N,
                           int64_t out_per_panel, GemmEpilogue E, float* c, int64_t ldc) {
  constexpr int64_t kRows = 3 * kTileRows, kCols = 2 * kPanelCols, buf_ld = kCols * 4;
  alignas(64) float buf[kRows * kCols];
  const char* bp = b + p * panel_bytes;
  float* t[6];
  int64_t ld[6];
  const bool third_whole = row0 + kRows <= M;
  for (int i = 0; i < 6; ++i) {
    const int64_t m = i / 2, n = i % 2;
    const bool direct = E != kSwiGlu && (m < 2 || third_whole);
    t[i] = direct ? c + (row0 + m * kTileRows) * ldc + (p + n) * kPanelCols
                  : buf + (E == kSwiGlu ? m * kTileRows : 0) * kCols + n * kPanelCols;
    ld[i] = direct ? ldc * 4 : buf_ld;
  }
  const int64_t store_rows = E == kSwiGlu ? 0 : third_whole ? kRows : 2 * kTileRows;
  auto tiles = [&](auto load) {
    wide_block_3x2<decltype(load)::value>(a, kTileRows * lda, bp, panel_bytes, k_tiles, t, ld,
                                          store_rows);
  };
  if (E == kSwiGlu) {
    tiles(std::false_type{});
    buffer_block<false>(buf, row0, M, 2, p, N, out_per_panel, E, c, ldc, kRows, kCols);
    return;
  }
  if (third_whole) {
    E == kAccumulate ? tiles(std::true_type{}) : tiles(std::false_type{});
    return;
  }
  const int64_t row2 = row0 + 2 * kTileRows;
  if (E == kAccumulate) {
    buffer_block<true>(buf, row2, M, 2, p, N, out_per_panel, E, c, ldc, kTileRows, kCols);
    tiles(std::true_type{});
  } else {
    tiles(std::false_type{});
  }
  buffer_block<false>(buf, row2, M, 2, p, N, out_per_panel, E, c, ldc, kTileRows, kCols);
}

// A wide block of MT row tiles at rows row0 and panels from p (6 panels for MT = 1, 3 for MT =
// 2), all of whose output columns exist. Rows past M, and SwiGLU, go through a buffer by
// buffer_block, as the 2 x 2 blocks' edge tiles do (an accumulate's buffer starts from c's
// values).
template <int MT>
void run_wide_block(const char* a, int64_t lda, const char* b, int64_t panel_bytes,
                    int64_t k_tiles, int64_t row0, int64_t M, int64_t p, int64_t N,
                    int64_t out_per_panel, GemmEpilogue E, float* c, int64_t ldc,
                    bool streamed_b) {
  constexpr int kPanels = MT == 1 ? 6 : 3;
  constexpr int64_t kRows = MT * kTileRows, kCols = kPanels * kPanelCols;
  const char* bp = b + p * panel_bytes;
  auto tiles = [&](auto load, float* d, int64_t ld_bytes) {
    constexpr bool kLoad = decltype(load)::value;
    if constexpr (MT == 1)
      wide_block_1x6<kLoad>(a, bp, panel_bytes, k_tiles, d, ld_bytes);
    else
      wide_block_2x3<kLoad>(a, kTileRows * lda, bp, panel_bytes, k_tiles, d, ld_bytes,
                            streamed_b);
  };
  if (E != kSwiGlu && row0 + kRows <= M) {
    float* dst = c + row0 * ldc + p * kPanelCols;
    if (E == kAccumulate)
      tiles(std::true_type{}, dst, ldc * 4);
    else
      tiles(std::false_type{}, dst, ldc * 4);
    return;
  }
  alignas(64) float buf[kRows * kCols];
  if (E == kAccumulate) {
    buffer_block<true>(buf, row0, M, kPanels, p, N, out_per_panel, E, c, ldc, kRows, kCols);
    tiles(std::true_type{}, buf, kCols * 4);
  } else {
    tiles(std::false_type{}, buf, kCols * 4);
  }
  buffer_block<false>(buf, row0, M, kPanels, p, N, out_per_panel, E, c, ldc, kRows, kCols);
}

}  // namespace amx_blocks
}  // namespace pagedllm
#endif  // PAGEDLLM_AMX
