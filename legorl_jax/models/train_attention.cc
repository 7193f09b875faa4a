// Causal attention of training rows on CPU, forward and backward, as XLA FFI
// calls: blockwise_attention's semantics (legorl_jax/models/blockwise_attention.py)
// at float32.
//
// XLA runs blockwise attention as nested while loops of small products, masks
// and exps, far below the FMA units' speed on CPU (a 16k-token row of the CLI
// demo model spent most of an SFT step there). Here a tile of 64 queries by 64
// keys is scored with the keys held transposed, so every inner loop runs
// across the tile's keys or a head's dimensions in full vector registers, and
// tiles no query of the block can see are skipped before any arithmetic:
// above the causal diagonal, across segments, or (tree rows) keys whose
// subtree ends before the block starts.
//
// Query (b, t, n) sees key (b, s, n / G) when s <= t, segment_ids[b, s] ==
// segment_ids[b, t] and t < kv_end[b, s]. A query that sees nothing gets 0 and
// a log-sum-exp of +inf, so the backward pass gives it no gradient.
//
// Forward: one work item per (row, kv head, query block), with a running max
// and sum per query (FlashAttention's scheme); it writes the output and each
// query's log-sum-exp, lse [B, N, T]. Backward: one item per (row, kv head,
// share of the key blocks); each recomputes its tiles' probabilities from lse,
// owns dK and dV of its key blocks, and adds dQ into a buffer of its own, the
// buffers summed at the end (so no two threads ever write the same float).

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

constexpr int64_t kTile = 64;  // queries per block and keys per tile
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Dims {
  int64_t batch, steps, heads, kv_heads, head_dim;
  int64_t group() const { return heads / kv_heads; }
  int64_t blocks() const { return steps / kTile; }
  // Offsets of [B, T, N, H] and [B, T, K, H] elements.
  int64_t q_at(int64_t b, int64_t t, int64_t n) const { return ((b * steps + t) * heads + n) * head_dim; }
  int64_t kv_at(int64_t b, int64_t s, int64_t k) const { return ((b * steps + s) * kv_heads + k) * head_dim; }
};

// What a tile of the row needs to be skipped or taken whole: its segment ids'
// range and its keys' kv_end range.
struct Span {
  int32_t seg_lo, seg_hi, end_lo, end_hi;
};

std::vector<Span> spans(const Dims& d, const int32_t* seg, const int32_t* end) {
  std::vector<Span> out(d.batch * d.blocks());
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t blk = 0; blk < d.blocks(); ++blk) {
      Span s{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
             std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t at = b * d.steps + blk * kTile + i;
        s.seg_lo = std::min(s.seg_lo, seg[at]), s.seg_hi = std::max(s.seg_hi, seg[at]);
        s.end_lo = std::min(s.end_lo, end[at]), s.end_hi = std::max(s.end_hi, end[at]);
      }
      out[b * d.blocks() + blk] = s;
    }
  }
  return out;
}

enum class Seen { kNone, kAll, kSome };

// Which of query block qb's pairs with key tile kb are visible (kb <= qb).
Seen classify(const Span& queries, const Span& keys, int64_t qb, int64_t kb) {
  const int64_t q_first = qb * kTile, q_last = q_first + kTile - 1;
  if (queries.seg_hi < keys.seg_lo || keys.seg_hi < queries.seg_lo || keys.end_hi <= q_first) return Seen::kNone;
  const bool one_segment = queries.seg_lo == queries.seg_hi && keys.seg_lo == keys.seg_hi;
  if (kb < qb && one_segment && keys.end_lo > q_last) return Seen::kAll;
  return Seen::kSome;
}

inline bool visible(const int32_t* seg, const int32_t* end, int64_t row, int64_t t, int64_t s) {
  return s <= t && seg[row + s] == seg[row + t] && t < end[row + s];
}

using legorl::f8;
using legorl::splat;
constexpr int64_t kLanes = 8;

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float max_of(const float* x) {
  f8 m = load8(x);
  for (int64_t c = kLanes; c < kTile; c += kLanes) {
    const f8 y = load8(x + c);
    m = y > m ? y : m;
  }
  float top = m[0];
  for (int64_t i = 1; i < kLanes; ++i) top = std::max(top, m[i]);
  return top;
}

// The four rows of a group, each a [kTile] run of scores.
constexpr int64_t kRows = 4;

