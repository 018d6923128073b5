// y = x W^T with int8 weights and int8 activations (W8A8), int32 accumulation.
//
// Quantization (the LLM.int8() / SmoothQuant W8A8 scheme: Dettmers et al. 2022 section 3.1
// "vector-wise quantization", Xiao et al. 2023 section 3): weights symmetric per output channel
// (done once at load, in Python), activations symmetric per token (row), here at every call:
// s_x = absmax(x_m) / 127 over the row's elements with |x| <= the outlier threshold. Then
// y[m, n] = (sum_k qx[m, k] qw[n, k]) * s_x[m] * s_w[n], the integer sum exact in int32, plus
// the outliers (LLM.int8() section 3.2's mixed-precision decomposition; coded 0 in qx) times
// qw[n, k] * s_w[n] in float.
//
// Weights are packed once into panels of 16 output columns, 4 k per 64-byte group (the operand
// layout of vpdpbusd and of maddubs + madd); the rows of x are quantized and packed per call into
// tiles of 4 rows, 4 k (one int32) per row and group. A micro-kernel keeps its int32 accumulators
// in registers over the whole K loop: 4 rows x 16 columns (AVX2, scalar) or 8 x 32 (AVX512-VNNI,
// two tiles against two panels). Threads split the pairs of weight panels.
//
// Inner loops, picked at run time from the CPU's flags (same results bit for bit):
// - AVX2: maddubs multiplies unsigned by signed bytes and saturates its int16 pair sums, so
//   x's sign moves onto the weight (|x| * (w * sign(x)) with _mm256_sign_epi8, the trick of
//   llama.cpp's q8 dot products): |x|, |w| <= 127 gives pair sums <= 32258, never saturated.
// - AVX512-VNNI: vpdpbusd (u8 x s8 -> int32 without saturation) on x + 128, minus 128 * the
//   weight row sums (precomputed at load).
// - AVX-VNNI: the same vpdpbusd, VEX-encoded on 256-bit registers, in the AVX2 loop's 4 x 16
//   tiles (16 registers: no room for the 8 x 32 tile).
// - AMX-INT8 (Intel Xeons from Sapphire Rapids on; only when PAGEDLLM_INT8_ISA=amx_int8 asks for
//   it, until it has been measured against AVX512-VNNI on such a CPU): TDPBUSD, u8 x s8 -> int32
//   on tiles (Intel SDM, TDPBUSD), C[m][n] += sum over 64 k of A[m][k] B[k / 4][4 n + k % 4].
//   The weight panels' 64-byte groups are already the B tile's rows (16 groups = one 1 KiB
//   tile, loaded in place); x is quantized into plain u8 rows (+128, as for vpdpbusd) padded to
//   whole 64-byte tile rows with zero bytes, so the k past the panel's last group add nothing
//   whatever B holds there. A block is 16 rows x 2 panels (C tiles 0-1, A tile 4, B tiles 6-7).
// - scalar: plain loops (kernels built without AVX2).
#include "int8_gemm.h"
#include "int8_rows.h"

#include "amx_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace pagedllm {
namespace {

using int8_rows::add_outliers_isa;
using int8_rows::Isa;
using int8_rows::KG;
using int8_rows::NR;
using int8_rows::outlier_limit;
using int8_rows::Outliers;
using int8_rows::quantize_row_isa;
using int8_rows::scale_out;
constexpr int MR = 4;  // rows per micro-kernel tile
// Outliers listed per row; a row with more is scanned again (Outliers::for_each).
constexpr int64_t kOutlierSlots = 32;

// c[ROWS][NR] (row stride ldc) = a_tile[G][MR] . panel[G][NR][KG] with int8 operands, int32
// results.
template <int ROWS>
void kernel_scalar(const int32_t* a, const int8_t* b, int64_t G, int32_t* c, int ldc) {
  int32_t acc[ROWS][NR] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < ROWS; ++i) {
      int8_t av[KG];
      std::memcpy(av, a + g * MR + i, KG);
      for (int j = 0; j < NR; ++j)
        for (int q = 0; q < KG; ++q) acc[i][j] += av[q] * b[(g * NR + j) * KG + q];
    }
  for (int i = 0; i < ROWS; ++i) std::memcpy(c + i * ldc, acc[i], sizeof(acc[i]));
}

