// Decode attention over the paged KV pool: one query row per sequence, keys and values read in
// place through the sequence's block table (no gather), every (row, kv head) computed start to
// finish by one thread in a fixed order, so a row's result never depends on the other rows.
//
// A step's contexts are read from memory once per layer (at 32 streams of ~70 tokens, SmolLM2's
// fp32 KV is 3.5 MB a layer): the work items are whole sequences, a block's pool rows read whole
// for all their kv heads, with the next block prefetched while one is computed on; with fewer
// sequences than the threads can share, a sequence's kv heads are split between items. Scores
// are dot products of kLanes-wide FMA chains, values summed with the head's dims in registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fast_math.h"
#include "pool_layer.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA: every row's chains alike

namespace {

using vec::kLanes, vec::vf;

// Under this many (key, kv head) pairs in a call, waking the other threads costs more than it saves.
constexpr int64_t kAlone = 256;

// bf16 rows are read as 32-bit words, two values each (vec::widen_pairs): a chunk of 2 * kLanes
// gives its even elements in one vector and its odd ones in the other, a load, a shift and a mask
// (not two widening loads and two shifts). Queries are laid out and sums kept in that order,
// and put back in order on the way out: element d of a head sits at paired(d).
template <int DIM, typename T>
constexpr bool kPaired = DIM > 0 && std::is_same_v<T, c10::BFloat16>;
inline int64_t paired(int64_t d) {
  const int64_t j = d % (2 * kLanes);
  return d - j + j % 2 * kLanes + j / 2;
}
template <int DIM, typename T>
inline void widen2(const T* p, vf& a, vf& b) {
  if constexpr (kPaired<DIM, T>) {
    vec::widen_pairs(p, a, b);
  } else {
    a = vec::widen(p);
    b = vec::widen(p + kLanes);
  }
}

// One row of DIM values and its query: sum over the DIM / kLanes vectors of their lane products
// (one FMA chain), then the lanes (lane_sum's tree).
template <int DIM, typename T>
inline float dot(const float* q, const T* k) {
  static_assert(DIM % (2 * kLanes) == 0, "whole pairs of vectors");
  vf a, b;
  widen2<DIM>(k, a, b);
  vf p = vec::load(q) * a;
  p += vec::load(q + kLanes) * b;
  for (int c = 2; c < DIM / kLanes; c += 2) {
    widen2<DIM>(k + c * kLanes, a, b);
    p += vec::load(q + c * kLanes) * a;
    p += vec::load(q + (c + 1) * kLanes) * b;
  }
  return vec::lane_sum(p);
}
// A head size that is not a multiple of kLanes: lane by lane.
template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  float total = 0.f;
  for (int64_t d = 0; d < dim; ++d) total += q[d] * static_cast<float>(k[d]);
  return total;
}

// acc[d] += p[t] * v[t][d] for t in [0, tokens), d in [0, DIM): each element one FMA chain over
// the tokens in order, up to 8 vectors of dims at a time held in registers.
template <int DIM, typename T>
inline void weigh(const float* p, const T* v, int64_t stride, int64_t tokens, float* acc) {
  constexpr int kDimVecs = std::min<int>(DIM / kLanes, 8), kChunk = kDimVecs * kLanes;
  for (int c0 = 0; c0 < DIM; c0 += kChunk) {
    vf a[kDimVecs];
    for (int c = 0; c < kDimVecs; ++c) a[c] = vec::load(acc + c0 + c * kLanes);
    const T* row = v + c0;
    for (int64_t t = 0; t < tokens; ++t, row += stride) {
      const vf w = vec::splat(p + t);
      for (int c = 0; c < kDimVecs; c += 2) {
        vf x, y;
        widen2<DIM>(row + c * kLanes, x, y);
        a[c] += w * x;
        a[c + 1] += w * y;
      }
    }
    for (int c = 0; c < kDimVecs; ++c) vec::store(acc + c0 + c * kLanes, a[c]);
  }
}
template <typename T>
inline void weigh(const float* p, const T* v, int64_t stride, int64_t tokens, float* acc, int64_t dim) {
  for (int64_t t = 0; t < tokens; ++t, v += stride)
    for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * static_cast<float>(v[d]);
}

// Softmax of n scores in place: exp of each less the top, over their sum in order.
inline void softmax(float* sc, int64_t n) {
  const float top = *std::max_element(sc, sc + n);
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) sc[t] = fast_exp(sc[t] - top);
  for (int64_t t = 0; t < n; ++t) total += sc[t];
  const float inv = 1.f / total;
  for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
}