// s[r][c] = scale * x[r] . y[c] for four rows x[r] (h_dim floats each) and a tile's rows y held
// transposed, y_t[h][c]: 8 accumulators, two loads and four broadcasts per 8 FMAs.
inline void products(const float* const* x, const float* y_t, int64_t h_dim, float scale, float* s) {
  for (int64_t c = 0; c < kTile; c += 2 * kLanes) {
    f8 a00{}, a01{}, a10{}, a11{}, a20{}, a21{}, a30{}, a31{};
    for (int64_t h = 0; h < h_dim; ++h) {
      const f8 y0 = load8(y_t + h * kTile + c), y1 = load8(y_t + h * kTile + c + kLanes);
      const f8 x0 = splat(x[0][h]), x1 = splat(x[1][h]), x2 = splat(x[2][h]), x3 = splat(x[3][h]);
      a00 += x0 * y0, a01 += x0 * y1, a10 += x1 * y0, a11 += x1 * y1;
      a20 += x2 * y0, a21 += x2 * y1, a30 += x3 * y0, a31 += x3 * y1;
    }
    store8(s + c, a00 * scale), store8(s + c + kLanes, a01 * scale);
    store8(s + kTile + c, a10 * scale), store8(s + kTile + c + kLanes, a11 * scale);
    store8(s + 2 * kTile + c, a20 * scale), store8(s + 2 * kTile + c + kLanes, a21 * scale);
    store8(s + 3 * kTile + c, a30 * scale), store8(s + 3 * kTile + c + kLanes, a31 * scale);
  }
}

// out[r] += sum_c w[r][c] * y[c] for four rows out[r] and a tile's rows y[c][h] (h_dim a multiple of 16).
inline void mix_into(const float* w, const float* y, int64_t h_dim, float* const* out) {
  for (int64_t h = 0; h < h_dim; h += 2 * kLanes) {
    f8 a00 = load8(out[0] + h), a01 = load8(out[0] + h + kLanes), a10 = load8(out[1] + h),
       a11 = load8(out[1] + h + kLanes), a20 = load8(out[2] + h), a21 = load8(out[2] + h + kLanes),
       a30 = load8(out[3] + h), a31 = load8(out[3] + h + kLanes);
    for (int64_t c = 0; c < kTile; ++c) {
      const f8 y0 = load8(y + c * h_dim + h), y1 = load8(y + c * h_dim + h + kLanes);
      const f8 w0 = splat(w[c]), w1 = splat(w[kTile + c]), w2 = splat(w[2 * kTile + c]),
               w3 = splat(w[3 * kTile + c]);
      a00 += w0 * y0, a01 += w0 * y1, a10 += w1 * y0, a11 += w1 * y1;
      a20 += w2 * y0, a21 += w2 * y1, a30 += w3 * y0, a31 += w3 * y1;
    }
    store8(out[0] + h, a00), store8(out[0] + h + kLanes, a01), store8(out[1] + h, a10);
    store8(out[1] + h + kLanes, a11), store8(out[2] + h, a20), store8(out[2] + h + kLanes, a21);
    store8(out[3] + h, a30), store8(out[3] + h + kLanes, a31);
  }
}

// out[c] += sum_r w[r][c] * x[r] over `rows` rows x[r] (h_dim floats each; w is [rows][kTile]) for a
// tile's rows out[c][h] (h_dim a multiple of 16): each 4 x 16 block of out held in registers over all rows.
inline void mix_into_tile(const float* w, const float* const* x, int64_t rows, int64_t h_dim, float* out) {
  for (int64_t c = 0; c < kTile; c += 4) {
    for (int64_t h = 0; h < h_dim; h += 2 * kLanes) {
      float *o0 = out + c * h_dim + h, *o1 = o0 + h_dim, *o2 = o1 + h_dim, *o3 = o2 + h_dim;
      f8 a00 = load8(o0), a01 = load8(o0 + kLanes), a10 = load8(o1), a11 = load8(o1 + kLanes), a20 = load8(o2),
         a21 = load8(o2 + kLanes), a30 = load8(o3), a31 = load8(o3 + kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const f8 x0 = load8(x[r] + h), x1 = load8(x[r] + h + kLanes);
        const float* wr = w + r * kTile + c;
        const f8 w0 = splat(wr[0]), w1 = splat(wr[1]), w2 = splat(wr[2]), w3 = splat(wr[3]);
        a00 += w0 * x0, a01 += w0 * x1, a10 += w1 * x0, a11 += w1 * x1;
        a20 += w2 * x0, a21 += w2 * x1, a30 += w3 * x0, a31 += w3 * x1;
      }
      store8(o0, a00), store8(o0 + kLanes, a01), store8(o1, a10), store8(o1 + kLanes, a11);
      store8(o2, a20), store8(o2 + kLanes, a21), store8(o3, a30), store8(o3 + kLanes, a31);
    }
  }
}

