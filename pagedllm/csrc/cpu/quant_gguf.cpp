// GEMV/GEMM on GGUF block-quantized weights without expanding them to fp32 (issue 22 item 4).
//
// The activation rows are quantized to int8 per block of 32 (scale da = max|a| / 127, llama.cpp's
// Q8_0/Q8_1 activation format), so a block's dot product is an integer sum computed with
// _mm256_maddubs_epi16 (u8 x s8 -> s16 pairs) and _mm256_madd_epi16 (-> s32), scaled once:
//   4-bit affine:  sum_j (d q_j + m) a_j = d da sum_j q_j qa_j + m (da sum_j qa_j)
//   8-bit, 16-scale: sum_j d_(j/16) q_j a_j = da (d_0 sum_{j<16} q_j qa_j + d_1 sum_{j>=16} ...)
//
// Layout (repacked once at load, gguf_native.interleave): the rows are interleaved in groups of
// eight, one record per (row group, block) holding the group's quants and then its scales, so
// a GEMV reads one sequential stream and every 32-bit lane of a register is one output row:
// the int-to-float conversion, the scale multiply and the accumulation are done once per block
// for 8 rows instead of once per row (the idea of llama.cpp's interleaved Q4_0x8 repacking; the
// record layout here is our own). Where the CPU has AVX512-VNNI + BW the records hold 16 rows
// and 512-bit loops read them (quant_gguf_512.h), bit-identical to these. Each row group is
// independent: at::parallel_for splits the groups over the cores.
//
// At batch 1 (decode) the weights stream from memory once per token, so bytes per weight set the
// speed: the scales are float16 wherever the GGUF value is exactly a float16 (Q4_0 / Q4_1 d and m,
// Q8_0 / Q5_0 d, one per 32) and float32 where it is a product (Q4_K's d * sc, Q6_K's d * sc, one
// per 16). The scale format is read off the record size.
#include "quant_gguf.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GGUF_AVX2 1
#endif

// AVX512-VNNI (with AVX512-VL: vpdpbusd on 256-bit registers) or AVX-VNNI (the same instruction
// VEX-encoded: Intel client CPUs from Alder Lake on, without AVX-512) replaces maddubs + madd +
// add by one instruction; picked at run time (GCC: target attributes).
#if defined(PAGEDLLM_GGUF_AVX2) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDLLM_GGUF_VNNI 1
#define PAGEDLLM_GGUF_VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define PAGEDLLM_GGUF_AVXVNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#include "quant_gguf_512.h"
#endif

#ifndef PAGEDLLM_GGUF_PREFETCH
#define PAGEDLLM_GGUF_PREFETCH 512
#endif

namespace pagedllm {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 8;  // weight rows interleaved per group (one per 32-bit lane)
constexpr int64_t kMaxRows = 16;  // the 512-bit loops' groups (quant_gguf_512.h)
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
// vec.h's hmax is for the variant's own vector width (512 bits in the avx512 build); these
// kernels are AVX2 in every build.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32: q = nearbyint(a * inv) (round half to even, as the scalar path), stored
// offset by 128 (q ^ 0x80: q + 128 as an unsigned byte) when `offset`; returns sum(q). The same
// float operations as the scalar path, so the codes are bit-identical.
inline int quantize_block(const float* a, float inv, bool offset, int8_t* q) {
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i i[4];
  for (int c = 0; c < 4; ++c)
    i[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), iv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  // packs interleave the 128-bit lanes; the permute restores element order.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  if (offset) p = _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

// offset: the codes stored as q + 128 in unsigned bytes (the 512-bit q8 loops' operand form,
// quant_gguf_512.h); sa is the same either way.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t stride, bool offset) {
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
      sum = quantize_block(a, d > 0.f ? 1.f / d : 0.f, offset, q);
#else
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(a[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int code = static_cast<int>(std::nearbyint(a[j] * inv));
        sum += code;
        q[j] = static_cast<int8_t>(offset ? code ^ 0x80 : code);
      }
#endif
      da[m * nb + b] = d;
      sa[m * nb + b] = d * static_cast<float>(sum);
    }
  }
  return {qa.data(), da.data(), sa.data()};
}

