// Prefill attention over the paged KV pool, flash-attention style: the query rows of a prompt
// span attend to keys and values read in place through the sequence's block table (no gather),
// a tile of keys at a time with an online softmax, causal within the span. Work items are
// (span, kv head, query tile): the `group` query heads sharing a kv head form one block of rows,
// so each key tile is read once for all of them.
//
// Batch invariance by construction: a row's result depends only on its own query, its position
// and the keys it sees. Key tiles start at absolute multiples of kKeyTile; a tile in which a row
// sees no key is skipped for that row; every score is a dot product in dimension order; the
// softmax sums and the weighted sum of values run in key order. Which rows share a query tile,
// a call or a thread changes nothing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fast_math.h"
#include "pool_layer.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA here: the GEMM-like loops

namespace {

using vec::kLanes, vec::vf, vec::load, vec::load_held, vec::store;

#if defined(__AVX512F__)
constexpr int64_t kKeyVecs = 4, kDimVecs = 4;  // 32 registers
#else
constexpr int64_t kKeyVecs = 2, kDimVecs = 2;  // AVX2 and narrower: 16 registers
#endif
constexpr int64_t kRows = 4;           // query rows per register block
constexpr int64_t kQueryTile = 128;    // query positions per work item
constexpr int64_t kKeyTile = 128;      // keys per softmax step (a multiple of kLanes * kKeyVecs)
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Shape {
  int64_t heads, kv_heads, dim, padded_dim, block_size, width, q_row_stride, window;
  PoolLayer pool;
  int64_t group() const { return heads / kv_heads; }
};

struct Item {
  int64_t span, kv_head, first, last, row, cost;  // positions [first, last) at rows row...
};

// S[r][j] = sum_d Q[r][d] * KT[d][j] for r < rows (a multiple of kRows), j < kKeyTile.
void scores(const float* q, int64_t q_stride, const float* kt, float* s, int64_t rows, int64_t dim) {
  constexpr int64_t step = kLanes * kKeyVecs;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows)
    for (int64_t j0 = 0; j0 < kKeyTile; j0 += step) {
      vf acc[kRows][kKeyVecs] = {};
      for (int64_t d = 0; d < dim; ++d) {
        vf k[kKeyVecs];
        for (int64_t v = 0; v < kKeyVecs; ++v) k[v] = load_held(kt + d * kKeyTile + j0 + v * kLanes);
        for (int64_t r = 0; r < kRows; ++r) {
          const float x = q[(r0 + r) * q_stride + d];
          for (int64_t v = 0; v < kKeyVecs; ++v) acc[r][v] += x * k[v];
        }
      }
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t v = 0; v < kKeyVecs; ++v) store(s + (r0 + r) * kKeyTile + j0 + v * kLanes, acc[r][v]);
    }
}

// acc[r][:] += sum_j P[r][j] * V[j][:] for j < keys, in key order.
void weigh(const float* p, const float* v, float* acc, int64_t rows, int64_t keys, int64_t padded_dim) {
  constexpr int64_t step = kLanes * kDimVecs;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows)
    for (int64_t c0 = 0; c0 < padded_dim; c0 += step) {
      vf a[kRows][kDimVecs];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < kDimVecs; ++c) a[r][c] = load(acc + (r0 + r) * padded_dim + c0 + c * kLanes);
      for (int64_t j = 0; j < keys; ++j) {
        vf x[kDimVecs];
        for (int64_t c = 0; c < kDimVecs; ++c) x[c] = load_held(v + j * padded_dim + c0 + c * kLanes);
        for (int64_t r = 0; r < kRows; ++r) {
          const float w = p[(r0 + r) * kKeyTile + j];
          for (int64_t c = 0; c < kDimVecs; ++c) a[r][c] += w * x[c];
        }
      }
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < kDimVecs; ++c) store(acc + (r0 + r) * padded_dim + c0 + c * kLanes, a[r][c]);
    }
}

