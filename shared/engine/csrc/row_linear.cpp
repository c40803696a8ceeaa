// Linear layers, every row of them: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32
// or bfloat16 weights, computed in float32.
//
// A decode step reads every weight once for a few rows: bound by memory at one row, by the FMA
// units at a few dozen. GEMM libraries serve those row counts poorly (oneDNN's packed fp32 on
// this project's machines: a batch-1 pass over SmolLM2's weights at 1.5-1.7x their read time),
// and bfloat16 on a CPU without bf16 instructions falls back to an emulation that collapses at
// 8 rows and more. Here the weights stream once per call, in panels of kPanel outputs laid out
// [panel][k][kPanel] (pack_rows in row_linear.py), and each panel serves every row while it is
// in cache; bf16 is widened to float32 in registers (exact: a shift and a mask per two vectors).
// A prompt chunk's hundreds of rows run at the FMA units' pace too, as oneDNN's GEMMs do: the
// panel is taken a tile of k at a time, held in L1 while every register block of rows passes
// over it.
//
// Where the CPU has AVX512-BF16, bf16 weights are packed in k-pairs ([panel][k / 2][output][2])
// and a bf16 input goes through its dot-product instruction (two products per lane at once),
// as oneDNN's bf16 GEMMs do.
//
// Batch invariance by construction: every output is one chain of FMAs (or bf16 pair dot
// products) over k in order, started from zero, then the bias added. Which rows share a call, a
// register block or a thread, and where k is tiled, changes nothing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA: every output's chain alike

namespace {

using vec::kLanes, vec::vf, vec::hold, vec::splat;

#if defined(__AVX512F__)
constexpr int kRows = 12;  // 24 accumulators, 2 weights, 1 input: of 32 registers
#else
constexpr int kRows = 6;  // AVX2 and narrower: 12 + 2 + 1 of 16 registers
#endif
constexpr int kVecs = 2, kPanel = kVecs * kLanes;

// A panel's kPanel weights at one k, as kVecs = 2 float vectors. bf16 panels are packed in
// interleaved halves (pack_rows(halves=True)): position 2j holds output j, 2j + 1 output
// j + kLanes, so one load of kLanes 32-bit words gives both vectors, the low halves shifted up and
// the high halves masked (bf16 -> f32 is exact: the 16 bits become the high half of the float).
inline void load_weights(const float* p, vf w[kVecs]) {
  for (int v = 0; v < kVecs; ++v) w[v] = vec::load_held(p + v * kLanes);
}
inline void load_weights(const at::BFloat16* p, vf w[kVecs]) {
  static_assert(kVecs == 2, "bf16 panels hold two vectors in interleaved halves");
  vec::widen_pairs(p, w[0], w[1]);
  w[0] = hold(w[0]);
  w[1] = hold(w[1]);
}

struct Operands {
  const float* x;  // [M, K] float32, row stride x_stride (the pairs path: xh, bfloat16)
  const uint16_t* xh;
  int64_t x_stride, K, N;
  const float* bias;      // [N], or nullptr
  float* out;             // [M, N] float32, or nullptr and:
  at::BFloat16* out_bf16; // [M, N] bfloat16
};

// One row's kPanel sums (a register block's row, stored) plus the bias, out to outputs [n, ...),
// rounded to bfloat16 (to nearest even, as torch's conversion) where the output is bf16.
void write_row(const Operands& o, float* sums, int64_t row, int64_t n) {
  const int64_t cols = std::min<int64_t>(kPanel, o.N - n);
  if (o.bias != nullptr)
    for (int64_t c = 0; c < cols; ++c) sums[c] += o.bias[n + c];
  if (o.out != nullptr) {
    std::memcpy(o.out + row * o.N + n, sums, cols * sizeof(float));
    return;
  }
  vec::bf16_round(sums, reinterpret_cast<uint16_t*>(o.out_bf16 + row * o.N + n), cols);
}

// A bf16 input's rows widened to float32 (exact), contiguous: the kernel's float input.
std::vector<float> widened_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), stride = x.stride(0);
  std::vector<float> out(M * K);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) vec::bf16_widen(src + m * stride, out.data() + m * K, K);
  return out;
}

// A stretch of k: where a call has several register blocks of rows, each panel is taken a tile
// of k at a time, every block passing over the tile while it is in L1 (a whole panel, K up to a
// few thousand, is not), each block's sums held between tiles in `state`.
constexpr int64_t kTile = 16384 / (kPanel * sizeof(float));  // 16 KiB of float32 panel, 8 of bf16

