// One float vector of the machine's width (GCC vector types: 16 lanes with AVX-512, 8 with AVX2
// and narrower) and its loads, for the GEMM-like loops of the kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace vec {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

// Kept in a register once loaded: without this GCC folds the load into every FMA that uses the
// value, and a loop of register blocks waits on loads (x86 issues fewer wide loads than FMAs
// per cycle). (Without AVX a vector of 8 floats spans two registers, which no constraint names.)
inline vf hold(vf v) {
#if defined(__x86_64__) && defined(__AVX__)
  asm("" : "+v"(v));
#endif
  return v;
}
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load_held(const float* p) { return hold(load(p)); }
// kLanes elements of a tensor's dtype as floats: float32 loaded, other types one by one (bfloat16
// goes through widen_pairs).
inline vf widen(const float* p) { return load(p); }
template <typename T>
inline vf widen(const T* p) {
  vf v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
// 2 * kLanes bfloat16 read as kLanes 32-bit words: the words' low halves shifted up (the even
// elements) and their high halves masked (the odd ones), two exact float vectors from one load.
inline void widen_pairs(const void* p, vf& even, vf& odd) {
  typedef uint32_t uv __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  uv u;
  std::memcpy(&u, p, sizeof u);  // little-endian: element 2j is word j's low half
  const uv lo = u << 16, hi = u & 0xFFFF0000u;
  std::memcpy(&even, &lo, sizeof lo);
  std::memcpy(&odd, &hi, sizeof hi);
}
// The lanes' sum: halves added, then halves of those, down to one.
inline float lane_sum(vf v) {
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
#if defined(__AVX512F__)
  typedef float v8h __attribute__((vector_size(8 * sizeof(float))));
  const v8h h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf h = v;
#endif
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// One value in every lane: a broadcast load (`vf{} + s` adds 0 to s first, an addition GCC
// must keep for -0.0, and a lane-by-lane build is compiled as ~8 inserts).
inline vf splat(const float* s) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*s);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(*s);
#else
  return vf{} + *s;
#endif
}

// Eight lanes whatever the machine's width, and bfloat16 (its 16 bits, uint16_t) to and from
// float32 eight at a time.
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t u8 __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef uint16_t h8 __attribute__((vector_size(8 * sizeof(uint16_t))));

// Exact: the 16 bits become the float's high half.
inline v8 bf16_load8(const void* p) {
  h8 h;
  std::memcpy(&h, p, sizeof h);
  const u8 u = __builtin_convertvector(h, u8) << 16;
  v8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// To nearest even, a NaN to the quiet 0x7FC0: c10::BFloat16's rounding, lane by lane.
inline uint32_t bf16_round1(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// v rounded to bfloat16 (c10's rounding, lane by lane), back in float32 (exact): the value a
// bfloat16 tensor would hold, without leaving the registers.
inline v8 bf16_round8(v8 v) {
  u8 u;
  std::memcpy(&u, &v, sizeof u);
  const u8 nan = (u8)((u & 0x7FFFFFFFu) > 0x7F800000u);  // all ones in a NaN's lane
  const u8 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const u8 bits = (rounded & ~nan) | (nan & 0x7FC00000u);
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// The rounded values' 16 bits.
inline void bf16_store8(uint16_t* p, v8 v) {
  u8 u;
  const v8 r = bf16_round8(v);
  std::memcpy(&u, &r, sizeof u);
  const h8 h = __builtin_convertvector(u >> 16, h8);
  std::memcpy(p, &h, sizeof h);
}

// Eight elements of a tensor's dtype as floats (float32 and bfloat16 in registers, other types
// one by one), and bfloat16's back, for the elementwise kernels.
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 load8(const c10::BFloat16* p) { return bf16_load8(p); }
template <typename T>
inline v8 load8(const T* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline void store8(c10::BFloat16* p, v8 v) { bf16_store8(reinterpret_cast<uint16_t*>(p), v); }

inline void bf16_widen(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = bf16_load8(src + i);
    std::memcpy(dst + i, &v, sizeof v);
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof bits);
  }
}
inline void bf16_round(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 v;
    std::memcpy(&v, src + i, sizeof v);
    bf16_store8(dst + i, v);
  }
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof bits);
    dst[i] = static_cast<uint16_t>(bf16_round1(bits));
  }
}

}  // namespace vec
