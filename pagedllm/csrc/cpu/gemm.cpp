// y = x W^T in fp32 for the decode step's linear layers (and every other row count).
//
// A register-blocked GEMM in the layout popularised by BLIS / GotoBLAS (Goto & van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008, section 6): the weight is
// packed once at load time into panels of 16 output columns stored k-major ([K][16], 64 bytes per
// k), the rows of x are packed per call into tiles of MR rows stored k-major ([K][MR]), and an
// MR x 16 micro-kernel keeps its accumulators in registers for the whole K loop. AVX2: 6 rows x 2
// registers; per k it loads 2 weight vectors, broadcasts 6 x values and issues 12 FMAs. AVX-512:
// 12 rows x 1 register; per k 1 weight vector, 12 broadcasts, 12 FMAs.
//
// bf16 weights (avx512 variant, CPUs with AVX512-BF16): panels of (k, k + 1) bf16 pairs, [K/2][16]
// x 32 bits; x rows are rounded to bf16 pairs per call and vdpbf16ps adds both products of a pair
// to fp32 accumulators; 6 rows x 4 panels per call (24 accumulators), so each broadcast of x
// feeds 4 instructions, and the next 4 panels are prefetched into L2 while these compute (from 7
// rows on: balanced tiles of 6-12 rows, all of a tile's rows x 2 panels per call instead).
// On Intel CPUs the same panels run on fp32 FMAs instead (micro_kernel_bf16_fma): vdpbf16ps
// issues there at a quarter of the FMA rate.
//
// Why not oneDNN's packed matmul (what torch's mkldnn linear runs)? On a 2-core AVX2 EPYC (Zen 3),
// at the decode step's 64 rows it reached ~105-115 GFLOP/s against ~130-150 for this kernel (the
// FMA peak is ~200); on Zen 4 (AVX-512) this kernel is 1.08-1.23x oneDNN at 1-64 rows in fp32 and
// 1.13-1.25x in bf16 (1.0x at 256 rows, 357-376 GFLOP/s of vdpbf16ps's 459 peak on 2 cores; fed
// float32 rows, as the fused op feeds it); see benchmarks/gemm.py. Running
// the linears here also lets all layers of a step run in one C++ op (fused_layer.cpp).
//
// Threads split the weight panels, so each panel is streamed from memory once per block of rows
// (by the block's first row tile, which also prefetches ahead) and then reused from L1/L2 by the
// block's other row tiles; a block's packed x stays in L2.
//
// Two epilogues save a pass over the output: accumulate (out += x W^T: the residual add after the
// down projection) and SwiGLU (the gate/up weight packed so that a panel's two halves are 8 gate
// and the matching 8 up columns; the tile stores silu(gate) * up, never the [M, 2I] product).
#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_amx.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define PAGEDLLM_GEMM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GEMM_AVX2 1
#endif

