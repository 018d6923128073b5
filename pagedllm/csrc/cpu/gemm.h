// fp32 linear layers for every row count (gemm.cpp), registered in torch_bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>

namespace pagedllm {
// Columns per packed weight panel (two AVX2 registers).
constexpr int kGemmPanel = 16;
// W [N, K] float32 -> panels [ceil(N / 16), K, 16] float32 (zero-padded last panel);
// W bfloat16 -> panels [ceil(N / 16), ceil(K / 2), 32] bfloat16 of (k, k + 1) pairs per column,
// which the GEMMs below take on CPUs with AVX512-BF16 (x rounded to bf16, fp32 sums).
at::Tensor gemm_pack_weight(const at::Tensor& weight);
// Whether bf16 panels run here: the avx512 variant on a CPU with avx512_bf16.
bool gemm_bf16_supported();
// Whether bf16 panels run on fp32 FMAs (widened in registers) instead of vdpbf16ps: by default
// on Intel CPUs, where vdpbf16ps issues at a quarter of the FMA rate; set_gemm_bf16_fma switches
// it for the process (tests, benchmarks) and returns gemm_bf16_fma_enabled(). Same sums as fp32
// arithmetic on the bf16-rounded x and weights, in k order. AMX tiles, where they run, come first.
bool gemm_bf16_fma_enabled();
bool set_gemm_bf16_fma(bool on);
// Fused gate/up W [2I, K] float32 (gate rows first, I % 8 == 0) -> panels [I / 8, K, 16]: panel
// p holds gate rows 8p..8p+7 in its first 8 columns and up rows 8p..8p+7 in its last 8.
at::Tensor gemm_pack_swiglu_weight(const at::Tensor& weight);
// y [M, N] = x [M, K] @ W^T from gemm_pack_weight panels; x float32 with unit inner stride.
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
// out [M, N] += x [M, K] @ W^T in place (the residual add fused into the matmul).
void gemm_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed);
// [M, I] = silu(x @ W_gate^T) * (x @ W_up^T) from gemm_pack_swiglu_weight panels.
at::Tensor gemm_swiglu(const at::Tensor& x, const at::Tensor& packed);
// gemm_swiglu into a view of workspace (a 1-D float32 tensor, replaced by a larger one when it
// is undefined or too small), so the decoder layers of one step share one buffer: a prefill
// chunk's [M, I] output is often above glibc's 32 MiB mmap threshold, and a fresh one per layer
// was mapped, page-faulted and zeroed by the kernel every time.
at::Tensor gemm_swiglu_into(at::Tensor& workspace, const at::Tensor& x, const at::Tensor& packed);
}  // namespace pagedllm
