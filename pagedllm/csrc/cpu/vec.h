// Small SIMD helpers for the paged attention CPU kernels.
//
// One implementation is chosen at compile time from the target flags of the variant being built
// (pagedllm/ops/loader.py: avx512, avx2 or scalar): AVX-512F (16 floats), AVX2 + FMA (8 floats),
// or plain scalar loops. The kernels only use the row-level helpers at the bottom of this file,
// so they are written once.
// bf16 values are widened to fp32 on load; all arithmetic is fp32. int8 and fp8 e4m3 (the
// quantized KV cache, kv_quant.h) load as their raw codes in fp32; callers apply the scale.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_VEC_AVX2 1
#endif

namespace pagedllm {
namespace vec {

// n elements of v (grown as needed, kept between calls) starting at a 64-byte boundary (malloc
// only promises 16): per-thread scratch rows that vector or tile loads read whole lines of.
template <typename T>
T* aligned_scratch(std::vector<T>& v, size_t n) {
  constexpr size_t kPad = 64 / sizeof(T);
  if (v.size() < n + kPad) v.resize(n + kPad);
  const auto addr = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - addr % 64) % 64) / sizeof(T);
}

using bf16 = c10::BFloat16;
using fp8 = c10::Float8_e4m3fn;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(fp8 x) { return static_cast<float>(x); }
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, bf16* dst) { *dst = bf16(x); }  // round to nearest even

// Whether vdpbf16ps is slow on this CPU: on Intel CPUs (measured on a 2-core Xeon, family 6
// model 207) 16 independent chains issue one per ~2.3 cycles against ~2 fp32 FMAs per cycle, so
// it does half the FMAs' multiply-adds per second; on AMD Zen 4 / Zen 5 it does twice as many.
// The bf16 GEMM (gemm.cpp) and the attention tiles (attention_bf16.cpp) then default to fp32
// FMAs on widened bf16 operands.
inline bool vdpbf16ps_slow() {
  static const bool slow = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return slow;
}