namespace pagedllm {
namespace {

constexpr int NR = kGemmPanel;
// Rows per micro-kernel tile: the accumulators are MR x 16 floats, 12 AVX2 registers for 6 rows;
// an AVX-512 register holds a whole panel row, so 12 rows keep 12 FMA chains in flight (two
// 512-bit FMA ports x 4-6 cycles of latency need at least 8).
#if defined(PAGEDLLM_GEMM_AVX512)
constexpr int MR = 12;
constexpr int kPanelAlign = 64;  // bytes: the kernels' aligned zmm loads
#else
constexpr int MR = 6;
constexpr int kPanelAlign = 32;
#endif
constexpr int kPrefetch = 24;  // k steps ahead (24 x 64 bytes) for the first tile of a panel
constexpr int kFmaBlockK = 16;  // k per block of the FMA loop's packed x (one 64-byte line)
constexpr int64_t kTileBlockBytes = 384 << 10;  // packed x per pass of the panels (see run)
constexpr int64_t kOwnPackTiles = 2;  // up to this many row tiles, each thread packs x (see run)

// Software prefetch of a bf16 micro-kernel: count lines per k step (0: none), into L1 or L2, and
// a second stream of count2 lines into L2 (the next group's panels when a group gets one call).
struct Prefetch {
  const uint32_t* at = nullptr;
  int count = 0;
  int64_t stride = 0;
  bool l2 = false;
  const uint32_t* at2 = nullptr;
  int count2 = 0;
  int64_t stride2 = 0;
};

// Row i of a finished tile (lo = columns 0-7, hi = 8-15) into c.
template <int E>
inline void finish_row(const float* lo, const float* hi, float* c) {
  if (E == kStore) {
    std::memcpy(c, lo, 8 * sizeof(float));
    std::memcpy(c + 8, hi, 8 * sizeof(float));
  } else if (E == kAccumulate) {
    for (int j = 0; j < 8; ++j) c[j] += lo[j];
    for (int j = 0; j < 8; ++j) c[8 + j] += hi[j];
  } else {
    vec::silu_mul_row(lo, hi, c, 8);  // 8 output columns per panel
  }
}

#if defined(PAGEDLLM_GEMM_AVX512)
// A bf16 micro-kernel's prefetches for k step k (always inlined: it runs in the kernels' loops).
__attribute__((always_inline)) inline void prefetch_step(const Prefetch& pf, int64_t k) {
  for (int j = 0; j < pf.count; ++j) {
    const char* line = reinterpret_cast<const char*>(pf.at + j * pf.stride + k * NR);
    if (pf.l2)
      _mm_prefetch(line, _MM_HINT_T1);
    else
      _mm_prefetch(line, _MM_HINT_T0);
  }
  for (int j = 0; j < pf.count2; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(pf.at2 + j * pf.stride2 + k * NR), _MM_HINT_T1);
}

// A finished AVX-512 tile (one register per row, 16 columns) into c with epilogue E.
template <int ROWS, int E>
inline void store_tile(const __m512* acc, float* c, int64_t ldc) {
  if (E == kStore) {
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
  } else if (E == kAccumulate) {
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i)
      _mm512_storeu_ps(c + i * ldc, _mm512_add_ps(_mm512_loadu_ps(c + i * ldc), acc[i]));
  } else {
    // A row's register holds 8 gate then 8 up columns: two rows make one full-width silu(g) * u.
    int i = 0;
    for (; i + 1 < ROWS; i += 2) {
      const __m512 y = vec::silu_mul(_mm512_shuffle_f32x4(acc[i], acc[i + 1], 0x44),
                                     _mm512_shuffle_f32x4(acc[i], acc[i + 1], 0xEE));
      _mm256_storeu_ps(c + i * ldc, _mm512_castps512_ps256(y));
      _mm256_storeu_ps(c + (i + 1) * ldc, _mm512_extractf32x8_ps(y, 1));
    }
    if (i < ROWS) {
      const __m512 y = vec::silu_mul(acc[i], _mm512_shuffle_f32x4(acc[i], acc[i], 0xEE));
      _mm256_storeu_ps(c + i * ldc, _mm512_castps512_ps256(y));
    }
  }
}

// bf16 panels: a_tile [K2][lda] and the panel [K2][16] hold (k, k + 1) bf16 pairs in 32 bits;
// vdpbf16ps adds both products of a pair to the fp32 accumulator. NP panels at once (b, then
// b + panel_stride; outputs c, then c + c_step): each broadcast of x feeds NP instructions.
// Per k step it prefetches pf.count lines, pf.at + j * pf.stride + k * NR (see run_bf16).
template <int ROWS, int E, int NP>
__attribute__((target("avx512bf16"))) void micro_kernel_bf16(const uint32_t* a, int64_t lda,
                                                           const uint32_t* b, int64_t K2,
                                                           int64_t panel_stride,
                                                           float* c, int64_t c_step, int64_t ldc,
                                                           Prefetch pf) {
  __m512 acc[NP][ROWS];
#pragma GCC unroll 24
  for (int n = 0; n < NP * ROWS; ++n) acc[n / ROWS][n % ROWS] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    prefetch_step(pf, k);
    __m512bh bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) bv[j] = (__m512bh)_mm512_load_si512(b + j * panel_stride + k * NR);
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a[k * lda + i]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], av, bv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) store_tile<ROWS, E>(acc[j], c + j * c_step, ldc);
}