struct Shape {
  int64_t heads, kv_heads, dim, max_blocks, block_size, q_row_stride, window, parts;
  PoolLayer pool;
};

// A work item: one sequence's kv heads [kv0, kv1) over its context positions [first, length).
struct Item {
  int64_t seq, kv0, kv1, first, length;
  const int64_t* table;
  Item(int64_t i, const int64_t* tables, const int64_t* lengths, const Shape& s)
      : seq(i / s.parts), kv0(i % s.parts * s.kv_heads / s.parts), kv1((i % s.parts + 1) * s.kv_heads / s.parts),
        first(s.window > 0 ? std::max<int64_t>(0, lengths[seq] - s.window) : 0), length(lengths[seq]),
        table(tables + seq * s.max_blocks) {}
  int64_t first_block(const Shape& s) const { return first / s.block_size; }
  int64_t last_block(const Shape& s) const { return (length - 1) / s.block_size; }
  // Block b's first position this item reads, and where in a layer of the pool its row is.
  int64_t start(int64_t b, const Shape& s) const { return std::max(b * s.block_size, first); }
  int64_t row(int64_t b, const Shape& s) const { return s.pool.at(table[b], start(b, s) - b * s.block_size); }
};

// The block to be read next, pulled into L2 a few pool rows at a time (this item's kv heads of
// each) while the one before it is computed on: the context's blocks lie anywhere in the pool,
// where the CPU's own prefetchers lose the stream at each block.
template <typename T>
struct Ahead {
  const char* base = nullptr;  // the block's first row, at kv head kv0; nullptr: nothing ahead
  int64_t stride = 0, bytes = 0;
  Ahead() = default;
  Ahead(const T* pool, const Item& it, int64_t b, const Shape& s)
      : base(reinterpret_cast<const char*>(pool + it.row(b, s) + it.kv0 * s.dim)),
        stride(s.kv_heads * s.dim * sizeof(T)), bytes((it.kv1 - it.kv0) * s.dim * sizeof(T)) {}
  void rows(int64_t begin, int64_t end) const {
    if (base == nullptr) return;
    for (int64_t i = begin; i < end; ++i)
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + i * stride + o, 0, 2);
  }
};

// One item: scores of its query heads (`query`: the row's, every head, scaled) over the context,
// softmax, then the weighted sum of values into acc (the row's heads), block by block: a block's
// keys (then values) for all the item's heads while the next is prefetched, the last key block
// prefetching the first value block, the last value block `next` (the thread's next item's
// first key block). DIM: the head size where it is a multiple of kLanes, else 0 (lane by lane).
template <int DIM, typename T>
void attend_one(const float* query, const T* keys, const T* values, const Item& it, const Shape& s,
                std::vector<float>& scores, float* acc, const Ahead<T>& next) {
  const int64_t group = s.heads / s.kv_heads, dim = DIM > 0 ? DIM : s.dim, stride = s.kv_heads * dim;
  const int64_t h0 = it.kv0 * group, h1 = it.kv1 * group, n = it.length - it.first;
  const int64_t b0 = it.first_block(s), last = it.last_block(s);
  scores.resize((h1 - h0) * n);
  for (int64_t b = b0; b <= last; ++b) {
    const int64_t start = it.start(b, s), stop = std::min((b + 1) * s.block_size, it.length);
    const Ahead<T> ahead = b < last ? Ahead<T>(keys, it, b + 1, s) : Ahead<T>(values, it, b0, s);
    const T* key = keys + it.row(b, s);
    for (int64_t t = start; t < stop; ++t, key += stride) {
      ahead.rows(t - start, t - start + 1);
      for (int64_t h = h0; h < h1; ++h) {
        float& score = scores[(h - h0) * n + t - it.first];
        if constexpr (DIM > 0)
          score = dot<DIM>(query + h * dim, key + h / group * dim);
        else
          score = dot(query + h * dim, key + h / group * dim, dim);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h) softmax(scores.data() + (h - h0) * n, n);
  std::fill(acc + h0 * dim, acc + h1 * dim, 0.f);
  for (int64_t b = b0; b <= last; ++b) {
    const int64_t start = it.start(b, s), stop = std::min((b + 1) * s.block_size, it.length);
    const Ahead<T> ahead = b < last ? Ahead<T>(values, it, b + 1, s) : next;
    const T* value = values + it.row(b, s);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t share = h - h0, heads = h1 - h0;  // this head's share of the next block's rows
      ahead.rows(share * s.block_size / heads, (share + 1) * s.block_size / heads);
      const float* p = scores.data() + share * n + start - it.first;
      if constexpr (DIM > 0)
        weigh<DIM>(p, value + h / group * dim, stride, stop - start, acc + h * dim);
      else
        weigh(p, value + h / group * dim, stride, stop - start, acc + h * dim, dim);
    }
  }
}

template <int DIM, typename T>
void attend(const T* q, const T* keys, const T* values, const int64_t* tables, const int64_t* lengths,
            const int64_t* rows, T* out, int64_t num_rows, int64_t grain, const Shape& s, float scale) {
  const int64_t width = s.heads * s.dim, group = s.heads / s.kv_heads;
  at::parallel_for(0, num_rows * s.parts, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(width), scores, acc(width);
    for (int64_t i = begin; i < end; ++i) {
      const Item it(i, tables, lengths, s);
      const int64_t lo = it.kv0 * group * s.dim, hi = it.kv1 * group * s.dim;
      const T* row_q = q + rows[it.seq] * s.q_row_stride;
      for (int64_t j = lo; j < hi; ++j) query[kPaired<DIM, T> ? paired(j) : j] = static_cast<float>(row_q[j]) * scale;
      Ahead<T> next;
      if (i + 1 < end) {
        const Item after(i + 1, tables, lengths, s);
        next = Ahead<T>(keys, after, after.first_block(s), s);
      }
      attend_one<DIM>(query.data(), keys, values, it, s, scores, acc.data(), next);
      T* row_out = out + rows[it.seq] * width;
      for (int64_t j = lo; j < hi; ++j) row_out[j] = static_cast<T>(acc[kPaired<DIM, T> ? paired(j) : j]);
    }
  });
}

}  // namespace