#if defined(PAGEDLLM_INT8_AVX2)
template <int ROWS>
void kernel_avx2(const int32_t* a, const int8_t* b, int64_t G, int32_t* c, int ldc) {
  __m256i lo[ROWS], hi[ROWS];
  for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG + 32));
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const __m256i av = _mm256_set1_epi32(a[g * MR + i]);
      const __m256i ax = _mm256_sign_epi8(av, av);  // |x|
      const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, av));
      const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, av));
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(p0, ones));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc), lo[i]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + 8), hi[i]);
  }
}
#endif

#if defined(PAGEDLLM_INT8_VNNI512)
// acc += u (u8) . w (s8) per 4-byte lane. As inline asm because GCC's builtin copies every tied
// accumulator through another register each iteration (and spills some), which halved the
// kernel's speed.
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline void dpbusd(__m512i& acc,
                                                                               __m512i u,
                                                                               __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
}

// c[ROWS][PANELS * NR] for up to 8 rows (two activation tiles: rows 0-3 from a0, 4-7 from a1)
// and up to two panels (b0, b1; wsum0 / wsum1 their weight row sums, for the +128 zero point of
// the u8 activations, which arrive with it applied). 8 x 32 keeps 16 independent accumulators in
// flight: vpdpbusd's latency is several cycles, so a 4 x 16 tile (4 chains) ran at ~40 % of the
// instruction's throughput.
template <int ROWS, int PANELS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void kernel_vnni512(
    const int32_t* a0, const int32_t* a1, const int8_t* b0, const int8_t* b1, int64_t G,
    const int32_t* wsum0, const int32_t* wsum1, int32_t* c) {
  __m512i acc[ROWS * PANELS];
#pragma GCC unroll 16
  for (int i = 0; i < ROWS * PANELS; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512i w[PANELS];
    w[0] = _mm512_load_si512(b0 + g * NR * KG);
    if constexpr (PANELS == 2) w[PANELS - 1] = _mm512_load_si512(b1 + g * NR * KG);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m512i u = _mm512_set1_epi32(i < MR ? a0[g * MR + i] : a1[g * MR + i - MR]);
#pragma GCC unroll 2
      for (int p = 0; p < PANELS; ++p) dpbusd(acc[i * PANELS + p], u, w[p]);
    }
  }
#pragma GCC unroll 2
  for (int p = 0; p < PANELS; ++p) {
    const __m512i zero_point = _mm512_slli_epi32(_mm512_loadu_si512(p ? wsum1 : wsum0), 7);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i)
      _mm512_storeu_si512(c + i * 2 * NR + p * NR, _mm512_sub_epi32(acc[i * PANELS + p], zero_point));
  }
}

// acc += u (u8) . w (s8) per 4-byte lane, VEX-encoded (AVX-VNNI: ymm0-15, hence "x").
__attribute__((target("avx2,avxvnni"), always_inline)) inline void dpbusd_vex(__m256i& acc,
                                                                             __m256i u,
                                                                             __m256i w) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(w));
}

// kernel_avx2's tile c[ROWS][NR] on vpdpbusd: the activations arrive as u8 with the +128 zero
// point applied (as for kernel_vnni512), minus 128 * wsum [NR] (the panel's weight row sums).
template <int ROWS>
__attribute__((target("avx2,avxvnni"))) void kernel_avxvnni(const int32_t* a, const int8_t* b,
                                                           int64_t G, const int32_t* wsum,
                                                           int32_t* c, int ldc) {
  // Every loop over the rows unrolled, so that GCC keeps lo / hi in registers (with a loop
  // left rolled it kept them on the stack, a load and a store around every vpdpbusd).
  __m256i lo[ROWS], hi[ROWS];
#pragma GCC unroll 4
  for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG + 32));
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const __m256i u = _mm256_set1_epi32(a[g * MR + i]);
      dpbusd_vex(lo[i], u, w0);
      dpbusd_vex(hi[i], u, w1);
    }
  }
  const __m256i* ws = reinterpret_cast<const __m256i*>(wsum);
  const __m256i zp_lo = _mm256_slli_epi32(_mm256_loadu_si256(ws), 7);
  const __m256i zp_hi = _mm256_slli_epi32(_mm256_loadu_si256(ws + 1), 7);
#pragma GCC unroll 4
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc), _mm256_sub_epi32(lo[i], zp_lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + 8),
                        _mm256_sub_epi32(hi[i], zp_hi));
  }
}
#endif

#if defined(PAGEDLLM_AMX)
constexpr int kAmxRows = 16;           // rows of an A / C tile
constexpr int kAmxGroups = 16;         // 4-k groups per tile row (64 k)
constexpr int kAmxTileBytes = kAmxGroups * NR * KG;  // one B tile: 16 groups of a panel, 1 KiB

