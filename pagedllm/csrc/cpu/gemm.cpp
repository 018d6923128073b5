// y = x W^T in fp32 for the decode step's linear layers (and every other row count).
//
// A register-blocked GEMM in the layout popularised by BLIS / GotoBLAS (Goto & van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008, section 6): the weight is
// packed once at load time into panels of 16 output columns stored k-major ([K][16], 64 bytes per
// k), the rows of x are packed per call into tiles of MR rows stored k-major ([K][MR]), and an
// MR x 16 micro-kernel keeps its accumulators in registers for the whole K loop. AVX2: 6 rows x 2
// registers; per k it loads 2 weight vectors, broadcasts 6 x values and issues 12 FMAs. AVX-512:
// 12 rows x 1 register; per k 1 weight vector, 12 broadcasts, 12 FMAs.
//
// Why not oneDNN's packed matmul (what torch's mkldnn linear runs)? On this 2-core AVX2 EPYC,
// at the decode step's 64 rows it reached ~105-115 GFLOP/s against ~130-150 for this kernel (the
// FMA peak is ~200); see benchmarks/gemm.py. Threads split the weight panels, so each panel is
// streamed from memory once per call (by the first row tile, which also prefetches ahead) and
// then reused from L1/L2 by the other row tiles; x is small and stays in cache.
//
// Two epilogues save a pass over the output: accumulate (out += x W^T: the residual add after the
// down projection) and SwiGLU (the gate/up weight packed so that a panel's two halves are 8 gate
// and the matching 8 up columns; the tile stores silu(gate) * up, never the [M, 2I] product).
#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define PAGEDLLM_GEMM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GEMM_AVX2 1
#endif

namespace pagedllm {
namespace {

constexpr int NR = kGemmPanel;
// Rows per micro-kernel tile: the accumulators are MR x 16 floats, 12 AVX2 registers for 6 rows;
// an AVX-512 register holds a whole panel row, so 12 rows keep 12 FMA chains in flight (two
// 512-bit FMA ports x 4-6 cycles of latency need at least 8).
#if defined(PAGEDLLM_GEMM_AVX512)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int kPrefetch = 24;  // k steps ahead (24 x 64 bytes) for the first tile of a panel

enum Epilogue { kStore, kAccumulate, kSwiGlu };

// Row i of a finished tile (lo = columns 0-7, hi = 8-15) into c.
template <int E>
inline void finish_row(const float* lo, const float* hi, float* c) {
  if (E == kStore) {
    std::memcpy(c, lo, 8 * sizeof(float));
    std::memcpy(c + 8, hi, 8 * sizeof(float));
  } else if (E == kAccumulate) {
    for (int j = 0; j < 8; ++j) c[j] += lo[j];
    for (int j = 0; j < 8; ++j) c[8 + j] += hi[j];
  } else {
    vec::silu_mul_row(lo, hi, c, 8);  // 8 output columns per panel
  }
}

#if defined(PAGEDLLM_GEMM_AVX512)
// silu(g) * u over 16 lanes, in vec::silu_mul_row's arithmetic.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = vec::exp(_mm512_mul_ps(g, _mm512_set1_ps(-1.0f)));  // e^-g
  return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, e))), u);
}
#endif

// c[0:rows, 0:NR] (row stride ldc) = a_tile[K][MR] . panel[K][NR]; rows <= ROWS <= MR.
template <int ROWS, bool PREFETCH, int E>
inline void micro_kernel(const float* a, const float* b, int64_t K, float* c, int64_t ldc) {
#if defined(PAGEDLLM_GEMM_AVX512)
  // One register per row; each lane adds its column's products in k order, as the AVX2 kernel's
  // lanes do, so both variants' sums have the same bits.
  __m512 acc[ROWS];
#pragma GCC unroll 12
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kPrefetch) * NR), _MM_HINT_T0);
    const __m512 bv = _mm512_load_ps(b + k * NR);
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[k * MR + i]), bv, acc[i]);
  }
  if (E == kStore) {
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
  } else if (E == kAccumulate) {
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; ++i)
      _mm512_storeu_ps(c + i * ldc, _mm512_add_ps(_mm512_loadu_ps(c + i * ldc), acc[i]));
  } else {
    // A row's register holds 8 gate then 8 up columns: two rows make one full-width silu(g) * u.
    int i = 0;
    for (; i + 1 < ROWS; i += 2) {
      const __m512 y = silu_mul(_mm512_shuffle_f32x4(acc[i], acc[i + 1], 0x44),
                                _mm512_shuffle_f32x4(acc[i], acc[i + 1], 0xEE));
      _mm256_storeu_ps(c + i * ldc, _mm512_castps512_ps256(y));
      _mm256_storeu_ps(c + (i + 1) * ldc, _mm512_extractf32x8_ps(y, 1));
    }
    if (i < ROWS) {
      const __m512 y = silu_mul(acc[i], _mm512_shuffle_f32x4(acc[i], acc[i], 0xEE));
      _mm256_storeu_ps(c + i * ldc, _mm512_castps512_ps256(y));
    }
  }
