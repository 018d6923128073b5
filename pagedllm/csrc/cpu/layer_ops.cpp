// Fused element-wise ops for the CPU step (fp32): RMSNorm, residual add + RMSNorm, the SwiGLU
// activation, rotary embedding in place, and the sampler's per-row argmax + logsumexp. Each
// replaces 3-7 separate ATen ops (and their temporaries) by one pass over the rows, parallel over
// rows with at::parallel_for. bf16 and other dtypes stay on the ATen path in Python.
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

float sum_squares(const float* x, int n) {
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
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// dst = src * inv * w
void scale_by_weight(float* dst, const float* src, const float* w, float inv, int n) {
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  vec::V iv = vec::set1(inv);
  for (; i + vec::W <= n; i += vec::W)
    vec::store(dst + i, vec::mul(vec::mul(vec::load(src + i), iv), vec::load(w + i)));
#endif
  for (; i < n; ++i) dst[i] = src[i] * inv * w[i];
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat, "weight must be float32");
  const int64_t T = x.size(0);
  const int d = static_cast<int>(x.size(1));
  TORCH_CHECK(out.size(0) == T && out.size(1) == d && weight.numel() == d, "shape mismatch");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = xp + t * xs;
      const float inv = 1.0f / std::sqrt(sum_squares(row, d) / d + static_cast<float>(eps));
      scale_by_weight(op + t * os, row, wp, inv, d);
    }
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat, "weight must be float32");
  const int64_t T = x.size(0);
  const int d = static_cast<int>(x.size(1));
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == d && weight.numel() == d,
              "shape mismatch");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = xp + t * xs;
      float* rr = rp + t * rs;
      int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      for (; i + vec::W <= d; i += vec::W)
        vec::store(rr + i, vec::add(vec::load(rr + i), vec::load(xr + i)));
#endif
      for (; i < d; ++i) rr[i] += xr[i];
      const float inv = 1.0f / std::sqrt(sum_squares(rr, d) / d + static_cast<float>(eps));
      scale_by_weight(xr, rr, wp, inv, d);
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  const int64_t T = gate_up.size(0);
  const int n = static_cast<int>(out.size(1));
  TORCH_CHECK(gate_up.size(1) == 2 * n && out.size(0) == T, "gate_up must be [T, 2 * I], out [T, I]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = gp + t * gs;
      vec::silu_mul_row(g, g + n, op + t * os, n);
    }
  });
}

void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with unit inner stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos and sin must be contiguous float32 [P, D/2]");
  const int64_t T = x.size(0), heads = x.size(1);
  const int D = static_cast<int>(x.size(2)), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.size(1) == half, "head_dim must be even and equal 2 * cos.size(1)");
  TORCH_CHECK(positions.numel() == T, "positions must have one entry per token");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table [0, ", P, ")");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * half;
      const float* sn = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * s0 + h * s1;  // "rotate half": pairs (i, i + D/2)
        float* x2 = x1 + half;
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
          const float a = x1[i], bb = x2[i];
          x1[i] = a * c[i] - bb * sn[i];
          x2[i] = bb * c[i] + a * sn[i];
        }
      }
    }
  });
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
      for (; v < V; ++v) sum += std::exp(row[v] - best);
      ip[r] = arg;
      op[r] = best == -std::numeric_limits<float>::infinity() ? best : best + std::log(sum);
    }
  });
  return {idx, lse};
}

}  // namespace pagedllm