// Cache lines of the next tile for a register block to prefetch as it goes, `per` a k step from
// `p` up to `end` (none by default).
struct Ahead {
  const char* p = nullptr;
  int64_t per = 0;
  const char* end = nullptr;
};

// Rows [m, m + R) of x by the panel's k in [k0, k1) ([K, kPanel], `panel` at k0) into outputs
// [n, n + kPanel). The sums start from zero at k0 = 0, else from `state` ([R][kPanel]); at
// k1 = K they go out, else back to `state`. A float stored and loaded is the same float: an
// output's chain of FMAs is the same however k is cut.
template <int R, typename W>
void block(const Operands& o, const W* panel, int64_t m, int64_t n, int64_t k0, int64_t k1, float* state,
           Ahead ahead = {}) {
  const float* x = o.x + m * o.x_stride;
  vf acc[R][kVecs] = {};
  if (k0 > 0) std::memcpy(acc, state, sizeof acc);
  for (int64_t k = k0; k < k1; ++k, panel += kPanel) {
    for (int64_t i = 0; i < ahead.per && ahead.p < ahead.end; ++i, ahead.p += 64)
      __builtin_prefetch(ahead.p, 0, 2);  // to L2: L1 holds this tile and the rows' x
    vf w[kVecs];
    load_weights(panel, w);
    for (int r = 0; r < R; ++r) {
      const vf xr = splat(x + r * o.x_stride + k);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xr * w[v];
    }
  }
  if (k1 < o.K) {
    std::memcpy(state, acc, sizeof acc);
    return;
  }
  for (int r = 0; r < R; ++r) {
    float sums[kPanel];
    std::memcpy(sums, acc[r], sizeof sums);
    write_row(o, sums, m + r, n);
  }
}

// f(std::integral_constant<int, rows>{}): a register block's row count as a template argument.
template <typename F, int R = kRows>
void with_rows(int64_t rows, F&& f) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    with_rows<F, R - 1>(rows, std::forward<F>(f));
  }
}

// f(rows, m) for the register blocks that cover M rows: kRows at a time, but never a last block
// of under kRows / 2 rows (2 accumulators a row: too few chains to hide the FMA latency), so
// between kRows and 2 * kRows rows are left, two near-equal blocks take them (32 rows on AVX2:
// 6, 6, 6, 6, 4, 4, not 6, 6, 6, 6, 6, 2). Each output's chain is the same in any block.
template <typename F>
void row_blocks(int64_t M, F&& f) {
  for (int64_t m = 0; m < M;) {
    const int64_t rest = M - m;
    const int64_t rows = rest > kRows && rest < 2 * kRows ? (rest + 1) / 2 : std::min<int64_t>(rest, kRows);
    with_rows(rows, [&](auto r) { f(r, m); });
    m += rows;
  }
}

// Block j (of `blocks`, j >= 1) of a tile `steps` k long: its share of the next tile's lines,
// [next, next + bytes), spread over its k steps.
Ahead share(const char* next, int64_t bytes, int64_t blocks, int64_t j, int64_t steps) {
  const int64_t lines = ((bytes + 63) / 64 + blocks - 2) / (blocks - 1);
  const char* first = next + (j - 1) * lines * 64;
  return {first, (lines + steps - 1) / steps, std::min(first + lines * 64, next + bytes)};
}

// All M rows by one panel: in one pass over k where one register block takes them, else a tile
// of k at a time. A tile's first block reads it from memory at the pace of the FMAs, the others
// from L1, so the memory would idle through them: they prefetch the next tile meanwhile (the
// rest of this panel's k, or the next panel's first tile, before `stop`), into L2, each a share
// of its lines spread over its k steps (30 SmolLM2 layers at 32 rows on a Zen 4 EPYC: 44 -> 41.5
// ms; built for AVX2 there: 55 -> 49 ms, and 25 -> 20 ms at 8 rows).
template <typename W>
void panel_rows(const Operands& o, const W* panel, const W* stop, int64_t M, int64_t n, std::vector<float>& state) {
  if (M <= kRows) {
    with_rows(M, [&](auto r) { block<decltype(r)::value>(o, panel, 0, n, 0, o.K, nullptr); });
    return;
  }
  state.resize(M * kPanel);
  int64_t blocks = 0;
  row_blocks(M, [&](auto, int64_t) { ++blocks; });
  for (int64_t k0 = 0; k0 < o.K; k0 += kTile) {
    const int64_t k1 = std::min(o.K, k0 + kTile);
    const W* next = panel + k1 * kPanel;  // panels are contiguous: this one's k1, or the next's 0
    const int64_t next_k = next < stop ? (k1 < o.K ? std::min(o.K - k1, kTile) : std::min(o.K, kTile)) : 0;
    int64_t j = 0;
    row_blocks(M, [&](auto r, int64_t m) {
      const Ahead ahead = j > 0 && next_k > 0 ? share(reinterpret_cast<const char*>(next), next_k * kPanel * sizeof(W),
                                                      blocks, j, k1 - k0)
                                              : Ahead{};
      ++j;
      block<decltype(r)::value>(o, panel + k0 * kPanel, m, n, k0, k1, state.data() + m * kPanel, ahead);
    });
  }
}

