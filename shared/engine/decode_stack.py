"""DecodeStack: a step in which every row decodes, through all the layers in one C++ call.

csrc/decode_stack.cpp runs each layer's norms, packed GEMMs, rotary embedding, KV write and paged
attention itself, with the bits the per-layer Python loop gives (a unit test compares them). It
applies only when every piece of it does: the fused C++ layer ops and the paged attention kernel
are built, every projection is packed without a bias, the norms share one epsilon and the MLP is
SiLU; otherwise `decode_stack` returns None and the runner loops over the layers.
"""

from shared.engine.layer_ops import KernelOps
from shared.engine.paged_attention import PagedAttention
from shared.engine.projection import Projection


class DecodeStack:
    def __init__(self, ops: KernelOps, paged: PagedAttention, weights, norms, eps: float, shape):
        self.ops = ops  # read at each call: a test spies on ops.kernels
        self.paged = paged
        self.weights, self.norms, self.eps = weights, norms, eps
        self.num_heads, self.num_kv_heads, self.head_dim = shape

    def __call__(self, hidden, cos, sin, pool, slots, decode):
        """The last norm's output for every row; the KV of every layer written to `slots`."""
        return self.ops.kernels.decode_stack(
            hidden,
            self.weights,
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
        )


def decode_stack(
    ops, paged, layers, final_norm, projections: list[Projection], config, shape
) -> DecodeStack | None:
    """The stack, when every piece of it applies. `projections`: q|k|v, o, gate|up and down of
    each layer in turn; `shape`: (heads, kv heads, head dim)."""
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(final_norm)
    eps = {getattr(n, "variance_epsilon", None) for n in norms}
    if (
        not isinstance(ops, KernelOps)
        or not paged
        or len(eps) != 1
        or None in eps
        or any(p.packed is None or p.bias is not None for p in projections)
        or getattr(config, "hidden_act", None) != "silu"
    ):
        return None
    weights = [p.packed for p in projections]
    return DecodeStack(ops, paged, weights, [n.weight for n in norms], eps.pop(), shape)