// c [16][2 * NR] int32 (row stride 2 * NR) = the 16 u8 rows of a (row stride lda bytes, each
// x + 128 over the k of full (+ 1 when tail) tile rows of 64, zero bytes past the row's last
// group) times the panels b0, b1 ([G][NR][KG] int8): `full` whole B tiles from the panels, then
// when `tail` one more from tail0 / tail1 (the panels' last G % 16 groups, zero-padded to a tile,
// so no load reads past a panel). Without the zero point: the caller subtracts 128 * wsum.
__attribute__((target("amx-tile,amx-int8"))) void block_amx(const uint8_t* a, int64_t lda,
                                                           const int8_t* b0, const int8_t* b1,
                                                           const int8_t* tail0,
                                                           const int8_t* tail1, int64_t full,
                                                           bool tail, int32_t* c) {
  constexpr int64_t ldc = 2 * NR * sizeof(int32_t);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t t = 0; t < full; ++t) {
    _tile_loadd(4, a + t * kAmxGroups * KG, lda);
    _tile_loadd(6, b0 + t * kAmxTileBytes, NR * KG);
    _tile_loadd(7, b1 + t * kAmxTileBytes, NR * KG);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
  }
  if (tail) {
    _tile_loadd(4, a + full * kAmxGroups * KG, lda);
    _tile_loadd(6, tail0, NR * KG);
    _tile_loadd(7, tail1, NR * KG);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
  }
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + NR, ldc);
}
#endif

Isa detect_isa() {
  Isa best = Isa::kScalar;
  bool avxvnni = false;
#if defined(PAGEDLLM_INT8_AVX2)
  best = Isa::kAvx2;
#endif
#if defined(PAGEDLLM_INT8_VNNI512)
  avxvnni = __builtin_cpu_supports("avxvnni");
  if (avxvnni) best = Isa::kAvxVnni;
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) best = Isa::kVnni512;
#endif
  // PAGEDLLM_INT8_ISA=avx_vnni|avx2|scalar picks a lower path (tests run every path on one
  // CPU), amx_int8 the AMX tiles (not yet the default); a path the CPU or build lacks is ignored.
  const char* forced = std::getenv("PAGEDLLM_INT8_ISA");
  if (forced != nullptr) {
    const std::string name(forced);
    if (name == "amx_int8" && best == Isa::kVnni512 && amx::int8_tiles_usable())
      return Isa::kAmxInt8;
    if (name == "scalar") return Isa::kScalar;
    if (name == "avx2" && best != Isa::kScalar) return Isa::kAvx2;
    if (name == "avx_vnni" && avxvnni) return Isa::kAvxVnni;
  }
  return best;
}

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

// The Python side (int8.int8_outlier_threshold) checks the same rule first, with a ValueError.
float read_outlier_threshold() {
  const char* v = std::getenv("PAGEDLLM_INT8_OUTLIER_THRESHOLD");
  if (v == nullptr) return kInt8OutlierThreshold;
  const std::string text(v);
  const size_t first = text.find_first_not_of(" \t\n");
  if (first == std::string::npos) return kInt8OutlierThreshold;
  char* end = nullptr;
  const float threshold = std::strtof(text.c_str() + first, &end);
  const size_t last = text.find_last_not_of(" \t\n");
  TORCH_CHECK(end == text.c_str() + last + 1 && std::isfinite(threshold) && threshold >= 0.f,
              "PAGEDLLM_INT8_OUTLIER_THRESHOLD must be a finite number >= 0 (0 = no outliers), "
              "got '", text, "'");
  return threshold;
}

// ws: the panel's weight row sums (the AVX-VNNI loop's zero point).
template <int ROWS>
void tile_rows(Isa isa, const int32_t* a, const int8_t* b, int64_t G, const int32_t* ws,
               int32_t* c, int ldc) {
#if defined(PAGEDLLM_INT8_VNNI512)
  if (isa == Isa::kAvxVnni) return kernel_avxvnni<ROWS>(a, b, G, ws, c, ldc);
#endif
#if defined(PAGEDLLM_INT8_AVX2)
  if (isa == Isa::kAvx2) return kernel_avx2<ROWS>(a, b, G, c, ldc);
#endif
  (void)isa, (void)ws;
  kernel_scalar<ROWS>(a, b, G, c, ldc);
}