// The same bf16 panels on fp32 FMAs (gemm_bf16_fma_enabled()): a [ceil(2 K2 / 16)][lda][16]
// holds x's bf16-rounded values as floats in blocks of 16 k, a row's 16 values one cache line
// (kFmaBlockK). The pack is whole-vector stores, no transposition, and a k step's broadcasts
// sit at fixed offsets from one pointer (a row-major tile cost a pointer per row, more than the
// general registers, reloaded from the stack: 108 against 148 GFLOP/s on one core). A bf16 pair
// widens to two fp32 vectors by a shift (k) and a mask (k + 1), so each accumulator adds its
// products in k order, as the fp32 kernel's do. On a Xeon without AMX (family 6 model 207)
// vdpbf16ps issues one per ~2.3 cycles against ~2 FMAs per cycle: on one core with the operands
// in cache this loop runs 143-149 GFLOP/s (of a ~165 FMA peak), the vdpbf16ps loop 83.
template <int ROWS, int E, int NP>
void micro_kernel_bf16_fma(const float* a, int64_t lda, const uint32_t* b, int64_t K2,
                           int64_t panel_stride, float* c, int64_t c_step, int64_t ldc,
                           Prefetch pf) {
  __m512 acc[NP][ROWS];
#pragma GCC unroll 24
  for (int n = 0; n < NP * ROWS; ++n) acc[n / ROWS][n % ROWS] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* block = a;  // the 16-k block of k step k
  int64_t in_block = 0;    // k's pair index in it
  for (int64_t k = 0; k < K2; ++k) {
    prefetch_step(pf, k);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {  // k = 2k (low bf16 of each pair), then 2k + 1
      __m512 bv[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const __m512i v = _mm512_load_si512(b + j * panel_stride + k * NR);
        bv[j] = _mm512_castsi512_ps(half ? _mm512_and_si512(v, high_half)
                                         : _mm512_slli_epi32(v, 16));
      }
      const float* ak = block + 2 * in_block + half;
#pragma GCC unroll 12
      for (int i = 0; i < ROWS; ++i) {
        const __m512 av = _mm512_set1_ps(ak[i * kFmaBlockK]);
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) acc[j][i] = _mm512_fmadd_ps(av, bv[j], acc[j][i]);
      }
    }
    if (++in_block == kFmaBlockK / 2) {
      in_block = 0;
      block += lda * kFmaBlockK;
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) store_tile<ROWS, E>(acc[j], c + j * c_step, ldc);
}
#endif

// c[0:rows, 0:NR] (row stride ldc) = a_tile[K][lda] . panel[K][NR]; rows <= ROWS <= lda, MR.
template <int ROWS, bool PREFETCH, int E>
inline void micro_kernel(const float* a, int64_t lda, const float* b, int64_t K, float* c,
                         int64_t ldc) {
#if defined(PAGEDLLM_GEMM_AVX512)
  // One register per row; each lane adds its column's products in k order, as the AVX2 kernel's
  // lanes do, so both variants' sums have the same bits.
  __m512 acc[ROWS];
#pragma GCC unroll 12
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kPrefetch) * NR), _MM_HINT_T0);
    const __m512 bv = _mm512_load_ps(b + k * NR);
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[k * lda + i]), bv, acc[i]);
  }
  store_tile<ROWS, E>(acc, c, ldc);
#elif defined(PAGEDLLM_GEMM_AVX2)
  __m256 lo[ROWS], hi[ROWS];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kPrefetch) * NR), _MM_HINT_T0);
    const __m256 b0 = _mm256_load_ps(b + k * NR);
    const __m256 b1 = _mm256_load_ps(b + k * NR + 8);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + k * lda + i);
      lo[i] = _mm256_fmadd_ps(av, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(av, b1, hi[i]);
    }
  }
  if (E == kStore) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      _mm256_storeu_ps(c + i * ldc, lo[i]);
      _mm256_storeu_ps(c + i * ldc + 8, hi[i]);
    }
  } else if (E == kAccumulate) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      _mm256_storeu_ps(c + i * ldc, _mm256_add_ps(_mm256_loadu_ps(c + i * ldc), lo[i]));
      _mm256_storeu_ps(c + i * ldc + 8, _mm256_add_ps(_mm256_loadu_ps(c + i * ldc + 8), hi[i]));
    }
  } else {
    alignas(32) float g[8], u[8];
    for (int i = 0; i < ROWS; ++i) {
      _mm256_store_ps(g, lo[i]);
      _mm256_store_ps(u, hi[i]);
      finish_row<E>(g, u, c + i * ldc);
    }
  }
