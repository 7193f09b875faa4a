// Decode attention over the engine's block pool, on CPU, as an XLA FFI call.
//
// XLA computes a decode step's attention as a gather of every row's window
// out of the pool, then per (kv head, row) products of G query rows by the
// window: dozens of tiny products per layer that run far below the memory
// system's speed. Here each (row, kv head) pair reads its keys and values
// straight from their pool blocks, once, scoring all G x T of its queries
// against each key while it is in cache. Pairs are shared between the
// calling thread and XLA's intra-op thread pool.
//
// Semantics are paged_attention's (legorl_jax/models/attention.py): query
// (b, t, n) at position p = max(positions[b, t], 0) reads kv head n / G at
// positions 0..p, position s living in block table[b, s / block_size] at
// offset s % block_size. Out-of-range table entries and positions are
// clamped, as XLA clamps a gather's indices, so a bad table cannot read
// outside the pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to nearest even, as XLA converts float32 to bfloat16 (inputs here are finite).
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// Asks for the cache lines of `count` elements from `p` (a hint; never faults).
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * int64_t{sizeof(T)}; b += 64) __builtin_prefetch(bytes + b);
}

struct Shape {
  int64_t batch, steps, heads, head_dim;          // q [B, T, N, H]
  int64_t kv_heads, num_blocks, block_size;       // pool [L, K, NB, BS, H]
  int64_t width;                                  // table [B, W]
  int64_t layer;
};

// One block's rows as float32: the pool's own memory when it is float32, else
// converted into `buffer`.
inline const float* block_rows(const float* rows, int64_t, float*) { return rows; }
inline const float* block_rows(const uint16_t* rows, int64_t count, float* buffer) {
  for (int64_t i = 0; i < count; ++i) buffer[i] = bf16_to_float(rows[i]);
  return buffer;
}

// Per-thread buffers, grown to the largest pair seen.
struct Scratch {
  std::vector<float> queries, acc, scores, totals, block;
  std::vector<int64_t> seen;
};

