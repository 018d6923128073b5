// The per-row work of int8_gemm.cpp around its micro-kernels: quantizing an activation row with
// its outliers left out (LLM.int8() section 3.2), scaling a block's int32 sums into the output,
// and adding the outliers' float products. Included by int8_gemm.cpp only (one translation
// unit); each function has a scalar and an AVX-512 form with the same results.
#pragma once

#include "int8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#define PAGEDLLM_INT8_AVX2 1
#endif
// Target attributes (GCC): the AVX512-VNNI and AVX-VNNI loops are compiled into every AVX2 build
// and picked at run time.
#if defined(PAGEDLLM_INT8_AVX2) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDLLM_INT8_VNNI512 1
#endif

namespace pagedllm {
namespace int8_rows {
namespace {  // one translation unit includes this

constexpr int NR = kInt8Panel;
constexpr int KG = 4;  // k per group (one int32 of activations)

// The inner loops, picked at run time (int8_gemm.cpp active_isa). kAvxVnni: vpdpbusd
// VEX-encoded on 256-bit registers (AVX-VNNI: Intel client CPUs from Alder Lake on, without
// AVX-512); its rows' quantization, scaling and outliers take the scalar / AVX2 forms. kAmxInt8:
// TDPBUSD tiles (Intel Xeons with AMX); the helpers below give its rows the kVnni512 forms.
enum class Isa { kScalar, kAvx2, kAvxVnni, kVnni512, kAmxInt8 };

// The form of the per-row helpers below for an inner loop: the AMX tiles' rows are the
// AVX512-VNNI loop's (every AMX CPU has AVX512-VNNI).
inline Isa row_isa(Isa isa) { return isa == Isa::kAmxInt8 ? Isa::kVnni512 : isa; }

// dst[j] = (c[j] * sx) * sw[j] (+ bias[j]) for j < cols <= 2 * NR: the order of the PyTorch
// fallback. A column takes the same path whatever the row count, so a row's result does not
// depend on the batch.
void scale_out_scalar(const int32_t* c, float sx, const float* sw, const float* bias, float* dst,
                      int cols) {
  for (int j = 0; j < cols; ++j) {
    const float v = static_cast<float>(c[j]) * sx * sw[j];
    dst[j] = bias ? v + bias[j] : v;
  }
}

#if defined(PAGEDLLM_INT8_VNNI512)
// The mask of the first min(n, 16) lanes.
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
}

__attribute__((target("avx512f"))) void scale_out_avx512(const int32_t* c, float sx,
                                                         const float* sw, const float* bias,
                                                         float* dst, int cols) {
  const __m512 vx = _mm512_set1_ps(sx);
  for (int j = 0; j < cols; j += NR) {
    const __mmask16 k = first_lanes(cols - j);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + j)), vx);
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, sw + j));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + j));
    _mm512_mask_storeu_ps(dst + j, k, v);
  }
}
#endif

void scale_out(Isa isa, const int32_t* c, float sx, const float* sw, const float* bias, float* dst,
               int cols) {
#if defined(PAGEDLLM_INT8_VNNI512)
  if (row_isa(isa) == Isa::kVnni512) return scale_out_avx512(c, sx, sw, bias, dst, cols);
#endif
  (void)isa;
  scale_out_scalar(c, sx, sw, bias, dst, cols);
}

// A row's outliers: the elements with |x| > limit (limit = the threshold, or infinity for none).
// quantize_row lists the first `cap` of them (columns out_k, values out_v) and counts all in n;
// a row with more than cap (rare: a few BOS-like rows) is scanned again where they are used.
struct Outliers {
  const float* x;  // the row, K elements
  int64_t K;
  float limit;
  const int32_t* out_k;
  const float* out_v;
  int32_t n, cap;

  // f(k, x[k]) for each outlier in increasing k, from the list or the row alike (so the same
  // float sums either way).
  template <typename F>
  void for_each(const F& f) const {
    if (n <= cap) {
      for (int32_t o = 0; o < n; ++o) f(out_k[o], out_v[o]);
      return;
    }
    for (int64_t k = 0; k < K; ++k)
      if (std::fabs(x[k]) > limit) f(k, x[k]);
  }
};

float outlier_limit(float threshold) {
  return threshold > 0.f ? threshold : std::numeric_limits<float>::infinity();
}

// One row: q[0, K) quantized, q[K, K4) left as is (zero); returns the scale. Elements with
// |x| > threshold (threshold > 0) are outliers: coded 0 and left out of the absmax; the first
// cap of them go to out_k / out_v, and *n_out gets their count (see Outliers).
float quantize_row(const float* x, int64_t K, int8_t* q, float threshold, int32_t* out_k,
                   float* out_v, int32_t cap, int32_t* n_out) {
  const float limit = outlier_limit(threshold);
  float absmax = 0.f;
  int32_t n = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(x[k]);
    if (a > limit) {
      if (n < cap) {
        out_k[n] = static_cast<int32_t>(k);
        out_v[n] = x[k];
      }
      ++n;
    } else {
      absmax = std::max(absmax, a);
    }
  }
  *n_out = n;
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::nearbyint(x[k] * inv);  // round half to even, as torch.round
    q[k] = std::fabs(x[k]) > limit ? 0 : static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  return absmax / 127.f;
}