// A key tile's rows copied out of [B, T, K, H]: as stored ([key][h]) and transposed ([h][key]).
void load_tile(const Dims& d, const float* x, int64_t b, int64_t kv, int64_t kb, float* rows, float* cols) {
  const int64_t h_dim = d.head_dim;
  for (int64_t c = 0; c < kTile; ++c) {
    const float* src = x + d.kv_at(b, kb * kTile + c, kv);
    if (rows != nullptr) std::memcpy(rows + c * h_dim, src, h_dim * sizeof(float));
    if (cols != nullptr)
      for (int64_t h = 0; h < h_dim; ++h) cols[h * kTile + c] = src[h];
  }
}

// Sets to -inf the scores query t of the row may not see, for the tile at key kb.
inline void mask_row(const int32_t* seg, const int32_t* end, int64_t row, int64_t t, int64_t kb, float* scores) {
  for (int64_t c = 0; c < kTile; ++c)
    if (!visible(seg, end, row, t, kb * kTile + c)) scores[c] = -kInf;
}

struct ForwardScratch {
  std::vector<float> keys_t, values, acc, top, total;
};

// Query block qb of kv head kv in row b: its G heads' queries against every visible key tile.
void forward_block(const Dims& d, const float* q, const float* k, const float* v, const int32_t* seg,
                   const int32_t* end, const Span* row_spans, int64_t b, int64_t kv, int64_t qb, float* out,
                   float* lse, ForwardScratch& w) {
  const int64_t g_count = d.group(), h_dim = d.head_dim, rows = g_count * kTile, row = b * d.steps;
  const float scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  w.keys_t.resize(h_dim * kTile);
  w.values.resize(kTile * h_dim);
  w.acc.assign(rows * h_dim, 0.0f);
  w.top.assign(rows, -kInf);
  w.total.assign(rows, 0.0f);
  float scores[kRows * kTile];
  const float* q_rows[kRows];
  float* acc_rows[kRows];
  for (int64_t kb = 0; kb <= qb; ++kb) {
    const Seen seen = classify(row_spans[qb], row_spans[kb], qb, kb);
    if (seen == Seen::kNone) continue;
    load_tile(d, k, b, kv, kb, nullptr, w.keys_t.data());
    load_tile(d, v, b, kv, kb, w.values.data(), nullptr);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = r0 + i;
        q_rows[i] = q + d.q_at(b, qb * kTile + r % kTile, kv * g_count + r / kTile);
        acc_rows[i] = w.acc.data() + r * h_dim;
      }
      products(q_rows, w.keys_t.data(), h_dim, scale, scores);
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = r0 + i;
        float* s = scores + i * kTile;
        if (seen == Seen::kSome) mask_row(seg, end, row, qb * kTile + r % kTile, kb, s);
        const float new_top = std::max(w.top[r], max_of(s));
        if (new_top == -kInf) {  // nothing seen yet: weigh this tile 0
          std::fill(s, s + kTile, 0.0f);
          continue;
        }
        const float rescale = legorl::fast_exp(w.top[r] - new_top);
        f8 sum{};
        for (int64_t c = 0; c < kTile; c += kLanes) {
          const f8 p = legorl::fast_exp(load8(s + c) - new_top);
          store8(s + c, p);
          sum += p;
        }
        float total = 0.0f;
        for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
        w.top[r] = new_top;
        w.total[r] = w.total[r] * rescale + total;
        float* a = acc_rows[i];
        for (int64_t h = 0; h < h_dim; h += kLanes) store8(a + h, load8(a + h) * rescale);
      }
      mix_into(scores, w.values.data(), h_dim, acc_rows);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / kTile, t = qb * kTile + r % kTile, n = kv * g_count + g;
    float* dst = out + d.q_at(b, t, n);
    const bool any = w.total[r] > 0.0f;
    const float inv = any ? 1.0f / w.total[r] : 0.0f;
    for (int64_t h = 0; h < h_dim; ++h) dst[h] = w.acc[r * h_dim + h] * inv;
    lse[(b * d.heads + n) * d.steps + t] = any ? w.top[r] + std::log(w.total[r]) : kInf;
  }
}

struct BackwardScratch {
  std::vector<float> keys, keys_t, values_t, dk, dv, probs, grads;
  std::vector<const float*> q_rows, do_rows;
  std::vector<float*> dq_rows;
};