// Scale r of a row group's 8 (float16 scales hold values that are exactly float16).
inline float scale_at(const float* s, int64_t i) { return s[i]; }
inline float scale_at(const at::Half* s, int64_t i) { return static_cast<float>(s[i]); }

// Bytes of one (row group, block) record: the quants, then the scales (see quant_gguf.h).
constexpr int64_t kQ4Quants = kRows * 16;
constexpr int64_t kQ8Quants = kRows * kBlock;

#ifdef PAGEDLLM_GGUF_AVX2
inline __m256 load8(const float* s) { return _mm256_loadu_ps(s); }
inline __m256 load8(const at::Half* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}
// Four activation codes broadcast to every 32-bit lane (one lane per weight row).
inline __m256i bcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, sizeof(v));
  return _mm256_set1_epi32(v);
}
inline void prefetch_record(const uint8_t* w, int64_t bytes) {
  if constexpr (kPrefetchBytes > 0)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + o, _MM_HINT_T0);
}

// The integer step of the group loops: acc += u (u8) . v (s8), 4 products per 32-bit lane,
// then finish(acc) = the block's int32 sums. Three ways to the same exact sums:
// - Q4Maddubs: maddubs into int16 lanes. 8 int16 partial sums per lane stay below 2^15
//   (8 * 2 * 15 * 127 = 30480), so they add as int16 and widen once per block;
// - Q8Maddubs: maddubs widened at every step (|w| up to 127 would overflow int16);
// - Vnni: vpdpbusd, int32 throughout (AVX512-VNNI + VL; inline asm because GCC's builtin copies
//   the tied accumulator through another register at every use, seen in int8_gemm.cpp);
// - AvxVnni: the same vpdpbusd VEX-encoded (AVX-VNNI; ymm0-15 only, hence the "x" operands).
struct Q4Maddubs {
  static __m256i step(__m256i acc, __m256i u, __m256i v) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, v));
  }
  static __m256i finish(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
};
struct Q8Maddubs {
  static __m256i step(__m256i acc, __m256i u, __m256i v) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v),
                                                   _mm256_set1_epi16(1)));
  }
  static __m256i finish(__m256i acc) { return acc; }
};
#ifdef PAGEDLLM_GGUF_VNNI
struct Vnni {
  PAGEDLLM_GGUF_VNNI_TARGET static __m256i step(__m256i acc, __m256i u, __m256i v) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v));
    return acc;
  }
  static __m256i finish(__m256i acc) { return acc; }
};
struct AvxVnni {
  PAGEDLLM_GGUF_AVXVNNI_TARGET static __m256i step(__m256i acc, __m256i u, __m256i v) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(v));
    return acc;
  }
  static __m256i finish(__m256i acc) { return acc; }
};
#endif

// One row group of the 4-bit layout against R quantized activation rows (row i's codes at
// qa + i * nb * 32, its scales at da / sa + i * nb): lane r of out[i] is output row r for
// activation row i. Lane r of quant chunk c holds row r's bytes 4c..4c+3 of the block (low
// nibbles: elements 4c..4c+3, high: 16+4c..), so one integer step multiplies all 8 rows by the
// same 4 broadcast activation codes; the nibbles are unpacked once per block for all R
// activation rows (M > 1). Each activation row sees the same operations in the same order
// whatever R is, so a row's result does not depend on the batch; every Dot gives the same int32
// sums, so the same floats.
template <typename Dot, typename S, int R>
__attribute__((always_inline)) inline void q4_group_body(const uint8_t* w, int64_t nb,
                                                          int64_t bytes, const int8_t* qa,
                                                          const float* da, const float* sa,
                                                          float* const* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R], macc[R];
  for (int i = 0; i < R; ++i) acc[i] = macc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    prefetch_record(w, bytes);
    __m256i sums[R];
    for (int i = 0; i < R; ++i) sums[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int i = 0; i < R; ++i) {
        const int8_t* a = qa + (i * nb + b) * kBlock;
        sums[i] = Dot::step(sums[i], lo, bcast4(a + 4 * c));
        sums[i] = Dot::step(sums[i], hi, bcast4(a + 16 + 4 * c));
      }
    }
    const S* s = reinterpret_cast<const S*>(w + kQ4Quants);  // d[8], then m[8]
    const __m256 d = load8(s), m = load8(s + kRows);
    for (int i = 0; i < R; ++i) {
      const __m256 dot = _mm256_cvtepi32_ps(Dot::finish(sums[i]));
      acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(da[i * nb + b])), acc[i]);
      macc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sa[i * nb + b]), macc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out[i], _mm256_add_ps(acc[i], macc[i]));
}