// One block of the output: c[rows][2 * NR] for rows <= 2 * MR (rows 0-3 from activation tile a0,
// 4-7 from a1) against `panels` (1 or 2) weight panels b0, b1 (ws0, ws1: their weight row sums).
// The AVX-VNNI, AVX2 and scalar loops run it as 4 x 16 tiles; AVX512-VNNI in one 8 x 32 kernel
// (the VNNI loops' activations arrive with the +128 zero point already applied).
#if defined(PAGEDLLM_INT8_VNNI512)
template <int ROWS>
void block_vnni_rows(int panels, const int32_t* a0, const int32_t* a1, const int8_t* b0,
                     const int8_t* b1, int64_t G, const int32_t* ws0, const int32_t* ws1,
                     int32_t* c) {
  if (panels == 2) return kernel_vnni512<ROWS, 2>(a0, a1, b0, b1, G, ws0, ws1, c);
  kernel_vnni512<ROWS, 1>(a0, a1, b0, b1, G, ws0, ws1, c);
}
#endif

void block(Isa isa, int rows, int panels, const int32_t* a0, const int32_t* a1, const int8_t* b0,
           const int8_t* b1, int64_t G, const int32_t* ws0, const int32_t* ws1, int32_t* c) {
  constexpr int ldc = 2 * NR;
#if defined(PAGEDLLM_INT8_VNNI512)
  if (isa == Isa::kVnni512) {
    switch (rows) {
      case 8: return block_vnni_rows<8>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 7: return block_vnni_rows<7>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 6: return block_vnni_rows<6>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 5: return block_vnni_rows<5>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 4: return block_vnni_rows<4>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 3: return block_vnni_rows<3>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      case 2: return block_vnni_rows<2>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
      default: return block_vnni_rows<1>(panels, a0, a1, b0, b1, G, ws0, ws1, c);
    }
  }
#endif
  for (int half = 0; half * MR < rows; ++half) {
    const int r = std::min(MR, rows - half * MR);
    const int32_t* a = half ? a1 : a0;
    for (int p = 0; p < panels; ++p) {
      const int8_t* b = p ? b1 : b0;
      const int32_t* ws = p ? ws1 : ws0;
      int32_t* cp = c + half * MR * ldc + p * NR;
      switch (r) {
        case 4: tile_rows<4>(isa, a, b, G, ws, cp, ldc); break;
        case 3: tile_rows<3>(isa, a, b, G, ws, cp, ldc); break;
        case 2: tile_rows<2>(isa, a, b, G, ws, cp, ldc); break;
        default: tile_rows<1>(isa, a, b, G, ws, cp, ldc); break;
      }
    }
  }
}

