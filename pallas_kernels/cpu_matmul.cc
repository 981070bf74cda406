// x @ w on the CPU for a weight kept as group-quantized integer codes, read at its own width.
//
// XLA:CPU can only dequantize such a weight to a full float32 copy before its dot (5-8x the bytes
// of the codes, written and read back on every pass); at a few rows of x a step is bound by the
// bytes it reads, so this kernel widens the codes in registers instead and never writes a weight.
//
// w[k, n] = scale[g, n] * (code[k, n] - bias) + offset[g, n], g = k / group (models/quant_weights.py,
// GroupQuantizedWeight). Per group the scale and offset are factored out of the sum over k:
//   y[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] code[k, n] + (offset[g, n] - bias scale[g, n]) X[m, g]
// with X[m, g] the sum of row m's inputs in group g: two vector operations per weight, accumulated
// in float32 (the order of the sum differs from XLA's dot, as any two matmuls' orders do).
//
// Two layouts of the same codes:
//   columns  codes [K, N] int8, or [K/2, N] uint8 nibbles (byte r: input 2r low, 2r + 1 high);
//            scale and offset [K/group, N]. Vectors run along n.
//   table    an embedding used as the output head, w = table^T: codes [N, K] or [N, K/2] (nibbles
//            along k), scale and offset [N, K/group]. Vectors run along k.
// Scales and offsets are float16 or float32. The work is split into chunks of output columns
// (rows of a table) shared by the calling thread and XLA's intra-op thread pool.
//
// `tiled` columns: the same arrays' bytes reordered so that each tile of kTile output columns lies
// in one piece (codes [N / kTile][K or K/2][kTile], scale and offset [N / kTile][K/group][kTile],
// still shaped [K, N] outside; models/quant_weights.py's with_matmul_kernel tiles them). A tile then streams
// from memory front to back instead of as one 64-byte piece per row N bytes apart, which the
// hardware prefetchers follow badly: 1.4-1.7x faster at one row of x once weights exceed L2.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vector.h"

namespace ffi = xla::ffi;

namespace {

using namespace paxserve_cpu;  // NOLINT: the shared vector helpers

constexpr int64_t kTile = 4 * kLanes;  // columns per chunk of the columns layout
constexpr int64_t kTableChunk = 256;   // rows per chunk of a table
// Rows of x per chunk of the columns layout: each chunk dequantizes its panel once (at >= 8 rows), so
// blocks as tall as kRowBlock (the panel's cost ~3% of the products') unless the work would then
// come in too few chunks to share between threads (kMinChunks), never under kMinRowBlock.
constexpr int64_t kRowBlock = 256;
constexpr int64_t kMinRowBlock = 64;
constexpr int64_t kMinChunks = 16;
// Software prefetch distances. The hardware prefetchers keep only a few lines in flight while the
// widening and FMAs keep the core busy; asking ~1 KiB ahead lets a tile stream at the thread's
// bandwidth once weights come from DRAM (1.7x on 30 up-projections, 33 MB, at one row of x).
constexpr int64_t kAheadRows = 16;   // rows of codes (a tiled tile's 64 bytes each)
constexpr int64_t kAheadGroups = 4;  // groups of scales and offsets
constexpr int64_t kAheadTableBytes = 16384;  // a table's rows, whole (a head's row: K or K/2 bytes)

struct Problem {
  const float* x = nullptr;  // [M, K]
  float* y = nullptr;        // [M, N]
  const void* codes = nullptr;
  const void* scale = nullptr;
  const void* offset = nullptr;  // null: no offsets
  int64_t M = 0, K = 0, N = 0, group = 0, groups = 0;
  int bits = 8, bias = 0;
  bool table = false, f16 = false, tiled = false;
  std::vector<float> xsum;  // [M, groups]
  // A 4-bit table's x, each 32 inputs reordered as the 16 bytes holding them unpack: even, then odd.
  std::vector<float> xperm;  // [M, K]

