// y = x W^T for bf16 weights on Intel AMX tiles (Sapphire Rapids and later Xeons).
//
// TDPBF16PS multiplies a tile of 16 rows x 32 bf16 (A) by a tile of 16 (k, k + 1) pair rows x 16
// columns (B, the "VNNI" layout) into a 16 x 16 fp32 tile (C) in 16 cycles: 16 times the bf16
// work per instruction of AVX512-BF16's vdpbf16ps (Intel 64 and IA-32 Architectures Optimization
// Reference Manual, chapter "Intel AMX"). gemm_pack_weight's bf16 panels ([K / 2][16 columns x
// (k, k + 1)], 64 bytes per k pair) are already that B layout: 16 k pairs of one panel are one
// 1 KiB B tile, so the kernel loads the weights the vdpbf16ps kernel loads, in place.
//
// Blocking: the 8 tile registers hold 2 x 2 C tiles (32 rows x 2 panels), 2 A tiles and 2 B
// tiles; per 32-wide k step the kernel loads 2 A and 2 B tiles and issues 4 TDPBF16PS. Up to
// kWideRows rows (decode), wide blocks of 1 x 6 or 2 x 3 C tiles, with one A and one B register,
// stream more panels at once (decode steps 7-13 % faster at batch 1-16). 2 x 2 and 2 x 3 blocks
// that read their panels from memory prefetch them two k steps ahead into L1 (prefetch_b_ahead;
// 1 x 6 blocks keep pace with memory without). x is
// rounded to a bf16 copy in tile order (each A tile one contiguous KiB), padded to a multiple of
// 16 rows (the pad rows are zero; at decode sizes the tiles are far from the bottleneck, which
// is streaming the weights). At decode sizes the threads split the panels, so each weight byte
// is read from memory once per block of rows and reused from L1 by the block's other row tiles,
// as in gemm.cpp; each thread rounds all rows of a block into its own copy. From kRowSplitRows
// rows per thread (prefill) they split the rows instead, each rounding its own rows and running
// them against L2-sized groups of panels. Rows come in blocks
// of about kRowBlockBytes of bf16 x, so prefill-sized x stays in L2 across the panels. Whole C
// tiles of a store go straight to the output and those of an accumulate start from it (the
// residual add costs no pass); edge tiles and SwiGLU go through a small buffer and a vector
// epilogue (SwiGLU two panels per SiLU vector). Store-only blocks ask for their output lines
// (PREFETCHW) while their k loop runs. The operand a pass reads once is loaded with TILELOADDT1
// (Stream), so it does not evict the reused one from L1: A in the panel split, B in the row
// split.
#include "gemm_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "vec.h"