#else
  float acc[ROWS][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += a[k * lda + i] * b[k * NR + j];
  for (int i = 0; i < ROWS; ++i) finish_row<E>(acc[i], acc[i] + 8, c + i * ldc);
#endif
}

// micro_kernel<rows> for 1 <= rows <= ROWS (= MR at the top call).
template <bool PREFETCH, int E, int ROWS = MR>
void tile(int rows, const float* a, int64_t lda, const float* b, int64_t K, float* c,
          int64_t ldc) {
  if constexpr (ROWS == 1) {
    micro_kernel<1, PREFETCH, E>(a, lda, b, K, c, ldc);
  } else if (rows == ROWS) {
    micro_kernel<ROWS, PREFETCH, E>(a, lda, b, K, c, ldc);
  } else {
    tile<PREFETCH, E, ROWS - 1>(rows, a, lda, b, K, c, ldc);
  }
}

// micro_kernel_bf16<rows> (FMA: micro_kernel_bf16_fma, a then 16-k blocks of floats) for
// 1 <= rows <= ROWS over NP panels; only called where gemm_bf16_supported().
template <int E, int NP, bool FMA, int ROWS = MR>
void tile_bf16(int rows, const void* a, int64_t lda, const uint32_t* b, int64_t K2,
               int64_t panel_stride, float* c, int64_t c_step, int64_t ldc, Prefetch pf) {
#if defined(PAGEDLLM_GEMM_AVX512)
  if (ROWS > 1 && rows < ROWS) {
    if constexpr (ROWS > 1)
      tile_bf16<E, NP, FMA, ROWS - 1>(rows, a, lda, b, K2, panel_stride, c, c_step, ldc, pf);
  } else if constexpr (FMA) {
    micro_kernel_bf16_fma<ROWS, E, NP>(static_cast<const float*>(a), lda, b, K2, panel_stride,
                                       c, c_step, ldc, pf);
  } else {
    micro_kernel_bf16<ROWS, E, NP>(static_cast<const uint32_t*>(a), lda, b, K2, panel_stride,
                                   c, c_step, ldc, pf);
  }
#else
  TORCH_CHECK(false, "bf16 GEMM panels need the avx512 kernel variant");
#endif
}

// x [K] fp32 -> [ceil(K / 2)] (k, k + 1) bf16 pairs (little-endian: the bf16 row itself, an
// odd K padded with 0), rounded to nearest even as c10::BFloat16.
inline void round_row_bf16(const float* x, int64_t K, uint32_t* pairs) {
  auto* out = reinterpret_cast<vec::bf16*>(pairs);
  int64_t k = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  for (; k + vec::W <= K; k += vec::W) vec::store(out + k, vec::load(x + k));
#endif
  for (; k < K; ++k) vec::from_float(x[k], out + k);
  if (K % 2) pairs[K / 2] &= 0xFFFFu;
}

// k per row of the FMA loop's packed x for Ku pairs: 2 Ku rounded up to whole 16-k blocks.
inline int64_t fma_tile_k(int64_t Ku) {
  return (2 * Ku + kFmaBlockK - 1) / kFmaBlockK * kFmaBlockK;
}

// bf16 [n] -> fp32 [n], exact.
inline void widen_row_bf16(const vec::bf16* h, int64_t n, float* out) {
  int64_t k = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  for (; k + vec::W <= n; k += vec::W) vec::store(out + k, vec::load(h + k));
#endif
  for (; k < n; ++k) out[k] = vec::to_float(h[k]);
}