  float scalar(const void* base, int64_t i) const {
    return f16 ? static_cast<float>(static_cast<const _Float16*>(base)[i]) : static_cast<const float*>(base)[i];
  }
  vf vector(const void* base, int64_t i) const {
    return f16 ? vhalf(static_cast<const _Float16*>(base) + i) : vload(static_cast<const float*>(base) + i);
  }
  // The term beside each group's sum: offset - bias * scale.
  float shift(int64_t i) const { return (offset ? scalar(offset, i) : 0.0f) - bias * scalar(scale, i); }
  vf shift_vector(int64_t i) const {
    const vf o = offset ? vector(offset, i) : vzero();
    return vfma(vset(-static_cast<float>(bias)), vector(scale, i), o);
  }
  // Columns layout: where the tile of columns from n0 starts in the codes and in scale / offset
  // (elements), and the distance between its consecutive rows.
  int64_t code_at(int64_t n0) const { return tiled ? n0 * (bits == 4 ? K / 2 : K) : n0; }
  int64_t scale_at(int64_t n0) const { return tiled ? n0 * groups : n0; }
  int64_t stride() const { return tiled ? kTile : N; }
  // Group g's scales and offsets of the tile from n0 on their way into the cache.
  void prefetch_groups(int64_t n0, int64_t g) const {
    const int64_t size = f16 ? 2 : 4, i = (scale_at(n0) + g * stride()) * size;
    prefetch_range(scale, i, kTile * size);
    prefetch_range(offset, i, kTile * size);
  }
  // Many rows of x are cut into blocks too, so that narrow weights still give every thread work.
  int64_t row_block = kRowBlock;
  void plan_row_blocks() {
    const int64_t tiles = std::max<int64_t>(1, N / kTile);
    const int64_t blocks = std::max(ceil_div(M, kRowBlock), std::min(ceil_div(M, kMinRowBlock), ceil_div(kMinChunks, tiles)));
    row_block = std::max<int64_t>(1, ceil_div(M, blocks));
  }
  int64_t row_blocks() const { return table ? 1 : ceil_div(M, row_block); }
  int64_t chunks() const {
    return table ? (N + kTableChunk - 1) / kTableChunk : (N + kTile - 1) / kTile * row_blocks();
  }
};

// Columns layout, rows m0 .. m0 + MB of x, the kTile columns from n0.
template <int MB, int BITS>
void columns_tile(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int T = kTile / kLanes;
  vf y[MB][T];
  for (int mb = 0; mb < MB; ++mb)
    for (int t = 0; t < T; ++t) y[mb][t] = vzero();
  const float* x = p.x + m0 * p.K;
  for (int64_t g = 0; g < p.groups; ++g) {
    vf a[MB][T];
    for (int mb = 0; mb < MB; ++mb)
      for (int t = 0; t < T; ++t) a[mb][t] = vzero();
    const int64_t k0 = g * p.group, stride = p.stride();
    if constexpr (BITS == 4) {
      const uint8_t* codes = static_cast<const uint8_t*>(p.codes) + p.code_at(n0);
      for (int64_t r = k0 / 2; r < (k0 + p.group) / 2; ++r) {
        vf lo[T], hi[T];
        prefetch(codes + (r + kAheadRows) * stride);
        for (int t = 0; t < T; ++t) vnibbles(codes + r * stride + t * kLanes, lo[t], hi[t]);
        for (int mb = 0; mb < MB; ++mb) {
          const vf xl = vset(x[mb * p.K + 2 * r]), xh = vset(x[mb * p.K + 2 * r + 1]);
          for (int t = 0; t < T; ++t) a[mb][t] = vfma(xh, hi[t], vfma(xl, lo[t], a[mb][t]));
        }
      }
    } else {
      const int8_t* codes = static_cast<const int8_t*>(p.codes) + p.code_at(n0);
      for (int64_t k = k0; k < k0 + p.group; ++k) {
        vf c[T];
        prefetch(codes + (k + kAheadRows) * stride);
        for (int t = 0; t < T; ++t) c[t] = vcodes(codes + k * stride + t * kLanes);
        for (int mb = 0; mb < MB; ++mb) {
          const vf xk = vset(x[mb * p.K + k]);
          for (int t = 0; t < T; ++t) a[mb][t] = vfma(xk, c[t], a[mb][t]);
        }
      }
    }
    p.prefetch_groups(n0, g + kAheadGroups);
    for (int t = 0; t < T; ++t) {
      const int64_t i = p.scale_at(n0) + g * stride + t * kLanes;
      const vf s = p.vector(p.scale, i), o = p.shift_vector(i);
      for (int mb = 0; mb < MB; ++mb)
        y[mb][t] = vfma(o, vset(p.xsum[(m0 + mb) * p.groups + g]), vfma(s, a[mb][t], y[mb][t]));
    }
  }
  for (int mb = 0; mb < MB; ++mb)
    for (int t = 0; t < T; ++t) vstore(p.y + (m0 + mb) * p.N + n0 + t * kLanes, y[mb][t]);
}

// Columns layout, one output y[m, n] (the columns past the last whole tile).
void columns_one(const Problem& p, int64_t m, int64_t n) {
  const float* x = p.x + m * p.K;
  float y = 0.0f;
  for (int64_t g = 0; g < p.groups; ++g) {
    float a = 0.0f;
    for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
      float c;
      if (p.bits == 4) {
        const uint8_t b = static_cast<const uint8_t*>(p.codes)[(k / 2) * p.N + n];
        c = static_cast<float>(k % 2 ? b >> 4 : b & 15);
      } else {
        c = static_cast<float>(static_cast<const int8_t*>(p.codes)[k * p.N + n]);
      }
      a += x[k] * c;
    }
    y += p.scalar(p.scale, g * p.N + n) * a + p.shift(g * p.N + n) * p.xsum[m * p.groups + g];
  }
  p.y[m * p.N + n] = y;
}

