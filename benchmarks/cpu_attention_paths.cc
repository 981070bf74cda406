// The CPU attention kernel's two paths on one decode step, one thread, outside XLA: the key-at-a-time
// path (`run_any`: one KV head per pass, a scalar exp and a read-modify-write of the output per key,
// what the kernel did for every head size until issue 35's part 6 and still does for head sizes that
// are not 16, 32, 64, 128 or 256) against the vector path (`run`: a key's slot read once for every
// KV head, prefetched through the block table, scores exponentiated sixteen at a time, output heads
// in registers).
//
//   g++ -O3 -std=c++17 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -w \
//       -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" -Ipallas_kernels \
//       benchmarks/cpu_attention_paths.cc -o /tmp/cpu_attention_paths
//   /tmp/cpu_attention_paths [TOKENS=32] [KEYS=290] [LAYERS=30]
//
// SmolLM2's heads (9 query heads, 3 KV heads of 64), 16-token pages in shuffled order, TOKENS
// sequences of about KEYS keys, LAYERS layers of cache (30: 449 MB at the defaults, beyond the
// caches, as a real step finds it); each path in turn, best of 10 passes over the layers, three times.
#include "cpu_attention.cc"  // the kernel itself

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atol(argv[1]) : 32, ctx = argc > 2 ? atol(argv[2]) : 290;
  const int64_t L = argc > 3 ? atol(argv[3]) : 30;
  const int64_t H = 9, KH = 3, D = 64, P = 16, W = (ctx + P - 1) / P, N = T * W + 1;
  std::mt19937 rng(0);
  std::vector<float> k(L * N * P * KH * D), v(k.size()), q(T * H * D), out(T * H * D), first(T * H * D);
  for (auto* a : {&k, &v, &q})
    for (auto& x : *a) x = (rng() % 2000) * 1e-3f - 1.0f;
  std::vector<int32_t> blocks(N - 1), tables(T * W), seq(T), pos(T);
  std::iota(blocks.begin(), blocks.end(), 1);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (int64_t i = 0; i < T * W; ++i) tables[i] = blocks[i];
  for (int64_t t = 0; t < T; ++t) seq[t] = t, pos[t] = ctx - 1 - t % 7;
  const double bytes = 2.0 * L * T * ctx * KH * D * 4;
  float diff = 0.0f;
  for (int round = 0; round < 3; ++round)
    for (bool vectors : {false, true}) {
      double best = 1e9;
      for (int rep = 0; rep < 10; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t l = 0; l < L; ++l) {
          Attention a{q.data(), k.data(), v.data(), out.data(), tables.data(), seq.data(), pos.data(),
                      T, H, D, N, P, KH, T, W, l, 0.125f};
          std::vector<float> scratch;
          for (int64_t t = 0; t < T; ++t) {
            if (vectors) {
              a.run(t, scratch);
            } else {
              for (int64_t kh = 0; kh < KH; ++kh) a.run_any(t, kh, scratch);
            }
          }
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      if (!vectors) first = out;  // the last layer's outputs, to compare the paths
      for (int64_t i = 0; vectors && i < T * H * D; ++i) diff = std::max(diff, std::abs(out[i] - first[i]));
      printf("%-14s %ld tokens x %ld keys, %ld layers: %.3f ms per layer, %.1f GB/s (one thread)\n",
             vectors ? "vectors" : "key at a time", T, ctx, L, best * 1e3 / L, bytes / best / 1e9);
    }
  printf("max |difference| between the paths' outputs: %.3g\n", diff);
}
