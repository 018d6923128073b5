// Paged attention (decode: paged_attention.cpp, prefill: prefill_attention.cpp) and KV cache
// writes / block ops (kv_cache_ops.cpp), registered in torch_bindings.cpp. Caches may be int8 /
// fp8 e4m3 with scale rows (kv_quant.h).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace pagedllm {
// Decode attention for sequences [0, num_seqs): sequence s's single query is query[s].
// out, query [T, H, D]; caches [KVH, NB, BS, D]; block_tables [S, MB] and seq_lens [S] int64.
// window > 0: attend to the last `window` positions only (keys before them are never read).
// partition_size > 0: keys are cut at its multiples (flash-decoding partitions, merged).
// sinks: none, or [H] float32 contiguous, one attention-sink logit per query head (gpt-oss): it
// joins each query's softmax denominator as a key of value zero (attention_common.h fold_sink).
void paged_attention_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t num_seqs, double scale,
                            int64_t partition_size, int64_t window,
                            const std::optional<at::Tensor>& sinks = std::nullopt);
// Causal attention for sequences [seq_begin, seq_end) whose new tokens are
// query[query_start_loc[s] : query_start_loc[s + 1]], the last ones of seq_lens[s] tokens;
// window > 0: the token at position p sees keys p - window + 1 .. p only; sinks as for decode.
// Each query's output equals, bit for bit, paged_attention_decode's for that query with the same
// partition_size and sinks (attention_common.h).
void paged_attention_prefill(at::Tensor out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t seq_begin,
                             int64_t seq_end, double scale, int64_t partition_size,
                             int64_t window,
                             const std::optional<at::Tensor>& sinks = std::nullopt);
// key/value [T, KVH, D] (rows contiguous) into their slots; negative slots are skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping);
// Copy-on-write: for every layer, block mapping[i, 0] -> mapping[i, 1] within the same cache.
void copy_blocks(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                 const at::Tensor& block_mapping);
// Copy block mapping[i, 0] of src to block mapping[i, 1] of dst (e.g. device <-> host pool).
void swap_blocks(const at::Tensor& src, at::Tensor dst, const at::Tensor& block_mapping);
// The SIMD code compiled in: "avx512", "avx2" or "scalar" (the kernel variant).
std::string simd_level();
}  // namespace pagedllm
