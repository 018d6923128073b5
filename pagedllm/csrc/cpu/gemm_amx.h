// bf16 linear layers on Intel AMX tiles (gemm_amx.cpp), called by gemm.cpp's driver on the same
// bf16 pair panels the vdpbf16ps kernel reads: no second packed copy of the weights.
#pragma once
#include <cstdint>

namespace pagedllm {
// The GEMMs' epilogues: c = x W^T, c += x W^T (the residual add after a projection), or SwiGLU
// (panels of 8 gate + 8 up columns; c gets silu(gate) * up, 8 outputs per panel).
enum GemmEpilogue { kStore, kAccumulate, kSwiGlu };

// Whether the AMX kernel runs in this process: the avx512 kernel variant on a CPU with amx_tile
// and amx_bf16 whose kernel granted the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and not
// turned off by set_gemm_amx(false).
bool gemm_amx_enabled();
// Turns the AMX kernel on or off for the process (on where it can run; off: the vdpbf16ps
// kernel); returns gemm_amx_enabled().
bool set_gemm_amx(bool on);
// Whether the AMX kernel takes an inner dimension K: a whole number of 32-wide tiles.
inline bool gemm_amx_takes(int64_t K) { return K > 0 && K % 32 == 0; }

// c[0:M, 0:N] (row stride ldc) <- x [M, K] float32 (row stride ldx) @ W^T with epilogue E, W in
// the bf16 pair panels of gemm_pack_weight ([panels][K / 2][16 columns x (k, k + 1)]); x is
// rounded to bf16 (nearest even, fp32 denormals to zero) and products are summed in fp32 by
// TDPBF16PS. Only called where gemm_amx_enabled() and gemm_amx_takes(K).
void gemm_amx_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, const uint32_t* panels,
                   int64_t num_panels, int64_t N, GemmEpilogue E, float* c, int64_t ldc);
}  // namespace pagedllm
