"""DecodeStack: a step in which every row decodes, through all the layers in one C++ call.

csrc/decode_stack.cpp runs each layer's norms, row-kernel projections, rotary embedding, KV write
and paged attention itself, with the bits the per-layer Python loop gives (a unit test compares
them). It applies only when every piece of it does: the fused C++ layer ops and the paged
attention kernel are built, every projection has the row kernel and no bias, the norms share one epsilon, q and k are
not normalized per head and the MLP is SiLU; otherwise `decode_stack` returns None and the runner
loops over the layers. Sliding windows are passed per layer.
"""

from torch import nn
from transformers.activations import SiLUActivation

from shared.engine.architecture import LayerParts
from shared.engine.layer_ops import KernelOps
from shared.engine.paged_attention import PagedAttention
from shared.engine.projection import Projection


class DecodeStack:
    def __init__(self, ops: KernelOps, paged: PagedAttention, rows, norms, eps, shape, windows):
        self.ops = ops  # read at each call: a test spies on ops.kernels
        self.paged = paged
        self.weights = [r.panels for r in rows]
        self.outs = [r.out_features for r in rows]
        self.norms, self.eps = norms, eps
        self.windows = windows
        self.num_heads, self.num_kv_heads, self.head_dim = shape

    def __call__(self, hidden, cos, sin, pool, slots, decode):
        """The last norm's output for every row; the KV of every layer written to `slots`."""
        return self.ops.kernels.decode_stack(
            hidden,
            self.weights,
            self.outs,
            self.norms,
            self.eps,
            cos,
            sin,
            pool.kv,
            slots,
            *decode,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            pool.block_size,
            self.paged.scale,
            self.windows,
        )


def decode_stack(
    ops, paged, parts: list[LayerParts], final_norm, projections: list[Projection], shape
) -> DecodeStack | None:
    """The stack, when every piece of it applies. `projections`: q|k|v, o, gate|up and down of
    each layer in turn; `shape`: (heads, kv heads, head dim)."""
    norms = [n for p in parts for n in (p.input_norm, p.post_norm)]
    norms.append(final_norm)
    eps = {getattr(n, "variance_epsilon", None) for n in norms}
    if (
        not isinstance(ops, KernelOps)
        or not paged
        or len(eps) != 1
        or None in eps
        or any(p.rows is None or p.bias is not None for p in projections)
        or any(
            p.q_norm is not None or not isinstance(p.act, (nn.SiLU, SiLUActivation)) for p in parts
        )
    ):
        return None
    rows = [p.rows for p in projections]
    windows = [p.window or 0 for p in parts]
    return DecodeStack(ops, paged, rows, [n.weight for n in norms], eps.pop(), shape, windows)
