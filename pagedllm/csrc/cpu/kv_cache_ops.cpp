// KV cache writes and block moves (paper section 4.1 / 4.5): reshape_and_cache stores a step's
// new K/V rows into their slots, quantizing into int8 / fp8 e4m3 caches (kv_quant.h);
// copy_blocks (copy-on-write) and swap_blocks (device <-> host swap pool) move whole blocks, scale
// rows included, as raw bytes. Registered in torch_bindings.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "paged_attention.h"
#include "vec.h"

namespace pagedllm {
namespace {

// One (block, kv head) of a quantized cache gets tokens order[b .. e) (all in that block):
// raise the block's running absmax scale if they need it, requantizing the rows already there,
// then quantize the new rows. A run holding offset 0 starts the block afresh (scale reset), so a
// reused block never inherits its previous owner's scale.
template <typename T, typename C>
void write_block_head(const T* x, int64_t xs0, const int64_t* slots, const int64_t* order,
                      int64_t b, int64_t e, C* head_base, const kvq::CacheView& cv) {
  const int D = cv.D, BS = cv.block_size;
  const int64_t block = slots[order[b]] / BS;
  C* rows = head_base + block * cv.rows * D;
  float amax = 0.f;
  bool fresh = false;
  for (int64_t i = b; i < e; ++i) {
    const T* src = x + order[i] * xs0;
    for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(vec::to_float(src[d])));
    fresh |= slots[order[i]] % BS == 0;
  }
  float scale = fresh ? 0.f : kvq::block_scale(head_base, block, cv);
  const float need = amax / kvq::kQmax<C>;
  if (need > scale) {
    if (scale > 0.f) {
      const float ratio = scale / need;
      for (int64_t r = 0; r < static_cast<int64_t>(BS) * D; ++r)
        rows[r] = kvq::quantize<C>(vec::to_float(rows[r]) * ratio);
    }
    scale = need;
  }
  std::memcpy(rows + static_cast<int64_t>(BS) * D, &scale, sizeof(float));
  const float div = scale > 0.f ? scale : 1.f;  // an all-zero block stays zero
  for (int64_t i = b; i < e; ++i) {
    const T* src = x + order[i] * xs0;
    C* dst = rows + (slots[order[i]] % BS) * D;
    for (int d = 0; d < D; ++d) dst[d] = kvq::quantize<C>(vec::to_float(src[d]) / div);
  }
}

template <typename T, typename C>
void write_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                     at::Tensor& value_cache, const int64_t* slots) {
  const int64_t T_ = key.size(0), KVH = key.size(1);
  const int rows = static_cast<int>(key_cache.size(2)), D = static_cast<int>(key.size(2));
  const kvq::CacheView cv{key_cache.size(1) * rows * D, rows - 1, rows, D};
  // Tokens grouped by block (stable: slot order within a block), so that each work item owns
  // one block-head: its scale and its rows.
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T_; ++t)
    if (slots[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return slots[a] / cv.block_size < slots[b] / cv.block_size;
  });
  std::vector<int64_t> runs;  // run r is order[runs[r] .. runs[r + 1])
  for (size_t i = 0; i < order.size(); ++i)
    if (i == 0 || slots[order[i]] / cv.block_size != slots[order[i - 1]] / cv.block_size)
      runs.push_back(static_cast<int64_t>(i));
  runs.push_back(static_cast<int64_t>(order.size()));
  const int64_t n_runs = static_cast<int64_t>(runs.size()) - 1;
  const T* kp = static_cast<const T*>(key.data_ptr());
  const T* vp = static_cast<const T*>(value.data_ptr());
  C* kc = static_cast<C*>(key_cache.data_ptr());
  C* vc = static_cast<C*>(value_cache.data_ptr());
  at::parallel_for(0, n_runs * KVH * 2, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const bool is_v = it % 2;
      const int64_t h = (it / 2) % KVH, r = it / (2 * KVH);
      const T* x = (is_v ? vp + h * value.stride(1) : kp + h * key.stride(1));
      const int64_t xs0 = is_v ? value.stride(0) : key.stride(0);
      C* base = (is_v ? vc : kc) + h * cv.head_stride;
      write_block_head<T, C>(x, xs0, slots, order.data(), runs[r], runs[r + 1], base, cv);
    }
  });
}