namespace pagedllm {
namespace {

std::atomic<bool> amx_on{true};

#if defined(PAGEDLLM_AMX)
using namespace amx;
constexpr int kPanelCols = 16;                // columns of a panel (a B or C tile's width)
constexpr int64_t kBTileBytes = 16 * 64;      // one B tile: 16 k pairs x 16 columns x 4 bytes
constexpr int64_t kRowBlockBytes = 512 << 10; // bf16 x per pass over the panels (L2-resident)
constexpr int64_t kPanelGroupBytes = 512 << 10;  // panels kept in L2 across a row block (row split)
constexpr int64_t kPanelPair = 2;  // the panel split's group: one pair of panels
constexpr int64_t kRowSplitRows = 192;  // rows per thread from which the threads split the rows
// The panel split streams A from this much bf16 x on: x too large to stay in L1 (48 KiB per core
// on Sapphire Rapids and Granite Rapids) with a panel pair beside it anyway.
constexpr int64_t kStreamABytes = 96 << 10;
// Wide blocks (see wide_block_1x6) up to this many rows, and their panel groups past 32 rows:
// the four linears x 30 layers on an AMX Xeon, against 2 x 2 blocks, 33 rows 16.25 -> 14.96 ms,
// 48 rows 17.2-17.4 -> 16.3-16.4, 64 rows 18.8 -> 18.4-18.5, 80 rows 21.1 -> 20.6; at 96 and 128
// rows 2-3 % slower (groups of 3 panels: 33-80 rows 1-5 % faster).
constexpr int64_t kWideRows = 80;
constexpr int64_t kWideGroup = 6;

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
// tile blocks and 2 x 3 blocks whose panels come from memory (a group's first row block). It
// matters for blocks of two row tiles: they issue two TDPBF16PS per B tile, and a tile load that misses L1 holds up the tile
// instructions behind it, so the second row tile's work added to the weight stream's time
// instead of hiding under it. One thread, 18 KiB panels streamed from a 192 MiB buffer, ns per
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

// C tiles 0-5 of a wide block at t[0..5] (row stride ld bytes): loaded (LOAD) or zeroed, and
// stored back.
template <bool LOAD, int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void init_six(float* const* t, int64_t ld) {
  if constexpr (I < 6) {
    if constexpr (LOAD)
      load_tile<I>(t[I], ld);
    else
      zero_tile<I>();
    init_six<LOAD, I + 1>(t, ld);
  }
}

template <int I = 0>
__attribute__((target("amx-tile,amx-bf16"))) inline void store_six(float* const* t, int64_t ld) {
  if constexpr (I < 6) {
    store_tile<I>(t[I], ld);
    store_six<I + 1>(t, ld);
  }
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

// One thread's panels [p0, p1) over the bf16 rows xb (row m0 of x first) [m0, m1), multiples of
// 16 with m1 at most M rounded up to 16, in blocks of 2 x 2 tiles (4 tile loads per 4
// TDPBF16PS). The panels go in groups of `group`: each group runs over all row blocks, a row
// block over all the group's panels. kPanelPair (the threads' split of the panels, small M) runs
// all row blocks of a panel pair before the next pair, so the pair's panels come from memory for
// its first rows and from L1 for the rest. A group of ~kPanelGroupBytes (the row split, large M)
// keeps the group's panels in L2 while a row block's A tiles stay in L1 across them and its
// output rows are written left to right. (Measured on an AMX Xeon at 48-64 rows: 1 panel x 4
// row tiles per pass, every B tile loaded once, was 3-4 % slower, its 4 A tile loads per B tile
// coming from L2; software prefetches of the panels ahead in every row block, into L1 or L2, up
// to 15 % slower than the hardware prefetchers alone: only the first row block, the one that
// reads the panels from memory, prefetches them, prefetch_b_ahead.)
template <Stream S>
void run_panels(const char* xb, int64_t lda, const char* b, int64_t panel_bytes, int64_t k_tiles,
                int64_t p0, int64_t p1, int64_t group, int64_t m0, int64_t m1, int64_t M,
                int64_t N, int64_t out_per_panel, GemmEpilogue E, float* c, int64_t ldc,
                bool wide = false) {
  alignas(64) float buf[2 * kTileRows * kBufCols];
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
      const int MT = m + kTileRows < m1 ? 2 : 1;
      const char* a = xb + (m - m0) * lda;
      // The group's first row block reads its panels from memory, the others from L1 / L2,
      // where a prefetch only costs (wide 2 x 3 blocks with B in L2: 18.5 -> 20.9 ns per KiB).
      const bool streamed_b = m == m0 && S != Stream::kB;
      for (int64_t p = g0; p < g1;) {
        const int64_t np = MT == 1 ? 6 : 3;  // a wide block's panels
        if (wide && p + np <= g1 && (p + np) * out_per_panel <= N) {
          if (MT == 1)
            run_wide_block<1>(a, lda, b, panel_bytes, k_tiles, m, M, p, N, out_per_panel, E, c,
                              ldc, streamed_b);
          else
            run_wide_block<2>(a, lda, b, panel_bytes, k_tiles, m, M, p, N, out_per_panel, E, c,
                              ldc, streamed_b);
          p += np;
          continue;
        }
        const int NT = p + 1 < g1 ? 2 : 1;
        const bool whole = (p + NT) * out_per_panel <= N && m + MT * kTileRows <= M;
        const char* bp = b + p * panel_bytes;
        auto run = [&](auto mt, auto nt) {
          run_block<decltype(mt)::value, decltype(nt)::value, S>(
              a, lda, bp, panel_bytes, k_tiles, whole, m, M, p, N, out_per_panel, E, c, ldc, buf,
              streamed_b);
        };
        if (MT == 2)
          NT == 2 ? run(Two{}, Two{}) : run(Two{}, One{});
        else
          NT == 2 ? run(One{}, Two{}) : run(One{}, One{});
        p += NT;
      }
    }
  }
}

// The calling thread's own block of bf16 x rows (n values, 64-byte aligned), kept between calls:
// a fresh allocation's page faults cost as much as the rounding.
vec::bf16* rows_scratch(int64_t n) {
  thread_local std::vector<vec::bf16> buffer;
  return aligned_scratch(buffer, static_cast<size_t>(n));
}

// x rows [m0, m1) (row stride ldx) -> bf16 in xb, rows from M on zero. xb holds row tiles from
// row `base` on in tile order: row r's 32-wide k step kt is row (r - base) % 16 of the 1 KiB A
// tile ((r - base) / 16, kt), so every tile load reads one contiguous KiB. Rounded to nearest
// even by vcvtne2ps2bf16 (AMX CPUs have AVX512-BF16), which also flushes fp32 denormals to zero.
__attribute__((target("avx512bf16"))) void round_rows(const float* x, int64_t ldx, int64_t K,
                                                     int64_t base, int64_t m0, int64_t m1,
                                                     int64_t M, vec::bf16* xb) {
  for (int64_t r = m0; r < m1; ++r) {
    const int64_t i = r - base;
    auto* dst = reinterpret_cast<char*>(xb + i / kTileRows * kTileRows * K) +
                i % kTileRows * kTileK * 2;
    const float* src = x + r * ldx;
    for (int64_t k = 0; k < K; k += kTileK, dst += kBTileBytes) {
      const __m512i v = r < M ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16),
                                                             _mm512_loadu_ps(src + k))
                              : _mm512_setzero_si512();
      _mm512_store_si512(dst, v);
    }
  }
}
#endif  // PAGEDLLM_AMX

}  // namespace

