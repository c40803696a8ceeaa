// A step's constrained rows, masked: out[i] = logits[index[i]] with every token whose bit is clear
// in bits[i] at -inf (bit k of word w: token 32 * w + k may come next; tokens past the words never
// may). One pass over each row, instead of a gather, a table lookup and an add in torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

template <typename T>
void mask_row(const T* x, const uint32_t* bits, int64_t words, int64_t width, T* y) {
  const T lowest = static_cast<T>(-std::numeric_limits<float>::infinity());
  const int64_t covered = std::min(width, words * 32);
  int64_t t = 0;
  for (; t + 32 <= covered; t += 32) {
    const uint32_t b = bits[t / 32];
    if (b == 0xFFFFFFFFu) {
      std::memcpy(y + t, x + t, 32 * sizeof(T));
    } else if (b == 0) {
      for (int k = 0; k < 32; ++k) y[t + k] = lowest;
    } else {
      for (int k = 0; k < 32; ++k) y[t + k] = ((b >> k) & 1u) ? x[t + k] : lowest;
    }
  }
  for (; t < covered; ++t) y[t] = ((bits[t / 32] >> (t % 32)) & 1u) ? x[t] : lowest;
  for (; t < width; ++t) y[t] = lowest;
}

template <typename T>
void mask_rows_of(const at::Tensor& logits, const at::Tensor& index, const at::Tensor& bits, at::Tensor& out) {
  const int64_t width = logits.size(1), words = bits.size(1);
  const T* x = logits.data_ptr<T>();
  const int64_t* rows = index.data_ptr<int64_t>();
  const uint32_t* b = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  T* y = out.data_ptr<T>();
  at::parallel_for(0, index.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mask_row(x + rows[i] * width, b + i * words, words, width, y + i * width);
  });
}

}  // namespace

at::Tensor masked_rows(at::Tensor logits, at::Tensor index, at::Tensor bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), "logits: contiguous [rows, vocab] on the CPU");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(), "index: int64 [n]");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.dim() == 2 && bits.is_contiguous() && bits.size(0) == index.size(0),
              "bits: contiguous int32 [n, words]");
  const auto rows = index.numel() ? index.max().item<int64_t>() : 0;
  TORCH_CHECK(index.numel() == 0 || (index.min().item<int64_t>() >= 0 && rows < logits.size(0)), "index out of range");
  at::Tensor out = at::empty({index.size(0), logits.size(1)}, logits.options());
  if (logits.scalar_type() == at::kFloat) {
    mask_rows_of<float>(logits, index, bits, out);
  } else if (logits.scalar_type() == at::kBFloat16) {
    mask_rows_of<at::BFloat16>(logits, index, bits, out);
  } else {
    TORCH_CHECK(false, "masked_rows: float32 or bfloat16 logits");
  }
  return out;
}