// Key tiles kb = part, part + parts, ... of kv head kv in row b against every query block that sees
// them: dK and dV of those tiles, and their share of dQ added into dq_part [G, T, H]. A tile's
// probabilities and score gradients are computed for all its G x 64 query rows first, so dK and dV
// take them as products over those rows with their blocks held in registers.
void backward_part(const Dims& d, const float* q, const float* k, const float* v, const int32_t* seg,
                   const int32_t* end, const Span* row_spans, const float* d_out, const float* lse,
                   const float* delta, int64_t b, int64_t kv, int64_t part, int64_t parts, float* dq_part,
                   float* dk, float* dv, BackwardScratch& w) {
  const int64_t g_count = d.group(), h_dim = d.head_dim, row = b * d.steps, nb = d.blocks();
  const int64_t rows = g_count * kTile;
  const float scale = 1.0f / std::sqrt(static_cast<float>(h_dim));
  w.keys.resize(kTile * h_dim);
  w.keys_t.resize(h_dim * kTile);
  w.values_t.resize(h_dim * kTile);
  w.probs.resize(rows * kTile);
  w.grads.resize(rows * kTile);
  w.q_rows.resize(rows);
  w.do_rows.resize(rows);
  w.dq_rows.resize(rows);
  for (int64_t kb = part; kb < nb; kb += parts) {
    load_tile(d, k, b, kv, kb, w.keys.data(), w.keys_t.data());
    load_tile(d, v, b, kv, kb, nullptr, w.values_t.data());
    w.dk.assign(kTile * h_dim, 0.0f);
    w.dv.assign(kTile * h_dim, 0.0f);
    for (int64_t qb = kb; qb < nb; ++qb) {
      const Seen seen = classify(row_spans[qb], row_spans[kb], qb, kb);
      if (seen == Seen::kNone) continue;
      for (int64_t r = 0; r < rows; ++r) {  // row r: head g = r / kTile, query qb * kTile + r % kTile
        const int64_t n = kv * g_count + r / kTile, t = qb * kTile + r % kTile;
        w.q_rows[r] = q + d.q_at(b, t, n);
        w.do_rows[r] = d_out + d.q_at(b, t, n);
        w.dq_rows[r] = dq_part + ((r / kTile) * d.steps + t) * h_dim;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        float *p = w.probs.data() + r0 * kTile, *ds = w.grads.data() + r0 * kTile;
        products(w.q_rows.data() + r0, w.keys_t.data(), h_dim, scale, p);
        products(w.do_rows.data() + r0, w.values_t.data(), h_dim, 1.0f, ds);  // dP = dO . V
        for (int64_t i = 0; i < kRows; ++i, p += kTile, ds += kTile) {
          const int64_t r = r0 + i, t = qb * kTile + r % kTile;
          const int64_t stats = (b * d.heads + kv * g_count + r / kTile) * d.steps + t;
          if (seen == Seen::kSome) mask_row(seg, end, row, t, kb, p);
          // A query that sees nothing has lse +inf: its probabilities come out 0.
          const float row_lse = lse[stats], row_delta = delta[stats];
          for (int64_t c = 0; c < kTile; c += kLanes) {
            const f8 pc = legorl::fast_exp(load8(p + c) - row_lse);
            store8(p + c, pc);
            store8(ds + c, pc * (load8(ds + c) - row_delta) * scale);  // dS, scaled for q and k
          }
        }
        mix_into(w.grads.data() + r0 * kTile, w.keys.data(), h_dim, w.dq_rows.data() + r0);
      }
      mix_into_tile(w.probs.data(), w.do_rows.data(), rows, h_dim, w.dv.data());
      mix_into_tile(w.grads.data(), w.q_rows.data(), rows, h_dim, w.dk.data());
    }
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t at = d.kv_at(b, kb * kTile + c, kv);
      std::memcpy(dk + at, w.dk.data() + c * h_dim, h_dim * sizeof(float));
      std::memcpy(dv + at, w.dv.data() + c * h_dim, h_dim * sizeof(float));
    }
  }
}

ffi::Error check(const Dims& d, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                 const ffi::Buffer<ffi::S32>& seg, const ffi::Buffer<ffi::S32>& end) {
  const auto kd = k.dimensions(), vd = v.dimensions(), sd = seg.dimensions(), ed = end.dimensions();
  if (kd.size() != 4 || vd.size() != 4 || sd.size() != 2 || ed.size() != 2 || kd[0] != d.batch ||
      kd[1] != d.steps || kd[3] != d.head_dim || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || sd[0] != d.batch || sd[1] != d.steps || ed[0] != d.batch || ed[1] != d.steps) {
    return ffi::Error::InvalidArgument("train_attention: q [B,T,N,H], k/v [B,T,K,H], segment_ids/kv_end [B,T]");
  }
  if (d.kv_heads == 0 || d.heads % d.kv_heads || d.steps % kTile || d.head_dim % 16) {
    return ffi::Error::InvalidArgument("train_attention: heads a multiple of kv heads, T of 64, head_dim of 16");
  }
  return ffi::Error::Success();
}