void check_x(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be a [M, K] float32 CPU tensor with unit inner stride");
  const bool pairs = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK((packed.scalar_type() == at::kFloat || pairs) && packed.dim() == 3 &&
                  packed.size(2) == (pairs ? 2 : 1) * kGemmPanel && packed.is_contiguous(),
              "packed must come from gemm_pack_weight or gemm_pack_swiglu_weight");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % kPanelAlign == 0,
              "packed must be ", kPanelAlign, "-byte aligned (the kernels use aligned loads)");
  const int64_t k_units = pairs ? (x.size(1) + 1) / 2 : x.size(1);
  TORCH_CHECK(packed.size(1) == k_units, "x has ", x.size(1), " columns, the weight ",
              pairs ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(!pairs || gemm_bf16_supported(),
              "bf16 GEMM panels need the avx512 kernel variant on a CPU with avx512_bf16");
}

// The columns [0, cols) of a finished edge tile [rows][NR] into dst (E: kStore or kAccumulate).
template <int E>
void add_edge(const float* edge, int rows, int64_t cols, float* dst, int64_t ldc) {
  for (int i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      dst[i * ldc + j] = (E == kAccumulate ? dst[i * ldc + j] : 0.f) + edge[i * NR + j];
}

// The row tiles of x: ceil(M / MR) tiles of up to MR rows. `balanced` (the bf16 panels' wide
// calls, M >= 7) spreads the rows evenly, so no tile is a tiny remainder (13 rows: 7 + 6, not
// 12 + 1, whose lone row would run as a latency-bound call over panels re-read from L2).
struct RowTiles {
  int64_t M, count;
  bool balanced;
  RowTiles(int64_t m, bool bal) : M(m), count((m + MR - 1) / MR), balanced(bal) {}
  // A tile's k stride in rows: MR, or M for a lone tile (a decode batch of up to MR rows), whose
  // packed rows then stay dense: 1 row of K = 1536 as [K][12] spans 72 KiB, more than L1.
  int64_t lda() const { return count == 1 ? M : MR; }
  int64_t begin(int64_t t) const { return balanced ? t * M / count : std::min(M, t * MR); }
  int rows(int64_t t) const { return static_cast<int>(begin(t + 1) - begin(t)); }
};

// One thread's panels [p0, p1) over the row tiles [t_begin, t_end) with bf16 pair panels; one
// micro-kernel call per panel group and tile. Narrow (M <= 6, one tile): groups of 4 full
// panels, then 2 or 1 (6 rows x 4 panels = 24 accumulators). Wide (M >= 7, balanced tiles of
// 6-12 rows): groups of 2 panels (2 x 12 accumulators), so every weight vector loaded feeds a
// whole tile (6-row halves of 4 panels made 7 rows cost 1.25x 6 rows, the second half
// re-reading the panels from L2 with few accumulator chains). A group's first call prefetches
// its own panels ahead; its later calls share the next group's panels (one each from four calls
// on; with fewer, each takes several, and a lone call takes them all as a second stream), so the
// weights stream into L2 while this group computes. FMA: the panels on fp32 FMAs, xd's tiles
// 16-k blocks [ceil(2 Ku / 16)][lda][16] of floats (else [Ku][lda] bf16 pairs).
template <int E, bool FMA>
void run_bf16(const void* xd, const uint32_t* b, const RowTiles& tiles, int64_t N, int64_t Ku,
              int64_t p0, int64_t p1, int64_t t_begin, int64_t t_end, float* c, int64_t ldc) {
  constexpr int64_t out_per_panel = E == kSwiGlu ? NR / 2 : NR;
  const int64_t ps = Ku * NR, full_end = std::min(p1, N / out_per_panel);
  const bool wide = tiles.balanced;
  const int64_t calls = t_end - t_begin;  // micro-kernel calls per panel group in this block
  alignas(64) float edge[MR * NR];
  const int64_t lda = tiles.lda();
  const int64_t tile_units = (FMA ? fma_tile_k(Ku) : Ku) * lda;  // 32-bit units per x tile
  for (int64_t p = p0; p < p1;) {
    const int64_t left = full_end - p;  // full panels from p in this thread's range
    const int np = left >= 4 && !wide ? 4 : left >= 2 ? 2 : 1;
    const int64_t next_np = std::min<int64_t>(wide ? 2 : 4, p1 - (p + np));
    const uint32_t* bp = b + p * ps;
    const uint32_t* next = bp + np * ps;
    const int64_t later = std::min(calls - 1, next_np);  // calls sharing the next group's panels
    Prefetch own{bp + kPrefetch * NR, np, ps};
    if (later == 0 && next_np > 0) {  // a lone call: the next group's panels too
      own.at2 = next;
      own.count2 = static_cast<int>(next_np);
      own.stride2 = ps;
    }
    // Call c >= 1 of this group prefetches the next group's panels c - 1, c - 1 + later, ...
    auto prefetch_for = [&](int call) {
      return call == 0 ? own
             : call <= later
                 ? Prefetch{next + (call - 1) * ps,
                            static_cast<int>((next_np - call + later) / later), later * ps, true}
                 : Prefetch{};
    };
    int call = 0;  // calls made on this group in this block
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int rows = tiles.rows(t);
      const void* at = static_cast<const uint32_t*>(xd) + t * tile_units;
      float* dst = c + tiles.begin(t) * ldc + p * out_per_panel;
      if (left >= 1) {
        const Prefetch pf = prefetch_for(call++);
        if (np == 4)  // narrow: the one tile has at most 6 rows
          tile_bf16<E, 4, FMA, 6>(rows, at, lda, bp, Ku, ps, dst, out_per_panel, ldc, pf);
        else if (np == 2)
          tile_bf16<E, 2, FMA>(rows, at, lda, bp, Ku, ps, dst, out_per_panel, ldc, pf);
        else
          tile_bf16<E, 1, FMA>(rows, at, lda, bp, Ku, ps, dst, 0, ldc, pf);
      } else {  // the last, partial panel (E is kStore or kAccumulate here)
        tile_bf16<kStore, 1, FMA>(rows, at, lda, bp, Ku, ps, edge, 0, NR, Prefetch{});
        add_edge<E>(edge, rows, N - p * out_per_panel, dst, ldc);
      }
    }
    p += np;
  }
}

