// Linear layers on GGUF block-quantized weights computed natively (quant_gguf.cpp), registered in
// torch_bindings.cpp. Python side and the repacking of each GGUF format:
// pagedllm/model/quant/gguf_native.py.
#pragma once
#include <ATen/ATen.h>

namespace pagedllm {
// 4-bit affine blocks of 32 (Q4_0, Q4_1, Q4_K repacked): w = d * q + m, q in 0..15.
//   x [M, K] float32; qs [N, K / 2] uint8 (per 32-block 16 bytes: byte j holds element j in its
//   low nibble and element j + 16 in its high nibble, llama.cpp's Q4_1 order);
//   dm [N, K / 32, 2] float32 or float16 (d, m). Returns y [M, N] float32 = x @ W^T.
at::Tensor gguf_q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm);
// Signed 8-bit blocks (Q8_0, Q5_0, Q6_K repacked): w = d * q.
//   x [M, K] float32; qs [N, K] int8; d [N, K / 16] float32 (one scale per 16) or [N, K / 32]
//   float16 (one per 32). Returns y [M, N] float32.
at::Tensor gguf_q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d);
}  // namespace pagedllm