int64_t panel_count(const Operands& o) { return (o.N + kPanel - 1) / kPanel; }

#if defined(__AVX512BF16__)
constexpr bool kPairs = true;
// bf16 x by a k-pair panel ([K / 2][kPanel][2]): one dot-product instruction per pair and vector.
template <int R>
void block_pairs(const Operands& o, const uint16_t* panel, int64_t m, int64_t n) {
  const uint16_t* x = o.xh + m * o.x_stride;
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < o.K; k += 2) {
    __m512bh w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + k * kPanel + v * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * o.x_stride + k, sizeof pair);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, w[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sums[kPanel];
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(sums + v * kLanes, acc[r][v]);
    write_row(o, sums, m + r, n);
  }
}

void run_pairs(const Operands& o, const uint16_t* panels, int64_t M) {
  at::parallel_for(0, panel_count(o), 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = panels + p * kPanel * o.K;
      row_blocks(M, [&](auto r, int64_t m) { block_pairs<decltype(r)::value>(o, panel, m, p * kPanel); });
    }
  });
}
#else
constexpr bool kPairs = false;
#endif

template <typename W>
void run(const Operands& o, const W* panels, int64_t M) {
  // Each thread takes a run of whole panels: its own stretch of the weights, read once.
  at::parallel_for(0, panel_count(o), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> state;
    const W* stop = panels + end * kPanel * o.K;
    for (int64_t p = begin; p < end; ++p) panel_rows(o, panels + p * kPanel * o.K, stop, M, p * kPanel, state);
  });
}

}  // namespace

int64_t row_linear_panel() { return kPanel; }
// Whether bf16 weights with an even K are packed in k-pairs here (and need a bf16 input).
bool row_linear_pairs() { return kPairs; }

// x [M, K] float32 or bfloat16 (rows contiguous); panels [ceil(N / kPanel), K, kPanel] float32
// or bfloat16; bias [N] or None. Returns [M, N] in x's dtype (bf16 rounded to nearest even), or
// in float32 with float_out (an output head's logits, not rounded to bf16 on the way).
at::Tensor row_linear(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "row_linear: x [M, K] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1) && panels.size(0) * kPanel >= N && N > 0 && x.size(1) > 0,
              "row_linear: panels [ceil(N / ", kPanel, "), K, ", kPanel, "] (pack_rows)");
  const auto dt = x.scalar_type(), wt = panels.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "row_linear: float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  const bool pairs = kPairs && wt == at::kBFloat16 && K % 2 == 0;
  TORCH_CHECK(!pairs || dt == at::kBFloat16, "row_linear: k-pair bf16 panels take a bf16 input");
  // A bf16 input is widened here, not by torch: no tensor, no dispatch, for each of a step's calls.
  const std::vector<float> widened = dt == at::kFloat || pairs ? std::vector<float>() : widened_rows(x);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "row_linear: a bias of N values");
    b = bias->to(at::kFloat).contiguous();
  }
  const bool bf16_out = dt == at::kBFloat16 && !float_out;
  at::Tensor out = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const Operands o{dt == at::kFloat ? x.data_ptr<float>() : widened.data(),
                   pairs ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr,
                   dt == at::kFloat || pairs ? x.stride(0) : K,
                   K,
                   N,
                   b.defined() ? b.data_ptr<float>() : nullptr,
                   bf16_out ? nullptr : out.data_ptr<float>(),
                   bf16_out ? out.data_ptr<at::BFloat16>() : nullptr};
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  if (pairs) {
    run_pairs(o, reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), M);
    return out;
  }
#endif
  if (wt == at::kFloat)
    run(o, panels.data_ptr<float>(), M);
  else
    run(o, panels.data_ptr<at::BFloat16>(), M);
  return out;
}
