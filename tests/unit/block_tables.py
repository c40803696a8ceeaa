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