#if defined(PAGEDLLM_VEC_AVX512)
constexpr int W = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// fp8 e4m3 -> the fp16 with the same sign, exponent and mantissa bits (exponent bias 15 instead
// of 7) -> fp32, times 2^8 for the bias difference: exact for every finite e4m3 value, subnormals
// included (e4m3 subnormals are fp16 subnormals too).
inline V load(const fp8* p) {
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
// fp32 -> bf16, round to nearest even (as c10::BFloat16); NaN stays a quiet NaN.
inline void store(bf16* p, V v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline float hmax(V v) { return _mm512_reduce_max_ps(v); }
// The first lane of v equal to x, or -1 (NaN equals nothing).
inline int first_equal(V v, float x) {
  const unsigned m = _mm512_cmp_ps_mask(v, set1(x), _CMP_EQ_OQ);
  return m ? __builtin_ctz(m) : -1;
}
// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, e^r by its Taylor polynomial.
inline V exp(V x) {
  x = _mm512_max_ps(x, set1(-87.0f));
  x = _mm512_min_ps(x, set1(88.0f));
  V n = _mm512_roundscale_ps(mul(x, set1(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  V p = set1(1.0f / 720.0f);
  p = fmadd(p, r, set1(1.0f / 120.0f));
  p = fmadd(p, r, set1(1.0f / 24.0f));
  p = fmadd(p, r, set1(1.0f / 6.0f));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return _mm512_scalef_ps(p, n);
}
#elif defined(PAGEDLLM_VEC_AVX2)
constexpr int W = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// fp8 e4m3 via fp16 bits, as in the AVX-512 branch (F16C's vcvtph2ps).
inline V load(const fp8* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                           _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
// fp32 -> bf16, round to nearest even (as c10::BFloat16); NaN stays a quiet NaN.
inline void store(bf16* p, V v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // packus works per 128-bit lane: [b0..b3 b0..b3 | b4..b7 b4..b7]; keep qwords 0 and 2.
  __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(h));
}
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
inline float hmax(V v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int first_equal(V v, float x) {
  const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, set1(x), _CMP_EQ_OQ));
  return m ? __builtin_ctz(m) : -1;
}
inline V exp(V x) {
  x = _mm256_max_ps(x, set1(-87.0f));
  x = _mm256_min_ps(x, set1(88.0f));
  V n = _mm256_round_ps(mul(x, set1(1.44269504088896341f)),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  V p = set1(1.0f / 720.0f);
  p = fmadd(p, r, set1(1.0f / 120.0f));
  p = fmadd(p, r, set1(1.0f / 24.0f));
  p = fmadd(p, r, set1(1.0f / 6.0f));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return mul(p, _mm256_castsi256_ps(e));
}
#else
constexpr int W = 0;  // scalar fallback
#endif

// ---- row helpers used by the kernels ------------------------------------------------------

// a * b + c, fused (one rounding) wherever the build has FMA: written out so that the scalar
// tails of the attention kernels round the same way in every translation unit, whatever the
// compiler would contract.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// dst[0:n] = x[0:n] as fp32 (exact for every cache dtype: bf16, int8 and fp8 values are fp32
// values); the same conversion the W-wide loads do.
template <typename T>
inline void to_float_row(const T* x, int n, float* dst) {
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  for (; i + W <= n; i += W) store(dst + i, load(x + i));
#endif
  for (; i < n; ++i) dst[i] = to_float(x[i]);
}

#if PAGEDLLM_VEC_AVX512
// out[j] = hsum(a[j]) for j < 16, bit for bit, in one transposing pass: each step adds lane pairs
// in the order of _mm512_reduce_add_ps (l[i] + l[i + 8], then i + 4, then i + 2, then i + 1) for
// several vectors per instruction, 15 adds and 31 shuffles instead of 16 x 8 operations.
inline void hsum16(const V* a, float* out) {
  V u[8], w[4], z[2];
  for (int p = 0; p < 8; ++p)  // [a[2p] lanes i + i+8 | a[2p+1] lanes i + i+8], i < 8
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int r = 0; r < 4; ++r)  // 128-bit lane k: a[4r + k] lanes i + i+4, i < 4
    w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0xDD));
  for (int t = 0; t < 2; ++t)  // lane k: a[8t + k] then a[8t + 4 + k], lanes i + i+2, i < 2
    z[t] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * t], w[2 * t + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * t], w[2 * t + 1], 0xEE));
  // Lane k, element e: the sum of a[4e + k]; the permutation puts a[j]'s sum at element j.
  const V f =
      _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, f));
}
#endif

#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
// out[j] = hsum(a[j]) for j < N, bit for bit: with AVX-512 sixteen at a time (hsum16), with AVX2
// eight at a time (two transposing steps of hadd that add the lanes in hsum's order:
// ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7))).
template <int N>
inline void hsum_n(const V* a, float* out) {
  int j = 0;
#if PAGEDLLM_VEC_AVX512
  for (; j + 16 <= N; j += 16) hsum16(a + j, out + j);
#endif
#if PAGEDLLM_VEC_AVX2
  for (; j + 8 <= N; j += 8) {
    __m256 u[4];
    for (int i = 0; i < 4; ++i)
      u[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[j + i], a[j + i + 4], 0x20),
                           _mm256_permute2f128_ps(a[j + i], a[j + i + 4], 0x31));
    _mm256_storeu_ps(out + j, _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]),
                                             _mm256_hadd_ps(u[2], u[3])));
  }
#endif
  for (; j < N; ++j) out[j] = hsum(a[j]);
}
#endif

