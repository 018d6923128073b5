// Fused element-wise layer ops for the CPU step (fp32): RMSNorm, residual add + RMSNorm, and the
// SwiGLU activation. Each replaces 4-7 separate ATen ops (and their temporaries) by one pass over
// the rows, parallel over tokens with at::parallel_for. bf16 and other dtypes stay on the ATen
// path in Python.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

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
      const float* u = g + n;
      float* o = op + t * os;
      int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
      const vec::V one = vec::set1(1.0f), neg = vec::set1(-1.0f);
      for (; i + vec::W <= n; i += vec::W) {
        vec::V gv = vec::load(g + i);
        vec::V sig = vec::exp(vec::mul(gv, neg));  // e^-g
#if PAGEDLLM_VEC_AVX512
        sig = _mm512_div_ps(one, vec::add(one, sig));
#else
        sig = _mm256_div_ps(one, vec::add(one, sig));
#endif
        vec::store(o + i, vec::mul(vec::mul(gv, sig), vec::load(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

}  // namespace pagedllm