// The shared driver: c [M, ldc] gets columns [0, N) (N <= panels * out_per_panel) with
// epilogue E; out_per_panel is 16, or 8 for SwiGLU (then N = panels * 8 exactly).
template <int E>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t N, float* c, int64_t ldc) {
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  constexpr int64_t out_per_panel = E == kSwiGlu ? NR / 2 : NR;
  if (M == 0 || N == 0) return;
  // bf16 panels count k in pairs (32 bits, as one fp32 k): the tiles and panels have Ku units.
  const bool pairs = packed.scalar_type() == at::kBFloat16;
  const int64_t Ku = packed.size(1);
  if (pairs && gemm_amx_takes(K) && gemm_amx_enabled()) {  // the same panels on AMX tiles
    gemm_amx_bf16(x.data_ptr<float>(), M, K, x.stride(0),
                  static_cast<const uint32_t*>(packed.data_ptr()), panels, N,
                  static_cast<GemmEpilogue>(E), c, ldc);
    return;
  }

  // x -> tiles [count][Kt][lda] (lda: RowTiles::lda) of fp32 (Kt = K) or bf16 pairs rounded from
  // fp32 (Kt = Ku); for the FMA loop on bf16 panels, tiles [count][Kt / 16][lda][16] of the
  // rounded values as floats (Kt = 2 Ku rounded up to whole 16-k blocks, zero past K). A tile's
  // rows past its own are left as they are: every micro-kernel reads exactly the tile's rows.
  const bool fma = pairs && gemm_bf16_fma_enabled();
  const int64_t Kt = fma ? fma_tile_k(Ku) : Ku;
  const RowTiles row_tiles(M, pairs && M >= 7);
  const int64_t lda = row_tiles.lda();
  const int64_t tiles = row_tiles.count;
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  auto pack = [&](int64_t t0, int64_t t1, float* xd) {
    std::vector<uint32_t> row_pairs(pairs ? Ku : 0);  // one row of x as bf16 pairs
    for (int64_t t = t0; t < t1; ++t) {
      float* d = xd + t * Kt * lda;
      auto* du = reinterpret_cast<uint32_t*>(d);
      const int64_t rows = row_tiles.rows(t);
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = xs + (row_tiles.begin(t) + i) * ldx;
        if (!pairs) {
          for (int64_t k = 0; k < K; ++k) d[k * lda + i] = src[k];
          continue;
        }
        round_row_bf16(src, K, row_pairs.data());
        if (fma) {  // each bf16 of the pairs as the float it is, 16 k per block, zeros past 2 Ku
          const auto* h = reinterpret_cast<const vec::bf16*>(row_pairs.data());
          for (int64_t k = 0; k < Kt; k += kFmaBlockK) {
            float* out = d + (k / kFmaBlockK * lda + i) * kFmaBlockK;
            const int64_t n = std::min<int64_t>(kFmaBlockK, 2 * Ku - k);
            widen_row_bf16(h + k, n, out);
            std::fill(out + n, out + kFmaBlockK, 0.f);
          }
        } else {
          for (int64_t k = 0; k < Ku; ++k) du[k * lda + i] = row_pairs[k];
        }
      }
    }
  };
  const float* b = static_cast<const float*>(packed.data_ptr());
  // Panels [p0, p1) over the packed tiles [t_begin, t_end) of xd.
  auto panels_over = [&](const float* xd, int64_t p0, int64_t p1, int64_t t_begin,
                         int64_t t_end) {
    if (pairs) {
      const auto* bu = reinterpret_cast<const uint32_t*>(b);
      if (fma)
        run_bf16<E, true>(xd, bu, row_tiles, N, Ku, p0, p1, t_begin, t_end, c, ldc);
      else
        run_bf16<E, false>(xd, bu, row_tiles, N, Ku, p0, p1, t_begin, t_end, c, ldc);
      return;
    }
    alignas(64) float edge[MR * NR];  // the last panel's tile when N is not a multiple of 16
    for (int64_t p = p0; p < p1; ++p) {
      const float* bp = b + p * K * NR;
      const int64_t cols = std::min<int64_t>(out_per_panel, N - p * out_per_panel);
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int rows = row_tiles.rows(t);
        const float* at = xd + t * K * lda;
        float* dst = c + row_tiles.begin(t) * ldc + p * out_per_panel;
        if (cols == out_per_panel) {
          if (t == t_begin)
            tile<true, E>(rows, at, lda, bp, K, dst, ldc);
          else
            tile<false, E>(rows, at, lda, bp, K, dst, ldc);
          continue;
        }
        tile<false, kStore>(rows, at, lda, bp, K, edge, NR);  // E is kStore or kAccumulate here
        add_edge<E>(edge, rows, cols, dst, ldc);
      }
    }
  };
  // Rows in blocks of about kTileBlockBytes of packed x: every panel passes over a block while
  // it is still in L2 (one pass over all the rows per panel re-read x from memory at prefill
  // sizes), and the weights are read once per block.
  const int64_t block = std::max<int64_t>(1, kTileBlockBytes / (Kt * MR * 4));
  if (tiles <= kOwnPackTiles) {
    // A decode batch: every thread packs the rows itself. Packed by the calling thread alone,
    // the others waited for it and then read the packed rows from its core's cache; on an AMX
    // Xeon (the vdpbf16ps loop, 2 threads) a batch-1 decode step took 12.72 -> 11.96 ms and
    // batch 8 19.81 -> 19.56 (fp32: 24.68 -> 24.23 and 35.30 -> 34.82), while at 64 rows
    // (11 tiles, packed in parallel anyway) packing them twice was 1 % slower.
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      thread_local std::vector<float> own;
      float* xd = vec::aligned_scratch(own, static_cast<size_t>(tiles * Kt * MR));
      pack(0, tiles, xd);
      panels_over(xd, p0, p1, 0, tiles);
    });
    return;
  }
  at::Tensor xa = x.new_empty({tiles, Kt, MR});
  float* xd = xa.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { pack(t0, t1, xd); });
  for (int64_t t_begin = 0; t_begin < tiles; t_begin += block) {
    const int64_t t_end = std::min(tiles, t_begin + block);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      panels_over(xd, p0, p1, t_begin, t_end);
    });
  }
}

