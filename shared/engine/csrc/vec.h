// One float vector of the machine's width (GCC vector types: 16 lanes with AVX-512, 8 with AVX2
// and narrower) and its loads, for the GEMM-like loops of the kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace vec {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

// Kept in a register once loaded: without this GCC folds the load into every FMA that uses the
// value, and a loop of register blocks waits on loads (x86 issues fewer wide loads than FMAs
// per cycle).
inline vf hold(vf v) {
#if defined(__x86_64__)
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
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

}  // namespace vec