// One row group of the 8-bit layout against R activation rows (as q4_group_body): lane r of
// group chunk g holds row r's elements 4g..4g+3; the integer step takes |w| as the unsigned
// operand and moves w's sign onto the activation codes. Elements 0-15 and 16-31 are summed apart
// (Q6_K has a scale per 16; float16 scales use the same arithmetic with both halves scaled by
// d, so the two layouts give equal results).
template <typename Dot, bool Half, int R>
__attribute__((always_inline)) inline void q8_group_body(const uint8_t* w, int64_t nb,
                                                          int64_t bytes, const int8_t* qa,
                                                          const float* da, float* const* out) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    prefetch_record(w, bytes);
    __m256 scale[2];
    if constexpr (Half) {
      scale[0] = scale[1] = load8(reinterpret_cast<const at::Half*>(w + kQ8Quants));
    } else {
      const float* s = reinterpret_cast<const float*>(w + kQ8Quants);  // d0[8], then d1[8]
      scale[0] = load8(s);
      scale[1] = load8(s + kRows);
    }
    for (int h = 0; h < 2; ++h) {
      __m256i sums[R];
      for (int i = 0; i < R; ++i) sums[i] = _mm256_setzero_si256();
      for (int g = 4 * h; g < 4 * h + 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g));
        const __m256i magnitude = _mm256_sign_epi8(v, v);
        for (int i = 0; i < R; ++i) {
          const __m256i av = bcast4(qa + (i * nb + b) * kBlock + 4 * g);
          sums[i] = Dot::step(sums[i], magnitude, _mm256_sign_epi8(av, v));
        }
      }
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot::finish(sums[i])),
                                 _mm256_mul_ps(scale[h], _mm256_set1_ps(da[i * nb + b])), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out[i], acc[i]);
}

template <typename S, int R>
void q4_group(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
              const float* sa, float* const* out) {
  q4_group_body<Q4Maddubs, S, R>(w, nb, bytes, qa, da, sa, out);
}
template <bool Half, int R>
void q8_group(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
              float* const* out) {
  q8_group_body<Q8Maddubs, Half, R>(w, nb, bytes, qa, da, out);
}
#endif

#ifdef PAGEDLLM_GGUF_VNNI
template <typename S, int R>
PAGEDLLM_GGUF_VNNI_TARGET void q4_group_vnni(const uint8_t* w, int64_t nb, int64_t bytes,
                                             const int8_t* qa, const float* da,
                                             const float* sa, float* const* out) {
  q4_group_body<Vnni, S, R>(w, nb, bytes, qa, da, sa, out);
}
template <bool Half, int R>
PAGEDLLM_GGUF_VNNI_TARGET void q8_group_vnni(const uint8_t* w, int64_t nb, int64_t bytes,
                                             const int8_t* qa, const float* da,
                                             float* const* out) {
  q8_group_body<Vnni, Half, R>(w, nb, bytes, qa, da, out);
}

template <typename S, int R>
PAGEDLLM_GGUF_AVXVNNI_TARGET void q4_group_avxvnni(const uint8_t* w, int64_t nb, int64_t bytes,
                                                   const int8_t* qa, const float* da,
                                                   const float* sa, float* const* out) {
  q4_group_body<AvxVnni, S, R>(w, nb, bytes, qa, da, sa, out);
}
template <bool Half, int R>
PAGEDLLM_GGUF_AVXVNNI_TARGET void q8_group_avxvnni(const uint8_t* w, int64_t nb, int64_t bytes,
                                                   const int8_t* qa, const float* da,
                                                   float* const* out) {
  q8_group_body<AvxVnni, Half, R>(w, nb, bytes, qa, da, out);
}

