// Decode attention over the paged KV pool: one query row per sequence, keys and values read in
// place through the sequence's block table (no gather), every (row, kv head) computed start to
// finish by one thread in a fixed order, so a row's result never depends on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fast_math.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;

// Eight floats: the 16 lanes of a dot product are two of them, a value row's 64 dims eight. The
// arithmetic below is that of a plain loop over 16 lanes, lane by lane, in the same order (the
// build keeps products and sums apart: no FMA), held in registers instead of a stack array.
using vec::load8, vec::v8;
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

// lanes[l] += q[d + l] * k[d + l] over d in steps of 16, then lanes[l] += lanes[l + w] for
// w = 8, 4, 2, 1, then the tail: one float, the same bits as that loop.
template <int DIM, typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  const int64_t n = DIM > 0 ? DIM : dim;
  v8 lo = {}, hi = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    lo += load8(q + d) * load8(k + d);
    hi += load8(q + d + 8) * load8(k + d + 8);
  }
  float tail = 0.f;
  for (; d < n; ++d) tail += q[d] * static_cast<float>(k[d]);
  const v8 w8 = lo + hi;
  const v4 w4 = __builtin_shufflevector(w8, w8, 0, 1, 2, 3) + __builtin_shufflevector(w8, w8, 4, 5, 6, 7);
  const float a = w4[0] + w4[2], b = w4[1] + w4[3];
  return (a + b) + tail;
}

// acc[d] += p[t] * v[t][d] for t in [0, tokens), d in [0, DIM): per element the same sums in
// the same order as one axpy per token, the DIM accumulators held in registers for all tokens.
template <int DIM, typename T>
inline void axpy_tokens(const float* p, const T* v, int64_t stride, int64_t tokens, float* acc) {
  static_assert(DIM % 8 == 0 && DIM <= 128, "a head size the registers hold");
  v8 sums[DIM / 8];
  for (int c = 0; c < DIM / 8; ++c) sums[c] = load8(acc + 8 * c);
  for (int64_t t = 0; t < tokens; ++t, v += stride) {
    v8 pt;
    for (int i = 0; i < 8; ++i) pt[i] = p[t];
    for (int c = 0; c < DIM / 8; ++c) sums[c] += pt * load8(v + 8 * c);
  }
  std::memcpy(acc, sums, sizeof sums);
}