// The sum of a row of kKeyTile values, lane by lane in key order, then the lanes in a fixed tree.
inline float row_sum(const float* x) {
  vf total = load(x);
  for (int64_t j = kLanes; j < kKeyTile; j += kLanes) total += load(x + j);
  float lanes[kLanes];
  store(lanes, total);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// One row's scores of a key tile -> its softmax weights (keys outside [lo, hi) exactly 0),
// updating its running max `m` and total `l` and rescaling its accumulator. False: the row sees
// no key of this tile.
bool softmax_step(float* s, int64_t lo, int64_t hi, float& m, float& l, float* acc, int64_t padded_dim) {
  if (hi <= lo) {
    std::fill(s, s + kKeyTile, 0.f);
    return false;
  }
  const bool masked = lo > 0 || hi < kKeyTile;
  if (masked) {
    std::fill(s, s + lo, kMinusInf);
    std::fill(s + hi, s + kKeyTile, kMinusInf);
  }
  vf top = load(s);
  for (int64_t j = kLanes; j < kKeyTile; j += kLanes) {
    const vf x = load(s + j);
    top = x > top ? x : top;
  }
  float lanes[kLanes], next = m;
  store(lanes, top);
  for (int64_t i = 0; i < kLanes; ++i) next = std::max(next, lanes[i]);
  for (int64_t j = 0; j < kKeyTile; ++j) s[j] = fast_exp(s[j] - next);
  if (masked) {
    std::fill(s, s + lo, 0.f);
    std::fill(s + hi, s + kKeyTile, 0.f);
  }
  const float alpha = m == kMinusInf ? 0.f : fast_exp(m - next);
  l = l * alpha + row_sum(s);
  if (alpha != 1.f)
    for (int64_t d = 0; d < padded_dim; ++d) acc[d] *= alpha;
  m = next;
  return true;
}

struct Workspace {
  std::vector<float> q, s, acc, kt, v, m, l;
  explicit Workspace(int64_t rows, int64_t dim, int64_t padded_dim)
      : q(rows * padded_dim), s(rows * kKeyTile), acc(rows * padded_dim), kt(dim * kKeyTile),
        v(kKeyTile * padded_dim), m(rows), l(rows) {}
};

template <typename T>
struct Spans {
  const T *q, *keys, *values;
  const int64_t *tables, *ranges;  // ranges[i] = (first row, first position, rows)
  T* out;
  Shape s;
  float scale;

  // The keys and values of positions [k0, k0 + n) for one kv head, as float: keys transposed.
  void pack(Workspace& w, const int64_t* table, int64_t kv_head, int64_t k0, int64_t n) const {
    std::fill(w.kt.begin(), w.kt.end(), 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = k0 + j, at = s.pool.at(table[p / s.block_size], p % s.block_size) + kv_head * s.dim;
      const T* key = keys + at;
      const T* value = values + at;
      for (int64_t d = 0; d < s.dim; ++d) {
        w.kt[d * kKeyTile + j] = static_cast<float>(key[d]);
        w.v[j * s.padded_dim + d] = static_cast<float>(value[d]);
      }
    }
  }

  void run(const Item& item, Workspace& w) const {
    const int64_t group = s.group(), n = item.last - item.first, rows = round_up(n * group, kRows);
    const int64_t* table = tables + item.span * s.width;
    std::fill(w.q.begin(), w.q.end(), 0.f);
    std::fill(w.acc.begin(), w.acc.end(), 0.f);
    std::fill(w.m.begin(), w.m.end(), kMinusInf);
    std::fill(w.l.begin(), w.l.end(), 0.f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + (item.row + i) * s.q_row_stride + (item.kv_head * group + g) * s.dim;
        float* dst = w.q.data() + (i * group + g) * s.padded_dim;
        for (int64_t d = 0; d < s.dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
      }
    const int64_t from = s.window > 0 ? std::max<int64_t>(0, item.first - s.window + 1) : 0;
    for (int64_t k0 = from / kKeyTile * kKeyTile; k0 < item.last; k0 += kKeyTile) {
      const int64_t keys = std::min(kKeyTile, item.last - k0);
      pack(w, table, item.kv_head, k0, keys);
      scores(w.q.data(), s.padded_dim, w.kt.data(), w.s.data(), rows, s.dim);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t position = item.first + r / group;
        int64_t lo = 0, hi = 0;
        if (r < n * group) {
          lo = s.window > 0 ? std::max<int64_t>(0, position - s.window + 1 - k0) : 0;
          hi = std::min(keys, position + 1 - k0);
        }
        softmax_step(w.s.data() + r * kKeyTile, lo, hi, w.m[r], w.l[r], w.acc.data() + r * s.padded_dim,
                     s.padded_dim);
      }
      weigh(w.s.data(), w.v.data(), w.acc.data(), rows, keys, s.padded_dim);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float inv = 1.f / w.l[r];
        T* dst = out + ((item.row + i) * s.heads + item.kv_head * group + g) * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) dst[d] = static_cast<T>(w.acc[r * s.padded_dim + d] * inv);
      }
  }
};

