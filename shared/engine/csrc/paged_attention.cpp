// Decode attention over the paged KV pool: one query row per sequence, keys and values read in
// place through the sequence's block table (no gather), every (row, kv head) computed start to
// finish by one thread in a fixed order, so a row's result never depends on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += q[d + l] * static_cast<float>(k[d + l]);
  float sum = 0.f;
  for (; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0] + sum;
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction and a degree-6
// polynomial, branch-free so the loop vectorizes; within ~2 ulp of std::exp, deterministic.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
void attend(const T* q, const T* keys, const T* values, const int64_t* tables, const int64_t* lengths,
            const int64_t* rows, T* out, int64_t num_rows, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, num_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), scores, acc(group * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, kv_head = item % kv_heads, row = rows[seq];
      const int64_t length = lengths[seq];
      const int64_t* table = tables + seq * max_blocks;
      for (int64_t i = 0; i < group * dim; ++i)
        query[i] = static_cast<float>(q[(row * heads + kv_head * group) * dim + i]) * scale;
      scores.assign(group * length, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* key = keys + (slot * kv_heads + kv_head) * dim;
        for (int64_t g = 0; g < group; ++g) scores[g * length + t] = dot(query.data() + g * dim, key, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        const float top = *std::max_element(s, s + length);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) s[t] = exp_nonpositive(s[t] - top);
        for (int64_t t = 0; t < length; ++t) total += s[t];
        const float inv = 1.f / total;
        for (int64_t t = 0; t < length; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* value = values + (slot * kv_heads + kv_head) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          float* a = acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t i = 0; i < group * dim; ++i)
        out[(row * heads + kv_head * group) * dim + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q, out: [total_rows, heads, dim]; keys, values: [slots, kv_heads, dim] (one layer of the pool);
// tables: int64 [n, max_blocks]; lengths, rows: int64 [n]. Writes out[rows[i]] for each i.
void decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                      torch::Tensor lengths, torch::Tensor rows, torch::Tensor out, int64_t block_size,
                      double scale) {
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous() && out.is_contiguous(),
              "decode_attention: contiguous tensors only");
  TORCH_CHECK(tables.is_contiguous() && tables.scalar_type() == torch::kInt64 &&
              lengths.scalar_type() == torch::kInt64 && rows.scalar_type() == torch::kInt64,
              "decode_attention: int64 tables, lengths and rows");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == out.scalar_type(),
              "decode_attention: q, the pool and out must share a dtype");
  const int64_t heads = q.size(1), kv_heads = keys.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(2) == dim, "decode_attention: head shapes");
  TORCH_CHECK(tables.size(0) == lengths.size(0) && rows.size(0) == lengths.size(0), "decode_attention: one table per row");
  const int64_t blocks = keys.size(0) / block_size, width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < lengths.size(0); ++i) {
    const int64_t length = lengths.data_ptr<int64_t>()[i], row = rows.data_ptr<int64_t>()[i];
    TORCH_CHECK(length >= 1 && length <= width * block_size, "decode_attention: context longer than its table");
    TORCH_CHECK(row >= 0 && row < q.size(0), "decode_attention: row out of range");
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && table[i * width + b] < blocks, "decode_attention: block out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), lengths.size(0), heads, kv_heads, dim, tables.size(1),
                     block_size, static_cast<float>(scale));
  });
}
