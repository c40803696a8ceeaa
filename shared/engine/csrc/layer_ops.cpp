// The elementwise work between a layer's GEMMs, one pass each instead of several torch ops:
// residual add + RMSNorm, rotary embedding (in place), the KV write. Each computes what the
// Hugging Face Llama modules compute, rounding to the tensor dtype where they round, and each
// row on its own, so a row's result does not depend on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "vec.h"
#include "pool_layer.h"

namespace {

using vec::bf16_round8, vec::load8, vec::store8, vec::v8;

constexpr int kLanes = 16;

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

template <typename T>
void add_rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden,
                       float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* h = residual + r * hidden;
      if (delta != nullptr)
        for (int64_t i = 0; i < hidden; ++i) h[i] = static_cast<T>(f(h[i]) + f(delta[r * hidden + i]));
      float lanes[kLanes] = {0};
      int64_t i = 0;
      for (; i + kLanes <= hidden; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += f(h[i + l]) * f(h[i + l]);
      float tail = 0.f;
      for (; i < hidden; ++i) tail += f(h[i]) * f(h[i]);
      for (int width = kLanes / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      const float inv = 1.f / std::sqrt((lanes[0] + tail) / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t j = 0; j < hidden; ++j) o[j] = static_cast<T>(f(weight[j]) * f(static_cast<T>(f(h[j]) * inv)));
    }
  });
}

// One head rotated in place: x * cos + rotate_half(x) * sin, each product and the sum rounded
// to T as torch does them one op at a time (the build turns FMA contraction off).
template <typename T>
void rope_head(T* v, const T* c, const T* s, int64_t half) {
  int64_t d = 0;
  // bf16 eight at a time in registers (the plain loop with c10's rounding does not vectorize: 3x
  // slower); float32 and fp16 through the plain loop, which GCC vectorizes at the machine's width.
  if constexpr (std::is_same_v<T, at::BFloat16>)
    for (; d + 8 <= half; d += 8) {
      const v8 x1 = load8(v + d), x2 = load8(v + d + half);
      const v8 a1 = bf16_round8(x1 * load8(c + d)), b1 = bf16_round8(-x2 * load8(s + d));
      const v8 a2 = bf16_round8(x2 * load8(c + d + half)), b2 = bf16_round8(x1 * load8(s + d + half));
      store8(v + d, a1 + b1);
      store8(v + d + half, a2 + b2);
    }
  for (; d < half; ++d) {
    const float x1 = f(v[d]), x2 = f(v[d + half]);
    const T a1 = static_cast<T>(x1 * f(c[d])), b1 = static_cast<T>(-x2 * f(s[d]));
    const T a2 = static_cast<T>(x2 * f(c[d + half])), b2 = static_cast<T>(x1 * f(s[d + half]));
    v[d] = static_cast<T>(f(a1) + f(b1));
    v[d + half] = static_cast<T>(f(a2) + f(b2));
  }
}

// x[r, head, :] rotated in place for every row and head.
template <typename T>
void rope_rows(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, int64_t head_stride,
               const T* cos, const T* sin) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t head = 0; head < heads; ++head)
        rope_head(x + r * row_stride + head * head_stride, cos + r * dim, sin + r * dim, dim / 2);
  });
}

}  // namespace

// residual += delta (if given, in place); returns weight * RMSNorm(residual).
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && weight.is_contiguous(), "add_rms_norm: shapes");
  TORCH_CHECK(weight.size(0) == residual.size(1) && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: weight");
  if (delta.has_value())
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == residual.sizes() &&
                delta->scalar_type() == residual.scalar_type(), "add_rms_norm: delta");
  auto out = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), residual.size(0),
                                residual.size(1), static_cast<float>(eps));
  });
  return out;
}

// q [rows, heads, dim] and k [rows, kv_heads, dim] (views with contiguous heads) rotated in place.
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(), "rope_: cos/sin");
  for (auto* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == cos.size(0) && x->size(2) == cos.size(1) &&
                x->size(2) % 2 == 0 && x->scalar_type() == cos.scalar_type(), "rope_: q/k shapes");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x->scalar_type(), "rope_", [&] {
      rope_rows<scalar_t>(x->data_ptr<scalar_t>(), x->size(0), x->size(1), x->size(2), x->stride(0), x->stride(1),
                          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
    });
  }
}

// Writes rows k[i], v[i] ([n, kv_heads, dim] views, contiguous heads) into slot slots[i] of one
// layer of the pool: keys, values [blocks, block_size, kv_heads, dim] (see pool_layer.h).
void store_kv(torch::Tensor keys, torch::Tensor values, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(keys.dim() == 4, "store_kv: keys and values [blocks, block_size, kv_heads, dim]");
  const int64_t block_size = keys.size(1);
  const PoolLayer pool = pool_layer(keys, values, block_size, "store_kv");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == torch::kInt64, "store_kv: int64 slots");
  const int64_t n = slots.size(0), width = pool.row, capacity = pool.blocks * block_size;
  for (auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) >= n && x->size(1) * x->size(2) == width && x->stride(2) == 1 &&
                x->stride(1) == x->size(2) && x->scalar_type() == keys.scalar_type(), "store_kv: k/v shapes");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "store_kv: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "store_kv", [&] {
    scalar_t* kd = keys.data_ptr<scalar_t>();
    scalar_t* vd = values.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = pool.at_slot(slot[i], block_size);
      std::copy(kp + i * k.stride(0), kp + i * k.stride(0) + width, kd + at);
      std::copy(vp + i * v.stride(0), vp + i * v.stride(0) + width, vd + at);
    }
  });
}
