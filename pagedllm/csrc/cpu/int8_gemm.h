// int8 W8A8 linear layers (int8_gemm.cpp), registered in torch_bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace pagedllm {
// Output columns per packed int8 weight panel (two AVX2 registers, one AVX-512 register).
constexpr int kInt8Panel = 16;
// Activations with |x| above this are outliers (LLM.int8(), Dettmers et al. 2022, section 3.2:
// "mixed-precision decomposition", threshold 6.0): they are left out of their row's int8 codes and
// scale and multiply the weights' int8 codes in float instead. $PAGEDLLM_INT8_OUTLIER_THRESHOLD
// overrides it (0 = none).
constexpr float kInt8OutlierThreshold = 6.0f;
// The threshold in use (the environment variable read once per process).
float int8_outlier_threshold();
// W [N, K] int8 (symmetric, in [-127, 127]) -> panels [ceil(N / 16), ceil(K / 4), 16, 4] int8:
// each 64-byte group holds 4 consecutive k of the panel's 16 columns (zero-padded).
at::Tensor int8_pack_weight(const at::Tensor& qweight);
// x [M, K] float32 -> (q [M, K] int8, scale [M] float32): per row s = absmax / 127,
// q = clamp(round_half_even(x * (127 / absmax)), -127, 127) (all zero for a zero row).
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x);
// y [M, N] float32 = (q_x @ q_w^T) * s_x[m] * s_w[n] (+ bias), the activations quantized per row
// inside the call; wsum [N] int32 holds each weight row's sum (the u8 VNNI paths' zero point).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale,
                       const at::Tensor& wsum, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);
// int8_linear on one int8 linear held as a single 1-D int8 tensor, a record (the fused layers'
// weight entry): the packed panels (int8_pack_weight's [P, G, 16, 4], P = ceil(N / 16),
// G = ceil(K / 4)), then wscale [N] float32, then wsum [P * 16] int32, back to back, the record
// 64-byte aligned. x [M, K] float32 -> [M, out_features] float32 (+ bias [out_features]).
at::Tensor int8_linear_record(const at::Tensor& x, const at::Tensor& record, int64_t out_features,
                              const c10::optional<at::Tensor>& bias);
// Which inner loop int8_linear runs on this CPU: "avx512_vnni", "avx_vnni", "avx2" or "scalar"
// ("amx_int8" only when PAGEDLLM_INT8_ISA=amx_int8 asks for the AMX tiles on a CPU with them).
std::string int8_gemm_isa();
}  // namespace pagedllm
