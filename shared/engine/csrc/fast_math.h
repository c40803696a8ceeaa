// exp for the kernels: Cody-Waite range reduction and a degree-6 polynomial, branch-free so
// loops over it vectorize; within ~2 ulp of std::exp, and deterministic.
#pragma once

#include <cstdint>

inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n as bits; n <= 127 after the clamp, and n = 128 (x near 88.7) is cut off by it.
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