// out[b * KB + j] = dot(q[b * qs : b * qs + D], k[j][0 : D]) for b < RB, j < KB: each q and k chunk
// is loaded once for the whole block. Every (b, j) pair is computed by the same operations in
// the same order whatever RB and KB are (W-wide FMA partial sums over the chunks, hsum, then the
// scalar tail), so decode (RB = G query heads, KB = 1) and prefill (tiles of rows and keys) give
// a query the same scores bit for bit.
template <int RB, int KB, typename T>
inline void dot_block(const float* q, int qs, const T* const* k, int D, float* out) {
  int d = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  // The first chunk's FMAs add to zero themselves: a zeroing loop over the array (which hsum_n
  // takes by address) became a slow `rep stos`.
  V acc[RB * KB];
  if (D < W)
    for (int i = 0; i < RB * KB; ++i) acc[i] = zero();
  for (; d + W <= D; d += W) {
    V kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load(k[j] + d);
    for (int b = 0; b < RB; ++b) {
      const V qv = load(q + b * qs + d);
      for (int j = 0; j < KB; ++j)
        acc[b * KB + j] = fmadd(qv, kv[j], d == 0 ? zero() : acc[b * KB + j]);
    }
  }
  hsum_n<RB * KB>(acc, out);
#else
  for (int i = 0; i < RB * KB; ++i) out[i] = 0.f;
#endif
  for (; d < D; ++d)
    for (int b = 0; b < RB; ++b)
      for (int j = 0; j < KB; ++j)
        out[b * KB + j] = madd(q[b * qs + d], to_float(k[j][d]), out[b * KB + j]);
}

inline void scale_row(float* a, float c, int n) {
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  V cv = set1(c);
  for (; i + W <= n; i += W) store(a + i, mul(load(a + i), cv));
#endif
  for (; i < n; ++i) a[i] *= c;
}

inline float max_row(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  if (n >= W) {
    V mv = load(x);
    for (i = W; i + W <= n; i += W) mv = vmax(mv, load(x + i));
    m = hmax(mv);
  }
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// x[i] = exp(x[i] - m) in place; returns the sum.
inline float exp_sub_sum(float* x, int n, float m) {
  float s = 0.f;
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  V mv = set1(m);
  V sv = zero();
  for (; i + W <= n; i += W) {
    V e = exp(add(load(x + i), mul(mv, set1(-1.0f))));
    store(x + i, e);
    sv = add(sv, e);
  }
  s = hsum(sv);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

// Ask for a row of n values to be brought into L2 (prefetcht1, one per 64-byte line). Into L1
// (prefetcht0) the decode kernel's prefetches stalled on L1's few miss buffers: bf16 KV decode
// (64 sequences x 400 keys, 2 threads, Zen 4) ran 7 % slower on the fp32 path and 25 % slower
// on the bf16 tiles than with prefetcht1. Locality 3 (prefetcht0, into L1) is for rows already
// near, read within the next few hundred cycles (the AMX decode scores' next chunk).
template <int Locality = 2, typename T>
inline void prefetch_row(const T* p, int n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int b = 0; b < n * static_cast<int>(sizeof(T)); b += 64)
    __builtin_prefetch(c + b, 0, Locality);
}

template <typename T>
inline void load_row_scaled(const T* src, float scale, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

template <typename T>
inline void store_row(const float* src, float scale, int n, T* dst) {
  for (int i = 0; i < n; ++i) from_float(src[i] * scale, dst + i);
}

#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
// silu(g) * u = g / (1 + e^-g) * u per lane (the SwiGLU activation).
inline V silu_mul(V g, V u) {
  const V one = set1(1.0f);
  const V e = exp(mul(g, set1(-1.0f)));  // e^-g
#if PAGEDLLM_VEC_AVX512
  const V sig = _mm512_div_ps(one, add(one, e));
#else
  const V sig = _mm256_div_ps(one, add(one, e));
#endif
  return mul(mul(g, sig), u);
}
#endif

// o[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] (the SwiGLU activation), in fp32.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int n) {
  int i = 0;
#if PAGEDLLM_VEC_AVX512 || PAGEDLLM_VEC_AVX2
  for (; i + W <= n; i += W) store(o + i, silu_mul(load(g + i), load(u + i)));
#endif
  for (; i < n; ++i) {
    const float gi = to_float(g[i]);
    from_float(gi / (1.0f + std::exp(-gi)) * to_float(u[i]), o + i);
  }
}

}  // namespace vec
}  // namespace pagedllm
