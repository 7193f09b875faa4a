// A decode step's products on CPU, as an XLA FFI call: y[M, N] = x[M, K] W[N, K]^T
// for the few rows M of a decode step, W in HF's [out, in] layout.
//
// At a few rows each weight element is used M times, so the product is bound
// by reading W; XLA's CPU dot reads it well below the memory system's speed
// at these shapes. Here each thread streams whole rows of W (contiguous, as
// stored), two at a time, against up to kRows rows of x held in cache, and the
// output columns are shared between the caller and XLA's intra-op pool. The
// LM head ([V, D] embedding) is the same product.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Lanes of one vector register and rows of x per pass: 2 x kRows accumulators
// plus two weight vectors fit the register file (32 with AVX-512, 16 without).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 8;
#else
constexpr int kLanes = 8;
constexpr int kRows = 4;
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

// Columns n and n + 1 (when two) of R rows of y: the weight rows are read once, from memory.
template <int R>
void columns(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n, bool two) {
  const float* w0 = w + n * K;
  const float* w1 = two ? w0 + K : w0;
  Vec a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = Vec{};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    __builtin_prefetch(w0 + k + 256);
    __builtin_prefetch(w1 + k + 256);
    const Vec v0 = load(w0 + k), v1 = load(w1 + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = load(x + r * K + k);
      a0[r] += xv * v0;
      a1[r] += xv * v1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float s0, s1;
    totals(a0[r], a1[r], s0, s1);
    for (int64_t k = body; k < K; ++k) {
      s0 += x[r * K + k] * w0[k];
      s1 += x[r * K + k] * w1[k];
    }
    y[r * N + n] = s0;
    if (two) y[r * N + n + 1] = s1;
  }
}

using ColumnsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, bool);

#if defined(__AVX512F__)
constexpr ColumnsFn kByRows[kRows + 1] = {nullptr,    columns<1>, columns<2>, columns<3>, columns<4>,
                                          columns<5>, columns<6>, columns<7>, columns<8>};
#else
constexpr ColumnsFn kByRows[kRows + 1] = {nullptr, columns<1>, columns<2>, columns<3>, columns<4>};
#endif

// Columns [n0, n1) of all M rows, kRows rows of x at a time (they stay in L1):
// the first pass reads the tile's weights from memory, later passes from L2.
void tile(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += kRows) {
    const ColumnsFn columns_of = kByRows[std::min<int64_t>(kRows, M - m)];
    for (int64_t n = n0; n < n1; n += 2) columns_of(x + m * K, w, y + m * N, K, N, n, n + 1 < n1);
  }
}

ffi::Error decode_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("decode_matmul: x [M, K], w [N, K] and y [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.0f);
    return ffi::Error::Success();
  }
  // Even column tiles, about four per thread (a thread that starts late costs
  // little), of at most 256 KB of weights, so that later row passes find them in L2.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t fit = (256 << 10) / (K * int64_t{sizeof(float)});
  const int64_t width = std::max<int64_t>(2, std::min(N / (4 * threads), fit) & ~int64_t{1});
  legorl::parallel_for(pool, (N + width - 1) / width, [=](int64_t t) {
    tile(xp, wp, yp, M, K, N, t * width, std::min(N, t * width + width));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LegorlDecodeMatmul, decode_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