// yd [M, N] = the W8A8 product of x (xp [M, K], row stride ldx) and the packed weight b
// (panels x G groups), scaled by the row scales, sw [N] and plus bd [N] when given. The callers
// check the shapes.
void int8_gemm(const float* xp, int64_t ldx, int64_t M, int64_t K, const int8_t* b,
               int64_t panels, const float* sw, const int32_t* ws, const float* bd, int64_t N,
               float* yd) {
  const int64_t G = (K + KG - 1) / KG;
  // x -> int8 tiles [2 * ceil(M / 8)][G][4] (one int32 = 4 k of one row; rows past M and k past
  // K zero, rows past M never read; on the VNNI paths each byte + 128, as u8) and the row scales.
  // For the AMX tiles instead plain rows [ceil(M / 16) * 16][Gt] of such words, Gt = G rounded
  // up to whole tile rows, the words past G and the rows past M zero.
  const Isa isa = active_isa();
  const bool amx = isa == Isa::kAmxInt8;
  const int64_t blocks = (M + 2 * MR - 1) / (2 * MR);
  const int64_t Gt = amx ? (G + 15) / 16 * 16 : G, Mt = (M + 15) / 16 * 16;
  // Per calling thread and reused: a decode step makes hundreds of these calls.
  // Room for kOutlierSlots outliers per row (SmolLM2's rows have ~2 on average).
  const int32_t cap = static_cast<int32_t>(std::min<int64_t>(K, kOutlierSlots));
  thread_local std::vector<int32_t> x_tiles, out_k, out_n;
  thread_local std::vector<float> x_scales, out_v;
  int32_t* xd =
      vec::aligned_scratch(x_tiles, static_cast<size_t>(amx ? Mt * Gt : 2 * blocks * G * MR));
  x_scales.resize(M);
  out_k.resize(M * cap);  // row m's first outliers at [m * cap, m * cap + min(out_n[m], cap))
  out_v.resize(M * cap);
  out_n.resize(M);
  // Raw pointers for the lambdas: a thread_local named inside one is the worker thread's own.
  float* sa = x_scales.data();
  int32_t* ok = out_k.data();
  float* ov = out_v.data();
  int32_t* on = out_n.data();
  const float threshold = int8_outlier_threshold(), limit = outlier_limit(threshold);
  const bool vnni = isa == Isa::kVnni512 || isa == Isa::kAvxVnni || amx;
  const uint32_t zero_point = vnni ? 0x80808080u : 0u;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<int8_t> row(G * KG, 0);
    for (int64_t m = m0; m < m1; ++m) {
      sa[m] = quantize_row_isa(isa, xp + m * ldx, K, row.data(), threshold, ok + m * cap,
                               ov + m * cap, cap, on + m);
      // Word g of the row at dst[g * step].
      int32_t* dst = amx ? xd + m * Gt : xd + (m / MR) * G * MR + m % MR;
      const int64_t step = amx ? 1 : MR;
      for (int64_t g = 0; g < G; ++g) {
        uint32_t word;
        std::memcpy(&word, row.data() + g * KG, KG);
        dst[g * step] = static_cast<int32_t>(word ^ zero_point);
      }
      if (amx) std::fill(dst + G, dst + Gt, 0);
    }
  });
  // Output row m, columns [n0, n0 + cols) of the panel pair from b0, from its int32 sums ci.
  auto finish_row = [&](const int32_t* ci, int64_t m, int64_t n0, int64_t cols,
                        const int8_t* b0) {
    scale_out(isa, ci, sa[m], sw + n0, bd ? bd + n0 : nullptr, yd + m * N + n0,
              static_cast<int>(cols));
    if (on[m])
      add_outliers_isa(isa, b0, G,
                       Outliers{xp + m * ldx, K, limit, ok + m * cap, ov + m * cap, on[m], cap},
                       sw + n0, yd + m * N + n0, static_cast<int>(cols));
  };
  const int64_t panel_pairs = (panels + 1) / 2;
#if defined(PAGEDLLM_AMX)
  if (amx) {
    std::fill(xd + M * Gt, xd + Mt * Gt, 0);
    const auto* xa = reinterpret_cast<const uint8_t*>(xd);
    const int64_t lda = Gt * KG, full = G / kAmxGroups;
    const bool tail = full * kAmxGroups < G;
    at::parallel_for(0, panel_pairs, 1, [&](int64_t q0, int64_t q1) {
      amx::load_tile_config();
      alignas(64) int32_t c[kAmxRows * 2 * NR];
      alignas(64) int8_t tails[2][kAmxTileBytes] = {};  // groups past G stay zero
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = 2 * q, n0 = p * NR, cols = std::min<int64_t>(2 * NR, N - n0);
        const bool pair = panels - p >= 2;
        const int8_t* b0 = b + p * G * NR * KG;
        const int8_t* b1 = pair ? b0 + G * NR * KG : b0;
        const int32_t* ws1 = pair ? ws + n0 + NR : ws + n0;
        if (tail) {
          const int64_t bytes = (G - full * kAmxGroups) * NR * KG;
          std::memcpy(tails[0], b0 + full * kAmxTileBytes, bytes);
          std::memcpy(tails[1], b1 + full * kAmxTileBytes, bytes);
        }
        for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
          block_amx(xa + m0 * lda, lda, b0, b1, tails[0], tails[1], full, tail, c);
          for (int64_t m = m0; m < std::min(M, m0 + kAmxRows); ++m) {
            int32_t* ci = c + (m - m0) * 2 * NR;
            for (int j = 0; j < NR; ++j) {  // the +128 zero point of the u8 rows
              ci[j] -= ws[n0 + j] * 128;
              ci[NR + j] -= ws1[j] * 128;
            }
            finish_row(ci, m, n0, cols, b0);
          }
        }
      }
      amx::release_tiles();
    });
    return;
  }
