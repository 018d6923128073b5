// GEMV/GEMM on GGUF block-quantized weights without expanding them to fp32 (issue 22 item 4).
//
// The activation rows are quantized to int8 per block of 32 (scale da = max|a| / 127, llama.cpp's
// Q8_0/Q8_1 activation format), so a block's dot product is an integer sum computed with
// _mm256_maddubs_epi16 (u8 x s8 -> s16 pairs) and _mm256_madd_epi16 (-> s32), scaled once:
//   4-bit affine:  sum_j (d q_j + m) a_j = d da sum_j q_j qa_j + m (da sum_j qa_j)
//   8-bit, 16-scale: sum_j d_(j/16) q_j a_j = da (d_0 sum_{j<16} q_j qa_j + d_1 sum_{j>=16} ...)
// Each output row is independent: at::parallel_for splits the rows over the cores and each task
// runs four weight rows against one activation row so the activation loads are shared.
//
// At batch 1 (decode) the weights stream from memory once per token, so bytes per weight set the
// speed: the scales are float16 wherever the GGUF value is exactly a float16 (Q4_0 / Q4_1 d and m,
// Q8_0 / Q5_0 d, one per 32) and float32 where it is a product (Q4_K's d * sc, Q6_K's d * sc, one
// per 16). The scale dtype and count per block are read off the scale tensor.
#include "quant_gguf.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GGUF_AVX2 1
#endif

#ifndef PAGEDLLM_GGUF_PREFETCH
#define PAGEDLLM_GGUF_PREFETCH 512
#endif

namespace pagedllm {
namespace {

constexpr int64_t kBlock = 32;
// How far ahead of the current block each weight row is prefetched (several rows stream at once).
constexpr int64_t kPrefetchBytes = PAGEDLLM_GGUF_PREFETCH;

// Activations of one call quantized per 32-block: qa [M, K] int8, da and sa [M, K / 32]
// (sa = da * sum(qa), the term the affine "m" multiplies). The storage is per thread and reused,
// so a decode step's hundreds of calls allocate nothing.
struct QuantizedRows {
  const int8_t* qa;
  const float* da;
  const float* sa;
};

#ifdef PAGEDLLM_GGUF_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32: q = nearbyint(a * inv) (round half to even, as the scalar path); returns
// sum(q). The same float operations as the scalar path, so the codes are bit-identical.
inline int quantize_block(const float* a, float inv, int8_t* q) {
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i i[4];
  for (int c = 0; c < 4; ++c)
    i[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), iv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  // packs interleave the 128-bit lanes; the permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t stride) {
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> da, sa;
  const int64_t nb = K / kBlock;
  qa.resize(static_cast<size_t>(M * K));
  da.resize(static_cast<size_t>(M * nb));
  sa.resize(static_cast<size_t>(M * nb));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* a = x + m * stride + b * kBlock;
      int8_t* q = qa.data() + m * K + b * kBlock;
      float amax = 0.f;
      int sum = 0;
#ifdef PAGEDLLM_GGUF_AVX2
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 mx = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c)
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(a + 8 * c)));
      amax = hmax(mx);
      const float d = amax / 127.f;
      sum = quantize_block(a, d > 0.f ? 1.f / d : 0.f, q);
#else
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(a[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(a[j] * inv));
        sum += q[j];
      }
#endif
      da[m * nb + b] = d;
      sa[m * nb + b] = d * static_cast<float>(sum);
    }
  }
  return {qa.data(), da.data(), sa.data()};
}

// Scale element i as float32 (float16 scales hold values that are exactly float16).
inline float scale_at(const float* s, int64_t i) { return s[i]; }
inline float scale_at(const at::Half* s, int64_t i) { return static_cast<float>(s[i]); }

void check_inputs(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                  at::ScalarType qtype, int64_t k_per_byte_row) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be [M, K] float32 with unit inner stride");
  TORCH_CHECK(x.size(1) % kBlock == 0, "x: K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == qtype && qs.is_contiguous(),
              "qs has the wrong dtype, shape or layout");
  TORCH_CHECK(qs.size(1) * k_per_byte_row == x.size(1), "qs: ", qs.size(1),
              " bytes per row do not match K = ", x.size(1));
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.is_contiguous() && scales.size(0) == qs.size(0),
              "scales must be contiguous float32 or float16 with one row per output row");
}