// The integer step of the 8-row loops on this CPU: vpdpbusd where the CPU has AVX512-VNNI +
// AVX512-VL (EVEX) or else AVX-VNNI (VEX), maddubs otherwise. PAGEDLLM_GGUF_ISA=avx2 forces
// maddubs and =avx_vnni the VEX form (where the CPU has it), for tests of every loop on one CPU.
enum class DotIsa { kMaddubs, kAvxVnni, kVnni };
DotIsa gguf_dot_isa() {
  static const DotIsa isa = [] {
    const bool avxvnni = __builtin_cpu_supports("avxvnni");
    const char* forced = std::getenv("PAGEDLLM_GGUF_ISA");
    const std::string name = forced ? forced : "";
    if (name == "avx2") return DotIsa::kMaddubs;
    if (name == "avx_vnni" && avxvnni) return DotIsa::kAvxVnni;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
      return DotIsa::kVnni;
    return avxvnni ? DotIsa::kAvxVnni : DotIsa::kMaddubs;
  }();
  return isa;
}

// Whether 16-row records run (quant_gguf_512.h): the AVX512-VNNI loops are on and the CPU has
// AVX512-BW for the 512-bit byte operations.
bool gguf_512_active() {
  static const bool active =
      gguf_dot_isa() == DotIsa::kVnni && __builtin_cpu_supports("avx512bw");
  return active;
}
#endif

// Plain C++ versions of the same integer arithmetic on the same layouts (scalar kernel variant).
template <typename S>
inline void q4_group_scalar(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa,
                            const float* da, const float* sa, float* out) {
  for (int r = 0; r < kRows; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const int8_t* a = qa + b * kBlock;
    const S* s = reinterpret_cast<const S*>(w + kQ4Quants);
    for (int r = 0; r < kRows; ++r) {
      int32_t isum = 0;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = w[32 * c + 4 * r + i];
          isum += (byte & 0x0F) * a[4 * c + i] + (byte >> 4) * a[16 + 4 * c + i];
        }
      out[r] += scale_at(s, r) * da[b] * static_cast<float>(isum) + scale_at(s, kRows + r) * sa[b];
    }
  }
}

template <bool Half>
inline void q8_group_scalar(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa,
                            const float* da, float* out) {
  for (int r = 0; r < kRows; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const int8_t* a = qa + b * kBlock;
    const int8_t* q = reinterpret_cast<const int8_t*>(w);
    for (int r = 0; r < kRows; ++r) {
      int32_t s[2] = {0, 0};
      for (int g = 0; g < 8; ++g)
        for (int i = 0; i < 4; ++i) s[g / 4] += q[32 * g + 4 * r + i] * a[4 * g + i];
      float d0, d1;
      if constexpr (Half) {
        d0 = d1 = scale_at(reinterpret_cast<const at::Half*>(w + kQ8Quants), r);
      } else {
        const float* sc = reinterpret_cast<const float*>(w + kQ8Quants);
        d0 = sc[r];
        d1 = sc[kRows + r];
      }
      out[r] += da[b] * (d0 * static_cast<float>(s[0]) + d1 * static_cast<float>(s[1]));
    }
  }
}

constexpr int64_t kGrain = 8;  // row groups per parallel task
constexpr int kActRows = 4;    // activation rows per pass over a row group's blocks (M > 1)

// Runs group(g, m0, count, outs) -- the G results of row group g (G = 8 or 16 rows per group)
// for activation rows m0 .. m0 + count - 1 (count <= kActRows), written to outs[0 .. count - 1]
// -- over all groups, split over the cores; the last group's padding rows are not written out.
template <typename F>
void for_row_groups(int64_t M, int64_t N, int64_t G, float* out, const F& group) {
  const int64_t groups = (N + G - 1) / G;
  const int64_t grain = std::max<int64_t>(1, kGrain * kRows / G);  // the same rows per task
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    alignas(64) float tmp[kActRows][kMaxRows];
    float* outs[kActRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * G, rows = std::min(G, N - r0);
      for (int64_t m0 = 0; m0 < M; m0 += kActRows) {
        const int count = static_cast<int>(std::min<int64_t>(kActRows, M - m0));
        for (int i = 0; i < count; ++i)
          outs[i] = rows == G ? out + (m0 + i) * N + r0 : tmp[i];
        group(g, m0, count, outs);
        if (rows < G)
          for (int i = 0; i < count; ++i) std::copy(tmp[i], tmp[i] + rows, out + (m0 + i) * N + r0);
      }
    }
  });
}

