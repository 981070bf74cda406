// Paged attention on the CPU for a step's tokens, decode or prefill: each token reads its own
// sequence's keys and values through the block table, where they lie in the cache (a prefill
// chunk's own keys written there before, as the reference reads them too).
//
// XLA's reference (pallas_kernels/reference.py) computes the same attention for any step, as a
// loop of gathers, scatters and small einsums: at one token it costs ~0.1 ms per layer in op
// dispatch alone, a third of a small model's decode step. This kernel computes, per token t of
// sequence s at position pos[t], the scores of every query head against keys 0 .. pos[t] (q.k,
// times sm_scale), their softmax (max subtracted, exponentials summed in float32) and the weighted
// sum of the values, divided by that sum once at the end, as the reference does. A token with
// pos < 0 is padding and gets zeros. Float32 caches only; the variants (sliding windows, ALiBi, soft
// caps, fp8 pages) stay on the reference.
//
// Where the time goes at batch 32 (SmolLM2, ~290 keys): the cache is read from memory once per
// token, so the kernel streams each key's slot (every KV head's row, one piece) once with software
// prefetch ahead through the block table, keeps the scores in a buffer, exponentiates them sixteen
// at a time, and holds the output heads in registers while the value rows stream by (1.7x the
// key-at-a-time version it replaced, one thread; benchmarks/RESULTS.md).
//
// q [T, H, D]; k_cache, v_cache [L, N, P, KH, D] (layer, block, slot in the block, KV head, dim);
// layer: the cache's layer; block_tables [S, W]; seq, pos [T]. Out [T, H, D].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxserve_cpu;  // NOLINT: the shared vector helpers

constexpr int kMaxGroup = 16;  // query heads per KV head this kernel takes

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
  if (n >= kLanes) {
    vf acc = vzero();
    for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
    s = vsum(acc);
  }
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w x
  int64_t i = 0;
  const vf wv = vset(w);
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(wv, vload(x + i), vload(y + i)));
  for (; i < n; ++i) y[i] += w * x[i];
}

constexpr int64_t kAheadKeys = 8;  // keys whose rows are asked for ahead: pages lie anywhere in the cache

struct Attention {
  const float *q, *k, *v;
  float* out;
  const int32_t *tables, *seq, *pos;
  int64_t T, H, D, N, P, KH, S, W, layer;
  float sm_scale;

  // Where key (or value) kp of KV head kh of sequence s's pages lies in a cache.
  const float* row(const float* cache, const int32_t* table, int64_t kp, int64_t kh) const {
    const int64_t block = std::clamp<int64_t>(table[kp / P], 0, N - 1);
    return cache + (((layer * N + block) * P + kp % P) * KH + kh) * D;
  }

  // Token t, heads of DV whole vectors. Every query head's scores against every key, a key's slot
  // (its rows of all KV heads, one piece in the cache) read once; each row of scores softmaxed in
  // vectors; then the values, GB heads' outputs held in registers while a value row is read.
  template <int DV>
  void run_vectors(int64_t t, std::vector<float>& scratch) const {
    constexpr int64_t kD = DV * kLanes;
    constexpr int GB = std::min(8, static_cast<int>(16 / DV));  // accumulators: GB * DV vectors
    const int64_t G = H / KH;
    float* o = out + t * H * kD;
    const int64_t p = pos[t], s = seq[t];
    if (p < 0 || s < 0 || s >= S) {
      std::fill(o, o + H * kD, 0.0f);
      return;
    }
    const int64_t keys = std::min(p + 1, W * P), stride = ceil_div(keys, kLanes) * kLanes;
    scratch.resize(H * stride + H);  // each head's row of scores, then each head's sum
    float* sum = scratch.data() + H * stride;
    const float* qt = q + t * H * kD;
    const int32_t* table = tables + s * W;
    for (int64_t kp = 0; kp < keys; ++kp) {
      if (kp + kAheadKeys < keys) prefetch_range(row(k, table, kp + kAheadKeys, 0), 0, KH * kD * 4);
      for (int64_t kh = 0; kh < KH; ++kh) {
        const float* key = row(k, table, kp, kh);
        vf kv[DV];
        for (int d = 0; d < DV; ++d) kv[d] = vload(key + d * kLanes);
        for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
          vf acc = vmul(vload(qt + h * kD), kv[0]);
          for (int d = 1; d < DV; ++d) acc = vfma(vload(qt + h * kD + d * kLanes), kv[d], acc);
          scratch[h * stride + kp] = vsum(acc) * sm_scale;
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* sc = scratch.data() + h * stride;
      std::fill(sc + keys, sc + stride, -std::numeric_limits<float>::infinity());
      vf m = vset(-std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < stride; i += kLanes) m = vmax(m, vload(sc + i));
      const vf top = vset(vmaxall(m));
      vf total = vzero();
      for (int64_t i = 0; i < stride; i += kLanes) {
        const vf e = vexp(vsub(vload(sc + i), top));
        vstore(sc + i, e);
        total = vadd(total, e);
      }
      sum[h] = vsum(total);
    }
    for (int64_t kh = 0; kh < KH; ++kh)
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const bool first = kh == 0 && g0 == 0;  // the pass that brings every value slot in
        // A last block of fewer heads repeats its last head rather than compile a kernel per count.
        const float* w[GB];
        for (int b = 0; b < GB; ++b) w[b] = scratch.data() + (kh * G + std::min<int64_t>(g0 + b, G - 1)) * stride;
        vf acc[GB][DV];
        for (int b = 0; b < GB; ++b)
          for (int d = 0; d < DV; ++d) acc[b][d] = vzero();
        for (int64_t kp = 0; kp < keys; ++kp) {
          if (kp + kAheadKeys < keys) {
            const float* ahead = row(v, table, kp + kAheadKeys, first ? 0 : kh);
            prefetch_range(ahead, 0, (first ? KH : 1) * kD * 4);
          }
          const float* value = row(v, table, kp, kh);
          vf e[GB];
          for (int b = 0; b < GB; ++b) e[b] = vset(w[b][kp]);
          for (int d = 0; d < DV; ++d) {
            const vf x = vload(value + d * kLanes);
            for (int b = 0; b < GB; ++b) acc[b][d] = vfma(e[b], x, acc[b][d]);
          }
        }
        for (int b = 0; b < GB && g0 + b < G; ++b) {
          const int64_t h = kh * G + g0 + b;
          const vf total = vset(sum[h] > 0.0f ? sum[h] : 1.0f);
          for (int d = 0; d < DV; ++d) vstore(o + h * kD + d * kLanes, vdiv(acc[b][d], total));
        }
      }
  }

