// Registers the CPU kernels with PyTorch's dispatcher as torch.ops.pagedllm.<name>.
//
// Each schema names its arguments and marks those written in place (Tensor(a!)), so the ops are
// ordinary dispatcher ops (torch.ops.pagedllm.rms_norm, ...). The tensor ops get a CPU kernel;
// simd_level, gemm_bf16_supported, gemm_amx, gemm_bf16_fma, gguf_isa, int8_gemm_isa,
// attention_bf16_dot and attention_amx have no tensor argument and are registered for every
// backend. Typed Python wrappers:
// pagedllm/ops/__init__.py. One build of these sources per ISA variant (avx512, avx2, scalar;
// pagedllm/ops/loader.py), and a process loads exactly one of them.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "attention_amx.h"
#include "attention_bf16.h"
#include "fused_layer.h"
#include "gemm.h"
#include "gemm_amx.h"
#include "int8_gemm.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "quant_gguf.h"

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, int num_seqs, float scale, int partition_size=512, "
      "int window=0, Tensor? sinks=None) -> ()");
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "int seq_begin, int seq_end, float scale, int partition_size=512, int window=0, "
      "Tensor? sinks=None) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) "
      "-> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  m.def("simd_level() -> str", &pagedllm::simd_level);
  // mode 1 / 0 turns the bf16 attention tiles on / off, -1 leaves them; returns whether they run.
  m.def("attention_bf16_dot(int mode) -> bool", [](int64_t mode) {
    if (mode >= 0) pagedllm::attn::set_bf16_dot(mode != 0);
    return pagedllm::attn::bf16_dot_enabled();
  });
  // mode 1 / 0 turns the AMX attention scores on / off, -1 leaves them; returns whether they run.
  m.def("attention_amx(int mode) -> bool", [](int64_t mode) {
    if (mode >= 0) pagedllm::attn::set_amx_attention(mode != 0);
    return pagedllm::attn::amx_attention_enabled();
  });
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("gemm_pack_weight(Tensor weight) -> Tensor");
  m.def("gemm_pack_swiglu_weight(Tensor weight) -> Tensor");
  m.def("gemm_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("gemm_linear_add_(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("gemm_swiglu(Tensor x, Tensor packed) -> Tensor");
  m.def("gemm_bf16_supported() -> bool", &pagedllm::gemm_bf16_supported);
  // mode 1 / 0 turns the AMX tiles for bf16 panels on / off, -1 leaves them; returns whether
  // they run.
  m.def("gemm_amx(int mode) -> bool", [](int64_t mode) {
    if (mode >= 0) pagedllm::set_gemm_amx(mode != 0);
    return pagedllm::gemm_amx_enabled();
  });
  // mode 1 / 0 runs bf16 panels on fp32 FMAs / on vdpbf16ps, -1 leaves it; returns whether the
  // FMAs run.
  m.def("gemm_bf16_fma(int mode) -> bool", [](int64_t mode) {
    if (mode >= 0) pagedllm::set_gemm_bf16_fma(mode != 0);
    return pagedllm::gemm_bf16_fma_enabled();
  });
  m.def("argmax_logsumexp(Tensor logits) -> (Tensor argmax, Tensor logsumexp)");
  m.def("gguf_q4_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("gguf_q8_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("gguf_group_rows() -> int", &pagedllm::gguf_group_rows);
  m.def("gguf_isa() -> str", &pagedllm::gguf_isa);
  m.def("int8_pack_weight(Tensor qweight) -> Tensor");
  m.def("int8_quantize_rows(Tensor x) -> (Tensor q, Tensor scale)");
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor wscale, Tensor wsum, Tensor? bias, "
      "int out_features) -> Tensor");
  m.def("int8_linear_record(Tensor x, Tensor record, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_gemm_isa() -> str", &pagedllm::int8_gemm_isa);
  m.def(
      "decoder_layers_(Tensor(a!) hidden, Tensor(b!)[] key_caches, Tensor(c!)[] value_caches, "
      "Tensor[] norms, float eps, Tensor[] weights, int[] kinds, int[] rows, int[] parts, "
      "Tensor[] biases, int[] windows, int num_heads, int num_kv_heads, int head_dim, "
      "int[] rotary_dims, float scale, Tensor cos, Tensor sin, Tensor rotary_rows, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "int num_decodes, int num_seqs, int partition_size, Tensor? interrupt=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention_decode", &pagedllm::paged_attention_decode);
  m.impl("paged_attention_prefill", &pagedllm::paged_attention_prefill);
  m.impl("reshape_and_cache", &pagedllm::reshape_and_cache);
  m.impl("copy_blocks", &pagedllm::copy_blocks);
  m.impl("swap_blocks", &pagedllm::swap_blocks);
  m.impl("rms_norm", &pagedllm::rms_norm);
  m.impl("fused_add_rms_norm", &pagedllm::fused_add_rms_norm);
  m.impl("silu_and_mul", &pagedllm::silu_and_mul);
  m.impl("rotary_embedding", &pagedllm::rotary_embedding);
  m.impl("gemm_pack_weight", &pagedllm::gemm_pack_weight);
  m.impl("gemm_pack_swiglu_weight", &pagedllm::gemm_pack_swiglu_weight);
  m.impl("gemm_linear", &pagedllm::gemm_linear);
  m.impl("gemm_linear_add_", &pagedllm::gemm_linear_add_);
  m.impl("gemm_swiglu", &pagedllm::gemm_swiglu);
  m.impl("argmax_logsumexp", &pagedllm::argmax_logsumexp);
  m.impl("gguf_q4_linear", &pagedllm::gguf_q4_linear);
  m.impl("gguf_q8_linear", &pagedllm::gguf_q8_linear);
  m.impl("int8_pack_weight", &pagedllm::int8_pack_weight);
  m.impl("int8_quantize_rows", &pagedllm::int8_quantize_rows);
  m.impl("int8_linear", &pagedllm::int8_linear);
  m.impl("int8_linear_record", &pagedllm::int8_linear_record);
  m.impl("decoder_layers_", &pagedllm::decoder_layers_);
}

// oneDNN's packed weights (kind 5) are MKLDNN tensors: with one among the arguments the
// dispatcher asks for the MkldnnCPU kernel of the op.
TORCH_LIBRARY_IMPL(pagedllm, MkldnnCPU, m) {
  m.impl("decoder_layers_", &pagedllm::decoder_layers_);
}