// q, out: [total_rows, heads, dim] (q may be a view with a row stride: q of the fused q|k|v);
// keys, values: [blocks, block_size, kv_heads, dim] (one layer of the pool, see pool_layer.h);
// tables: int64 [n, max_blocks]; lengths, rows: int64 [n]. Writes out[rows[i]] for each i.
// window > 0: each row attends to its last `window` positions only (a sliding-window layer).
void decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                      torch::Tensor lengths, torch::Tensor rows, torch::Tensor out, int64_t block_size,
                      double scale, int64_t window) {
  TORCH_CHECK(out.is_contiguous() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              out.sizes() == q.sizes(), "decode_attention: contiguous tensors (q: contiguous heads) only");
  const PoolLayer pool = pool_layer(keys, values, block_size, "decode_attention");
  TORCH_CHECK(tables.is_contiguous() && tables.scalar_type() == torch::kInt64 &&
              lengths.scalar_type() == torch::kInt64 && rows.scalar_type() == torch::kInt64,
              "decode_attention: int64 tables, lengths and rows");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == out.scalar_type() &&
              values.scalar_type() == keys.scalar_type(), "decode_attention: q, the pool and out must share a dtype");
  TORCH_CHECK(lengths.is_contiguous() && rows.is_contiguous() && lengths.dim() == 1 && rows.dim() == 1,
              "decode_attention: lengths and rows are 1-d");
  const int64_t heads = q.size(1), kv_heads = keys.size(2), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(3) == dim, "decode_attention: head shapes");
  TORCH_CHECK(tables.size(0) == lengths.size(0) && rows.size(0) == lengths.size(0), "decode_attention: one table per row");
  const int64_t blocks = keys.size(0), width = tables.size(1);
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
  // Whole sequences as items, or, with too few to keep every thread busy, a share of the kv heads each.
  const int64_t n = lengths.size(0), threads = at::get_num_threads();
  const int64_t parts = std::min(kv_heads, std::max<int64_t>(1, (2 * threads + n - 1) / std::max<int64_t>(n, 1)));
  const int64_t grain = tokens * kv_heads < kAlone ? std::max<int64_t>(n * parts, 1) : 1;
  const Shape shape{heads, kv_heads, dim, width, block_size, q.stride(0), window, parts, pool};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), lengths.size(0), grain, shape, static_cast<float>(scale));
    };
    if (dim == 64) run(attend<64, scalar_t>);
    else if (dim == 128) run(attend<128, scalar_t>);
    else run(attend<0, scalar_t>);
  });
}
