"""Architecture: which checkpoints the engine runs, and what each family's layers are made of.

The engine runs a checkpoint's own Hugging Face modules (embedding, norms, MLP activation,
rotary tables, its `apply_rotary_pos_emb`) with its own attention over the paged pool and its
own packed projections. The supported families differ in a few places, which `LayerParts`
names per layer:

- Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3, Gemma, Phi-3;
- q/k/v (and o, MLP) biases are carried by the projections;
- Qwen3 normalizes q and k per head before the rotary embedding (`q_norm`, `k_norm`);
- Phi-3 stores q|k|v and gate|up fused (one module each, split by `qkv_sizes`, `gate_up_sizes`);
- Gemma's (1 + w) RMSNorm, tanh GELU and scaled embedding are its own modules, run as they are;
- sliding-window layers (Mistral, Phi-3, Qwen with `use_sliding_window`) attend to the last
  `window` positions.

Anything else is refused at start (`check`), naming what is supported: an option we do not
implement must never be silently ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher checks a config without importing torch
    from torch import nn

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Config options that change the computation in ways the engine does not implement.
REFUSED_OPTIONS = (
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "attention_chunk_size",
    "quantization_config",
)


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


def architecture_of(config) -> str:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else ""


def check(config, arch: str = "") -> str:
    """The checkpoint's family name; UnsupportedModel when anything in its config is not run
    faithfully by the engine. `arch`: the model class, where known (else config.json's)."""
    arch = arch or architecture_of(config)
    if arch not in FAMILIES:
        raise UnsupportedModel(
            f"architecture {arch or '(none in config.json)'!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    for option in REFUSED_OPTIONS:
        if getattr(config, option, None) not in (None, False):
            raise UnsupportedModel(f"{arch}: config option {option!r} is not supported")
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        raise UnsupportedModel(f"{arch}: pretraining_tp > 1 is not supported")
    rope = _rope_type(config)
    if rope not in ROPE_TYPES:
        raise UnsupportedModel(
            f"{arch}: rope type {rope!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    unknown = set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES)
    if unknown:
        raise UnsupportedModel(f"{arch}: layer types {sorted(unknown)} are not supported")
    return FAMILIES[arch]


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    if params and not isinstance(params.get("rope_type", ""), str):
        return "per-layer"  # nested per layer type: not one of ours
    return params.get("rope_type", "default")


@dataclass
class LayerParts:
    """One decoder layer as the runner computes it."""

    qkv: list[nn.Module]  # q, k, v projections, or the one fused module
    qkv_sizes: list[int]  # the widths of q, k and v in the fused output
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o_proj: nn.Module
    gate_up: list[nn.Module]  # gate and up projections, or the one fused module
    gate_up_sizes: list[int]
    down: nn.Module
    act: nn.Module
    input_norm: nn.Module
    post_norm: nn.Module
    window: int | None  # attends to the last `window` positions; None: to all


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window, as Hugging Face's modules apply it: Mistral and Phi-3 window
    every layer when `sliding_window` is set, Qwen2/Qwen3 the layers `layer_types` says; Llama
    and Gemma never (a stray `sliding_window` in their config.json is ignored, as HF does)."""
    window = getattr(config, "sliding_window", None)
    kind = getattr(config, "model_type", "")
    layers = config.num_hidden_layers
    if kind in ("mistral", "phi3"):
        return [window] * layers
    types = getattr(config, "layer_types", None) if kind in ("qwen2", "qwen3") else None
    if types is None:
        return [None] * layers
    return [window if t == "sliding_attention" else None for t in types]


def parts_of(model) -> list[LayerParts]:
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    out = []
    for layer, window in zip(model.model.layers, layer_windows(config)):
        attn, mlp = layer.self_attn, layer.mlp
        fused_qkv = hasattr(attn, "qkv_proj")
        fused_mlp = hasattr(mlp, "gate_up_proj")
        inner = mlp.gate_up_proj.out_features // 2 if fused_mlp else mlp.gate_proj.out_features
        out.append(
            LayerParts(
                [attn.qkv_proj] if fused_qkv else [attn.q_proj, attn.k_proj, attn.v_proj],
                qkv_sizes,
                getattr(attn, "q_norm", None),
                getattr(attn, "k_norm", None),
                attn.o_proj,
                [mlp.gate_up_proj] if fused_mlp else [mlp.gate_proj, mlp.up_proj],
                [inner, inner],
                mlp.down_proj,
                getattr(mlp, "act_fn", None) or mlp.activation_fn,
                layer.input_layernorm,
                layer.post_attention_layernorm,
                window,
            )
        )
    return out


def apply_rotary(model):
    """The family's own `apply_rotary_pos_emb` (Phi-3's rotates only part of each head when
    `partial_rotary_factor` < 1)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