// Table layout, rows m0 .. m0 + MB of x, outputs n (rows of the table) from n_begin to n_end.
template <int MB, int BITS>
void table_rows(const Problem& p, int64_t m0, int64_t n_begin, int64_t n_end) {
  constexpr int kChains = 4;  // accumulators per row, so successive groups do not wait on each other
  const int64_t row_bytes = BITS == 4 ? p.K / 2 : p.K;
  const bool shifted = p.offset != nullptr || p.bias != 0;  // Q8_0 tables have neither
  const int64_t ahead_rows = std::max<int64_t>(1, kAheadTableBytes / row_bytes);
  for (int64_t n = n_begin; n < n_end; ++n) {
    vf acc[MB][kChains];
    float off[MB] = {};
    for (int mb = 0; mb < MB; ++mb)
      for (int c = 0; c < kChains; ++c) acc[mb][c] = vzero();
    if (n + ahead_rows < n_end) {  // a later row's codes and scales on their way in
      prefetch_range(p.codes, (n + ahead_rows) * row_bytes, row_bytes);
      const int64_t size = p.f16 ? 2 : 4, i = (n + ahead_rows) * p.groups * size;
      prefetch_range(p.scale, i, p.groups * size);
      prefetch_range(p.offset, i, p.groups * size);
    }
    for (int64_t g = 0; g < p.groups; ++g) {
      vf a[MB];
      for (int mb = 0; mb < MB; ++mb) a[mb] = vzero();
      if constexpr (BITS == 4) {
        const uint8_t* codes = static_cast<const uint8_t*>(p.codes) + n * row_bytes + g * p.group / 2;
        for (int64_t j = 0; j < p.group / 2; j += kLanes) {
          vf lo, hi;
          vnibbles(codes + j, lo, hi);
          for (int mb = 0; mb < MB; ++mb) {
            const float* xs = p.xperm.data() + (m0 + mb) * p.K + g * p.group + 2 * j;
            a[mb] = vfma(hi, vload(xs + kLanes), vfma(lo, vload(xs), a[mb]));
          }
        }
      } else {
        const int8_t* codes = static_cast<const int8_t*>(p.codes) + n * row_bytes + g * p.group;
        for (int64_t j = 0; j < p.group; j += kLanes) {
          const vf c = vcodes(codes + j);
          for (int mb = 0; mb < MB; ++mb) a[mb] = vfma(c, vload(p.x + (m0 + mb) * p.K + g * p.group + j), a[mb]);
        }
      }
      const vf s = vset(p.scalar(p.scale, n * p.groups + g));
      for (int mb = 0; mb < MB; ++mb) acc[mb][g % kChains] = vfma(s, a[mb], acc[mb][g % kChains]);
      if (shifted) {
        const float o = p.shift(n * p.groups + g);
        for (int mb = 0; mb < MB; ++mb) off[mb] += o * p.xsum[(m0 + mb) * p.groups + g];
      }
    }
    for (int mb = 0; mb < MB; ++mb)
      p.y[(m0 + mb) * p.N + n] = vsum(vadd(vadd(acc[mb][0], acc[mb][1]), vadd(acc[mb][2], acc[mb][3]))) + off[mb];
  }
}

