// Linear layers on GGUF block-quantized weights computed natively (quant_gguf.cpp), registered in
// torch_bindings.cpp. Python side, the repacking of each GGUF format and the interleaving:
// pagedllm/model/quant/gguf_native.py.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace pagedllm {
// Both kernels take w [ceil(N / G), K / 32, bytes] uint8: output rows in groups of G = 8 (the last
// group zero-padded), one record per (row group, block of 32) of `bytes` bytes. The records below
// are for G = 8; with G = 16 (gguf_group_rows(), quant_gguf_512.h) every chunk is twice as wide
// (row r's 4 bytes at 4r, r < 16) and every scale array holds 16, so the bytes double. The
// kernels read G off the record size.
//
// 4-bit affine blocks (Q4_0, Q4_1, Q4_K repacked): w = d * q + m, q in 0..15. A record is
//   128 bytes of quants -- 4 chunks of 32, chunk c holding for row r (bytes 4r..4r+3) that row's
//   Q4_1-order bytes 4c..4c+3 (low nibble: element j, high: element j + 16) -- then d[8] and
//   m[8], float16 (bytes = 160) or float32 (bytes = 192).
// x [M, K] float32 -> y [M, N] float32 = x @ W^T.
at::Tensor gguf_q4_linear(const at::Tensor& x, const at::Tensor& w, int64_t n);
// Signed 8-bit blocks (Q8_0, Q5_0, Q6_K repacked): w = d * q. A record is 256 bytes of int8
//   quants -- 8 chunks of 32, chunk g holding for row r (bytes 4r..4r+3) its elements
//   4g..4g+3 -- then either d[8] float16, one scale per 32 (bytes = 272), or d0[8], d1[8]
//   float32, one per 16 (bytes = 320).
at::Tensor gguf_q8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n);
// The rows per group the fastest loops on this CPU read: 16 with AVX512-VNNI + BW (unless
// PAGEDLLM_GGUF_ISA=avx2 or avx_vnni), else 8. Records of 8 rows run everywhere.
int64_t gguf_group_rows();
// The integer step the loops run: "avx512_vnni" (vpdpbusd, EVEX), "avx_vnni" (vpdpbusd, VEX:
// AVX-VNNI CPUs without AVX-512, or forced by PAGEDLLM_GGUF_ISA=avx_vnni), "avx2" (maddubs;
// forced by PAGEDLLM_GGUF_ISA=avx2) or "scalar" (kernels built without AVX2).
std::string gguf_isa();
}  // namespace pagedllm