template <int DIM, typename T>
inline void axpy(float p, const T* v, float* acc, int64_t dim) {
  const int64_t n = DIM > 0 ? DIM : dim;
  for (int64_t d = 0; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

struct Shape {
  int64_t heads, kv_heads, dim, max_blocks, block_size, q_row_stride, grain, window;
};

// One (sequence, kv head): scores of its `group` query heads over the context (its last
// `window` positions when the layer has a sliding window), softmax, then the weighted sum of
// values, walking the block table block by block.
template <int DIM, typename T>
void attend_one(const float* query, const T* keys, const T* values, const int64_t* table, int64_t length,
                int64_t kv_head, const Shape& s, std::vector<float>& scores, float* acc) {
  const int64_t group = s.heads / s.kv_heads, dim = DIM > 0 ? DIM : s.dim, stride = s.kv_heads * dim;
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, length - s.window) : 0, n = length - first;
  scores.resize(group * n);
  for (int64_t b = first / s.block_size; b * s.block_size < length; ++b) {
    const int64_t start = std::max(b * s.block_size, first), stop = std::min((b + 1) * s.block_size, length);
    const T* key = keys + (table[b] * s.block_size + start - b * s.block_size) * stride + kv_head * dim;
    for (int64_t t = start; t < stop; ++t, key += stride)
      for (int64_t g = 0; g < group; ++g) scores[g * n + t - first] = dot<DIM>(query + g * dim, key, dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores.data() + g * n;
    const float top = *std::max_element(sc, sc + n);
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) sc[t] = fast_exp(sc[t] - top);
    for (int64_t t = 0; t < n; ++t) total += sc[t];
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t b = first / s.block_size; b * s.block_size < length; ++b) {
    const int64_t start = std::max(b * s.block_size, first), stop = std::min((b + 1) * s.block_size, length);
    const T* value = values + (table[b] * s.block_size + start - b * s.block_size) * stride + kv_head * dim;
    if constexpr (DIM > 0) {
      for (int64_t g = 0; g < group; ++g)
        axpy_tokens<DIM>(scores.data() + g * n + start - first, value, stride, stop - start, acc + g * dim);
      continue;
    }
    for (int64_t t = start; t < stop; ++t, value += stride)
      for (int64_t g = 0; g < group; ++g) axpy<DIM>(scores[g * n + t - first], value, acc + g * dim, dim);
  }
}

template <int DIM, typename T>
void attend(const T* q, const T* keys, const T* values, const int64_t* tables, const int64_t* lengths,
            const int64_t* rows, T* out, int64_t num_rows, const Shape& s, float scale) {
  const int64_t group = s.heads / s.kv_heads;
  at::parallel_for(0, num_rows * s.kv_heads, s.grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * s.dim), scores, acc(group * s.dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, kv_head = item % s.kv_heads;
      const int64_t offset = (rows[seq] * s.heads + kv_head * group) * s.dim;
      const T* row_q = q + rows[seq] * s.q_row_stride + kv_head * group * s.dim;
      for (int64_t i = 0; i < group * s.dim; ++i) query[i] = static_cast<float>(row_q[i]) * scale;
      attend_one<DIM>(query.data(), keys, values, tables + seq * s.max_blocks, lengths[seq], kv_head, s, scores,
                      acc.data());
      for (int64_t i = 0; i < group * s.dim; ++i) out[offset + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q, out: [total_rows, heads, dim] (q may be a view with a row stride: q of the fused q|k|v);
// keys, values: [slots, kv_heads, dim] (one layer of the pool);
// tables: int64 [n, max_blocks]; lengths, rows: int64 [n]. Writes out[rows[i]] for each i.
// window > 0: each row attends to its last `window` positions only (a sliding-window layer).
void decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                      torch::Tensor lengths, torch::Tensor rows, torch::Tensor out, int64_t block_size,
                      double scale, int64_t window) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && out.is_contiguous() && q.dim() == 3 &&
              q.stride(2) == 1 && q.stride(1) == q.size(2) && out.sizes() == q.sizes(),
              "decode_attention: contiguous tensors (q: contiguous heads) only");
  TORCH_CHECK(tables.is_contiguous() && tables.scalar_type() == torch::kInt64 &&
              lengths.scalar_type() == torch::kInt64 && rows.scalar_type() == torch::kInt64,
              "decode_attention: int64 tables, lengths and rows");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == out.scalar_type() &&
              values.scalar_type() == keys.scalar_type(), "decode_attention: q, the pool and out must share a dtype");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && block_size > 0 && keys.size(1) > 0,
              "decode_attention: keys and values [slots, kv_heads, dim], block_size > 0");
  TORCH_CHECK(lengths.is_contiguous() && rows.is_contiguous() && lengths.dim() == 1 && rows.dim() == 1,
              "decode_attention: lengths and rows are 1-d");
  const int64_t heads = q.size(1), kv_heads = keys.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(2) == dim, "decode_attention: head shapes");
  TORCH_CHECK(tables.size(0) == lengths.size(0) && rows.size(0) == lengths.size(0), "decode_attention: one table per row");
  const int64_t blocks = keys.size(0) / block_size, width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  int64_t tokens = 0;
  for (int64_t i = 0; i < lengths.size(0); ++i) {
    const int64_t length = lengths.data_ptr<int64_t>()[i], row = rows.data_ptr<int64_t>()[i];
    tokens += length;
    TORCH_CHECK(length >= 1 && length <= width * block_size, "decode_attention: context longer than its table");
    TORCH_CHECK(row >= 0 && row < q.size(0), "decode_attention: row out of range");
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && table[i * width + b] < blocks, "decode_attention: block out of range");
  }
  // A few thousand keys are less work than waking the other threads: run those on this one.
  const int64_t items = lengths.size(0) * kv_heads, grain = tokens * kv_heads < 4096 ? std::max<int64_t>(items, 1) : 1;
  const Shape shape{heads, kv_heads, dim, width, block_size, q.stride(0), grain, window};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), lengths.size(0), shape, static_cast<float>(scale));
    };
    if (dim == 64) run(attend<64, scalar_t>);
    else if (dim == 128) run(attend<128, scalar_t>);
    else run(attend<0, scalar_t>);
  });
}
