// The Python module of Tandem's CPU kernels (see shared/engine/kernels.py).
#include <torch/extension.h>

void decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                      torch::Tensor lengths, torch::Tensor rows, torch::Tensor out, int64_t block_size, double scale,
                      int64_t window);
void prefill_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                       torch::Tensor ranges, torch::Tensor out, int64_t block_size, double scale, int64_t window);
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void store_kv(torch::Tensor keys, torch::Tensor values, torch::Tensor slots, torch::Tensor k, torch::Tensor v);
at::Tensor decode_stack(at::Tensor hidden, std::vector<at::Tensor> weights, std::vector<int64_t> outs,
                        std::vector<at::Tensor> norms,
                        double eps, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor slots,
                        at::Tensor tables, at::Tensor lengths, at::Tensor rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, double scale, std::vector<int64_t> windows);
at::Tensor row_linear(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias, bool float_out);
int64_t row_linear_panel();
bool row_linear_pairs();
at::Tensor masked_rows(at::Tensor logits, at::Tensor index, at::Tensor bits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the paged KV pool");
  m.def("prefill_attention", &prefill_attention, "causal prompt attention over the paged KV pool");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; weight * RMSNorm(residual)");
  m.def("rope_", &rope_, "rotary embedding of q and k, in place");
  m.def("store_kv", &store_kv, "k and v rows into their pool slots");
  m.def("row_linear", &row_linear, "x @ weight.T (+ bias) over packed panels, each row on its own",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias"), py::arg("float_out") = false);
  m.def("row_linear_panel", &row_linear_panel, "the outputs per panel row_linear's weights are packed in");
  m.def("row_linear_pairs", &row_linear_pairs, "whether bf16 panels are packed in k-pairs here");
  m.def("decode_stack", &decode_stack, "the decoder stack for a step of single-token rows");
  m.def("masked_rows", &masked_rows, "copies of the indexed rows, the tokens their bitmasks clear at -inf");
}
