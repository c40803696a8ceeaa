"""The KV cache as it crosses the data plane: one contiguous [layers, 2, kv_heads, tokens, head_dim] tensor.

The prefill side packs its per-layer keys and values into that buffer (one copy); the decode
side receives straight into a buffer of the same shape and unpacks it into views (no copy).
"""

import torch
from transformers import DynamicCache

from shared.messages import KVLayout


def layout_of(config, model: str, dtype: torch.dtype) -> KVLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVLayout(model=model, dtype=str(dtype).removeprefix("torch."),
                    num_layers=config.num_hidden_layers,
                    num_kv_heads=config.num_key_value_heads, head_dim=head_dim)


def bytes_per_token(layout: KVLayout) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * itemsize


def empty_buffer(layout: KVLayout, num_tokens: int, device: str) -> torch.Tensor:
    shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
    return torch.empty(shape, dtype=getattr(torch, layout.dtype), device=device)


def pack(cache: DynamicCache, layout: KVLayout, device: str) -> torch.Tensor:
    """Copies a single-sequence cache into one contiguous buffer."""
    num_tokens = cache.get_seq_length()
    buffer = empty_buffer(layout, num_tokens, device)
    for i, layer in enumerate(cache.layers):
        buffer[i, 0].copy_(layer.keys[0])
        buffer[i, 1].copy_(layer.values[0])
    return buffer


def unpack(buffer: torch.Tensor, config) -> DynamicCache:
    """A cache whose layers start as views of the received buffer."""
    cache = DynamicCache(config=config)
    for i in range(buffer.shape[0]):
        cache.update(buffer[i, 0].unsqueeze(0), buffer[i, 1].unsqueeze(0), i)
    return cache
