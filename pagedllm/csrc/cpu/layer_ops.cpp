// Fused element-wise ops for the CPU step: RMSNorm, residual add + RMSNorm, the SwiGLU
// activation, rotary embedding in place, and the sampler's per-row argmax + logsumexp. Each
// replaces 3-7 separate ATen ops (and their temporaries) by one pass over the rows, parallel over
// rows with at::parallel_for. RMSNorm, the SwiGLU activation and RoPE also take bfloat16 rows
// (widened to fp32 on load, one rounding per stored value); the sampler op is fp32 only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "layer_ops.h"
#include "vec.h"

namespace pagedllm {
namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, d] with unit inner stride");
}

// As check_rows, for the ops that take float32 or bfloat16 rows (of dtype `dtype`).
void check_act_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " (as x), got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, d] with unit inner stride");
}

void check_act_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// The RMSNorm ops' arguments: x and `other` (out or residual) [T, d] rows of one dtype, weight [d].
void check_norm_args(const at::Tensor& x, const at::Tensor& other, const char* other_name,
                     const at::Tensor& weight) {
  check_act_dtype(x, "x");
  check_act_rows(x, "x", x.scalar_type());
  check_act_rows(other, other_name, x.scalar_type());
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous and of x's dtype");
  TORCH_CHECK(other.size(0) == x.size(0) && other.size(1) == x.size(1) &&
                  weight.numel() == x.size(1),
              "shape mismatch");
}

template <typename T>
float sum_squares(const T* x, int n) {
  float s = 0.f;
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  vec::V acc = vec::zero();
  for (; i + vec::W <= n; i += vec::W) {
    vec::V v = vec::load(x + i);
    acc = vec::fmadd(v, v, acc);
  }
  s = vec::hsum(acc);
#endif
  for (; i < n; ++i) s += vec::to_float(x[i]) * vec::to_float(x[i]);
  return s;
}

// dst = src * inv * w, in fp32, rounded once to T.
template <typename T>
void scale_by_weight(T* dst, const T* src, const T* w, float inv, int n) {
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  vec::V iv = vec::set1(inv);
  for (; i + vec::W <= n; i += vec::W)
    vec::store(dst + i, vec::mul(vec::mul(vec::load(src + i), iv), vec::load(w + i)));
#endif
  for (; i < n; ++i) vec::from_float(vec::to_float(src[i]) * inv * vec::to_float(w[i]), dst + i);
}

template <typename T>
void rms_norm_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t T_ = x.size(0);
  const int d = static_cast<int>(x.size(1));
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = xp + t * xs;
      const float inv = 1.0f / std::sqrt(sum_squares(row, d) / d + static_cast<float>(eps));
      scale_by_weight(op + t * os, row, wp, inv, d);
    }
  });
}

template <typename T>
void fused_add_rms_norm_rows(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  const int64_t T_ = x.size(0);
  const int d = static_cast<int>(x.size(1));
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* xr = xp + t * xs;
      T* rr = rp + t * rs;
      int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      for (; i + vec::W <= d; i += vec::W)
        vec::store(rr + i, vec::add(vec::load(rr + i), vec::load(xr + i)));
#endif
      for (; i < d; ++i) vec::from_float(vec::to_float(rr[i]) + vec::to_float(xr[i]), rr + i);
      // The sum is rounded to T first (the residual stream's dtype), then normalized.
      const float inv = 1.0f / std::sqrt(sum_squares(rr, d) / d + static_cast<float>(eps));
      scale_by_weight(xr, rr, wp, inv, d);
    }
  });
}

template <typename T>
void silu_and_mul_rows(at::Tensor& out, const at::Tensor& gate_up, int n) {
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, gate_up.size(0), 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* g = gp + t * gs;
      vec::silu_mul_row(g, g + n, op + t * os, n);
    }
  });
}

