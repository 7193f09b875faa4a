// Small math shared by the CPU kernels.

#ifndef LEGORL_CPU_MATH_H_
#define LEGORL_CPU_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace legorl {

// exp for x <= 0, inline and branch-free instead of a libm call per score
// (a profile shows this loop at a few percent of the kernel). 2^n * e^r with |r| <= ln2 / 2, a degree-6 polynomial:
// relative error ~2e-7. Below -87 it returns 0 (so does -inf).
// e^r for |r| <= ln2 / 2: a degree-6 polynomial, on a float or a vector of floats.
template <typename T>
inline T exp_polynomial(T r) {
  T p = r * 0.0f + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

inline float fast_exp(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float p = exp_polynomial(clamped - n * 0.693359375f + n * 2.12194440e-4f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Eight floats in a vector register (GCC's vector extension: AVX2 or whatever the target has).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 splat(float x) { return f8{} + x; }

// fast_exp on eight lanes. Rounds to the nearest integer by adding and taking away 1.5 * 2^23,
// which needs no rounding instruction.
inline f8 fast_exp(f8 x) {
  const f8 clamped = x < -87.0f ? splat(-87.0f) : x;
  const f8 n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const f8 p = exp_polynomial(clamped - n * 0.693359375f + n * 2.12194440e-4f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  return x < -87.0f ? splat(0.0f) : p * reinterpret_cast<const f8&>(bits);
}

}  // namespace legorl

#endif  // LEGORL_CPU_MATH_H_
