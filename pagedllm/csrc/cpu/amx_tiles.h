// Intel AMX tile plumbing shared by the bf16 GEMM (gemm_amx.cpp), the attention scores
// (attention_amx.cpp) and the int8 GEMM's TDPBUSD tiles (int8_gemm.cpp): the tile
// configuration, the CPU and kernel checks, and literal-number wrappers of the tile intrinsics.
// Only the avx512 kernel variant on x86-64 defines PAGEDLLM_AMX; elsewhere this header declares
// only tiles_usable() and int8_tiles_usable(), always false.
//
// One configuration serves all users: palette 1 with all 8 tiles at 16 rows x 64 bytes (an A
// tile is 16 rows x 32 bf16 or 64 u8, a B tile 16 (k, k + 1) pair rows or 16 rows of 4 k x 16
// columns, a C tile 16 x 16 fp32 or int32). TDPBF16PS computes C[m][n] += sum over k of
// A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] in fp32 (Intel 64 and IA-32 Architectures
// Software Developer's Manual, TDPBF16PS): an element depends only on its A row and B column,
// never on the other rows of the tile.
#pragma once
#include <cstdint>
#include <vector>

#include "vec.h"

#if defined(__x86_64__) && defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_AMX 1

namespace pagedllm {
namespace amx {

constexpr int kTileRows = 16;  // rows of an A or C tile (and k pairs of a B tile)
constexpr int kTileK = 32;     // bf16 values of k per A row (64 bytes)

// The 64-byte operand of LDTILECFG (palette 1: 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Whether CPUID leaf 7 (subleaf 0) sets EDX bit 24 (AMX-TILE) and bit `feature` (22: AMX-BF16,
// 25: AMX-INT8).
inline bool cpu_has_amx(int feature) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1) && (d >> feature & 1);
}
inline bool cpu_has_amx_bf16() { return cpu_has_amx(22); }
inline bool cpu_has_amx_int8() { return cpu_has_amx(25); }

// Linux hands out the 8 KiB tile state only to processes that ask (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16+); the grant covers all threads.
inline bool request_tile_state() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Whether this process may run AMX bf16 tiles: the CPU has them and the kernel granted the
// tile state (asked once).
inline bool tiles_usable() {
  static const bool ok = cpu_has_amx_bf16() && request_tile_state();
  return ok;
}

// Whether this process may run AMX int8 tiles (TDPBUSD): the CPU has them and the kernel granted
// the tile state.
inline bool int8_tiles_usable() {
  static const bool ok = cpu_has_amx_int8() && request_tile_state();
  return ok;
}

// Tile rows that straddle two cache lines load at ~3/4 of the speed of aligned ones (a 2 x 2
// block on an AMX Xeon with A in L2: 1.26 vs 1.66 TFLOP/s per core): scratch for tiles comes from
// vec::aligned_scratch.
using vec::aligned_scratch;

// Loads the shared configuration in the calling thread (all 8 tiles 16 rows x 64 bytes).
__attribute__((target("amx-tile"))) inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  // GCC 12 does not see LDTILECFG read cfg and drops the stores above without this barrier.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// GCC's AMX intrinsics paste the tile number into their assembly text, so it must be a literal:
// these map a template constant onto the literal calls.
template <int T>
__attribute__((target("amx-tile"))) inline void zero_tile() {
  static_assert(T >= 0 && T <= 7, "8 tile registers");
  if constexpr (T == 0) _tile_zero(0);
  if constexpr (T == 1) _tile_zero(1);
  if constexpr (T == 2) _tile_zero(2);
  if constexpr (T == 3) _tile_zero(3);
  if constexpr (T == 4) _tile_zero(4);
  if constexpr (T == 5) _tile_zero(5);
  if constexpr (T == 6) _tile_zero(6);
  if constexpr (T == 7) _tile_zero(7);
}