// Query tiles at absolute multiples of kQueryTile (any cut gives the same bits; this one keeps
// the tiles of a span alike), longest first so that the threads finish together.
std::vector<Item> items_of(const int64_t* ranges, int64_t spans, const Shape& s) {
  std::vector<Item> items;
  for (int64_t i = 0; i < spans; ++i) {
    const int64_t row = ranges[3 * i], first = ranges[3 * i + 1], end = first + ranges[3 * i + 2];
    for (int64_t a = first; a < end; a = std::min(end, (a / kQueryTile + 1) * kQueryTile)) {
      const int64_t b = std::min(end, (a / kQueryTile + 1) * kQueryTile);
      const int64_t seen = s.window > 0 ? std::min(b, s.window + (b - a)) : b;
      for (int64_t h = 0; h < s.kv_heads; ++h) items.push_back({i, h, a, b, row + a - first, (b - a) * seen});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <typename T>
void attend(const Spans<T>& spans, const std::vector<Item>& items, int64_t work) {
  std::atomic<int64_t> next{0};
  const int64_t rows = round_up(kQueryTile * spans.s.group(), kRows);
  auto worker = [&] {
    Workspace w(rows, spans.s.dim, spans.s.padded_dim);
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) spans.run(items[i], w);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items.size());
  if (threads <= 1 || work < (1 << 16)) return worker();  // less than waking the other threads
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) worker();
  });
}

}  // namespace

// q, out: [total_rows, heads, dim] (q may be a view with a row stride: q of the fused q|k|v);
// keys, values: [blocks, block_size, kv_heads, dim] (one layer of the pool, see pool_layer.h);
// tables: int64 [n, max_blocks];
// ranges: int64 [n, 3] = (first row, first position, rows): rows first.. attend, causally, to
// positions up to their own (the last `window` of them when window > 0) of sequence i, whose
// keys and values for every such position are in the pool already. Writes those rows of out.
void prefill_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                       torch::Tensor ranges, torch::Tensor out, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(out.is_contiguous() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              out.sizes() == q.sizes(), "prefill_attention: contiguous tensors (q: contiguous heads) only");
  const PoolLayer pool = pool_layer(keys, values, block_size, "prefill_attention");
  TORCH_CHECK(tables.is_contiguous() && ranges.is_contiguous() && tables.scalar_type() == torch::kInt64 &&
              ranges.scalar_type() == torch::kInt64 && tables.dim() == 2 && ranges.dim() == 2 &&
              ranges.size(1) == 3 && tables.size(0) == ranges.size(0),
              "prefill_attention: int64 tables [n, blocks] and ranges [n, 3]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == out.scalar_type() &&
              values.scalar_type() == keys.scalar_type(), "prefill_attention: q, the pool and out share a dtype");
  const int64_t heads = q.size(1), kv_heads = keys.size(2), dim = q.size(2), width = tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(3) == dim, "prefill_attention: head shapes");
  const int64_t blocks = keys.size(0), n = ranges.size(0);
  const int64_t *table = tables.data_ptr<int64_t>(), *range = ranges.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = range[3 * i], first = range[3 * i + 1], count = range[3 * i + 2];
    TORCH_CHECK(count >= 1 && first >= 0 && row >= 0 && row + count <= q.size(0), "prefill_attention: rows out of range");
    TORCH_CHECK(first + count <= width * block_size, "prefill_attention: span longer than its table");
    for (int64_t b = 0; b < (first + count + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && table[i * width + b] < blocks, "prefill_attention: block out of range");
    work += count * (first + count) * heads * dim;
  }
  const Shape shape{heads, kv_heads, dim, round_up(dim, kLanes * kDimVecs), block_size, width, q.stride(0), window, pool};
  const auto items = items_of(range, n, shape);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    const Spans<scalar_t> spans{q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                table, range, out.data_ptr<scalar_t>(), shape, static_cast<float>(scale)};
    attend(spans, items, work);
  });
}