  // Token t: every head (a task).
  void run(int64_t t, std::vector<float>& scratch) const {
    switch (D) {
      case 16: return run_vectors<1>(t, scratch);
      case 32: return run_vectors<2>(t, scratch);
      case 64: return run_vectors<4>(t, scratch);
      case 128: return run_vectors<8>(t, scratch);
      case 256: return run_vectors<16>(t, scratch);
      default:
        for (int64_t kh = 0; kh < KH; ++kh) run_any(t, kh, scratch);
    }
  }

  // Token t, KV head kh, any head size: its group of query heads, a key at a time.
  void run_any(int64_t t, int64_t kh, std::vector<float>& scores) const {
    const int64_t G = H / KH;
    float* o = out + (t * H + kh * G) * D;
    std::fill(o, o + G * D, 0.0f);
    const int64_t p = pos[t];
    const int64_t s = seq[t];
    if (p < 0 || s < 0 || s >= S) return;
    const int64_t keys = std::min(p + 1, W * P);
    scores.resize(keys * G);
    const float* qh = q + (t * H + kh * G) * D;
    const int32_t* table = tables + s * W;
    for (int64_t kp = 0; kp < keys; ++kp) {
      const float* key = row(k, table, kp, kh);
      for (int64_t g = 0; g < G; ++g) scores[kp * G + g] = dot(qh + g * D, key, D) * sm_scale;
    }
    float m[kMaxGroup], sum[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      sum[g] = 0.0f;
    }
    for (int64_t kp = 0; kp < keys; ++kp)
      for (int64_t g = 0; g < G; ++g) m[g] = std::max(m[g], scores[kp * G + g]);
    for (int64_t kp = 0; kp < keys; ++kp) {
      const float* value = row(v, table, kp, kh);
      for (int64_t g = 0; g < G; ++g) {
        const float e = std::exp(scores[kp * G + g] - m[g]);
        sum[g] += e;
        axpy(e, value, o + g * D, D);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = sum[g] > 0.0f ? sum[g] : 1.0f;
      for (int64_t d = 0; d < D; ++d) o[g * D + d] /= inv;
    }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> pos,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  const auto vd = v_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("q [T, H, D], caches [L, N, P, KH, D], block tables [S, W]");
  Attention a{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), out->typed_data(),
              block_tables.typed_data(), seq.typed_data(), pos.typed_data(),
              qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], td[0], td[1], 0, sm_scale};
  if (kd[4] != a.D || a.KH <= 0 || a.H % a.KH || a.H / a.KH > kMaxGroup)
    return ffi::Error::InvalidArgument("head shapes do not match the cache");
  if (seq.element_count() != a.T || pos.element_count() != a.T || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("seq and pos need one entry per token, layer one");
  a.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  const int64_t tasks = a.T;
  // Work worth a second thread: a few thousand keys in all (one token's whole context is not).
  int64_t keys = 0;
  for (int64_t t = 0; t < a.T; ++t) keys += std::max<int32_t>(a.pos[t] + 1, 0);
  const int64_t threads = keys * a.KH >= 8192 ? tasks : 1;
  parallel_chunks(pool, tasks, threads, [&a](int64_t task) {
    thread_local std::vector<float> scores;
    a.run(task, scores);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
