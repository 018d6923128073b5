// The bundled SmolLM2-135M's linears (30 layers of QKV, O, gate/up with SwiGLU, down, then the LM
// head: 270 MB of bf16 weights, each layer its own) through gemm_amx_bf16 in model order, one
// "step" of M rows at a time, for two builds of the kernel alternating in one process (A/B on a
// noisy machine): pagedllm_base (a git revision) and pagedllm_var (the working tree). Prints per
// M and build the min / median ms of each linear kind and of the whole step. Built and run by
// benchmarks/amx_linears.sh; needs a CPU with amx_bf16.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define DECLARE_GEMM(NS)                                                                       \
  namespace NS {                                                                               \
  enum GemmEpilogue { kStore, kAccumulate, kSwiGlu };                                          \
  void gemm_amx_bf16(const float*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t, \
                     GemmEpilogue, float*, int64_t);                                           \
  bool gemm_amx_enabled();                                                                     \
  }
DECLARE_GEMM(pagedllm_base)
DECLARE_GEMM(pagedllm_var)

namespace {
struct Linear {
  int64_t K, N;
  int E;  // 0 store, 1 accumulate, 2 SwiGLU
  std::vector<uint16_t> w;
  int64_t panels;
};

void run(int build, const Linear& l, const float* x, int64_t M, float* c) {
  const auto* w = reinterpret_cast<const uint32_t*>(l.w.data());
  if (build)
    pagedllm_var::gemm_amx_bf16(x, M, l.K, l.K, w, l.panels, l.N,
                                static_cast<pagedllm_var::GemmEpilogue>(l.E), c, l.N);
  else
    pagedllm_base::gemm_amx_bf16(x, M, l.K, l.K, w, l.panels, l.N,
                                 static_cast<pagedllm_base::GemmEpilogue>(l.E), c, l.N);
}
}  // namespace

int main(int argc, char** argv) {
  if (!pagedllm_var::gemm_amx_enabled() || !pagedllm_base::gemm_amx_enabled()) {
    std::printf("AMX tiles unavailable (amx_bf16 / amx_tile missing, or the kernel refused)\n");
    return 1;
  }
  const int iters = std::getenv("ITERS") ? std::atoi(std::getenv("ITERS")) : 20;
  std::vector<Linear> lins;
  srand(1);
  auto add = [&](int64_t K, int64_t N, int E) {
    const int64_t panels = (N + 15) / 16 * (E == 2 ? 2 : 1);
    Linear l{K, N, E, std::vector<uint16_t>(panels * 16 * K), panels};
    for (auto& v : l.w) v = 0x3c00 + (rand() & 0x7f) - ((rand() & 1) << 15);  // about +-1
    lins.push_back(std::move(l));
  };
  for (int layer = 0; layer < 30; ++layer) {
    add(576, 960, 0);   // QKV
    add(576, 576, 1);   // O, the residual add in the epilogue
    add(576, 1536, 2);  // gate/up with the SwiGLU epilogue
    add(1536, 576, 1);  // down
  }
  add(576, 49152, 0);  // LM head
  std::vector<int64_t> rows;
  for (int i = 1; i < argc; ++i) rows.push_back(std::atol(argv[i]));
  const int64_t max_m = *std::max_element(rows.begin(), rows.end());
  std::vector<float> x(max_m * 1536);
  for (auto& v : x) v = (rand() % 2000 - 1000) / 1000.f;
  std::vector<float> c(max_m * 49152);
  const char* kinds[5] = {"qkv", "o", "gateup", "down", "lmhead"};
  // times[row count][build][kind 0-4, 5 = step] over the iterations
  std::vector<std::vector<std::vector<std::vector<double>>>> times(
      rows.size(), std::vector<std::vector<std::vector<double>>>(2, std::vector<std::vector<double>>(6)));
  using clock = std::chrono::steady_clock;
  for (int it = 0; it < iters; ++it)
    for (size_t r = 0; r < rows.size(); ++r)
      for (int b = 0; b < 2; ++b) {
        const int build = (b + it) % 2;  // alternate which build goes first
        double part[5] = {};
        const auto t0 = clock::now();
        for (size_t i = 0; i < lins.size(); ++i) {
          const auto t = clock::now();
          run(build, lins[i], x.data(), rows[r], c.data());
          part[i + 1 == lins.size() ? 4 : i % 4] +=
              std::chrono::duration<double, std::milli>(clock::now() - t).count();
        }
        for (int k = 0; k < 5; ++k) times[r][build][k].push_back(part[k]);
        times[r][build][5].push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
      }
  for (size_t r = 0; r < rows.size(); ++r)
    for (int build = 0; build < 2; ++build) {
      std::printf("M %3ld %-4s", static_cast<long>(rows[r]), build ? "var" : "base");
      for (int k = 0; k < 6; ++k) {
        auto v = times[r][build][k];
        std::sort(v.begin(), v.end());
        std::printf(" %s %.2f/%.2f", k < 5 ? kinds[k] : "step", v[0], v[v.size() / 2]);
      }
      std::printf("\n");
    }
}
