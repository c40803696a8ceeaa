"""Block tables for the attention kernels' tests."""

import torch


def scattered_tables(g, lengths, blocks, block_size):
    """One table per context length: blocks drawn without repeats from `blocks`, in a random
    order (`g`), so no context's blocks are contiguous or shared."""
    order = torch.randperm(blocks, generator=g).tolist()
    tables = []
    for length in lengths:
        need = -(-length // block_size)
        tables.append(order[:need])
        order = order[need:]
    return tables


def in_pool(keys, values, block_size: int, layers: int = 3, layer: int = 1):
    """keys, values [slots, kv_heads, dim] as one layer of a block-major pool whose other layers
    hold noise: the [blocks, block_size, kv_heads, dim] views the kernels read (a kernel that
    steps over a block's stride wrongly reads the noise)."""
    slots, kv_heads, dim = keys.shape
    shape = (slots // block_size, layers, 2, block_size, kv_heads, dim)
    noise = torch.Generator().manual_seed(layers)
    pool = torch.randn(shape, generator=noise).to(keys.dtype) * 100
    pool[:, layer, 0] = keys.view(shape[0], block_size, kv_heads, dim)
    pool[:, layer, 1] = values.view(shape[0], block_size, kv_heads, dim)
    return pool[:, layer, 0], pool[:, layer, 1]
