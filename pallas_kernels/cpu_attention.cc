// Paged attention on the CPU for steps of one query token per sequence (decode steps): each token
// reads its own sequence's keys and values through the block table, where they lie in the cache.
//
// XLA's reference (pallas_kernels/reference.py) computes the same attention for any step, as a
// loop of gathers, scatters and small einsums: at one token it costs ~0.1 ms per layer in op
// dispatch alone, a third of a small model's decode step. This kernel computes, per token t of
// sequence s at position pos[t] and per KV head, the scores of its query heads against keys
// 0 .. pos[t] (q.k, times sm_scale), their softmax (max subtracted, exponentials summed in float32)
// and the weighted sum of the values, divided by that sum once at the end, as the reference does.
// A token with pos < 0 is padding and gets zeros. Float32 caches only; the variants (sliding
// windows, ALiBi, soft caps, fp8 pages) stay on the reference.
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

struct Attention {
  const float *q, *k, *v;
  float* out;
  const int32_t *tables, *seq, *pos;
  int64_t T, H, D, N, P, KH, S, W, layer;
  float sm_scale;

  // Token t, KV head kh: its group of query heads.
  void run(int64_t t, int64_t kh, std::vector<float>& scores) const {
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
      const int64_t block = std::clamp<int64_t>(table[kp / P], 0, N - 1);
      const float* key = k + (((layer * N + block) * P + kp % P) * KH + kh) * D;
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
      const int64_t block = std::clamp<int64_t>(table[kp / P], 0, N - 1);
      const float* value = v + (((layer * N + block) * P + kp % P) * KH + kh) * D;
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
  const int64_t tasks = a.T * a.KH;
  // Work worth a second thread: a few thousand keys in all (one token's whole context is not).
  int64_t keys = 0;
  for (int64_t t = 0; t < a.T; ++t) keys += std::max<int32_t>(a.pos[t] + 1, 0);
  const int64_t threads = keys * a.KH >= 8192 ? tasks : 1;
  parallel_chunks(pool, tasks, threads, [&a](int64_t task) {
    thread_local std::vector<float> scores;
    a.run(task / a.KH, task % a.KH, scores);
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
