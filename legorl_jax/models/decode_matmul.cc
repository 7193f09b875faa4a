// A decode step's products on CPU, as an XLA FFI call: y[M, N] = x[M, K] W[N, K]^T
// for the few rows M of a decode step, W in HF's [out, in] layout.
//
// At a few rows each weight element is used M times, so the product is bound
// by reading W; XLA's CPU dot reads it well below the memory system's speed
// at these shapes. Here each thread streams whole rows of W (contiguous, as
// stored), a few side by side, against a few rows of x held in registers, and
// runs of column tiles are shared between the caller and XLA's intra-op pool.
// Past a few rows (32 in a full decode step) the product is bound by the FMAs
// instead, so it takes wider register blocks, and while it works on a tile
// from L2 it brings the next tile in from memory. The LM head ([V, D]
// embedding) is the same product.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Lanes of one vector register, and the register blocks: C weight rows
// (output columns) by R rows of x take C x R accumulators, C weight vectors
// and one x vector, within the register file (32 with AVX-512, 16 without).
// Up to kNarrowRows rows the product is bound by reading W, and 2 x 8 reads
// it in the fewest passes; past that it is bound by the FMAs, and 4 x 6 does
// 24 of them per 10 loads where 2 x 8 does 16.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kNarrowCols = 2, kNarrowRows = 8;
constexpr int kWideCols = 4, kWideRows = 6;
#else
constexpr int kLanes = 8;
constexpr int kNarrowCols = 2, kNarrowRows = 4;
constexpr int kWideCols = 2, kWideRows = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned load
  return v;
}

typedef int IVec __attribute__((vector_size(kLanes * sizeof(int))));