template <int T>
__attribute__((target("amx-tile"))) inline void load_tile(const void* p, int64_t stride) {
  if constexpr (T == 0) _tile_loadd(0, p, stride);
  if constexpr (T == 1) _tile_loadd(1, p, stride);
  if constexpr (T == 2) _tile_loadd(2, p, stride);
  if constexpr (T == 3) _tile_loadd(3, p, stride);
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  if constexpr (T == 5) _tile_loadd(5, p, stride);
  if constexpr (T == 6) _tile_loadd(6, p, stride);
  if constexpr (T == 7) _tile_loadd(7, p, stride);
}

// TILELOADDT1: the same load, with a hint that the data will not be reused soon, so that it does
// not evict from L1 the operand that will be (Intel SDM, TILELOADD / TILELOADDT1).
template <int T>
__attribute__((target("amx-tile"))) inline void stream_load_tile(const void* p, int64_t stride) {
  static_assert(T >= 4 && T <= 7, "streamed loads fill A or B tiles");
  if constexpr (T == 4) _tile_stream_loadd(4, p, stride);
  if constexpr (T == 5) _tile_stream_loadd(5, p, stride);
  if constexpr (T == 6) _tile_stream_loadd(6, p, stride);
  if constexpr (T == 7) _tile_stream_loadd(7, p, stride);
}

// load_tile, or stream_load_tile when STREAM (a GEMM block's operand read once per pass).
template <int T, bool STREAM>
__attribute__((target("amx-tile"))) inline void load_tile_as(const void* p, int64_t stride) {
  if constexpr (STREAM)
    stream_load_tile<T>(p, stride);
  else
    load_tile<T>(p, stride);
}

template <int T>
__attribute__((target("amx-tile"))) inline void store_tile(void* p, int64_t stride) {
  static_assert(T >= 0 && T <= 7, "8 tile registers");
  if constexpr (T == 0) _tile_stored(0, p, stride);
  if constexpr (T == 1) _tile_stored(1, p, stride);
  if constexpr (T == 2) _tile_stored(2, p, stride);
  if constexpr (T == 3) _tile_stored(3, p, stride);
  if constexpr (T == 4) _tile_stored(4, p, stride);
  if constexpr (T == 5) _tile_stored(5, p, stride);
  if constexpr (T == 6) _tile_stored(6, p, stride);
  if constexpr (T == 7) _tile_stored(7, p, stride);
}

// C (0-3) += A (4-5, or 2-3 into C 1) . B (6-7)
template <int C, int A, int B>
__attribute__((target("amx-tile,amx-bf16"))) inline void dp_tile() {
  // Any other combination would compile to nothing.
  static_assert(B >= 6 && B <= 7 && ((C >= 0 && C <= 3 && A >= 4 && A <= 5) ||
                                      (C == 1 && A >= 2 && A <= 3)),
                "dp_tile covers C 0-3 with A 4-5, C 1 with A 2-3, B 6-7");
#define PAGEDLLM_DP(c, a, b) \
  if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
  PAGEDLLM_DP(0, 4, 6) PAGEDLLM_DP(0, 4, 7) PAGEDLLM_DP(0, 5, 6) PAGEDLLM_DP(0, 5, 7)
  PAGEDLLM_DP(1, 4, 6) PAGEDLLM_DP(1, 4, 7) PAGEDLLM_DP(1, 5, 6) PAGEDLLM_DP(1, 5, 7)
  PAGEDLLM_DP(2, 4, 6) PAGEDLLM_DP(2, 4, 7) PAGEDLLM_DP(2, 5, 6) PAGEDLLM_DP(2, 5, 7)
  PAGEDLLM_DP(3, 4, 6) PAGEDLLM_DP(3, 4, 7) PAGEDLLM_DP(3, 5, 6) PAGEDLLM_DP(3, 5, 7)
  PAGEDLLM_DP(1, 2, 6) PAGEDLLM_DP(1, 2, 7) PAGEDLLM_DP(1, 3, 6) PAGEDLLM_DP(1, 3, 7)
#undef PAGEDLLM_DP
}

}  // namespace amx
}  // namespace pagedllm
#else   // no AMX in this kernel variant
namespace pagedllm {
namespace amx {
inline bool tiles_usable() { return false; }
inline bool int8_tiles_usable() { return false; }
}  // namespace amx
}  // namespace pagedllm
#endif  // x86-64 with AVX-512
