"""LayerOps: the elementwise work between a layer's GEMMs (and the KV write), behind one small interface.

`TorchOps` calls the Hugging Face modules (RMSNorm, rotary, SiLU) as they are; `KernelOps`
runs the norms, the rotary embedding and the KV write as one fused C++ pass each (see
csrc/layer_ops.cpp), which saves a dozen small torch ops per layer. (SiLU * up stays in torch:
its vectorized ops beat a fused pass here.) Both update the residual stream and return the normalized input of
the next block.
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

from shared.engine.architecture import LayerParts, apply_rotary


class TorchOps:
    def __init__(self, apply_rotary_pos_emb=llama_rotary):
        self.apply_rotary_pos_emb = apply_rotary_pos_emb  # the model family's own

    def norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, module(residual + delta))."""
        if delta is not None:
            residual = residual + delta
        return residual, module(residual)

    def rope(self, q, k, cos, sin):
        return self.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

    def act_mul(self, act, gate, up):
        return act(gate) * up

    def kv_index(self, pool, slots):
        """What `store` takes for a pass's KV slots, computed once for all its layers."""
        return pool.rows(slots)

    def store(self, pool, layer: int, index, k, v) -> None:
        """`index`: `kv_index(pool, slots)`; k, v may carry padding rows past the real ones."""
        pool.write(layer, index, k[: index.numel()], v[: index.numel()])


class KernelOps(TorchOps):
    def __init__(self, kernels, apply_rotary_pos_emb=llama_rotary):
        super().__init__(apply_rotary_pos_emb)
        self.kernels = kernels

    def norm(self, residual, delta, module):
        """The residual is updated in place."""
        return residual, self.kernels.add_rms_norm(
            residual, delta, module.weight, module.variance_epsilon
        )

    def rope(self, q, k, cos, sin):
        self.kernels.rope_(q, k, cos, sin)
        return q, k

    def kv_index(self, pool, slots):
        return slots  # the kernel finds a slot through the block stride itself

    def store(self, pool, layer: int, index, k, v) -> None:
        self.kernels.store_kv(*pool.layers[layer], index, k, v)


def llama_norm(module) -> bool:
    """weight * RMSNorm(x), rounded as Llama's: what the fused kernel computes (Gemma's (1 + w)
    norm, which rounds differently, is not)."""
    return hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def layer_ops(kernels, model, parts: list[LayerParts]) -> TorchOps | KernelOps:
    """The fused ops where they are built, the model's norms are Llama RMSNorms and its rotary
    embedding turns every dimension of a head (Phi-3 may turn only part of it)."""
    rotary = apply_rotary(model)
    config = model.config
    params = getattr(config, "rope_parameters", None) or {}
    fits = (
        kernels is not None
        and all(llama_norm(p.input_norm) and llama_norm(p.post_norm) for p in parts)
        and llama_norm(model.model.norm)
        and params.get("partial_rotary_factor", 1.0) == 1.0
    )
    return KernelOps(kernels, rotary) if fits else TorchOps(rotary)
