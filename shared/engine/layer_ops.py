"""LayerOps: the elementwise work between a layer's GEMMs (and the KV write), behind one small interface.

`TorchOps` calls the Hugging Face modules (RMSNorm, rotary, SiLU) as they are; `KernelOps`
runs the norms, the rotary embedding and the KV write as one fused C++ pass each (see
csrc/layer_ops.cpp), which saves a dozen small torch ops per layer. (SiLU * up stays in torch:
its vectorized ops beat a fused pass here.) Both update the residual stream and return the normalized input of
the next block.
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class TorchOps:
    def norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, module(residual + delta))."""
        if delta is not None:
            residual = residual + delta
        return residual, module(residual)

    def rope(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

    def act_mul(self, act, gate, up):
        return act(gate) * up

    def store(self, pool, layer: int, slots, k, v) -> None:
        """k, v may carry padding rows past the len(slots) real ones."""
        pool.write(layer, slots, k[: slots.numel()], v[: slots.numel()])


class KernelOps(TorchOps):
    def __init__(self, kernels):
        self.kernels = kernels

    def norm(self, residual, delta, module):
        """The residual is updated in place."""
        return residual, self.kernels.add_rms_norm(
            residual, delta, module.weight, module.variance_epsilon
        )

    def rope(self, q, k, cos, sin):
        self.kernels.rope_(q, k, cos, sin)
        return q, k

    def store(self, pool, layer: int, slots, k, v) -> None:
        self.kernels.store_kv(pool.kv[layer], slots, k, v)


def layer_ops(kernels, model) -> TorchOps | KernelOps:
    """The fused ops where they are built and the model's norms are Llama RMSNorms."""
    fits = kernels is not None and all(
        hasattr(layer.input_layernorm, "variance_epsilon") for layer in model.model.layers
    )
    return KernelOps(kernels) if fits else TorchOps()
