// Pre-norm decoder layers (Llama's: RMSNorm, QKV, RoPE, paged attention, O, residual, RMSNorm,
// gate/up, SiLU, down, residual) in one op (fused_layer.cpp), registered in torch_bindings.cpp.
// Python side: pagedllm/model/layers/fused_layer.py.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include <vector>

namespace pagedllm {
// Kinds of a linear part (`kinds`): the kernel that computes it from its weight tensor.
enum LinearKind : int64_t {
  kLinearQ4 = 0,      // gguf_q4_linear's interleaved 4-bit records
  kLinearQ8 = 1,      // gguf_q8_linear's interleaved 8-bit records
  kLinearGemm = 2,    // gemm_pack_weight's fp32 panels
  kLinearSwiGLU = 3,  // gemm_pack_swiglu_weight's panels: the gate/up part yields the activation
  kLinearInt8 = 4,    // an Int8Linear record (int8_linear_record)
  kLinearOneDNN = 5,  // mkldnn::_reorder_linear_weight's packed fp32 / bf16 weight (AMX tiles)
};

// hidden [T, d] float32 (the residual stream, updated in place) through L layers in order.
// Layer l has caches key_caches[l] / value_caches[l], RMSNorm weights norms[2l] (input) and
// norms[2l + 1] (post-attention), window windows[l] (0: none) and four linears (qkv, o, gate_up,
// down): linear i of layer l is the next parts[4l + i] entries of (weights, kinds, rows), its
// outputs side by side, plus biases[4l + i] ([N] float32, or empty for none). Attention arguments
// as paged_attention_decode / _prefill and reshape_and_cache; RoPE as rotary_embedding on the
// first rotary_dims[l] dimensions of each q and k head of layer l (0: no RoPE on that layer).
// interrupt (optional) is an int32 [2] tensor another thread may write while this runs:
// element 0 nonzero stops the call before its next layer; element 1 receives the number of layers
// run (the caller discards a step stopped early; its K/V writes are rewritten identically when
// the step runs again).
void decoder_layers_(at::Tensor hidden, std::vector<at::Tensor> key_caches,
                     std::vector<at::Tensor> value_caches, std::vector<at::Tensor> norms,
                     double eps, std::vector<at::Tensor> weights, at::IntArrayRef kinds,
                     at::IntArrayRef rows, at::IntArrayRef parts, std::vector<at::Tensor> biases,
                     at::IntArrayRef windows, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, at::IntArrayRef rotary_dims, double scale,
                     const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& rotary_rows,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t num_decodes, int64_t num_seqs, int64_t partition_size,
                     const std::optional<at::Tensor>& interrupt);
}  // namespace pagedllm