Dims dims_of(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return Dims{0, 0, 0, 0, 0};
  return Dims{qd[0], qd[1], qd[2], kd[2], qd[3]};
}

ffi::Error forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::S32> end,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const Dims d = dims_of(q, k);
  if (ffi::Error error = check(d, k, v, seg, end); error.failure()) return error;
  const std::vector<Span> all = spans(d, seg.typed_data(), end.typed_data());
  const float *qd = q.typed_data(), *kd = k.typed_data(), *vd = v.typed_data();
  const int32_t *sd = seg.typed_data(), *ed = end.typed_data();
  const Span* span_data = all.data();
  float *od = out->typed_data(), *ld = lse->typed_data();
  const int64_t nb = d.blocks();
  // Late query blocks first: they see the most tiles, so the last items handed out are short.
  legorl::parallel_for(pool, d.batch * d.kv_heads * nb, [=](int64_t item) {
    thread_local ForwardScratch scratch;
    const int64_t qb = nb - 1 - item % nb, pair = item / nb;
    const int64_t b = pair / d.kv_heads, kv = pair % d.kv_heads;
    forward_block(d, qd, kd, vd, sd, ed, span_data + b * nb, b, kv, qb, od, ld, scratch);
  });
  return ffi::Error::Success();
}

ffi::Error backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::S32> end,
                    ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_out,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  const Dims d = dims_of(q, k);
  if (ffi::Error error = check(d, k, v, seg, end); error.failure()) return error;
  const std::vector<Span> all = spans(d, seg.typed_data(), end.typed_data());
  const int64_t nb = d.blocks(), h_dim = d.head_dim, g_count = d.group(), pairs = d.batch * d.kv_heads;
  // D = rowsum(dO * O) per query, [B, N, T].
  std::vector<float> delta(d.batch * d.heads * d.steps);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < d.steps; ++t)
      for (int64_t n = 0; n < d.heads; ++n) {
        const float *o = out.typed_data() + d.q_at(b, t, n), *g = d_out.typed_data() + d.q_at(b, t, n);
        float sum = 0.0f;
        for (int64_t h = 0; h < h_dim; ++h) sum += o[h] * g[h];
        delta[(b * d.heads + n) * d.steps + t] = sum;
      }
  // Enough parts per (row, kv head) to keep every thread busy; each part has its own dQ buffer.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t parts = std::min<int64_t>(nb, (threads + pairs - 1) / pairs);
  const int64_t part_floats = g_count * d.steps * h_dim;
  std::vector<float> dq_parts(pairs * parts * part_floats, 0.0f);
  const float *qd = q.typed_data(), *kd = k.typed_data(), *vd = v.typed_data(), *dod = d_out.typed_data();
  const float *ld = lse.typed_data(), *dd = delta.data();
  const int32_t *sd = seg.typed_data(), *ed = end.typed_data();
  const Span* span_data = all.data();
  float *dqp = dq_parts.data(), *dkd = dk->typed_data(), *dvd = dv->typed_data();
  legorl::parallel_for(pool, pairs * parts, [=](int64_t item) {
    thread_local BackwardScratch scratch;
    const int64_t pair = item / parts, part = item % parts, b = pair / d.kv_heads, kv = pair % d.kv_heads;
    backward_part(d, qd, kd, vd, sd, ed, span_data + b * nb, dod, ld, dd, b, kv, part, parts,
                  dqp + item * part_floats, dkd, dvd, scratch);
  });
  float* dqd = dq->typed_data();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / d.kv_heads, kv = pair % d.kv_heads;
    for (int64_t g = 0; g < g_count; ++g)
      for (int64_t t = 0; t < d.steps; ++t) {
        float* dst = dqd + d.q_at(b, t, kv * g_count + g);
        std::memset(dst, 0, h_dim * sizeof(float));
        for (int64_t part = 0; part < parts; ++part) {
          const float* src = dqp + (pair * parts + part) * part_floats + (g * d.steps + t) * h_dim;
#pragma omp simd
          for (int64_t h = 0; h < h_dim; ++h) dst[h] += src[h];
        }
      }
  }
  return ffi::Error::Success();
}

}  // namespace

// Both calls take the thread pool, q, k, v, segment_ids and kv_end first.
static auto row_inputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LegorlTrainAttentionForward, forward,
                              row_inputs().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

// Then out, lse and dO.
XLA_FFI_DEFINE_HANDLER_SYMBOL(LegorlTrainAttentionBackward, backward,
                              row_inputs()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
