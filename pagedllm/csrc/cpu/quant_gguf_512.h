// The GGUF group loops of quant_gguf.cpp on 512-bit registers: 16 weight rows per record (one per
// 32-bit lane), for CPUs with AVX512-VNNI + BW (Zen 4 / 5, Xeons from Ice Lake on). Included by
// quant_gguf.cpp only, inside PAGEDLLM_GGUF_VNNI.
//
// Why a second layout: with 8 rows per 256-bit record, a block's float steps (int-to-float, the
// scale multiplies and FMAs, the broadcasts) cost as much as its 8 vpdpbusd per activation row;
// 16 rows per register do both for twice the rows. The record is the 8-row record with every
// chunk twice as wide (lane r = row r, r < 16) and 16 scales per scale array, so each output row
// gets the same int32 block sums and the same float operations in the same order as in the
// 8-row loops: the two layouts give bit-identical outputs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define PAGEDLLM_GGUF_512_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace pagedllm {
namespace gguf512 {

constexpr int64_t kRows = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kQ4Quants = kRows * 16;      // 4 chunks of 64 bytes
constexpr int64_t kQ8Quants = kRows * kBlock;  // 8 chunks of 64 bytes

PAGEDLLM_GGUF_512_TARGET inline __m512i dpbusd(__m512i acc, __m512i u, __m512i v) {
  // inline asm: GCC's builtin copies the tied accumulator at every use (int8_gemm.cpp).
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v));
  return acc;
}
PAGEDLLM_GGUF_512_TARGET inline __m512 load16(const float* s) { return _mm512_loadu_ps(s); }
PAGEDLLM_GGUF_512_TARGET inline __m512 load16(const at::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
// Four activation codes broadcast to every 32-bit lane.
PAGEDLLM_GGUF_512_TARGET inline __m512i bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, sizeof(v));
  return _mm512_set1_epi32(v);
}

// quant_gguf.cpp's q4_group_body on a 16-row record: 4 chunks of 64 bytes (lane r: row r's bytes
// 4c..4c+3), then d[16] and m[16] (float16 or float32).
template <typename S, int R>
PAGEDLLM_GGUF_512_TARGET void q4_group(const uint8_t* w, int64_t nb, int64_t bytes,
                                       const int8_t* qa, const float* da, const float* sa,
                                       float* const* out, int64_t prefetch_bytes) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R], macc[R];
  for (int i = 0; i < R; ++i) acc[i] = macc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w) + prefetch_bytes + o, _MM_HINT_T0);
    __m512i sums[R];
    for (int i = 0; i < R; ++i) sums[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(w + 64 * c);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < R; ++i) {
        const int8_t* a = qa + (i * nb + b) * kBlock;
        sums[i] = dpbusd(sums[i], lo, bcast4(a + 4 * c));
        sums[i] = dpbusd(sums[i], hi, bcast4(a + 16 + 4 * c));
      }
    }
    const S* s = reinterpret_cast<const S*>(w + kQ4Quants);  // d[16], then m[16]
    const __m512 d = load16(s), m = load16(s + kRows);
    for (int i = 0; i < R; ++i) {
      const __m512 dot = _mm512_cvtepi32_ps(sums[i]);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(da[i * nb + b])), acc[i]);
      macc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[i * nb + b]), macc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out[i], _mm512_add_ps(acc[i], macc[i]));
}

// quant_gguf.cpp's q8_group_body on a 16-row record: 8 chunks of 64 bytes (lane r: row r's
// elements 4g..4g+3), then d[16] float16 or d0[16], d1[16] float32. The activation codes come
// offset by 128 (quantize_rows' offset form: a + 128 as unsigned bytes), so vpdpbusd takes them
// as its unsigned operand and the weights as its signed one as they are: sum (a + 128) w -
// 128 sum w = sum a w, exactly (int32 throughout), with 128 sum w computed once per half block
// for all R activation rows. The 8-row loops move w's sign onto the codes instead (one more
// operation per activation row and chunk); both give the same int32 sums.
template <bool Half, int R>
PAGEDLLM_GGUF_512_TARGET void q8_group(const uint8_t* w, int64_t nb, int64_t bytes,
                                       const int8_t* ua, const float* da, float* const* out,
                                       int64_t prefetch_bytes) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w) + prefetch_bytes + o, _MM_HINT_T0);
    __m512 scale[2];
    if constexpr (Half) {
      scale[0] = scale[1] = load16(reinterpret_cast<const at::Half*>(w + kQ8Quants));
    } else {
      const float* s = reinterpret_cast<const float*>(w + kQ8Quants);  // d0[16], then d1[16]
      scale[0] = load16(s);
      scale[1] = load16(s + kRows);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i v[4];
      __m512i bias = zero;  // 128 sum w per lane over this half's 16 elements
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm512_loadu_si512(w + 64 * (4 * h + j));
        bias = dpbusd(bias, offset, v[j]);
      }
      const __m512i start = _mm512_sub_epi32(zero, bias);
      __m512i sums[R];
      for (int i = 0; i < R; ++i) sums[i] = start;
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < R; ++i)
          sums[i] = dpbusd(sums[i], bcast4(ua + (i * nb + b) * kBlock + 4 * (4 * h + j)), v[j]);
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]),
                                 _mm512_mul_ps(scale[h], _mm512_set1_ps(da[i * nb + b])), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

}  // namespace gguf512
}  // namespace pagedllm