// The lane totals of a and b in a few shuffles (a sum lane by lane would be
// a chain of scalar adds, a large part of a short product's time): fold the
// halves of a and b into one vector, then swap and add lanes until each half
// holds one total.
inline void totals(Vec a, Vec b, float& sa, float& sb) {
#if defined(__AVX512F__)
  const IVec low = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const IVec high = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const IVec swaps[] = {{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                        {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                        {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#else
  const IVec low = {0, 1, 2, 3, 8, 9, 10, 11};
  const IVec high = {4, 5, 6, 7, 12, 13, 14, 15};
  const IVec swaps[] = {{2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#endif
  Vec v = __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
  for (const IVec& swap : swaps) v += __builtin_shuffle(v, swap);
  sa = v[0];
  sb = v[kLanes / 2];
}

// A run of cache lines to bring into L2 a line at a time, spread through a block's loop.
struct Lookahead {
  const char* next;
  const char* end;
};

// Columns n .. n + C - 1 of R rows of y: the C weight rows are read once, side by side.
template <int C, int R>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n, Lookahead& ahead) {
  const float* wc[C];
  for (int c = 0; c < C; ++c) wc[c] = w + (n + c) * K;
  Vec acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = Vec{};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    Vec v[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(wc[c] + k + 256);
      v[c] = load(wc[c] + k);
    }
    if (ahead.next < ahead.end) {
      __builtin_prefetch(ahead.next, 0, 2);
      ahead.next += 64;
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[c][r] += xv * v[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; c += 2) {
      const int d = c + 1 < C ? c + 1 : c;  // an odd C sums its last column twice and keeps one
      float s0, s1;
      totals(acc[c][r], acc[d][r], s0, s1);
      for (int64_t k = body; k < K; ++k) {
        s0 += x[r * K + k] * wc[c][k];
        s1 += x[r * K + k] * wc[d][k];
      }
      y[r * N + n + c] = s0;
      y[r * N + n + d] = s1;
    }
  }
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, Lookahead&);

// block<C, R> for R = 1 .. sizeof(Rs), indexed by R.
template <int C, int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs) + 1> by_rows(std::integer_sequence<int, Rs...>) {
  return {nullptr, block<C, Rs + 1>...};
}
constexpr auto kNarrow = by_rows<kNarrowCols>(std::make_integer_sequence<int, kNarrowRows>());
constexpr auto kWide = by_rows<kWideCols>(std::make_integer_sequence<int, kWideRows>());
constexpr auto kSingle = by_rows<1>(std::make_integer_sequence<int, std::max(kNarrowRows, kWideRows)>());

// Columns [n0, n1) of all M rows, a register block's rows of x at a time (they
// stay in L1): the first pass reads the tile's weights from memory, later passes
// from L2. Later passes also bring the weights of columns [n1, n2), the
// caller's next tile, into L2, so its first pass does not wait on memory.
// Passes take even shares of the rows: 32 rows run as 6, 6, 5, 5, 5, 5, not
// five of 6 and one of 2, whose blocks do half the FMAs per load.
void tile(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
          int64_t n2) {
  const bool wide = M > kNarrowRows;
  const int most = wide ? kWideRows : kNarrowRows, cols = wide ? kWideCols : kNarrowCols;
  const int64_t passes = (M + most - 1) / most;
  const int64_t bytes = (n2 - n1) * K * int64_t{sizeof(float)};
  const char* next = reinterpret_cast<const char*>(w + n1 * K);
  const int64_t share = passes > 1 ? (bytes + passes - 2) / (passes - 1) : 0;
  Lookahead ahead{next, next};
  for (int64_t m = 0, pass = 0; pass < passes; ++pass) {
    if (pass > 0) ahead.end = next + std::min(pass * share, bytes);
    const int64_t r = M / passes + (pass < M % passes ? 1 : 0);
    const BlockFn blocks_of = wide ? kWide[r] : kNarrow[r];
    int64_t n = n0;
    for (; n + cols <= n1; n += cols) blocks_of(x + m * K, w, y + m * N, K, N, n, ahead);
    for (; n < n1; ++n) kSingle[r](x + m * K, w, y + m * N, K, N, n, ahead);
    m += r;
  }
}

// w is one weight [N, K] or a stack of them [L, N, K], of which layer[0] is read
// in place: a step scanning its layers passes every layer's weights whole, and
// slicing one layer out would copy it on every step.
ffi::Error decode_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || (r == 3 && wd[0] < 1) || layer.element_count() != 1 ||
      yd.size() != 2 || xd[1] != wd[r - 1] || yd[0] != xd[0] || yd[1] != wd[r - 2]) {
    return ffi::Error::InvalidArgument("decode_matmul: x [M, K], w [N, K] or [L, N, K], layer [1] and y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[r - 2];
  const int64_t layers = r == 3 ? wd[0] : 1;
  // Clamped as XLA clamps a dynamic index: never a read outside the stack.
  const int64_t at = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), layers - 1);
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + at * N * K;
  float* yp = y->typed_data();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.0f);
    return ffi::Error::Success();
  }
  // Even column tiles of at most 256 KB of weights, so that later row passes
  // find them in L2, in about four work items per thread (a thread that starts
  // late costs little). An item is a run of consecutive tiles, so each tile
  // knows the next one its thread will read.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t fit = (256 << 10) / (K * int64_t{sizeof(float)});
  const int64_t width = std::max<int64_t>(4, std::min(N / (4 * threads), fit) & ~int64_t{3});
  const int64_t tiles = (N + width - 1) / width;
  const int64_t per_item = (tiles + 4 * threads - 1) / (4 * threads);
  legorl::parallel_for(pool, (tiles + per_item - 1) / per_item, [=](int64_t item) {
    const int64_t last = std::min(tiles, item * per_item + per_item);
    for (int64_t t = item * per_item; t < last; ++t) {
      const int64_t n0 = t * width, n1 = std::min(N, n0 + width);
      tile(xp, wp, yp, M, K, N, n0, n1, t + 1 < last ? std::min(N, n1 + width) : n1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LegorlDecodeMatmul, decode_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
