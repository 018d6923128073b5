// y = x W^T with int8 weights and int8 activations (W8A8), int32 accumulation.
//
// Quantization (the LLM.int8() / SmoothQuant W8A8 scheme without outlier handling: Dettmers et al.
// 2022 section 3.1 "vector-wise quantization", Xiao et al. 2023 section 3): weights symmetric per
// output channel (done once at load, in Python), activations symmetric per token (row), here at
// every call: s_x = absmax(x_m) / 127. Then y[m, n] = (sum_k qx[m, k] qw[n, k]) * s_x[m] * s_w[n],
// the integer sum exact in int32.
//
// Weights are packed once into panels of 16 output columns, 4 k per 64-byte group (the operand
// layout of vpdpbusd and of maddubs + madd); the rows of x are quantized and packed per call into
// tiles of 4 rows, 4 k (one int32) per row and group. A 4 x 16 micro-kernel keeps its int32
// accumulators in registers over the whole K loop. Threads split the weight panels.
//
// Inner loops, picked at run time from the CPU's flags (same results bit for bit):
// - AVX2: maddubs multiplies unsigned by signed bytes and saturates its int16 pair sums, so
//   x's sign moves onto the weight (|x| * (w * sign(x)) with _mm256_sign_epi8, the trick of
//   llama.cpp's q8 dot products): |x|, |w| <= 127 gives pair sums <= 32258, never saturated.
// - AVX512-VNNI: vpdpbusd (u8 x s8 -> int32 without saturation) on x + 128, minus 128 * the
//   weight row sums (precomputed at load).
// - scalar: plain loops (kernels built without AVX2).
#include "int8_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#define PAGEDLLM_INT8_AVX2 1
#endif
#if defined(PAGEDLLM_INT8_AVX2) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDLLM_INT8_VNNI512 1
#endif

namespace pagedllm {
namespace {

constexpr int NR = kInt8Panel;
constexpr int MR = 4;  // rows per micro-kernel tile
constexpr int KG = 4;  // k per group (one int32 of activations)

// c[ROWS][NR] = a_tile[G][MR] . panel[G][NR][KG] with int8 operands, int32 results.
template <int ROWS>
void kernel_scalar(const int32_t* a, const int8_t* b, int64_t G, int32_t* c) {
  int32_t acc[ROWS][NR] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < ROWS; ++i) {
      int8_t av[KG];
      std::memcpy(av, a + g * MR + i, KG);
      for (int j = 0; j < NR; ++j)
        for (int q = 0; q < KG; ++q) acc[i][j] += av[q] * b[(g * NR + j) * KG + q];
    }
  std::memcpy(c, acc, sizeof(acc));
}

#if defined(PAGEDLLM_INT8_AVX2)
template <int ROWS>
void kernel_avx2(const int32_t* a, const int8_t* b, int64_t G, int32_t* c) {
  __m256i lo[ROWS], hi[ROWS];
  for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + g * NR * KG + 32));
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const __m256i av = _mm256_set1_epi32(a[g * MR + i]);
      const __m256i ax = _mm256_sign_epi8(av, av);  // |x|
      const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, av));
      const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, av));
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(p0, ones));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * NR), lo[i]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * NR + 8), hi[i]);
  }
}
#endif

#if defined(PAGEDLLM_INT8_VNNI512)
// wsum: the panel's 16 weight row sums, for the +128 zero point of the u8 activations.
template <int ROWS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void kernel_vnni512(
    const int32_t* a, const int8_t* b, int64_t G, const int32_t* wsum, int32_t* c) {
  __m512i acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i w = _mm512_load_si512(b + g * NR * KG);
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const int32_t u = a[g * MR + i] ^ static_cast<int32_t>(0x80808080u);  // x + 128 per byte
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(u), w);
    }
  }
  const __m512i zero_point = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_si512(c + i * NR, _mm512_sub_epi32(acc[i], zero_point));
}
#endif

enum class Isa { kScalar, kAvx2, kVnni512 };

Isa detect_isa() {
#if defined(PAGEDLLM_INT8_VNNI512)
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return Isa::kVnni512;
#endif
#if defined(PAGEDLLM_INT8_AVX2)
  return Isa::kAvx2;
#else
  return Isa::kScalar;
#endif
}

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

template <int ROWS>
void tile_rows(Isa isa, const int32_t* a, const int8_t* b, int64_t G, const int32_t* wsum,
               int32_t* c) {
  switch (isa) {
#if defined(PAGEDLLM_INT8_VNNI512)
    case Isa::kVnni512: kernel_vnni512<ROWS>(a, b, G, wsum, c); return;
#endif
#if defined(PAGEDLLM_INT8_AVX2)
    case Isa::kAvx2: kernel_avx2<ROWS>(a, b, G, c); return;
#endif
    default: kernel_scalar<ROWS>(a, b, G, c); return;
  }
}