// Checks x and w, quantizes x (codes offset by 128 with offset_codes) and returns (y [M, N],
// activation codes, blocks per row, record bytes, rows per group).
struct Call {
  at::Tensor y;
  QuantizedRows a;
  int64_t nb;
  int64_t bytes;
  int64_t group_rows;
};

// Rows per record (8 or 16) from its size, one of `per_row` bytes of quants and scales per row
// times the rows. Refuses 16-row records where the 512-bit loops are off, and other sizes.
int64_t record_rows(int64_t bytes, std::initializer_list<int64_t> per_row, const char* op) {
  for (const int64_t G : {kRows, kMaxRows})
    for (const int64_t b : per_row)
      if (bytes == G * b) {
        TORCH_CHECK(G == kRows || gguf_group_rows() == kMaxRows, op,
                    ": 16-row records need the AVX512-VNNI + BW loops, which this CPU or build "
                    "lacks (interleave with gguf_group_rows() rows)");
        return G;
      }
  TORCH_CHECK(false, op, ": ", bytes,
              " bytes per record matches no layout (csrc/cpu/quant_gguf.h)");
}

Call prepare(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t group_rows,
             bool offset_codes, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be [M, K] float32 with unit inner stride");
  TORCH_CHECK(x.size(1) % kBlock == 0, op, ": K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(n >= 0 && w.size(0) == (n + group_rows - 1) / group_rows, op, ": w has ",
              w.size(0), " row groups of ", group_rows, ", N = ", n, " needs ",
              (n + group_rows - 1) / group_rows);
  TORCH_CHECK(w.size(1) * kBlock == x.size(1), op, ": w has ", w.size(1),
              " blocks per row, K = ", x.size(1));
  Call c{x.new_empty({x.size(0), n}), {}, w.size(1), w.size(2), group_rows};
  if (x.size(0) > 0 && n > 0)
    c.a = quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), offset_codes);
  return c;
}

// One row group (8 results) of each layout against `count` activation rows (1..kActRows; row
// i's codes at qa + i * nb * 32, its scales at da / sa + i * nb), on this build's instruction
// set; sa is unused by q8.
using GroupFn = void (*)(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa,
                         const float* da, const float* sa, int count, float* const* out);

#ifdef PAGEDLLM_GGUF_AVX2
// kernel(std::integral_constant<int, R>) with R = count: the row count as a template argument.
template <typename K>
void with_row_count(int count, const K& kernel) {
  static_assert(kActRows == 4, "one case per row count");
  switch (count) {
    case 1: kernel(std::integral_constant<int, 1>{}); break;
    case 2: kernel(std::integral_constant<int, 2>{}); break;
    case 3: kernel(std::integral_constant<int, 3>{}); break;
    default: kernel(std::integral_constant<int, 4>{}); break;
  }
}
#endif

template <typename S>
void q4_run(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
            const float* sa, int count, float* const* out) {
#ifdef PAGEDLLM_GGUF_AVX2
#ifdef PAGEDLLM_GGUF_VNNI
  if (gguf_dot_isa() == DotIsa::kVnni)
    return with_row_count(count, [&](auto r) {
      q4_group_vnni<S, decltype(r)::value>(w, nb, bytes, qa, da, sa, out);
    });
  if (gguf_dot_isa() == DotIsa::kAvxVnni)
    return with_row_count(count, [&](auto r) {
      q4_group_avxvnni<S, decltype(r)::value>(w, nb, bytes, qa, da, sa, out);
    });
#endif
  with_row_count(count, [&](auto r) {
    q4_group<S, decltype(r)::value>(w, nb, bytes, qa, da, sa, out);
  });
#else
  for (int i = 0; i < count; ++i)
    q4_group_scalar<S>(w, nb, bytes, qa + i * nb * kBlock, da + i * nb, sa + i * nb, out[i]);
#endif
}

template <bool Half>
void q8_run(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
            const float* /*sa*/, int count, float* const* out) {
#ifdef PAGEDLLM_GGUF_AVX2
#ifdef PAGEDLLM_GGUF_VNNI
  if (gguf_dot_isa() == DotIsa::kVnni)
    return with_row_count(count, [&](auto r) {
      q8_group_vnni<Half, decltype(r)::value>(w, nb, bytes, qa, da, out);
    });
  if (gguf_dot_isa() == DotIsa::kAvxVnni)
    return with_row_count(count, [&](auto r) {
      q8_group_avxvnni<Half, decltype(r)::value>(w, nb, bytes, qa, da, out);
    });
#endif
  with_row_count(count, [&](auto r) {
    q8_group<Half, decltype(r)::value>(w, nb, bytes, qa, da, out);
  });
#else
  for (int i = 0; i < count; ++i)
    q8_group_scalar<Half>(w, nb, bytes, qa + i * nb * kBlock, da + i * nb, out[i]);
#endif
}

