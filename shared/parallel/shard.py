"""Shard a model for rank `rank` of a tensor-parallel group, Megatron-style, in place.

Every decoder layer keeps the rows of q/k/v for the rank's query and KV heads (HeadSplit) and of
gate/up for its slice of the MLP's inner width (columns of the layer's output, as the weights are
[out, in]); o and down keep the matching columns of their input, and each of their outputs is
summed across the group (one all-reduce after each: `reduce_after_row_layers`). Their biases are
added once, on rank 0. Phi-3's fused q|k|v and gate|up keep each part's slice. Per-head norms
(Qwen3's q_norm, k_norm), embeddings, the final norm and the head are replicated. The config then
describes the rank's share (its heads, its inner width), so everything sized from it (the KV pool,
the attention modules) holds only the rank's part.
"""

import torch
import torch.distributed as dist
from torch import nn

from shared.engine.architecture import parts_of
from shared.parallel.heads import HeadSplit, TPError


def shard_model(model, tp: int, rank: int) -> HeadSplit:
    """Cuts `model` down to rank's share; TPError (naming the degrees that would work) when `tp`
    does not split its heads or its MLP."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    split = HeadSplit(heads, kv_heads, tp)
    layers = parts_of(model)
    inner = layers[0].gate_up_sizes[0]
    if inner % tp:
        raise TPError(f"a tensor-parallel degree of {tp} does not split the MLP's {inner} columns")
    q0, q1 = (h * head_dim for h in split.q_heads(rank))
    k0, k1 = (h * head_dim for h in split.kv_heads(rank))
    i0, i1 = inner // tp * rank, inner // tp * (rank + 1)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    for parts, layer in zip(layers, model.model.layers):
        parts_rows = [(0, q0, q1), (q_width, k0, k1), (q_width + kv_width, k0, k1)]
        if len(parts.qkv) == 1:  # fused q|k|v
            _keep_rows(parts.qkv[0], [(base + a, base + b) for base, a, b in parts_rows])
        else:
            for module, (_, a, b) in zip(parts.qkv, parts_rows):
                _keep_rows(module, [(a, b)])
        if len(parts.gate_up) == 1:  # fused gate|up
            _keep_rows(parts.gate_up[0], [(i0, i1), (inner + i0, inner + i1)])
        else:
            for module in parts.gate_up:
                _keep_rows(module, [(i0, i1)])
        _keep_columns(parts.o_proj, q0, q1, keep_bias=rank == 0)
        _keep_columns(parts.down, i0, i1, keep_bias=rank == 0)
        attn = layer.self_attn
        attn.num_key_value_groups = (heads // tp) // split.kv_per_rank
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = split.kv_per_rank
    config.head_dim = head_dim
    config.num_attention_heads = heads // tp
    config.num_key_value_heads = split.kv_per_rank
    config.intermediate_size = inner // tp
    return split


def reduce_after_row_layers(model, group=None) -> list:
    """Sums each o and down projection's output across the group (their handles, to remove)."""

    def all_reduce(module, args, output):
        dist.all_reduce(output, group=group)
        return output

    handles = []
    for parts in parts_of(model):
        handles.append(parts.o_proj.register_forward_hook(all_reduce))
        handles.append(parts.down.register_forward_hook(all_reduce))
    return handles


def _keep_rows(module: nn.Linear, ranges: list[tuple[int, int]]) -> None:
    rows = torch.cat([torch.arange(a, b) for a, b in ranges])
    module.weight = nn.Parameter(module.weight.data[rows].clone(), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
    module.out_features = len(rows)


def _keep_columns(module: nn.Linear, first: int, end: int, keep_bias: bool) -> None:
    module.weight = nn.Parameter(module.weight.data[:, first:end].clone(), requires_grad=False)
    if module.bias is not None and not keep_bias:
        module.bias = None
    module.in_features = end - first
