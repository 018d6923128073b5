// Fused element-wise layer ops (layer_ops.cpp), registered in torch_bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace pagedllm {
// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. x, out: [T, d] float32.
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
// residual[t] += x[t]; x[t] = rms_norm(residual[t]) * weight, both in place. [T, d] float32.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
// out[t, j] = silu(gate_up[t, j]) * gate_up[t, I + j]. gate_up [T, 2I], out [T, I] float32.
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);
// Rotary embedding ("rotate half" layout) in place: x [T, heads, D] float32 (any row and head
// strides, unit inner stride), positions [T] int64, cos / sin [P, D/2] float32 tables.
void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin);
// Per row of logits [B, V] float32: (argmax [B] int64, first index of the max; logsumexp [B]).
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits);
}  // namespace pagedllm
