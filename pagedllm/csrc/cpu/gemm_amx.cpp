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
// stream more panels at once (decode steps 7-13 % faster at batch 1-16), and from 33 rows on 3 x
// 2 blocks take the first three row tiles in one pass over the weights (run_tall_block). 2 x 2,
// 2 x 3 and 3 x 2 blocks that read their panels from memory prefetch them two k steps ahead into
// L1 (prefetch_b_ahead; 1 x 6 blocks keep pace with memory without). x is
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
#include "gemm_amx_blocks.h"
#include "vec.h"

namespace pagedllm {
namespace {

std::atomic<bool> amx_on{true};

#if defined(PAGEDLLM_AMX)
using namespace amx;
using namespace amx_blocks;
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

// One thread's panels [p0, p1) over the bf16 rows xb (row m0 of x first) [m0, m1), multiples of
// 16 with m1 at most M rounded up to 16, in blocks of 2 x 2 tiles (4 tile loads per 4
// TDPBF16PS), or with `wide` in wide blocks: 3 x 2 blocks for the first three row tiles when
// there are three or more, then 2 x 3 / 1 x 6 blocks. The panels go in groups of `group`: each
// group runs over all row blocks, a row block over all the group's panels. kPanelPair (the
// threads' split of the panels, small M) runs all row blocks of a panel pair before the next
// pair, so the pair's panels come from memory for its first rows and from L1 for the rest. A
// group of ~kPanelGroupBytes (the row split, large M) keeps the group's panels in L2 while a row
// block's A tiles stay in L1 across them and its output rows are written left to right.
// (Measured on an AMX Xeon at 48-64 rows: 1 panel x 4 row tiles per pass, every B tile loaded
// once, was 3-4 % slower than 2 x 2 blocks, and 3-13 % slower than 3 x 2 + 1 x 6 blocks with B
// prefetched too (session 35), its 4 A tile loads per B tile coming from L2; software prefetches
// of the panels ahead in every row block, into L1 or L2, up to 15 % slower than the hardware
// prefetchers alone: only the first row block, the one that reads the panels from memory,
// prefetches them, prefetch_b_ahead.)
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
    int64_t m_first = m0;  // the rows left for the blocks below
    if (wide && m1 - m0 >= 3 * kTileRows) {
      // The first 3 row tiles in 3 x 2 blocks, the group's panels from memory; the rest, if
      // any, below from L2.
      const int64_t m3 = m0 + 3 * kTileRows;
      int64_t p = g0;
      for (; p + 2 <= g1 && (p + 2) * out_per_panel <= N; p += 2)
        run_tall_block(xb, lda, b, panel_bytes, k_tiles, m0, M, p, N, out_per_panel, E, c, ldc);
      if (p < g1)  // an odd last panel, or one with missing columns
        run_panels<S>(xb, lda, b, panel_bytes, k_tiles, p, g1, g1 - p, m0, m3, M, N,
                      out_per_panel, E, c, ldc);
      m_first = m3;
    }
    for (int64_t m = m_first; m < m1; m += 2 * kTileRows) {
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