// From kPanelRows rows of x on, each weight is dequantized once per chunk into a buffer (XLA's
// values: scale (code - bias) + offset, rounded as it rounds them) and every row block multiplies
// it from there, a small matmul bound by FMAs rather than by widening codes again for each row.
constexpr int64_t kPanelRows = 8;  // below, widening the codes again per pair of rows is cheaper (measured)

// Columns layout: the dequantized [K, kTile] panel of the columns from n0.
template <int BITS>
void decode_panel(const Problem& p, int64_t n0, float* panel) {
  constexpr int T = kTile / kLanes;
  const vf bias = vset(static_cast<float>(p.bias));
  const int64_t stride = p.stride();
  for (int64_t g = 0; g < p.groups; ++g) {
    vf s[T], o[T];
    for (int t = 0; t < T; ++t) {
      const int64_t i = p.scale_at(n0) + g * stride + t * kLanes;
      s[t] = p.vector(p.scale, i);
      o[t] = p.offset ? p.vector(p.offset, i) : vzero();
    }
    const int64_t k0 = g * p.group;
    if constexpr (BITS == 4) {
      const uint8_t* codes = static_cast<const uint8_t*>(p.codes) + p.code_at(n0);
      for (int64_t r = k0 / 2; r < (k0 + p.group) / 2; ++r)
        for (int t = 0; t < T; ++t) {
          vf lo, hi;
          vnibbles(codes + r * stride + t * kLanes, lo, hi);
          vstore(panel + 2 * r * kTile + t * kLanes, vadd(vmul(s[t], vsub(lo, bias)), o[t]));
          vstore(panel + (2 * r + 1) * kTile + t * kLanes, vadd(vmul(s[t], vsub(hi, bias)), o[t]));
        }
    } else {
      const int8_t* codes = static_cast<const int8_t*>(p.codes) + p.code_at(n0);
      for (int64_t k = k0; k < k0 + p.group; ++k)
        for (int t = 0; t < T; ++t)
          vstore(panel + k * kTile + t * kLanes, vadd(vmul(s[t], vsub(vcodes(codes + k * stride + t * kLanes), bias)), o[t]));
    }
  }
}

// Rows m0 .. m0 + MB of y's kTile columns from n0, plus x's inputs k0 .. k1 times the panel's rows
// (`first`: y starts at zero). The panel is swept in slices that stay in the L1 cache while every
// block of rows uses them, not once per block of rows from L2.
template <int MB>
void panel_rows(const Problem& p, const float* panel, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool first) {
  constexpr int T = kTile / kLanes;
  vf acc[MB][T];
  for (int mb = 0; mb < MB; ++mb)
    for (int t = 0; t < T; ++t) acc[mb][t] = first ? vzero() : vload(p.y + (m0 + mb) * p.N + n0 + t * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    vf w[T];
    for (int t = 0; t < T; ++t) w[t] = vload(panel + k * kTile + t * kLanes);
    for (int mb = 0; mb < MB; ++mb) {
      const vf xk = vset(p.x[(m0 + mb) * p.K + k]);
      for (int t = 0; t < T; ++t) acc[mb][t] = vfma(xk, w[t], acc[mb][t]);
    }
  }
  for (int mb = 0; mb < MB; ++mb)
    for (int t = 0; t < T; ++t) vstore(p.y + (m0 + mb) * p.N + n0 + t * kLanes, acc[mb][t]);
}

constexpr int64_t kPanelSlice = 128;  // panel rows per slice: 32 KiB of float32