template <typename T>
void rotate_rows(at::Tensor& x, const int64_t* pos, const float* cp, const float* sp) {
  const int64_t T_ = x.size(0), heads = x.size(1);
  const int half = static_cast<int>(x.size(2)) / 2;
  T* xp = x.data_ptr<T>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * half;
      const float* sn = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xp + t * s0 + h * s1;  // "rotate half": pairs (i, i + D/2)
        T* x2 = x1 + half;
        int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
        for (; i + vec::W <= half; i += vec::W) {
          vec::V a = vec::load(x1 + i), bb = vec::load(x2 + i);
          vec::V cv = vec::load(c + i), sv = vec::load(sn + i);
          vec::store(x1 + i, vec::fmadd(a, cv, vec::mul(bb, vec::mul(sv, vec::set1(-1.0f)))));
          vec::store(x2 + i, vec::fmadd(bb, cv, vec::mul(a, sv)));
        }
#endif
        for (; i < half; ++i) {
          const float a = vec::to_float(x1[i]), bb = vec::to_float(x2[i]);
          vec::from_float(a * c[i] - bb * sn[i], x1 + i);
          vec::from_float(bb * c[i] + a * sn[i], x2 + i);
        }
      }
    }
  });
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, out, "out", weight);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<vec::bf16>(out, x, weight, eps);
  else
    rms_norm_rows<float>(out, x, weight, eps);
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, residual, "residual", weight);
  if (x.scalar_type() == at::kBFloat16)
    fused_add_rms_norm_rows<vec::bf16>(x, residual, weight, eps);
  else
    fused_add_rms_norm_rows<float>(x, residual, weight, eps);
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_act_dtype(gate_up, "gate_up");
  check_act_rows(gate_up, "gate_up", gate_up.scalar_type());
  check_act_rows(out, "out", gate_up.scalar_type());
  const int64_t T = gate_up.size(0);
  const int n = static_cast<int>(out.size(1));
  TORCH_CHECK(gate_up.size(1) == 2 * n && out.size(0) == T, "gate_up must be [T, 2 * I], out [T, I]");
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_and_mul_rows<vec::bf16>(out, gate_up, n);
  else
    silu_and_mul_rows<float>(out, gate_up, n);
}

void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  check_act_dtype(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with unit inner stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos and sin must be contiguous float32 [P, D/2]");
  const int64_t T = x.size(0);
  const int D = static_cast<int>(x.size(2)), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(1) == half, "head_dim must be even and equal 2 * cos.size(1)");
  TORCH_CHECK(positions.numel() == T, "positions must have one entry per token");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table [0, ", P, ")");
  if (x.scalar_type() == at::kBFloat16)
    rotate_rows<vec::bf16>(x, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  else
    rotate_rows<float>(x, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
}

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t B = logits.size(0);
  const int64_t V = logits.size(1);
  TORCH_CHECK(V > 0, "logits must have at least one column");
  at::Tensor idx = logits.new_empty({B}, at::kLong);
  at::Tensor lse = logits.new_empty({B});
  const float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  int64_t* ip = idx.data_ptr<int64_t>();
  float* op = lse.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = lp + r * ls;
      // Pass 1: the maximum (vectorized), then its first index (torch.argmax's tie rule). NaN
      // is not handled (the caller checks the result is finite).
      float best = row[0];
      int64_t v0 = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      if (V >= vec::W) {
        vec::V mx = vec::load(row);
        for (v0 = vec::W; v0 + vec::W <= V; v0 += vec::W) mx = vec::vmax(mx, vec::load(row + v0));
        best = vec::hmax(mx);
      }
#endif
      for (; v0 < V; ++v0) best = std::max(best, row[v0]);
      int64_t arg = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      // A vector compare per W entries: the scalar scan to the maximum's index was ~a fifth of
      // the op (64 x 49152 logits).
      for (; arg + vec::W <= V; arg += vec::W) {
        const int lane = vec::first_equal(vec::load(row + arg), best);
        if (lane >= 0) {
          arg += lane;
          break;
        }
      }
#endif
      while (arg < V - 1 && row[arg] != best) ++arg;
      // Pass 2: sum of exp(x - max), vectorized; the row is still in cache for small V.
      float sum = 0.f;
      int64_t v = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      vec::V acc = vec::zero();
      const vec::V m = vec::set1(best);
      for (; v + vec::W <= V; v += vec::W)
        acc = vec::add(acc, vec::exp(vec::add(vec::load(row + v), vec::mul(m, vec::set1(-1.0f)))));
      sum = vec::hsum(acc);
#endif
      // The rest of the row (all of it without SIMD) in double: a float running sum over a
      // 49152-entry vocabulary drifts ~1e-5 (relative) from torch.logsumexp's.
      double rest = 0.0;
      for (; v < V; ++v) rest += std::exp(static_cast<double>(row[v]) - best);
      sum += static_cast<float>(rest);
      ip[r] = arg;
      op[r] = best == -std::numeric_limits<float>::infinity() ? best : best + std::log(sum);
    }
  });
  return {idx, lse};
}

}  // namespace pagedllm