// dst[j] += (sum_o v_o w[n0 + j, k_o]) * sw[j] for one row's outliers (k_o, v_o), over the
// cols <= 2 * NR columns of panels p, p + 1 (the panels' packed int8 weights b0; G groups).
void add_outliers(const int8_t* b0, int64_t G, const Outliers& outliers, const float* sw,
                  float* dst, int cols) {
  float t[2 * NR] = {};
  outliers.for_each([&](int64_t k, float v) {
    const int64_t g = k / KG, r = k % KG;
    for (int j = 0; j < cols; ++j) {
      const int64_t panel = j / NR, col = j % NR;
      t[j] += v * static_cast<float>(b0[((panel * G + g) * NR + col) * KG + r]);
    }
  });
  for (int j = 0; j < cols; ++j) dst[j] += t[j] * sw[j];
}

#if defined(PAGEDLLM_INT8_VNNI512)
// quantize_row with 16 lanes: the same multiply and round-half-to-even (cvtps2dq under the
// default rounding mode), so the same codes and scale.
__attribute__((target("avx512f,avx512bw"))) float quantize_row_avx512(
    const float* x, int64_t K, int8_t* q, float threshold, int32_t* out_k, float* out_v,
    int32_t cap, int32_t* n_out) {
  const __m512 limit = _mm512_set1_ps(outlier_limit(threshold));
  __m512 vmax = _mm512_setzero_ps();
  int32_t n = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = first_lanes(K - k);
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, x + k));
    const __mmask16 outlier = _mm512_mask_cmp_ps_mask(lanes, a, limit, _CMP_GT_OQ);
    // max(a, vmax) keeps vmax where a is NaN, as std::max(absmax, a) in the scalar loop.
    vmax = _mm512_mask_max_ps(vmax, static_cast<__mmask16>(lanes & ~outlier), a, vmax);
    for (unsigned m = outlier; m; m &= m - 1, ++n) {
      if (n >= cap) continue;
      const int64_t i = k + __builtin_ctz(m);
      out_k[n] = static_cast<int32_t>(i);
      out_v[n] = x[i];
    }
  }
  *n_out = n;
  const float absmax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = first_lanes(K - k);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + k);
    const __mmask16 outlier = _mm512_cmp_ps_mask(_mm512_abs_ps(v), limit, _CMP_GT_OQ);
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    r = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~outlier),
                               _mm512_max_epi32(_mm512_min_epi32(r, hi), lo));
    _mm512_mask_cvtsepi32_storeu_epi8(q + k, lanes, r);
  }
  return absmax / 127.f;
}

// add_outliers with the 16 columns of a panel in one register: byte r of each 32-bit lane of
// the weight group is column j's weight at k = 4 g + r.
__attribute__((target("avx512f,avx512bw"))) void add_outliers_avx512(
    const int8_t* b0, int64_t G, const Outliers& outliers, const float* sw, float* dst,
    int cols) {
  const int panels = cols > NR ? 2 : 1;
  __m512 t[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  // The lambda needs the target too: the file may be built without AVX-512.
  outliers.for_each([&](int64_t k, float value) __attribute__((target("avx512f,avx512bw"))) {
    const __m128i shift = _mm_cvtsi32_si128(24 - 8 * static_cast<int>(k % KG));
    const __m512 v = _mm512_set1_ps(value);
    for (int p = 0; p < panels; ++p) {
      const __m512i w = _mm512_load_si512(b0 + (p * G + k / KG) * NR * KG);
      const __m512i wk = _mm512_srai_epi32(_mm512_sll_epi32(w, shift), 24);  // byte k % 4
      t[p] = _mm512_fmadd_ps(v, _mm512_cvtepi32_ps(wk), t[p]);
    }
  });
  for (int p = 0; p < panels; ++p) {
    const __mmask16 lanes = first_lanes(cols - p * NR);
    float* d = dst + p * NR;
    _mm512_mask_storeu_ps(d, lanes, _mm512_fmadd_ps(t[p], _mm512_maskz_loadu_ps(lanes, sw + p * NR),
                                                    _mm512_maskz_loadu_ps(lanes, d)));
  }
}
#endif

float quantize_row_isa(Isa isa, const float* x, int64_t K, int8_t* q, float threshold,
                       int32_t* out_k, float* out_v, int32_t cap, int32_t* n_out) {
#if defined(PAGEDLLM_INT8_VNNI512)
  if (row_isa(isa) == Isa::kVnni512)
    return quantize_row_avx512(x, K, q, threshold, out_k, out_v, cap, n_out);
#endif
  (void)isa;
  return quantize_row(x, K, q, threshold, out_k, out_v, cap, n_out);
}

void add_outliers_isa(Isa isa, const int8_t* b0, int64_t G, const Outliers& outliers,
                      const float* sw, float* dst, int cols) {
#if defined(PAGEDLLM_INT8_VNNI512)
  if (row_isa(isa) == Isa::kVnni512)
    return add_outliers_avx512(b0, G, outliers, sw, dst, cols);
#endif
  (void)isa;
  add_outliers(b0, G, outliers, sw, dst, cols);
}

}  // namespace
}  // namespace int8_rows
}  // namespace pagedllm
