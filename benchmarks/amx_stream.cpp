// How the AMX GEMM's block shapes keep pace with their weight stream (issue 22; gemm_amx.cpp's
// prefetch_b_ahead). One thread walks bf16 weight panels of K = 576 (18 KiB each, the bundled
// model's hidden size) the way gemm_amx.cpp's blocks do, and prints the median ns per KiB of
// weights for each block shape, with and without B prefetched N k steps ahead into L1, next to a
// plain vector read of the same bytes. Timing only: the tiles multiply ones.
//
//   g++ -O2 -march=sapphirerapids benchmarks/amx_stream.cpp -o /tmp/amx_stream
//   /tmp/amx_stream 192   # weights from memory (192 MiB)
//   /tmp/amx_stream 1     # weights in L2 (1 MiB, walked repeatedly)
//
// Needs a CPU with amx_bf16 (Linux asks for the tile state with arch_prctl).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr long kTiles = 18;            // k steps per panel (K = 576)
constexpr long kPanel = kTiles * 1024; // one panel: 16 columns x K bf16
char* a;                               // two row tiles' A tiles (in L1)
char* b;                               // the panels
long b_bytes;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Small regions are walked repeatedly, 64 MiB in all, so that they are timed in cache.
int passes_over_b() { return b_bytes < (64l << 20) ? int((64l << 20) / b_bytes) : 1; }

// Blocks: 16 = 1 x 6 (one row tile, 6 panels), 13 = 1 x 3, 23 = 2 x 3, 22 = 2 x 2. PF: k steps
// of prefetch ahead (0: none).
template <int SHAPE, int PF>
double walk() {
  constexpr int panels_per_block = SHAPE % 10;
  const long panels = b_bytes / kPanel;
  const int passes = passes_over_b();
  const auto t = std::chrono::steady_clock::now();
  for (int pass = 0; pass < passes; ++pass) {
    for (long p = 0; p + panels_per_block <= panels; p += panels_per_block) {
      for (long kt = 0; kt < kTiles; ++kt) {
        const char* bk = b + p * kPanel + kt * 1024;
        const char* a0 = a + kt * 1024;
        const char* a1 = a0 + 32768;
        if (PF)
          for (int n = 0; n < panels_per_block; ++n)
            for (int line = 0; line < 16; ++line)
              _mm_prefetch(bk + PF * 1024 + n * kPanel + 64 * line, _MM_HINT_T0);
        if constexpr (SHAPE == 16 || SHAPE == 13) {
          _tile_loadd(6, a0, 64);
          _tile_loadd(7, bk, 64); _tile_dpbf16ps(0, 6, 7);
          _tile_loadd(7, bk + kPanel, 64); _tile_dpbf16ps(1, 6, 7);
          _tile_loadd(7, bk + 2 * kPanel, 64); _tile_dpbf16ps(2, 6, 7);
          if constexpr (SHAPE == 16) {
            _tile_loadd(7, bk + 3 * kPanel, 64); _tile_dpbf16ps(3, 6, 7);
            _tile_loadd(7, bk + 4 * kPanel, 64); _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(7, bk + 5 * kPanel, 64); _tile_dpbf16ps(5, 6, 7);
          }
        } else if constexpr (SHAPE == 23) {  // gemm_amx.cpp's wide_block_2x3 order
          _tile_loadd(6, a0, 64); _tile_loadd(7, bk, 64); _tile_dpbf16ps(0, 6, 7);
          _tile_loadd(6, a1, 64); _tile_dpbf16ps(3, 6, 7);
          _tile_loadd(7, bk + kPanel, 64); _tile_dpbf16ps(4, 6, 7);
          _tile_loadd(6, a0, 64); _tile_dpbf16ps(1, 6, 7);
          _tile_loadd(7, bk + 2 * kPanel, 64); _tile_dpbf16ps(2, 6, 7);
          _tile_loadd(6, a1, 64); _tile_dpbf16ps(5, 6, 7);
        } else {  // 22: tile_block<2, 2>
          _tile_loadd(6, bk, 64); _tile_loadd(7, bk + kPanel, 64);
          _tile_loadd(4, a0, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, a1, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
  }
  return seconds_since(t) / passes / (b_bytes / 1024) * 1e9;
}

double plain_read() {
  const int passes = passes_over_b();
  const auto t = std::chrono::steady_clock::now();
  __m512 sum = _mm512_setzero_ps();
  for (int pass = 0; pass < passes; ++pass)
    for (long i = 0; i < b_bytes; i += 64)
      sum = _mm512_add_ps(sum, _mm512_load_ps(reinterpret_cast<const float*>(b + i)));
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return seconds_since(t) / passes / (b_bytes / 1024) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::fprintf(stderr, "no AMX tile state (needs amx_bf16 and Linux 5.16+)\n");
    return 1;
  }
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
  const double mib = argc > 1 ? std::atof(argv[1]) : 192;
  b_bytes = static_cast<long>(mib * (1 << 20)) / (6 * kPanel) * (6 * kPanel);
  a = static_cast<char*>(std::aligned_alloc(4096, 1 << 17));
  b = static_cast<char*>(std::aligned_alloc(4096, b_bytes + (1 << 20)));
  std::memset(a, 0, 1 << 17);
  std::memset(b, 0, b_bytes + (1 << 20));
  constexpr int kVariants = 10, kRounds = 7;
  const char* names[kVariants] = {"plain read", "1x6", "1x6 pf2", "1x3", "2x3", "2x3 pf2",
                                  "2x3 pf4", "2x3 pf8", "2x2", "2x2 pf2"};
  double ns[kVariants][kRounds];
  for (int r = 0; r < kRounds; ++r) {  // variants alternate, so a slow minute hits them alike
    ns[0][r] = plain_read();
    ns[1][r] = walk<16, 0>(), ns[2][r] = walk<16, 2>(), ns[3][r] = walk<13, 0>();
    ns[4][r] = walk<23, 0>(), ns[5][r] = walk<23, 2>(), ns[6][r] = walk<23, 4>();
    ns[7][r] = walk<23, 8>(), ns[8][r] = walk<22, 0>(), ns[9][r] = walk<22, 2>();
  }
  std::printf("%.0f MiB of weights, ns per KiB (median of %d rounds):\n", b_bytes / 1048576.0,
              kRounds);
  for (int v = 0; v < kVariants; ++v) {
    std::sort(ns[v], ns[v] + kRounds);
    std::printf("  %-10s %6.1f\n", names[v], ns[v][kRounds / 2]);
  }
}