// One (row, kv head) pair: its G x T queries against the row's window, a
// block at a time (a block's keys stay in cache while every query reads them).
template <typename Q, typename KV>
void attend_pair(const Shape& s, int64_t b, int64_t kv, const Q* q, const KV* k_pool, const KV* v_pool,
                 const int32_t* table, const int32_t* positions, Q* out, Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads, queries = group * s.steps, h_dim = s.head_dim;
  const int64_t last_position = s.width * s.block_size - 1, block_floats = s.block_size * h_dim;
  scratch.queries.resize(queries * h_dim);
  scratch.acc.assign(queries * h_dim, 0.0f);
  scratch.totals.resize(queries);
  scratch.seen.resize(queries);
  scratch.block.resize(block_floats);
  float* qs = scratch.queries.data();  // [queries, H], scaled
  float* acc = scratch.acc.data();     // [queries, H]
  int64_t* seen = scratch.seen.data();
  int64_t span = 0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t t = 0; t < s.steps; ++t) {
      const int64_t r = g * s.steps + t, head = kv * group + g;
      const Q* src = q + ((b * s.steps + t) * s.heads + head) * h_dim;
      for (int64_t h = 0; h < h_dim; ++h) {
        float x = load(src, h) * scale;
        if constexpr (sizeof(Q) == 2) x = bf16_to_float(float_to_bf16(x));  // as XLA rounds q * scale
        qs[r * h_dim + h] = x;
      }
      seen[r] = std::min(std::max<int64_t>(positions[b * s.steps + t], 0), last_position);
      span = std::max(span, seen[r] + 1);
    }
  }
  scratch.scores.resize(queries * span);
  float* scores = scratch.scores.data();  // [queries, span]
  const int64_t layer_base = (s.layer * s.kv_heads + kv) * s.num_blocks;
  auto block_start = [&](int64_t position) {  // offset of the block holding `position`, in elements
    const int64_t entry = table[b * s.width + position / s.block_size];
    return (layer_base + std::min<int64_t>(std::max<int64_t>(entry, 0), s.num_blocks - 1)) * block_floats;
  };
  // Scores, four keys at a time for every query (four independent sums keep the
  // FMA units busy). Each group of keys prefetches the same rows of the next
  // block, the values' first block after the last: the pool's blocks are
  // scattered, so the hardware's prefetch restarts at each one.
  for (int64_t start = 0; start < span; start += s.block_size) {
    const int64_t count = std::min(s.block_size, span - start);
    const KV* ahead = start + s.block_size < span ? k_pool + block_start(start + s.block_size) : v_pool + block_start(0);
    const float* keys = block_rows(k_pool + block_start(start), count * h_dim, scratch.block.data());
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      prefetch(ahead + i * h_dim, 4 * h_dim);
      const float *k0 = keys + i * h_dim, *k1 = k0 + h_dim, *k2 = k1 + h_dim, *k3 = k2 + h_dim;
      for (int64_t r = 0; r < queries; ++r) {
        const float* qr = qs + r * h_dim;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t h = 0; h < h_dim; ++h) {
          d0 += qr[h] * k0[h];
          d1 += qr[h] * k1[h];
          d2 += qr[h] * k2[h];
          d3 += qr[h] * k3[h];
        }
        float* out_row = scores + r * span + start + i;
        out_row[0] = d0, out_row[1] = d1, out_row[2] = d2, out_row[3] = d3;
      }
    }
    for (; i < count; ++i) {
      const float* key = keys + i * h_dim;
      for (int64_t r = 0; r < queries; ++r) {
        const float* qr = qs + r * h_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t h = 0; h < h_dim; ++h) dot += qr[h] * key[h];
        scores[r * span + start + i] = dot;
      }
    }
  }
  // Softmax numerators over each query's own positions; those past it weigh 0.
  for (int64_t r = 0; r < queries; ++r) {
    float* row = scores + r * span;
    const int64_t reach = seen[r] + 1;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < reach; ++p) top = std::max(top, row[p]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < reach; ++p) {
      const float e = legorl::fast_exp(row[p] - top);
      total += e;
      // The probabilities meet the values in the values' dtype, as on the XLA path.
      row[p] = sizeof(KV) == 2 ? bf16_to_float(float_to_bf16(e)) : e;
    }
    std::fill(row + reach, row + span, 0.0f);
    scratch.totals[r] = total;
  }
  // Values: each read once, four at a time added into the accumulator of every
  // query that reaches them (one load and store of it per four values).
  for (int64_t start = 0; start < span; start += s.block_size) {
    const int64_t count = std::min(s.block_size, span - start);
    const bool last = start + s.block_size >= span;
    const KV* ahead = last ? nullptr : v_pool + block_start(start + s.block_size);
    const float* values = block_rows(v_pool + block_start(start), count * h_dim, scratch.block.data());
    for (int64_t i = 0; i < count; i += 4) {
      if (!last) prefetch(ahead + i * h_dim, 4 * h_dim);
      const float *v0 = values + i * h_dim, *v1 = v0 + h_dim, *v2 = v1 + h_dim, *v3 = v2 + h_dim;
      for (int64_t r = 0; r < queries; ++r) {
        // A stale value past the query may be anything, even NaN: never touch one.
        const int64_t reach = std::min<int64_t>(seen[r] + 1 - start - i, std::min<int64_t>(4, count - i));
        const float* w = scores + r * span + start + i;
        float* a = acc + r * h_dim;
        if (reach == 4) {
          const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma omp simd
          for (int64_t h = 0; h < h_dim; ++h) a[h] += w0 * v0[h] + w1 * v1[h] + w2 * v2[h] + w3 * v3[h];
        } else {
          for (int64_t j = 0; j < reach; ++j) {
            const float* value = v0 + j * h_dim;
#pragma omp simd
            for (int64_t h = 0; h < h_dim; ++h) a[h] += w[j] * value[h];
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t t = 0; t < s.steps; ++t) {
      const int64_t r = g * s.steps + t, head = kv * group + g;
      Q* dst = out + ((b * s.steps + t) * s.heads + head) * h_dim;
      const float inv = 1.0f / scratch.totals[r];
      for (int64_t h = 0; h < h_dim; ++h) {
        const float x = acc[r * h_dim + h] * inv;
        if constexpr (sizeof(Q) == 2) {
          dst[h] = float_to_bf16(x);
        } else {
          dst[h] = x;
        }
      }
    }
  }
}

template <typename Q, typename KV>
void run(const Shape& s, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_pool, const ffi::AnyBuffer& v_pool,
         const int32_t* table, const int32_t* positions, ffi::Result<ffi::AnyBuffer>& out, ffi::ThreadPool& pool) {
  const Q* q_data = static_cast<const Q*>(q.untyped_data());
  const KV* k_data = static_cast<const KV*>(k_pool.untyped_data());
  const KV* v_data = static_cast<const KV*>(v_pool.untyped_data());
  Q* out_data = static_cast<Q*>(out->untyped_data());
  // One item per (row, kv head) pair; everything captured by value (a task may outlive this frame).
  legorl::parallel_for(pool, s.batch * s.kv_heads, [=](int64_t i) {
    thread_local Scratch scratch;
    attend_pair<Q, KV>(s, i / s.kv_heads, i % s.kv_heads, q_data, k_data, v_data, table, positions, out_data,
                       scratch);
  });
}

ffi::Error decode_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                            ffi::Buffer<ffi::S32> positions, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || k_pool.element_type() != v_pool.element_type() ||
      out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("decode_attention: q [B,T,N,H], pools [L,K,NB,BS,H], table [B,W]");
  }
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[3], td[1], 0};
  if (kd[4] != s.head_dim || s.heads % s.kv_heads || td[0] != s.batch || s.width == 0) {
    return ffi::Error::InvalidArgument("decode_attention: mismatched head_dim, heads or rows, or an empty window");
  }
  s.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), kd[0] - 1);
  const int32_t* tbl = table.typed_data();
  const int32_t* pos = positions.typed_data();
  const auto qt = q.element_type(), kt = k_pool.element_type();
  using ffi::DataType;
  if (qt == DataType::F32 && kt == DataType::F32) {
    run<float, float>(s, q, k_pool, v_pool, tbl, pos, out, pool);
  } else if (qt == DataType::F32 && kt == DataType::BF16) {
    run<float, uint16_t>(s, q, k_pool, v_pool, tbl, pos, out, pool);
  } else if (qt == DataType::BF16 && kt == DataType::F32) {
    run<uint16_t, float>(s, q, k_pool, v_pool, tbl, pos, out, pool);
  } else if (qt == DataType::BF16 && kt == DataType::BF16) {
    run<uint16_t, uint16_t>(s, q, k_pool, v_pool, tbl, pos, out, pool);
  } else {
    return ffi::Error::InvalidArgument("decode_attention: q and pools must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LegorlDecodeAttention, decode_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
