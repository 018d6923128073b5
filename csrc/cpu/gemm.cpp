// y = x W^T in fp32 for the decode step's linear layers (and every other row count).
//
// A register-blocked GEMM in the layout popularised by BLIS / GotoBLAS (Goto & van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008, section 6): the weight is
// packed once at load time into panels of 16 output columns stored k-major ([K][16], 64 bytes per
// k), the rows of x are packed per call into tiles of 6 rows stored k-major ([K][6]), and a 6 x 16
// micro-kernel keeps its 12 accumulators (6 rows x 2 AVX2 registers) in registers for the whole
// K loop: per k it loads 2 weight vectors, broadcasts 6 x values and issues 12 FMAs.
//
// Why not oneDNN's packed matmul (what torch's mkldnn linear runs)? On this 2-core AVX2 EPYC,
// at the decode step's 64 rows it reached ~105-115 GFLOP/s against ~130-150 for this kernel (the
// FMA peak is ~200); see benchmarks/gemm.py. Threads split the weight panels, so each panel is
// streamed from memory once per call (by the first row tile, which also prefetches ahead) and
// then reused from L1/L2 by the other row tiles; x is small and stays in cache.
#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_GEMM_AVX2 1
#endif

namespace pagedllm {
namespace {

constexpr int NR = kGemmPanel;
constexpr int MR = 6;        // rows per micro-kernel tile
constexpr int kPrefetch = 24;  // k steps ahead (24 x 64 bytes) for the first tile of a panel

// c[0:rows, 0:NR] (row stride ldc) = a_tile[K][MR] . panel[K][NR]; rows <= ROWS <= MR.
template <int ROWS, bool PREFETCH>
inline void micro_kernel(const float* a, const float* b, int64_t K, float* c, int64_t ldc) {
#if defined(PAGEDLLM_GEMM_AVX2)
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
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_ps(c + i * ldc, lo[i]);
    _mm256_storeu_ps(c + i * ldc + 8, hi[i]);
  }
#else
  float acc[ROWS][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] += a[k * MR + i] * b[k * NR + j];
  for (int i = 0; i < ROWS; ++i) std::memcpy(c + i * ldc, acc[i], sizeof(acc[i]));
#endif
}

template <bool PREFETCH>
void tile(int rows, const float* a, const float* b, int64_t K, float* c, int64_t ldc) {
  switch (rows) {
    case 6: micro_kernel<6, PREFETCH>(a, b, K, c, ldc); break;
    case 5: micro_kernel<5, PREFETCH>(a, b, K, c, ldc); break;
    case 4: micro_kernel<4, PREFETCH>(a, b, K, c, ldc); break;
    case 3: micro_kernel<3, PREFETCH>(a, b, K, c, ldc); break;
    case 2: micro_kernel<2, PREFETCH>(a, b, K, c, ldc); break;
    default: micro_kernel<1, PREFETCH>(a, b, K, c, ldc); break;
  }
}

}  // namespace

at::Tensor gemm_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a 2-D float32 CPU tensor [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  at::Tensor out = at::zeros({panels, K, NR}, w.options());  // 64-byte aligned by the allocator
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

at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be a [M, K] float32 CPU tensor with unit inner stride");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == NR &&
                  packed.is_contiguous(),
              "packed must come from gemm_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * NR && out_features <= panels * NR,
              "out_features ", out_features, " does not match ", panels, " packed panels");
  const int64_t N = out_features;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();

  // x -> tiles [ceil(M / 6)][K][6], the rows past M zero.
  const int64_t tiles = (M + MR - 1) / MR;
  at::Tensor xa = at::empty({tiles, K, MR}, x.options());
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* xd = xa.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* d = xd + t * K * MR;
      const int64_t rows = std::min<int64_t>(MR, M - t * MR);
      for (int64_t i = 0; i < MR; ++i) {
        if (i < rows) {
          const float* s = xs + (t * MR + i) * ldx;
          for (int64_t k = 0; k < K; ++k) d[k * MR + i] = s[k];
        } else {
          for (int64_t k = 0; k < K; ++k) d[k * MR + i] = 0.f;
        }
      }
    }
  });

  const float* b = packed.data_ptr<float>();
  float* c = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float edge[MR * NR];  // the last panel's tile when N is not a multiple of 16
    for (int64_t p = p0; p < p1; ++p) {
      const float* bp = b + p * K * NR;
      const int64_t cols = std::min<int64_t>(NR, N - p * NR);
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - t * MR));
        float* dst = cols == NR ? c + t * MR * N + p * NR : edge;
        const int64_t ld = cols == NR ? N : NR;
        if (t == 0)
          tile<true>(rows, xd + t * K * MR, bp, K, dst, ld);
        else
          tile<false>(rows, xd + t * K * MR, bp, K, dst, ld);
        if (cols != NR)
          for (int i = 0; i < rows; ++i)
            std::memcpy(c + (t * MR + i) * N + p * NR, edge + i * NR, cols * sizeof(float));
      }
    }
  });
  return y;
}

}  // namespace pagedllm