// Table layout: rows n .. n + rows of the table dequantized into [rows, K] (a 4-bit table's in
// xperm's order).
template <int BITS>
void decode_table(const Problem& p, int64_t n, int64_t rows, float* buf) {
  const vf bias = vset(static_cast<float>(p.bias));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t i = (n + r) * p.groups + g;
      const vf s = vset(p.scalar(p.scale, i)), o = vset(p.offset ? p.scalar(p.offset, i) : 0.0f);
      float* out = buf + r * p.K + g * p.group;
      if constexpr (BITS == 4) {
        const uint8_t* codes = static_cast<const uint8_t*>(p.codes) + (n + r) * (p.K / 2) + g * p.group / 2;
        for (int64_t j = 0; j < p.group / 2; j += kLanes) {
          vf lo, hi;
          vnibbles(codes + j, lo, hi);
          vstore(out + 2 * j, vadd(vmul(s, vsub(lo, bias)), o));
          vstore(out + 2 * j + kLanes, vadd(vmul(s, vsub(hi, bias)), o));
        }
      } else {
        const int8_t* codes = static_cast<const int8_t*>(p.codes) + (n + r) * p.K + g * p.group;
        for (int64_t j = 0; j < p.group; j += kLanes) vstore(out + j, vadd(vmul(s, vsub(vcodes(codes + j), bias)), o));
      }
    }
}

template <int MB, int NB>
void table_block(const Problem& p, const float* buf, const float* xs, int64_t m0, int64_t n) {
  vf acc[MB][NB];
  for (int mb = 0; mb < MB; ++mb)
    for (int nb = 0; nb < NB; ++nb) acc[mb][nb] = vzero();
  for (int64_t k = 0; k < p.K; k += kLanes) {
    vf w[NB];
    for (int nb = 0; nb < NB; ++nb) w[nb] = vload(buf + nb * p.K + k);
    for (int mb = 0; mb < MB; ++mb) {
      const vf xv = vload(xs + (m0 + mb) * p.K + k);
      for (int nb = 0; nb < NB; ++nb) acc[mb][nb] = vfma(xv, w[nb], acc[mb][nb]);
    }
  }
  for (int mb = 0; mb < MB; ++mb)
    for (int nb = 0; nb < NB; ++nb) p.y[(m0 + mb) * p.N + n + nb] = vsum(acc[mb][nb]);
}

template <int NB>
void table_panel(const Problem& p, const float* buf, int64_t n) {
  const float* xs = p.bits == 4 ? p.xperm.data() : p.x;
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) table_block<4, NB>(p, buf, xs, m, n);
  for (; m < p.M; ++m) table_block<1, NB>(p, buf, xs, m, n);
}

template <int BITS>
void run_chunk_bits(const Problem& p, int64_t chunk) {
  thread_local std::vector<float> buffer;
  int64_t m = 0;
  if (p.table) {
    const int64_t n0 = chunk * kTableChunk, n1 = std::min(p.N, n0 + kTableChunk);
    if (p.M >= kPanelRows) {
      constexpr int64_t kRows = 4;
      buffer.resize(kRows * p.K);
      int64_t n = n0;
      for (; n + kRows <= n1; n += kRows) {
        decode_table<BITS>(p, n, kRows, buffer.data());
        table_panel<kRows>(p, buffer.data(), n);
      }
      for (; n < n1; ++n) {
        decode_table<BITS>(p, n, 1, buffer.data());
        table_panel<1>(p, buffer.data(), n);
      }
      return;
    }
    for (; m + 4 <= p.M; m += 4) table_rows<4, BITS>(p, m, n0, n1);
    for (; m + 2 <= p.M; m += 2) table_rows<2, BITS>(p, m, n0, n1);
    for (; m < p.M; ++m) table_rows<1, BITS>(p, m, n0, n1);
    return;
  }
  const int64_t n0 = chunk / p.row_blocks() * kTile;
  m = chunk % p.row_blocks() * p.row_block;
  const int64_t m_end = std::min(p.M, m + p.row_block);
  if (n0 + kTile > p.N) {
    for (; m < m_end; ++m)
      for (int64_t n = n0; n < p.N; ++n) columns_one(p, m, n);
  } else if (p.M >= kPanelRows) {
    buffer.resize(p.K * kTile);
    decode_panel<BITS>(p, n0, buffer.data());
    for (int64_t k0 = 0; k0 < p.K; k0 += kPanelSlice) {
      const int64_t k1 = std::min(p.K, k0 + kPanelSlice);
      int64_t rows = m;
      for (; rows + 6 <= m_end; rows += 6) panel_rows<6>(p, buffer.data(), rows, n0, k0, k1, k0 == 0);
      for (; rows + 4 <= m_end; rows += 4) panel_rows<4>(p, buffer.data(), rows, n0, k0, k1, k0 == 0);
      for (; rows + 2 <= m_end; rows += 2) panel_rows<2>(p, buffer.data(), rows, n0, k0, k1, k0 == 0);
      for (; rows < m_end; ++rows) panel_rows<1>(p, buffer.data(), rows, n0, k0, k1, k0 == 0);
    }
  } else {
    for (; m + 2 <= m_end; m += 2) columns_tile<2, BITS>(p, m, n0);
    for (; m < m_end; ++m) columns_tile<1, BITS>(p, m, n0);
  }
}

