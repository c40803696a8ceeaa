"""Assembly: one piece of KV put together on the sending side in the receiving rank's layout,
from views of the sending group's rank pools: runs of blocks, and of each the KV heads a route
carries (a strided slice of a block where the rank holds more heads, one of several ranks'
head ranges where the receiver holds more). The one copy a transfer between groups of different
degrees pays, made where the sender's pools are all mapped.

A plane that gathers (the data-plane helper) is handed the Assembly: each part's place in the
piece as a byte offset, shape and strides, and its source view; it copies them into one buffer
of its own, off the worker's threads. Otherwise `assembled` does it with torch.
"""

import math
from dataclasses import dataclass

import torch

from shared.dataplane.plane import Assembly


@dataclass(frozen=True)
class Part:
    """The source's blocks land at block `block` of the piece, its heads at `head` of `heads`."""

    block: int
    head: int
    heads: int  # the piece's: every head the receiving rank holds
    source: torch.Tensor  # [blocks, layers, 2, block_size, its heads, head_dim], maybe strided


def head_slice(blocks: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """KV heads [first, first + count) of a pool's blocks [n, layers, 2, block_size, heads, dim]:
    the blocks themselves when that is all of their heads, else a strided view."""
    if first == 0 and count == blocks.shape[-2]:
        return blocks
    return blocks[..., first : first + count, :]


def _shape(parts: list[Part]) -> list[int]:
    """The piece as a tensor: every part's blocks, the receiver's heads."""
    first = parts[0].source
    blocks = max(p.block + p.source.shape[0] for p in parts)
    return [blocks, *first.shape[1:-2], parts[0].heads, first.shape[-1]]


def assembly(parts: list[Part]) -> Assembly:
    shape = _shape(parts)
    size = parts[0].source.element_size()
    strides = [math.prod(shape[i + 1 :]) * size for i in range(len(shape))]  # contiguous, bytes
    strides[-1] = 1
    out = []
    for p in parts:
        offset = p.block * strides[0] + p.head * strides[-2]
        part_shape = [*p.source.shape[:-1], p.source.shape[-1] * size]
        out.append((offset, part_shape, strides, p.source))
    return Assembly(math.prod(shape) * size, out)


def assembled(parts: list[Part]) -> torch.Tensor:
    """The piece, contiguous, put together with torch (on the pools' device)."""
    first = parts[0].source
    out = torch.empty(_shape(parts), dtype=first.dtype, device=first.device)
    for p in parts:
        count = p.source.shape[0]
        out[p.block : p.block + count, ..., p.head : p.head + p.source.shape[-2], :] = p.source
    return out