// vdpbf16ps or fp32 FMAs for bf16 panels (see micro_kernel_bf16_fma): -1 until a
// set_gemm_bf16_fma, then its choice; by default FMAs where vdpbf16ps is slow (Intel CPUs).
std::atomic<int> bf16_fma_on{-1};

}  // namespace

bool gemm_bf16_fma_enabled() {
  const int on = bf16_fma_on.load(std::memory_order_relaxed);
  return gemm_bf16_supported() && (on < 0 ? vec::vdpbf16ps_slow() : on == 1);
}

bool set_gemm_bf16_fma(bool on) {
  bf16_fma_on.store(on ? 1 : 0, std::memory_order_relaxed);
  return gemm_bf16_fma_enabled();
}

bool gemm_bf16_supported() {
#if defined(PAGEDLLM_GEMM_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

at::Tensor gemm_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be a 2-D float32 or bfloat16 CPU tensor [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  if (w.scalar_type() == at::kBFloat16) {
    // [panels, ceil(K / 2), 16 columns x (k, k + 1)], zero-padded.
    const int64_t K2 = (K + 1) / 2;
    at::Tensor out = w.new_zeros({panels, K2, 2 * NR});
    const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
          const uint16_t* row = src + (p * NR + j) * K;
          uint16_t* col = dst + p * K2 * 2 * NR + 2 * j;
          for (int64_t k = 0; k < K; ++k) col[(k / 2) * 2 * NR + (k % 2)] = row[k];
        }
    });
    return out;
  }
  at::Tensor out = w.new_zeros({panels, K, NR});  // 64-byte aligned by the allocator
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const float* row = src + (p * NR + j) * K;
        float* col = dst + p * K * NR + j;
        for (int64_t k = 0; k < K; ++k) col[k * NR] = row[k];
      }
  });
  return out;
}