#ifdef PAGEDLLM_GGUF_AVX2
// (d, m) of one q4 block in lanes 0 and 1.
inline __m128 load_pair(const float* s) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
}
inline __m128 load_pair(const at::Half* s) {
  int32_t bits;
  std::memcpy(&bits, s, sizeof(bits));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// Rows [r, r + R) of the 4-bit weight against one quantized activation row. Per block the
// products (d da, m sa) come from one multiply; lane 1 accumulates the affine term.
template <int R, typename S>
inline void q4_rows(const uint8_t* qs, const S* dm, int64_t nb, const int8_t* qa,
                    const float* da, const float* sa, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  __m128 macc[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    macc[i] = _mm_setzero_ps();
  }
  const int64_t row_bytes = nb * 16;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + b * kBlock));
    const __m128 ad = _mm_setr_ps(da[b], sa[b], 0.f, 0.f);
    for (int i = 0; i < R; ++i) {
      const uint8_t* w = qs + i * row_bytes + b * 16;
      if constexpr (kPrefetchBytes > 0)
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
      const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), ones);
      const __m128 prod = _mm_mul_ps(load_pair(dm + (i * nb + b) * 2), ad);  // d da, m sa
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), acc[i]);
      macc[i] = _mm_add_ps(macc[i], prod);
    }
  }
  for (int i = 0; i < R; ++i)
    out[i] = hsum(acc[i]) + _mm_cvtss_f32(_mm_shuffle_ps(macc[i], macc[i], 1));
}

// The per-lane scale of one q8 block (lanes 0-3: elements 0-15, lanes 4-7: 16-31), times da.
template <int SPB>
inline __m256 q8_scale(const float* s, __m256 ad) {
  if constexpr (SPB == 2)
    return _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0])), ad);
  else
    return _mm256_mul_ps(_mm256_set1_ps(s[0]), ad);
}
template <int SPB>
inline __m256 q8_scale(const at::Half* s, __m256 ad) {
  static_assert(SPB == 1, "float16 q8 scales are one per block");
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const uint16_t*>(s)));
  return _mm256_mul_ps(_mm256_broadcastss_ps(d), ad);
}

// Rows [r, r + R) of the 8-bit weight (SPB scales per block of 32) against one quantized
// activation row.
template <int R, typename S, int SPB>
inline void q8_rows(const int8_t* qs, const S* d, int64_t nb, const int8_t* qa,
                    const float* da, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t K = nb * kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + b * kBlock));
    const __m256 ad = _mm256_set1_ps(da[b]);
    for (int i = 0; i < R; ++i) {
      const int8_t* wp = qs + i * K + b * kBlock;
      if constexpr (kPrefetchBytes > 0)
        _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      // maddubs multiplies unsigned by signed: move w's sign onto the activation.
      const __m256i p = _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w)), ones);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), q8_scale<SPB>(d + (i * nb + b) * SPB, ad),
                               acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}
#endif

// Plain C++ versions of the same integer arithmetic (scalar kernel variant).
template <typename S>
inline float q4_row_scalar(const uint8_t* qs, const S* dm, int64_t nb, const int8_t* qa,
                           const float* da, const float* sa) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = qs[b * 16 + j];
      isum += (byte & 0x0F) * qa[b * kBlock + j] + (byte >> 4) * qa[b * kBlock + j + 16];
    }
    total += scale_at(dm, 2 * b) * da[b] * static_cast<float>(isum) + scale_at(dm, 2 * b + 1) * sa[b];
  }
  return total;
}

template <typename S, int SPB>
inline float q8_row_scalar(const int8_t* qs, const S* d, int64_t nb, const int8_t* qa,
                           const float* da) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 16; ++j) s0 += qs[b * kBlock + j] * qa[b * kBlock + j];
    for (int j = 16; j < 32; ++j) s1 += qs[b * kBlock + j] * qa[b * kBlock + j];
    const float d0 = scale_at(d, SPB * b), d1 = scale_at(d, SPB * b + SPB - 1);
    total += da[b] * (d0 * static_cast<float>(s0) + d1 * static_cast<float>(s1));
  }
  return total;
}