bool gemm_amx_enabled() { return amx_on.load(std::memory_order_relaxed) && amx::tiles_usable(); }

bool set_gemm_amx(bool on) {
  amx_on.store(on, std::memory_order_relaxed);
  return gemm_amx_enabled();
}

void gemm_amx_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, const uint32_t* panels,
                   int64_t num_panels, int64_t N, GemmEpilogue E, float* c, int64_t ldc) {
#if defined(PAGEDLLM_AMX)
  if (M == 0 || N == 0) return;
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t lda = K * static_cast<int64_t>(sizeof(vec::bf16));
  const int64_t panel_bytes = K / 2 * kBTileBytes / 16;
  const int64_t k_tiles = K / kTileK;
  const int64_t out_per_panel = E == kSwiGlu ? kPanelCols / 2 : kPanelCols;
  const int64_t block =
      std::min(Mp, std::max<int64_t>(2 * kTileRows, kRowBlockBytes / lda / 32 * 32));
  const auto* b = reinterpret_cast<const char*>(panels);
  const int64_t threads = at::get_num_threads();
  if (Mp >= kRowSplitRows * threads) {
    // Large M: each thread rounds its own rows (into its own L2) and runs them against every
    // panel, the panels in L2-sized groups. Splitting the panels instead made every thread read
    // the whole of x, half of it from the other core's L2 (the rounding is split too), and
    // wrote each output column strip top to bottom: on an AMX Xeon at 512-2048 rows the row
    // split is 1.13-1.35x faster (docs/dtype.md), although every thread reads every weight.
    const int64_t pairs = (Mp / kTileRows + 1) / 2;  // row tiles in pairs
    const int64_t group = std::max<int64_t>(2, kPanelGroupBytes / panel_bytes / 2 * 2);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      vec::bf16* const xt = rows_scratch(block * K);  // this worker's own rows only
      load_tile_config();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = std::min(Mp, pairs * t / threads * 2 * kTileRows);
        const int64_t r1 = std::min(Mp, pairs * (t + 1) / threads * 2 * kTileRows);
        for (int64_t m0 = r0; m0 < r1; m0 += block) {
          const int64_t m1 = std::min(r1, m0 + block);
          round_rows(x, ldx, K, m0, m0, m1, M, xt);
          run_panels<Stream::kB>(reinterpret_cast<const char*>(xt), lda, b, panel_bytes,
                                 k_tiles, 0, num_panels, group, m0, m1, M, N, out_per_panel, E,
                                 c, ldc);
        }
      }
      release_tiles();
    });
    return;
  }
  // Small M (decode): the threads split the panels, so each weight byte is read from memory
  // once. Each thread rounds every row of a block into its own rows_scratch: reading the calling
  // thread's rounded tiles instead made the other thread fetch them from the first core's cache
  // in 1 KiB tile loads, which cost more than rounding the fp32 rows again (on an AMX Xeon with
  // the weights in L2, 960 x 576 at 16 rows 16.9 -> 12.2 us, at 64 rows 44.3 -> 33.8 us;
  // decode steps of the bundled model 1-2 % faster at batch 1-64, docs/dtype.md, session 28).
  // Wide blocks: over the thread's whole panel range when all rows fit in two row tiles; with
  // more, over groups of kWideGroup panels, each row block after the first reading the group's
  // panels from L2.
  const bool wide = Mp <= kWideRows;
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    vec::bf16* const xt = rows_scratch(block * K);
    load_tile_config();
    for (int64_t m0 = 0; m0 < Mp; m0 += block) {
      const int64_t m1 = std::min(Mp, m0 + block);
      round_rows(x, ldx, K, m0, m0, m1, M, xt);
      const auto* xd = reinterpret_cast<const char*>(xt);
      if (wide)
        run_panels<Stream::kNone>(xd, lda, b, panel_bytes, k_tiles, p0, p1,
                                  Mp <= 2 * kTileRows ? p1 - p0 : kWideGroup, m0, m1, M, N,
                                  out_per_panel, E, c, ldc, true);
      else if ((m1 - m0) * lda >= kStreamABytes)
        run_panels<Stream::kA>(xd, lda, b, panel_bytes, k_tiles, p0, p1, kPanelPair, m0, m1, M,
                               N, out_per_panel, E, c, ldc);
      else
        run_panels<Stream::kNone>(xd, lda, b, panel_bytes, k_tiles, p0, p1, kPanelPair, m0, m1,
                                  M, N, out_per_panel, E, c, ldc);
    }
    release_tiles();
  });
#else
  (void)x, (void)M, (void)K, (void)ldx, (void)panels, (void)num_panels, (void)N, (void)E, (void)c,
      (void)ldc;
#endif
}

}  // namespace pagedllm
