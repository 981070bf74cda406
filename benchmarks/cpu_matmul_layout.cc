// The CPU matmul kernel's columns layout at one row of x, plain (each 64-column tile a 64-byte piece
// per row, N bytes apart) against tiled (each tile in one piece), on one thread, outside XLA.
//
//   g++ -O3 -std=c++17 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -w \
//       -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" -Ipallas_kernels \
//       benchmarks/cpu_matmul_layout.cc -o /tmp/cpu_matmul_layout
//   /tmp/cpu_matmul_layout [K=576] [N=3072] [LAYERS=30]
//
// LAYERS weights of Q4_1 shape [K, N] (random codes, float16 scales and offsets), each multiplied once
// per pass in turn, as a decode step does; best of 30 passes, each layout in turn, three times.
#include "cpu_matmul.cc"  // the kernel itself: its chunks run here without XLA's pool

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? atol(argv[1]) : 576, N = argc > 2 ? atol(argv[2]) : 3072;
  const int64_t L = argc > 3 ? atol(argv[3]) : 30, groups = K / 32;
  std::mt19937 rng(0);
  std::vector<std::vector<uint8_t>> codes(L, std::vector<uint8_t>(K / 2 * N));
  std::vector<std::vector<_Float16>> scale(L, std::vector<_Float16>(groups * N)), offset = scale;
  for (auto& c : codes)
    for (auto& b : c) b = rng() & 255;
  for (auto* s : {&scale, &offset})
    for (auto& v : *s)
      for (auto& b : v) b = static_cast<_Float16>((rng() % 1000) * 2e-5f);
  std::vector<float> x(K, 1.0f), y(N);
  const double bytes = L * (K / 2 * N + 4.0 * groups * N), macs = double(L) * K * N;
  for (int round = 0; round < 3; ++round)
    for (bool tiled : {false, true}) {
      double best = 1e9;
      for (int rep = 0; rep < 30; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t l = 0; l < L; ++l) {
          Problem p;  // the bytes are the same either way: only how the kernel walks them differs
          p.x = x.data(), p.y = y.data(), p.codes = codes[l].data(), p.scale = scale[l].data();
          p.offset = offset[l].data(), p.M = 1, p.K = K, p.N = N, p.groups = groups, p.group = 32, p.bits = 4;
          p.f16 = true, p.tiled = tiled;
          p.xsum.assign(groups, 32.0f);
          for (int64_t c = 0; c < p.chunks(); ++c) run_chunk(p, c);
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      printf("%-6s K=%ld N=%ld x %ld layers: %.3f ms, %.1f GB/s, %.1f GMAC/s (one thread)\n", tiled ? "tiled" : "plain",
             K, N, L, best * 1e3, bytes / best / 1e9, macs / best / 1e9);
    }
}