#ifdef PAGEDLLM_GGUF_VNNI
template <typename S>
void q4_run16(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
              const float* sa, int count, float* const* out) {
  with_row_count(count, [&](auto r) {
    gguf512::q4_group<S, decltype(r)::value>(w, nb, bytes, qa, da, sa, out, kPrefetchBytes);
  });
}

template <bool Half>
void q8_run16(const uint8_t* w, int64_t nb, int64_t bytes, const int8_t* qa, const float* da,
              const float* /*sa*/, int count, float* const* out) {
  with_row_count(count, [&](auto r) {
    gguf512::q8_group<Half, decltype(r)::value>(w, nb, bytes, qa, da, out, kPrefetchBytes);
  });
}
#endif

void run_linear(const Call& c, const uint8_t* w, int64_t M, int64_t N, GroupFn group) {
  const int64_t nb = c.nb, bytes = c.bytes;
  for_row_groups(M, N, c.group_rows, c.y.data_ptr<float>(),
                 [&](int64_t g, int64_t m0, int count, float* const* o) {
                   group(w + g * nb * bytes, nb, bytes, c.a.qa + m0 * nb * kBlock,
                         c.a.da + m0 * nb, c.a.sa + m0 * nb, count, o);
                 });
}

}  // namespace

int64_t gguf_group_rows() {
#ifdef PAGEDLLM_GGUF_VNNI
  if (gguf_512_active()) return kMaxRows;
#endif
  return kRows;
}

std::string gguf_isa() {
#ifdef PAGEDLLM_GGUF_VNNI
  switch (gguf_dot_isa()) {
    case DotIsa::kVnni: return "avx512_vnni";
    case DotIsa::kAvxVnni: return "avx_vnni";
    default: return "avx2";
  }
#elif defined(PAGEDLLM_GGUF_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor gguf_q4_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  constexpr const char* op = "gguf_q4_linear";
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(), op,
              ": w must be a contiguous uint8 [ceil(N / G), K / 32, bytes] tensor");
  // Per row: 16 bytes of quants, then d and m as float16 (4 bytes) or float32 (8).
  const int64_t G = record_rows(w.size(2), {20, 24}, op);
  Call c = prepare(x, w, n, G, /*offset_codes=*/false, op);
  if (x.size(0) == 0 || n == 0) return c.y;
  const bool half = c.bytes == 20 * G;
  GroupFn fn = half ? q4_run<at::Half> : q4_run<float>;
#ifdef PAGEDLLM_GGUF_VNNI
  if (G == kMaxRows) fn = half ? q4_run16<at::Half> : q4_run16<float>;
#endif
  run_linear(c, w.data_ptr<uint8_t>(), x.size(0), n, fn);
  return c.y;
}

at::Tensor gguf_q8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  constexpr const char* op = "gguf_q8_linear";
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(), op,
              ": w must be a contiguous uint8 [ceil(N / G), K / 32, bytes] tensor");
  // Per row: 32 bytes of quants, then one float16 scale (2 bytes) or two float32 (8).
  const int64_t G = record_rows(w.size(2), {34, 40}, op);
  // The 16-row loops take the codes offset by 128 (quant_gguf_512.h q8_group).
  Call c = prepare(x, w, n, G, /*offset_codes=*/G == kMaxRows, op);
  if (x.size(0) == 0 || n == 0) return c.y;
  const bool half = c.bytes == 34 * G;
  GroupFn fn = half ? q8_run<true> : q8_run<false>;
#ifdef PAGEDLLM_GGUF_VNNI
  if (G == kMaxRows) fn = half ? q8_run16<true> : q8_run16<false>;
#endif
  run_linear(c, w.data_ptr<uint8_t>(), x.size(0), n, fn);
  return c.y;
}

}  // namespace pagedllm
