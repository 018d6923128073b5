// fp32 linear layers for small and medium row counts (gemm.cpp), bound in paged_attention.cpp.
#pragma once
#include <torch/extension.h>

namespace pagedllm {
// Columns per packed weight panel (two AVX2 registers).
constexpr int kGemmPanel = 16;
// W [N, K] float32 -> panels [ceil(N / 16), K, 16] float32 (zero-padded last panel).
at::Tensor gemm_pack_weight(const at::Tensor& weight);
// y [M, N] = x [M, K] @ W^T from the packed panels; x float32 with unit inner stride.
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
}  // namespace pagedllm