at::Tensor gemm_pack_swiglu_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 16 == 0,
              "gate/up weight must be [2I, K] with I a multiple of 8");
  const int64_t inter = weight.size(0) / 2;
  // Reorder the rows to gate 0-7, up 0-7, gate 8-15, up 8-15, ... and pack as usual.
  at::Tensor rows = weight.reshape({2, inter / 8, 8, weight.size(1)}).transpose(0, 1);
  return gemm_pack_weight(rows.reshape({2 * inter, weight.size(1)}));
}

at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  check_x(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(out_features > (panels - 1) * NR && out_features <= panels * NR,
              "out_features ", out_features, " does not match ", panels, " packed panels");
  at::Tensor y = x.new_empty({x.size(0), out_features});
  if (x.size(1) == 0) return y.zero_();
  run<kStore>(x, packed, out_features, y.data_ptr<float>(), out_features);
  return y;
}

void gemm_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  check_x(x, packed);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "out must be a [M, N] float32 tensor with unit inner stride");
  const int64_t N = out.size(1), panels = packed.size(0);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "out has ", N, " columns, the weight ",
              panels, " packed panels");
  const auto* o0 = static_cast<const char*>(out.data_ptr());
  const auto* x0 = static_cast<const char*>(x.data_ptr());
  const int64_t o_bytes = out.numel() ? (out.size(0) - 1) * out.stride(0) * 4 + N * 4 : 0;
  const int64_t x_bytes = x.numel() ? (x.size(0) - 1) * x.stride(0) * 4 + x.size(1) * 4 : 0;
  TORCH_CHECK(o_bytes == 0 || x_bytes == 0 || o0 + o_bytes <= x0 || x0 + x_bytes <= o0,
              "out must not overlap x");
  run<kAccumulate>(x, packed, N, out.data_ptr<float>(), out.stride(0));
}

at::Tensor gemm_swiglu_into(at::Tensor& workspace, const at::Tensor& x,
                            const at::Tensor& packed) {
  check_x(x, packed);
  const int64_t inter = packed.size(0) * (NR / 2), need = x.size(0) * inter;
  if (!workspace.defined() || workspace.numel() < need) workspace = x.new_empty({need});
  at::Tensor y = workspace.narrow(0, 0, need).view({x.size(0), inter});
  if (x.size(1) == 0) return y.fill_(0.f);  // silu(0) * 0
  run<kSwiGlu>(x, packed, inter, y.data_ptr<float>(), inter);
  return y;
}

at::Tensor gemm_swiglu(const at::Tensor& x, const at::Tensor& packed) {
  at::Tensor workspace;
  return gemm_swiglu_into(workspace, x, packed);
}

}  // namespace pagedllm
