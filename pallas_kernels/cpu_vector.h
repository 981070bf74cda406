// Shared by paxserve's CPU kernels (cpu_matmul.cc, cpu_attention.cc): sixteen-lane float vectors
// and the split of a kernel's work between the calling thread and XLA's intra-op thread pool.
#ifndef PAXSERVE_CPU_VECTOR_H_
#define PAXSERVE_CPU_VECTOR_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace paxserve_cpu {

constexpr int64_t kLanes = 16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sixteen float32 lanes. With AVX-512, one register and its intrinsics (GCC's generic vector
// conversions widen bytes one lane at a time); elsewhere plain loops the compiler vectorizes.
#if defined(__AVX512F__)
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vmaxall(vf v) { return _mm512_reduce_max_ps(v); }
// e^x for x <= 0 (a softmax's shifted scores), within 2 ulp of expf: x = n ln2 + r with |r| <= ln2/2,
// e^r by Cephes' degree-6 polynomial, times 2^n. Below -87.3 (e^x under float32's normal range) it
// gives 0, where expf gives a subnormal: nothing a sum of terms >= 1 can tell apart.
inline vf vexp(vf x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, vset(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, vset(-87.3f));
  const vf n = _mm512_roundscale_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  vf poly = vset(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    poly = vfma(poly, r, vset(c));
  poly = vfma(poly, vmul(r, r), vadd(r, vset(1.0f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), poly, n);
}
inline vf vhalf(const _Float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf vcodes(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Sixteen bytes of nibble pairs: the low nibbles' values and the high nibbles'.
inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
struct vf {
  float v[kLanes];
};
inline vf vzero() { return vf{}; }
inline vf vset(float a) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a;
  return r;
}
inline vf vload(const float* p) {
  vf r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, vf v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline vf vfma(vf a, vf b, vf c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline vf vmul(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline vf vadd(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline vf vsub(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] -= b.v[i];
  return a;
}
inline vf vdiv(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] /= b.v[i];
  return a;
}
inline float vsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v.v[i];
  return s;
}
inline vf vmax(vf a, vf b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
inline float vmaxall(vf v) {
  float m = v.v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v.v[i]);
  return m;
}
inline vf vexp(vf x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = std::exp(x.v[i]);
  return x;
}
inline vf vhalf(const _Float16* p) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline vf vcodes(const int8_t* p) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {
  for (int i = 0; i < kLanes; ++i) {
    lo.v[i] = static_cast<float>(p[i] & 15);
    hi.v[i] = static_cast<float>(p[i] >> 4);
  }
}
#endif

// A cache line on its way in (reading; no fault on any address, so it may point past an array).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
// Every line of bytes [offset, offset + size) from base (none when base is null).
inline void prefetch_range(const void* base, int64_t offset, int64_t size) {
  if (base == nullptr) return;
  for (int64_t b = 0; b < size; b += 64) prefetch(static_cast<const char*>(base) + offset + b);
}

// Work in chunks, claimed from a shared counter by the calling thread and by helpers on XLA's pool.
// The caller waits only for chunks already claimed, which are running, never for a helper still
// queued behind other work, so two kernels waiting at once cannot deadlock; a helper that starts
// after every chunk is claimed finds none and returns (the counters it touches live until it has;
// `fn` is never called once the caller has returned).
template <typename F>
struct Chunks {
  Chunks(F f, int64_t n) : fn(std::move(f)), count(n) {}
  F fn;
  int64_t count;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void claim() {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// fn(0) .. fn(count - 1), on up to `threads` threads (the caller's included).
template <typename F>
void parallel_chunks(xla::ffi::ThreadPool& pool, int64_t count, int64_t threads, F fn) {
  auto chunks = std::make_shared<Chunks<F>>(std::move(fn), count);
  const int64_t helpers = std::min<int64_t>({pool.num_threads(), count, threads}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([chunks] { chunks->claim(); });
  chunks->claim();
  while (chunks->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace paxserve_cpu

#endif  // PAXSERVE_CPU_VECTOR_H_