#elif defined(PAGEDLLM_GEMM_AVX2)
  __m256 lo[ROWS], hi[ROWS];
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kPrefetch) * NR), _MM_HINT_T0);
    const __m256 b0 = _mm256_load_ps(b + k * NR);
    const __m256 b1 = _mm256_load_ps(b + k * NR + 8);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + k * MR + i);
      lo[i] = _mm256_fmadd_ps(av, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(av, b1, hi[i]);
    }
  }
  if (E == kStore) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      _mm256_storeu_ps(c + i * ldc, lo[i]);
      _mm256_storeu_ps(c + i * ldc + 8, hi[i]);
    }
  } else if (E == kAccumulate) {
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      _mm256_storeu_ps(c + i * ldc, _mm256_add_ps(_mm256_loadu_ps(c + i * ldc), lo[i]));
      _mm256_storeu_ps(c + i * ldc + 8, _mm256_add_ps(_mm256_loadu_ps(c + i * ldc + 8), hi[i]));
    }
  } else {
    alignas(32) float g[8], u[8];
    for (int i = 0; i < ROWS; ++i) {
      _mm256_store_ps(g, lo[i]);
      _mm256_store_ps(u, hi[i]);
      finish_row<E>(g, u, c + i * ldc);
    }
  }
#else
  float acc[ROWS][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += a[k * MR + i] * b[k * NR + j];
  for (int i = 0; i < ROWS; ++i) finish_row<E>(acc[i], acc[i] + 8, c + i * ldc);
#endif
}

// micro_kernel<rows> for 1 <= rows <= ROWS (= MR at the top call).
template <bool PREFETCH, int E, int ROWS = MR>
void tile(int rows, const float* a, const float* b, int64_t K, float* c, int64_t ldc) {
  if constexpr (ROWS == 1) {
    micro_kernel<1, PREFETCH, E>(a, b, K, c, ldc);
  } else if (rows == ROWS) {
    micro_kernel<ROWS, PREFETCH, E>(a, b, K, c, ldc);
  } else {
    tile<PREFETCH, E, ROWS - 1>(rows, a, b, K, c, ldc);
  }
}

void check_x(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be a [M, K] float32 CPU tensor with unit inner stride");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.size(2) == kGemmPanel && packed.is_contiguous(),
              "packed must come from gemm_pack_weight or gemm_pack_swiglu_weight");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
              "packed must be 32-byte aligned (the kernel uses aligned loads)");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " columns, the weight ",
              packed.size(1));
}