#endif
  at::parallel_for(0, panel_pairs, 1, [&](int64_t q0, int64_t q1) {
    alignas(64) int32_t c[2 * MR * 2 * NR];
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q, n0 = p * NR, cols = std::min<int64_t>(2 * NR, N - n0);
      const int np = static_cast<int>(std::min<int64_t>(2, panels - p));
      const int8_t* b0 = b + p * G * NR * KG;
      const int8_t* b1 = np == 2 ? b0 + G * NR * KG : b0;
      const int32_t* ws1 = np == 2 ? ws + n0 + NR : ws + n0;
      for (int64_t t = 0; t < blocks; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(2 * MR, M - t * 2 * MR));
        const int32_t* a0 = xd + 2 * t * G * MR;
        block(isa, rows, np, a0, a0 + G * MR, b0, b1, G, ws + n0, ws1, c);
        for (int i = 0; i < rows; ++i) finish_row(c + i * 2 * NR, t * 2 * MR + i, n0, cols, b0);
      }
    }
  });
}

const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be [out_features] float32");
  return bias->data_ptr<float>();
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be a [M, K] float32 CPU tensor with unit inner stride");
}

}  // namespace

float int8_outlier_threshold() {
  static const float threshold = read_outlier_threshold();
  return threshold;
}

std::string int8_gemm_isa() {
  switch (active_isa()) {
    case Isa::kAmxInt8: return "amx_int8";
    case Isa::kVnni512: return "avx512_vnni";
    case Isa::kAvxVnni: return "avx_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

at::Tensor int8_pack_weight(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar &&
                  qweight.dim() == 2,
              "qweight must be a 2-D int8 CPU tensor [N, K]");
  const at::Tensor w = qweight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR, G = (K + KG - 1) / KG;
  at::Tensor out = w.new_zeros({panels, G, NR, KG});  // 64-byte aligned
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const int8_t* row = src + (p * NR + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * G + k / KG) * NR + j) * KG + k % KG] = row[k];
      }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = x.new_empty({M, K}, at::kChar);
  at::Tensor s = x.new_empty({M});
  const float* xs = x.data_ptr<float>();
  int8_t* qd = q.data_ptr<int8_t>();
  float* sd = s.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    int32_t n_out = 0;
    for (int64_t m = m0; m < m1; ++m)
      sd[m] = quantize_row_isa(active_isa(), xs + m * x.stride(0), K, qd + m * K, 0.f, nullptr,
                               nullptr, 0, &n_out);
  });
  return {q, s};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale,
                       const at::Tensor& wsum, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  check_x(x);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == NR &&
                  packed.size(3) == KG && packed.is_contiguous(),
              "packed must come from int8_pack_weight");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed must be 64-byte aligned (the kernels use aligned loads)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t panels = packed.size(0), G = packed.size(1);
  TORCH_CHECK(G == (K + KG - 1) / KG, "x has ", K, " columns, the packed weight ", G * KG);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "out_features ", N,
              " does not match ", panels, " packed panels");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == N,
              "wscale must be [out_features] float32");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == panels * NR,
              "wsum must be [panels * 16] int32 (zero-padded)");
  const float* bd = bias_data(bias, N);
  at::Tensor y = x.new_empty({M, N});
  if (M == 0 || N == 0) return y;

  int8_gemm(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<int8_t>(), panels,
            wscale.data_ptr<float>(), wsum.data_ptr<int32_t>(), bd, N, y.data_ptr<float>());
  return y;
}

at::Tensor int8_linear_record(const at::Tensor& x, const at::Tensor& record, int64_t out_features,
                              const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const int64_t N = out_features, K = x.size(1);
  const int64_t panels = (N + NR - 1) / NR, G = (K + KG - 1) / KG;
  const int64_t wbytes = panels * G * NR * KG;
  TORCH_CHECK(record.scalar_type() == at::kChar && record.dim() == 1 && record.is_contiguous() &&
                  record.numel() == wbytes + 4 * N + 4 * panels * NR,
              "int8_linear_record: record of ", record.numel(), " bytes does not match a [",
              N, ", ", K, "] weight");
  const int8_t* base = record.data_ptr<int8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0,
              "int8_linear_record: the record must be 64-byte aligned (the kernels use aligned "
              "loads)");
  // Raw pointers into the record, not tensor views: a decode step makes hundreds of these calls
  // and each view costs the dispatcher about a microsecond.
  at::Tensor y = x.new_empty({x.size(0), N});
  if (x.size(0) == 0 || N == 0) return y;
  int8_gemm(x.data_ptr<float>(), x.stride(0), x.size(0), K, base, panels,
            reinterpret_cast<const float*>(base + wbytes),
            reinterpret_cast<const int32_t*>(base + wbytes + 4 * N), bias_data(bias, N), N,
            y.data_ptr<float>());
  return y;
}

}  // namespace pagedllm
