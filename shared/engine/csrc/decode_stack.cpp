// The whole decoder stack for a step in which every row decodes one token: the same calls the
// Python loop makes for such a step (the row kernel on the packed panels, then our other
// kernels), in the same order with the same arguments, so the bits are the same; only the ~20
// Python-level calls per layer are gone, which is most of what a batch-1 step spends outside
// its GEMMs.
#include <torch/extension.h>

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
void rope_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
void store_kv(at::Tensor keys, at::Tensor values, at::Tensor slots, at::Tensor k, at::Tensor v);
void decode_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor tables, at::Tensor lengths,
                      at::Tensor rows, at::Tensor out, int64_t block_size, double scale, int64_t window);

at::Tensor row_linear(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias, bool float_out);

// hidden: the padded embeddings [total, hidden], the residual stream (updated in place).
// weights: per layer the panels of q|k|v, o, gate|up, down (outs: their output widths); norms: per layer input and post-attention
// RMSNorm weights, then the final norm's; windows: each layer's sliding window (0: none).
// kv: the whole block-major pool [blocks, layers, 2, block_size, kv_heads, head_dim].
// Returns the final-normed hidden states.
at::Tensor decode_stack(at::Tensor hidden, std::vector<at::Tensor> weights, std::vector<int64_t> outs,
                        std::vector<at::Tensor> norms,
                        double eps, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor slots,
                        at::Tensor tables, at::Tensor lengths, at::Tensor rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, double scale, std::vector<int64_t> windows) {
  const int64_t layers = kv.size(1), total = hidden.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers && outs.size() == weights.size() &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decode_stack: 4 weights, 2 norms and a window per layer, and the final norm");
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const auto linear = [&](const at::Tensor& x, int64_t i) { return row_linear(x, weights[i], outs[i], std::nullopt, false); };
  at::Tensor x = add_rms_norm(hidden, std::nullopt, norms[0], eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = linear(x, 4 * l);
    at::Tensor q = qkv.narrow(1, 0, q_width).view({total, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_width, kv_width).view({total, kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({total, kv_heads, head_dim});
    rope_(q, k, cos, sin);
    const at::Tensor keys = kv.select(1, l).select(1, 0), values = kv.select(1, l).select(1, 1);
    store_kv(keys, values, slots, k, v);
    at::Tensor out = at::zeros({total, heads, head_dim}, x.options());
    decode_attention(q, keys, values, tables, lengths, rows, out, block_size, scale, windows[l]);
    x = add_rms_norm(hidden, linear(out.view({total, q_width}), 4 * l + 1), norms[2 * l + 1], eps);
    const at::Tensor gate_up = linear(x, 4 * l + 2);
    const int64_t inter = gate_up.size(1) / 2;
    const at::Tensor act = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
    x = add_rms_norm(hidden, linear(act, 4 * l + 3), norms[2 * l + 2], eps);
  }
  return x;
}