void tile(Isa isa, int rows, const int32_t* a, const int8_t* b, int64_t G, const int32_t* wsum,
          int32_t* c) {
  switch (rows) {
    case 4: tile_rows<4>(isa, a, b, G, wsum, c); break;
    case 3: tile_rows<3>(isa, a, b, G, wsum, c); break;
    case 2: tile_rows<2>(isa, a, b, G, wsum, c); break;
    default: tile_rows<1>(isa, a, b, G, wsum, c); break;
  }
}

// One row: q[0, K) quantized, q[K, K4) left as is (zero); returns the scale.
float quantize_row(const float* x, int64_t K, int8_t* q) {
  float absmax = 0.f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(x[k]));
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::nearbyint(x[k] * inv);  // round half to even, as torch.round
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  return absmax / 127.f;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be a [M, K] float32 CPU tensor with unit inner stride");
}

}  // namespace

std::string int8_gemm_isa() {
  switch (active_isa()) {
    case Isa::kVnni512: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

at::Tensor int8_pack_weight(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar &&
                  qweight.dim() == 2,
              "qweight must be a 2-D int8 CPU tensor [N, K]");
  const at::Tensor w = qweight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR, G = (K + KG - 1) / KG;
  at::Tensor out = w.new_zeros({panels, G, NR, KG});  // 64-byte aligned
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const int8_t* row = src + (p * NR + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * G + k / KG) * NR + j) * KG + k % KG] = row[k];
      }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = x.new_empty({M, K}, at::kChar);
  at::Tensor s = x.new_empty({M});
  const float* xs = x.data_ptr<float>();
  int8_t* qd = q.data_ptr<int8_t>();
  float* sd = s.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) sd[m] = quantize_row(xs + m * x.stride(0), K, qd + m * K);
  });
  return {q, s};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wscale,
                       const at::Tensor& wsum, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  check_x(x);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == NR &&
                  packed.size(3) == KG && packed.is_contiguous(),
              "packed must come from int8_pack_weight");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed must be 64-byte aligned (the kernels use aligned loads)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t panels = packed.size(0), G = packed.size(1);
  TORCH_CHECK(G == (K + KG - 1) / KG, "x has ", K, " columns, the packed weight ", G * KG);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "out_features ", N,
              " does not match ", panels, " packed panels");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == N,
              "wscale must be [out_features] float32");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == panels * NR,
              "wsum must be [panels * 16] int32 (zero-padded)");
  const float* bd = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be [out_features] float32");
    bd = bias->data_ptr<float>();
  }
  at::Tensor y = x.new_empty({M, N});
  if (M == 0 || N == 0) return y;

  // x -> int8 tiles [ceil(M / 4)][G][4] (one int32 = 4 k of one row; rows past M and k past K
  // zero) and the row scales.
  const int64_t tiles = (M + MR - 1) / MR;
  at::Tensor xa = x.new_zeros({tiles, G, MR}, at::kInt);
  at::Tensor xs = x.new_empty({M});
  int32_t* xd = xa.data_ptr<int32_t>();
  float* sa = xs.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<int8_t> row(G * KG, 0);
    for (int64_t m = m0; m < m1; ++m) {
      sa[m] = quantize_row(xp + m * x.stride(0), K, row.data());
      int32_t* dst = xd + (m / MR) * G * MR + m % MR;
      for (int64_t g = 0; g < G; ++g) std::memcpy(dst + g * MR, row.data() + g * KG, KG);
    }
  });

  const Isa isa = active_isa();
  const int8_t* b = packed.data_ptr<int8_t>();
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* sw = wscale.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t c[MR * NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min<int64_t>(NR, N - n0);
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - t * MR));
        tile(isa, rows, xd + t * G * MR, b + p * G * NR * KG, G, ws + n0, c);
        for (int i = 0; i < rows; ++i) {
          const int64_t m = t * MR + i;
          float* dst = yd + m * N + n0;
          // Same order as the PyTorch fallback: (acc * s_x) * s_w (+ bias).
          for (int64_t j = 0; j < cols; ++j) {
            const float v = static_cast<float>(c[i * NR + j]) * sa[m] * sw[n0 + j];
            dst[j] = bd ? v + bd[n0 + j] : v;
          }
        }
      }
    }
  });
  return y;
}

at::Tensor int8_linear_record(const at::Tensor& x, const at::Tensor& record, int64_t out_features,
                              const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const int64_t N = out_features, K = x.size(1);
  const int64_t panels = (N + NR - 1) / NR, G = (K + KG - 1) / KG;
  const int64_t wbytes = panels * G * NR * KG;
  TORCH_CHECK(record.scalar_type() == at::kChar && record.dim() == 1 && record.is_contiguous() &&
                  record.numel() == wbytes + 4 * N + 4 * panels * NR,
              "int8_linear_record: record of ", record.numel(), " bytes does not match a [",
              N, ", ", K, "] weight");
  const at::Tensor packed = record.narrow(0, 0, wbytes).view({panels, G, NR, KG});
  const at::Tensor wscale = record.narrow(0, wbytes, 4 * N).view(at::kFloat);
  const at::Tensor wsum = record.narrow(0, wbytes + 4 * N, 4 * panels * NR).view(at::kInt);
  return int8_linear(x, packed, wscale, wsum, bias, N);
}

}  // namespace pagedllm