// The shared driver: c [M, ldc] gets columns [0, N) (N <= panels * out_per_panel) with
// epilogue E; out_per_panel is 16, or 8 for SwiGLU (then N = panels * 8 exactly).
template <int E>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t N, float* c, int64_t ldc) {
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  constexpr int64_t out_per_panel = E == kSwiGlu ? NR / 2 : NR;
  if (M == 0 || N == 0) return;

  // x -> tiles [ceil(M / MR)][K][MR], the rows past M zero.
  const int64_t tiles = (M + MR - 1) / MR;
  at::Tensor xa = x.new_empty({tiles, K, MR});
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* xd = xa.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* d = xd + t * K * MR;
      const int64_t rows = std::min<int64_t>(MR, M - t * MR);
      for (int64_t i = 0; i < MR; ++i) {
        if (i < rows) {
          const float* src = xs + (t * MR + i) * ldx;
          for (int64_t k = 0; k < K; ++k) d[k * MR + i] = src[k];
        } else {
          for (int64_t k = 0; k < K; ++k) d[k * MR + i] = 0.f;
        }
      }
    }
  });

  const float* b = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float edge[MR * NR];  // the last panel's tile when N is not a multiple of 16
    for (int64_t p = p0; p < p1; ++p) {
      const float* bp = b + p * K * NR;
      const int64_t cols = std::min<int64_t>(out_per_panel, N - p * out_per_panel);
      const bool full = cols == out_per_panel;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - t * MR));
        const float* at = xd + t * K * MR;
        float* dst = c + t * MR * ldc + p * out_per_panel;
        if (full) {
          if (t == 0)
            tile<true, E>(rows, at, bp, K, dst, ldc);
          else
            tile<false, E>(rows, at, bp, K, dst, ldc);
          continue;
        }
        tile<false, kStore>(rows, at, bp, K, edge, NR);  // E is kStore or kAccumulate here
        for (int i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j)
            dst[i * ldc + j] = (E == kAccumulate ? dst[i * ldc + j] : 0.f) + edge[i * NR + j];
      }
    }
  });
}

}  // namespace

at::Tensor gemm_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a 2-D float32 CPU tensor [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  at::Tensor out = w.new_zeros({panels, K, NR});  // 64-byte aligned by the allocator
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const float* row = src + (p * NR + j) * K;
        float* col = dst + p * K * NR + j;
        for (int64_t k = 0; k < K; ++k) col[k * NR] = row[k];
      }
  });
  return out;
}

at::Tensor gemm_pack_swiglu_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 16 == 0,
              "gate/up weight must be [2I, K] with I a multiple of 8");
  const int64_t inter = weight.size(0) / 2;
  // Reorder the rows to gate 0-7, up 0-7, gate 8-15, up 8-15, ... and pack as usual.
  at::Tensor rows = weight.reshape({2, inter / 8, 8, weight.size(1)}).transpose(0, 1);
  return gemm_pack_weight(rows.reshape({2 * inter, weight.size(1)}));
}

at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  check_x(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(out_features > (panels - 1) * NR && out_features <= panels * NR,
              "out_features ", out_features, " does not match ", panels, " packed panels");
  at::Tensor y = x.new_empty({x.size(0), out_features});
  if (x.size(1) == 0) return y.zero_();
  run<kStore>(x, packed, out_features, y.data_ptr<float>(), out_features);
  return y;
}

void gemm_linear_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  check_x(x, packed);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "out must be a [M, N] float32 tensor with unit inner stride");
  const int64_t N = out.size(1), panels = packed.size(0);
  TORCH_CHECK(N > (panels - 1) * NR && N <= panels * NR, "out has ", N, " columns, the weight ",
              panels, " packed panels");
  const auto* o0 = static_cast<const char*>(out.data_ptr());
  const auto* x0 = static_cast<const char*>(x.data_ptr());
  const int64_t o_bytes = out.numel() ? (out.size(0) - 1) * out.stride(0) * 4 + N * 4 : 0;
  const int64_t x_bytes = x.numel() ? (x.size(0) - 1) * x.stride(0) * 4 + x.size(1) * 4 : 0;
  TORCH_CHECK(o_bytes == 0 || x_bytes == 0 || o0 + o_bytes <= x0 || x0 + x_bytes <= o0,
              "out must not overlap x");
  run<kAccumulate>(x, packed, N, out.data_ptr<float>(), out.stride(0));
}

at::Tensor gemm_swiglu(const at::Tensor& x, const at::Tensor& packed) {
  check_x(x, packed);
  const int64_t inter = packed.size(0) * (NR / 2);
  at::Tensor y = x.new_empty({x.size(0), inter});
  if (x.size(1) == 0) return y.fill_(0.f);  // silu(0) * 0
  run<kSwiGlu>(x, packed, inter, y.data_ptr<float>(), inter);
  return y;
}

}  // namespace pagedllm