constexpr int64_t kRows = 4;     // weight rows per inner call
constexpr int64_t kGrain = 16;   // row groups per parallel task

// Runs rows(r0, n, m) -- output rows [r0, r0 + n) of activation row m, n <= kRows -- over all
// rows, split over the cores by row groups.
template <typename F>
void for_row_groups(int64_t M, int64_t N, const F& rows) {
  const int64_t groups = (N + kRows - 1) / kRows;
  at::parallel_for(0, groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kRows;
      for (int64_t m = 0; m < M; ++m) rows(r0, std::min(kRows, N - r0), m);
    }
  });
}

template <typename S>
void q4_linear(const QuantizedRows& a, const uint8_t* w, const S* s, float* out, int64_t M,
               int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  for_row_groups(M, N, [&](int64_t r0, int64_t rows, int64_t m) {
    const int8_t* qa = a.qa + m * K;
    const float *da = a.da + m * nb, *sa = a.sa + m * nb;
    float* o = out + m * N + r0;
#ifdef PAGEDLLM_GGUF_AVX2
    if (rows == kRows)
      return q4_rows<kRows, S>(w + r0 * nb * 16, s + r0 * nb * 2, nb, qa, da, sa, o);
    for (int64_t i = 0; i < rows; ++i)
      q4_rows<1, S>(w + (r0 + i) * nb * 16, s + (r0 + i) * nb * 2, nb, qa, da, sa, o + i);
#else
    for (int64_t i = 0; i < rows; ++i)
      o[i] = q4_row_scalar<S>(w + (r0 + i) * nb * 16, s + (r0 + i) * nb * 2, nb, qa, da, sa);
#endif
  });
}

template <typename S, int SPB>
void q8_linear(const QuantizedRows& a, const int8_t* w, const S* s, float* out, int64_t M,
               int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  for_row_groups(M, N, [&](int64_t r0, int64_t rows, int64_t m) {
    const int8_t* qa = a.qa + m * K;
    const float* da = a.da + m * nb;
    float* o = out + m * N + r0;
#ifdef PAGEDLLM_GGUF_AVX2
    if (rows == kRows)
      return q8_rows<kRows, S, SPB>(w + r0 * K, s + r0 * nb * SPB, nb, qa, da, o);
    for (int64_t i = 0; i < rows; ++i)
      q8_rows<1, S, SPB>(w + (r0 + i) * K, s + (r0 + i) * nb * SPB, nb, qa, da, o + i);
#else
    for (int64_t i = 0; i < rows; ++i)
      o[i] = q8_row_scalar<S, SPB>(w + (r0 + i) * K, s + (r0 + i) * nb * SPB, nb, qa, da);
#endif
  });
}

}  // namespace

at::Tensor gguf_q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm) {
  check_inputs(x, qs, dm, at::kByte, 2);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  TORCH_CHECK(dm.numel() == N * nb * 2, "dm must be [N, K / 32, 2]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows a = quantize_rows(x.data_ptr<float>(), M, K, x.stride(0));
  const uint8_t* w = qs.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  if (dm.scalar_type() == at::kHalf)
    q4_linear<at::Half>(a, w, dm.data_ptr<at::Half>(), out, M, K, N);
  else
    q4_linear<float>(a, w, dm.data_ptr<float>(), out, M, K, N);
  return y;
}

at::Tensor gguf_q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_inputs(x, qs, d, at::kChar, 1);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / kBlock;
  const bool half = d.scalar_type() == at::kHalf;
  TORCH_CHECK(half ? d.numel() == N * nb : d.numel() == N * nb * 2,
              "d must be [N, K / 16] float32 or [N, K / 32] float16");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows a = quantize_rows(x.data_ptr<float>(), M, K, x.stride(0));
  const int8_t* w = qs.data_ptr<int8_t>();
  float* out = y.data_ptr<float>();
  if (half)
    q8_linear<at::Half, 1>(a, w, d.data_ptr<at::Half>(), out, M, K, N);
  else
    q8_linear<float, 2>(a, w, d.data_ptr<float>(), out, M, K, N);
  return y;
}

}  // namespace pagedllm
