// GEMV/GEMM on GGUF block-quantized weights without expanding them to fp32 (issue 22 item 4).
//
// The activation rows are quantized to int8 per block of 32 (scale da = max|a| / 127, llama.cpp's
// Q8_0/Q8_1 activation format), so a block's dot product is an integer sum computed with
// _mm256_maddubs_epi16 (u8 x s8 -> s16 pairs) and _mm256_madd_epi16 (-> s32), scaled once:
//   4-bit affine:  sum_j (d q_j + m) a_j = d da sum_j q_j qa_j + m (da sum_j qa_j)
//   8-bit, 16-scale: sum_j d_(j/16) q_j a_j = da (d_0 sum_{j<16} q_j qa_j + d_1 sum_{j>=16} ...)
// Each output row is independent: at::parallel_for splits the rows over the cores and each task
// runs four weight rows against one activation row so the activation loads are shared.
#include "quant_gguf.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GGUF_AVX2 1
#endif

namespace pagedllm {
namespace {

constexpr int64_t kBlock = 32;

// Activations of one call quantized per 32-block: qa [M, K] int8, da and sa [M, K / 32]
// (sa = da * sum(qa), the term the affine "m" multiplies).
struct QuantizedRows {
  std::vector<int8_t> qa;
  std::vector<float> da;
  std::vector<float> sa;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t stride) {
  const int64_t nb = K / kBlock;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* a = x + m * stride + b * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(a[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = r.qa.data() + m * K + b * kBlock;
      int sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(a[j] * inv));
        sum += q[j];
      }
      r.da[m * nb + b] = d;
      r.sa[m * nb + b] = d * static_cast<float>(sum);
    }
  }
  return r;
}

void check_inputs(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                  at::ScalarType qtype, int64_t k_per_byte_row) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be [M, K] float32 with unit inner stride");
  TORCH_CHECK(x.size(1) % kBlock == 0, "x: K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == qtype && qs.is_contiguous(),
              "qs has the wrong dtype, shape or layout");
  TORCH_CHECK(qs.size(1) * k_per_byte_row == x.size(1), "qs: ", qs.size(1),
              " bytes per row do not match K = ", x.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == qs.size(0),
              "scales must be contiguous float32 with one row per output row");
}

#ifdef PAGEDLLM_GGUF_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r, r + R) of the 4-bit weight against one quantized activation row.
template <int R>
inline void q4_rows(const uint8_t* qs, const float* dm, int64_t nb, const int8_t* qa,
                    const float* da, const float* sa, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float macc[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    macc[i] = 0.f;
  }
  const int64_t row_bytes = nb * 16;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + b * kBlock));
    const float ad = da[b], as = sa[b];
    for (int i = 0; i < R; ++i) {
      const __m128i v =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + i * row_bytes + b * 16));
      const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), ones);
      const float* s = dm + (i * nb + b) * 2;
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s[0] * ad), acc[i]);
      macc[i] += s[1] * as;
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]) + macc[i];
}

// Rows [r, r + R) of the 8-bit weight (one scale per 16) against one quantized activation row.
template <int R>
inline void q8_rows(const int8_t* qs, const float* d, int64_t nb, const int8_t* qa,
                    const float* da, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t K = nb * kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + b * kBlock));
    const __m256 ad = _mm256_set1_ps(da[b]);
    for (int i = 0; i < R; ++i) {
      const __m256i w =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * K + b * kBlock));
      // maddubs multiplies unsigned by signed: move w's sign onto the activation.
      const __m256i p = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w)), ones);
      const float* s = d + i * nb * 2 + b * 2;
      // Lanes 0-3 hold elements 0-15 (scale s[0]), lanes 4-7 elements 16-31 (scale s[1]).
      const __m256 sc = _mm256_mul_ps(
          _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0])), ad);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}
#endif

// Plain C++ versions of the same integer arithmetic (scalar kernel variant).
inline float q4_row_scalar(const uint8_t* qs, const float* dm, int64_t nb, const int8_t* qa,
                           const float* da, const float* sa) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = qs[b * 16 + j];
      isum += (byte & 0x0F) * qa[b * kBlock + j] + (byte >> 4) * qa[b * kBlock + j + 16];
    }
    total += dm[2 * b] * da[b] * static_cast<float>(isum) + dm[2 * b + 1] * sa[b];
  }
  return total;
}

inline float q8_row_scalar(const int8_t* qs, const float* d, int64_t nb, const int8_t* qa,
                           const float* da) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 16; ++j) s0 += qs[b * kBlock + j] * qa[b * kBlock + j];
    for (int j = 16; j < 32; ++j) s1 += qs[b * kBlock + j] * qa[b * kBlock + j];
    total += da[b] * (d[2 * b] * static_cast<float>(s0) + d[2 * b + 1] * static_cast<float>(s1));
  }
  return total;
}

constexpr int64_t kRows = 4;     // weight rows per inner call
constexpr int64_t kGrain = 16;   // row groups per parallel task

}  // namespace

at::Tensor gguf_q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
  check_inputs(x, qs, dm, at::kByte, 2);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(dm.numel() == N * nb * 2, "dm must be [N, K / 32, 2]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows a = quantize_rows(x.data_ptr<float>(), M, K, x.stride(0));
  const uint8_t* w = qs.data_ptr<uint8_t>();
  const float* s = dm.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t groups = (N + kRows - 1) / kRows;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kRows, rows = std::min(kRows, N - r0);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* qa = a.qa.data() + m * K;
        const float* da = a.da.data() + m * nb;
        const float* sa = a.sa.data() + m * nb;
        float* o = out + m * N + r0;
#ifdef PAGEDLLM_GGUF_AVX2
        if (rows == kRows) {
          q4_rows<kRows>(w + r0 * nb * 16, s + r0 * nb * 2, nb, qa, da, sa, o);
          continue;
        }
        for (int64_t i = 0; i < rows; ++i)
          q4_rows<1>(w + (r0 + i) * nb * 16, s + (r0 + i) * nb * 2, nb, qa, da, sa, o + i);
#else
        for (int64_t i = 0; i < rows; ++i)
          o[i] = q4_row_scalar(w + (r0 + i) * nb * 16, s + (r0 + i) * nb * 2, nb, qa, da, sa);
#endif
      }
    }
  });
  return y;
}

at::Tensor gguf_q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_inputs(x, qs, d, at::kChar, 1);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(d.numel() == N * nb * 2, "d must be [N, K / 16]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows a = quantize_rows(x.data_ptr<float>(), M, K, x.stride(0));
  const int8_t* w = qs.data_ptr<int8_t>();
  const float* s = d.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t groups = (N + kRows - 1) / kRows;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kRows, rows = std::min(kRows, N - r0);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* qa = a.qa.data() + m * K;
        const float* da = a.da.data() + m * nb;
        float* o = out + m * N + r0;
#ifdef PAGEDLLM_GGUF_AVX2
        if (rows == kRows) {
          q8_rows<kRows>(w + r0 * K, s + r0 * nb * 2, nb, qa, da, o);
          continue;
        }
        for (int64_t i = 0; i < rows; ++i)
          q8_rows<1>(w + (r0 + i) * K, s + (r0 + i) * nb * 2, nb, qa, da, o + i);
#else
        for (int64_t i = 0; i < rows; ++i)
          o[i] = q8_row_scalar(w + (r0 + i) * K, s + (r0 + i) * nb * 2, nb, qa, da);
#endif
      }
    }
  });
  return y;
}

}  // namespace pagedllm