void run_chunk(const Problem& p, int64_t chunk) {
  if (p.bits == 4) {
    run_chunk_bits<4>(p, chunk);
  } else {
    run_chunk_bits<8>(p, chunk);
  }
}

ffi::Error GroupMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::AnyBuffer scale,
                       ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y, int32_t bits, int32_t bias,
                       int32_t table, int32_t has_offset, int32_t tiled) {
  Problem p;
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scale must be 2-D");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits must be 4 or 8");
  const bool is_table = table != 0;
  p.M = xd[0];
  p.K = xd[1];
  p.N = is_table ? cd[0] : cd[1];
  const int64_t code_k = is_table ? cd[1] : cd[0];
  p.groups = is_table ? sd[1] : sd[0];
  if (code_k * (bits == 4 ? 2 : 1) != p.K || p.groups <= 0 || p.K % p.groups)
    return ffi::Error::InvalidArgument("codes and scale do not match x's width");
  p.group = p.K / p.groups;
  if ((is_table ? sd[0] : sd[1]) != p.N) return ffi::Error::InvalidArgument("scale does not match the codes");
  const bool table_ok = p.group % (bits == 4 ? 2 * kLanes : kLanes) == 0;
  if ((is_table && !table_ok) || (bits == 4 && p.group % 2))
    return ffi::Error::InvalidArgument("group size not supported by this layout");
  if (tiled && (is_table || p.N % kTile))
    return ffi::Error::InvalidArgument("tiled codes: the columns layout with a whole number of tiles");
  const auto expect_codes = bits == 4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if (codes.element_type() != expect_codes) return ffi::Error::InvalidArgument("codes: uint8 nibbles or int8");
  if (scale.element_type() != ffi::DataType::F16 && scale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("scale must be float16 or float32");
  if (has_offset && (offset.element_type() != scale.element_type() || offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("offset must match scale");
  p.x = x.typed_data();
  p.y = y->typed_data();
  p.codes = codes.untyped_data();
  p.scale = scale.untyped_data();
  p.offset = has_offset ? offset.untyped_data() : nullptr;
  p.bits = bits;
  p.bias = bias;
  p.table = is_table;
  p.tiled = tiled != 0;
  p.f16 = scale.element_type() == ffi::DataType::F16;
  p.plan_row_blocks();
  p.xsum.assign(p.M * p.groups, 0.0f);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) p.xsum[m * p.groups + k / p.group] += p.x[m * p.K + k];
  if (is_table && bits == 4) {
    p.xperm.resize(p.M * p.K);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t c = 0; c < p.K; c += 2 * kLanes)
        for (int64_t i = 0; i < kLanes; ++i) {
          p.xperm[m * p.K + c + i] = p.x[m * p.K + c + 2 * i];
          p.xperm[m * p.K + c + kLanes + i] = p.x[m * p.K + c + 2 * i + 1];
        }
  }
  parallel_chunks(pool, p.chunks(), p.chunks(), [&p](int64_t chunk) { run_chunk(p, chunk); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxserveGroupMatmul, GroupMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("bias")
                                  .Attr<int32_t>("table")
                                  .Attr<int32_t>("has_offset")
                                  .Attr<int32_t>("tiled"));