// Same-layout write with a dtype change (e.g. a float32 model with a bf16 cache).
template <typename T, typename C>
void write_converted(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                     at::Tensor& value_cache, const int64_t* slots) {
  const int64_t T_ = key.size(0), KVH = key.size(1), D = key.size(2);
  const int64_t head_stride = key_cache.size(1) * key_cache.size(2) * D;
  at::parallel_for(0, T_ * KVH, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / KVH, h = i % KVH;
      if (slots[t] < 0) continue;
      for (int which = 0; which < 2; ++which) {
        const at::Tensor& x = which ? value : key;
        const T* src = static_cast<const T*>(x.data_ptr()) + t * x.stride(0) + h * x.stride(1);
        C* dst = static_cast<C*>((which ? value_cache : key_cache).data_ptr()) +
                 h * head_stride + slots[t] * D;
        for (int64_t d = 0; d < D; ++d) vec::from_float(vec::to_float(src[d]), dst + d);
      }
    }
  });
}

}  // namespace

// key/value [T, KVH, D] (rows contiguous) into their slots; negative slots are skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  kvq::check_cache(key_cache, value_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, KVH, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key/value dtypes differ");
  TORCH_CHECK(key.size(1) == key_cache.size(0) && key.size(2) == key_cache.size(3),
              "shape mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  TORCH_CHECK(slot_mapping.numel() >= T, "slot_mapping too short");
  const bool quantized = kvq::is_quantized(key_cache.scalar_type());
  const int64_t block_size = key_cache.size(2) - (quantized ? 1 : 0);
  const int64_t num_slots = key_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range");
  if (quantized || key.scalar_type() != key_cache.scalar_type()) {
    kvq::dispatch_types(key, key_cache, "reshape_and_cache", [&](auto t, auto c) {
      using Tq = decltype(t);
      using Cq = decltype(c);
      if constexpr (kvq::kQuantized<Cq>)
        write_quantized<Tq, Cq>(key, value, key_cache, value_cache, slots);
      else
        write_converted<Tq, Cq>(key, value, key_cache, value_cache, slots);
    });
    return;
  }
  const int64_t head_stride = num_slots * D;
  const int64_t esz = key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t k0 = key.stride(0), k1 = key.stride(1), v0 = value.stride(0), v1 = value.stride(1);
  at::parallel_for(0, T * KVH, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / KVH, h = i % KVH;
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(kc + (h * head_stride + slot * D) * esz, kp + (t * k0 + h * k1) * esz, D * esz);
      std::memcpy(vc + (h * head_stride + slot * D) * esz, vp + (t * v0 + h * v1) * esz, D * esz);
    }
  });
}

namespace {
void check_mapping(const at::Tensor& mapping) {
  TORCH_CHECK(mapping.scalar_type() == at::kLong && mapping.dim() == 2 && mapping.size(1) == 2 &&
                  mapping.is_contiguous(),
              "block_mapping must be a contiguous int64 [N, 2] tensor");
}

// Copy whole blocks (all kv heads) src -> dst between two [KVH, NB, BS, D] tensors.
void copy_block_pairs(const at::Tensor& src, at::Tensor& dst, const int64_t* pairs, int64_t n) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "tensors must be on the CPU");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(src.dim() == 4 && dst.dim() == 4 && src.size(0) == dst.size(0) &&
                  src.size(2) == dst.size(2) && src.size(3) == dst.size(3) &&
                  src.scalar_type() == dst.scalar_type(),
              "block shapes or dtypes differ");
  const int64_t KVH = src.size(0), sNB = src.size(1), dNB = dst.size(1);
  const int64_t block_bytes = src.size(2) * src.size(3) * src.element_size();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(pairs[2 * i] >= 0 && pairs[2 * i] < sNB && pairs[2 * i + 1] >= 0 &&
                    pairs[2 * i + 1] < dNB,
                "block id out of range");
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* dp = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, n * KVH, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t p = i / KVH, h = i % KVH;
      std::memcpy(dp + (h * dNB + pairs[2 * p + 1]) * block_bytes,
                  sp + (h * sNB + pairs[2 * p]) * block_bytes, block_bytes);
    }
  });
}
}  // namespace

// Copy-on-write: for every layer, block mapping[i, 0] -> mapping[i, 1] within the same cache.
void copy_blocks(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                 const at::Tensor& block_mapping) {
  check_mapping(block_mapping);
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key/value cache lists differ");
  const int64_t n = block_mapping.size(0);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (size_t i = 0; i < key_caches.size(); ++i) {
    copy_block_pairs(key_caches[i], key_caches[i], pairs, n);
    copy_block_pairs(value_caches[i], value_caches[i], pairs, n);
  }
}

// Swap: copy block mapping[i, 0] of src to block mapping[i, 1] of dst (e.g. device <-> host pool).
void swap_blocks(const at::Tensor& src, at::Tensor dst, const at::Tensor& block_mapping) {
  check_mapping(block_mapping);
  copy_block_pairs(src, dst, block_mapping.data_ptr<int64_t>(), block_mapping.size(0));
}

}  // namespace pagedllm
