// All decoder layers of a step in one op: at batch 1 a SmolLM2-135M layer is ~15 small kernels,
// and calling them one by one from Python (module calls, views, allocation, dispatch) cost about
// as much as the GGUF GEMVs themselves (issue 22). Here the same kernels run back to back from
// C++, with the same arithmetic as the unfused path (so outputs are bit-identical to it).
#include "fused_layer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>

#include <vector>

#include "gemm.h"
#include "int8_gemm.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "quant_gguf.h"

namespace pagedllm {
namespace {

// One linear layer: its parts' outputs side by side, plus the bias.
struct Linear {
  const at::Tensor* weights;
  const int64_t* kinds;
  const int64_t* rows;
  int64_t count;
  const at::Tensor* bias;
};

// x W^T through oneDNN's packed matmul (what PackedLinear runs when the own GEMM does not: bf16
// weights on AMX CPUs, where it uses the AMX tiles). x [T, K] float32 is rounded to the weight's
// dtype; the product [T, N] comes back as float32. Called boxed through the dispatcher, so the
// op's C++ signature (which changes between PyTorch versions) does not matter here.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(bf16 ? x.to(at::kBFloat16) : x);
  stack.emplace_back(w);
  stack.emplace_back();  // no bias: run_linear adds it in float32
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  return bf16 ? y.to(at::kFloat) : y;
}

at::Tensor run_part(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n) {
  switch (kind) {
    case kLinearOneDNN:
      return onednn_linear(x, w);
    case kLinearQ4:
      return gguf_q4_linear(x, w, n);
    case kLinearQ8:
      return gguf_q8_linear(x, w, n);
    case kLinearGemm:
      return gemm_linear(x, w, n);
    case kLinearInt8:
      return int8_linear_record(x, w, n, c10::nullopt);
    default:
      // kLinearSwiGLU never comes here: run_layer takes it (a whole gate/up, checked at entry).
      TORCH_CHECK(false, "decoder_layers_: unknown linear kind ", kind);
  }
}

at::Tensor run_linear(const at::Tensor& x, const Linear& l) {
  // The int8 kernel adds the bias in its epilogue, as the unfused Int8Linear does (a later add
  // would round differently where the compiler contracts the epilogue into an FMA).
  if (l.count == 1 && l.kinds[0] == kLinearInt8 && l.bias->numel())
    return int8_linear_record(x, l.weights[0], l.rows[0], *l.bias);
  at::Tensor y;
  if (l.count == 1) {
    y = run_part(x, l.weights[0], l.kinds[0], l.rows[0]);
  } else {
    std::vector<at::Tensor> ys;
    for (int64_t i = 0; i < l.count; ++i)
      ys.push_back(run_part(x, l.weights[i], l.kinds[i], l.rows[i]));
    y = at::cat(ys, 1);
  }
  if (l.bias->numel()) y.add_(*l.bias);
  return y;
}

// The per-step arguments every layer shares.
struct Step {
  int64_t H, KVH, D;
  double eps, scale;
  const at::Tensor *cos, *sin, *rotary_rows, *slot_mapping, *block_tables, *seq_lens, *starts;
  int64_t num_decodes, num_seqs, partition_size;
};

void run_layer(at::Tensor& hidden, const Step& st, const at::Tensor& input_norm,
               const at::Tensor& post_norm, const Linear* lin, at::Tensor& key_cache,
               at::Tensor& value_cache, int64_t window, int64_t rotary_dim,
               at::Tensor& act_workspace) {
  const int64_t T = hidden.size(0);
  const int64_t H = st.H, KVH = st.KVH, D = st.D;

  // Attention block: x = rms_norm(hidden); qkv = x Wqkv^T; RoPE on q and k in place (none on a
  // layer whose rotary_dim is 0: SmolLM3's NoPE layers).
  at::Tensor x = hidden.new_empty(hidden.sizes());
  rms_norm(x, hidden, input_norm, st.eps);
  at::Tensor qkv = run_linear(x, lin[0]);  // [T, (H + 2 KVH) D]
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "decoder_layers_: qkv has ", qkv.size(1),
              " columns, expected (num_heads + 2 num_kv_heads) head_dim");
  at::Tensor qk = qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D});
  if (rotary_dim > 0)
    rotary_embedding(rotary_dim == D ? qk : qk.narrow(2, 0, rotary_dim), *st.rotary_rows, *st.cos,
                     *st.sin);
  at::Tensor q = qk.narrow(1, 0, H);
  at::Tensor k = qk.narrow(1, H, KVH);
  at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
  reshape_and_cache(k, v, key_cache, value_cache, *st.slot_mapping);
  at::Tensor attn = hidden.new_empty({T, H, D});
  if (st.num_decodes > 0)
    paged_attention_decode(attn, q, key_cache, value_cache, *st.block_tables, *st.seq_lens,
                           st.num_decodes, st.scale, st.partition_size, window);
  if (st.num_decodes < st.num_seqs)
    paged_attention_prefill(attn, q, key_cache, value_cache, *st.block_tables, *st.seq_lens,
                            *st.starts, st.num_decodes, st.num_seqs, st.scale, st.partition_size,
                            window);
  at::Tensor o = run_linear(attn.view({T, H * D}), lin[1]);
  // hidden += o; o = rms_norm(hidden) (one pass).
  fused_add_rms_norm(o, hidden, post_norm, st.eps);

  // MLP block: hidden += down(silu(gate) * up).
  at::Tensor act;
  if (lin[2].count == 1 && lin[2].kinds[0] == kLinearSwiGLU) {
    act = gemm_swiglu_into(act_workspace, o, lin[2].weights[0]);
  } else {
    at::Tensor gate_up = run_linear(o, lin[2]);
    act = hidden.new_empty({T, gate_up.size(1) / 2});
    silu_and_mul(act, gate_up);
  }
  if (lin[3].count == 1 && lin[3].kinds[0] == kLinearGemm && !lin[3].bias->numel())
    gemm_linear_add_(hidden, act, lin[3].weights[0]);  // the residual add in the GEMM epilogue
  else
    hidden.add_(run_linear(act, lin[3]));
}

}  // namespace

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
                     const std::optional<at::Tensor>& interrupt) {
  const size_t L = key_caches.size();
  int32_t* flag = nullptr;
  if (interrupt.has_value() && interrupt->defined()) {
    TORCH_CHECK(interrupt->scalar_type() == at::kInt && interrupt->numel() == 2 &&
                    interrupt->is_contiguous(),
                "decoder_layers_: interrupt must be a contiguous int32 [2] tensor");
    flag = interrupt->data_ptr<int32_t>();
  }
  TORCH_CHECK(value_caches.size() == L && norms.size() == 2 * L && windows.size() == L &&
                  rotary_dims.size() == L && parts.size() == 4 * L && biases.size() == 4 * L,
              "decoder_layers_: per layer one key and value cache, two norms, one window, one "
              "rotary size, four part counts and four biases");
  for (int64_t r : rotary_dims)
    TORCH_CHECK(r >= 0 && r <= head_dim && r % 2 == 0,
                "decoder_layers_: a rotary size must be even and within [0, head_dim], got ", r);
  int64_t total = 0;
  for (int64_t p : parts) {
    TORCH_CHECK(p >= 1, "decoder_layers_: a linear has no part");
    total += p;
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == total && kinds.size() == weights.size() &&
                  rows.size() == weights.size(),
              "decoder_layers_: weights, kinds and rows must have one entry per part");
  for (size_t i = 0; i < kinds.size(); ++i)
    TORCH_CHECK(kinds[i] >= kLinearQ4 && kinds[i] <= kLinearOneDNN,
                "decoder_layers_: unknown linear kind ", kinds[i]);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "decoder_layers_: hidden must be a contiguous [T, d] float32 tensor");
  const Step st{num_heads, num_kv_heads, head_dim, eps, scale, &cos, &sin,
                &rotary_rows, &slot_mapping, &block_tables, &seq_lens, &query_start_loc,
                num_decodes, num_seqs, partition_size};
  int64_t first = 0;
  at::Tensor act_workspace;  // the SwiGLU output, shared by the layers (gemm_swiglu_into)
  for (size_t l = 0; l < L; ++l) {
    if (flag && __atomic_load_n(flag, __ATOMIC_ACQUIRE)) break;
    Linear lin[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t n = parts[4 * l + i];
      lin[i] = Linear{weights.data() + first, kinds.data() + first, rows.data() + first, n,
                      &biases[4 * l + i]};
      first += n;
      for (int64_t p = 0; p < n; ++p)
        TORCH_CHECK(lin[i].kinds[p] != kLinearSwiGLU ||
                        (i == 2 && n == 1 && !lin[i].bias->numel()),
                    "decoder_layers_: a SwiGLU part must be the whole bias-free gate/up linear");
    }
    run_layer(hidden, st, norms[2 * l], norms[2 * l + 1], lin, key_caches[l], value_caches[l],
              windows[l], rotary_dims[l], act_workspace);
    if (flag) __atomic_store_n(flag + 1, static_cast<int32_t>(l + 1), __ATOMIC_RELEASE);
  }
}

}  // namespace pagedllm
