"""The bytes of a route: one run of KV heads of a prompt's blocks, from a prefill rank's pool into
a decode rank's, whatever the two groups' degrees.

Pools are block-major, [blocks, layers, 2, block_size, heads, head_dim] (shared.engine.kv_cache),
and each rank's holds only its heads, so a route's heads are a strided slice of both blocks. The
sender gathers the slice into one contiguous buffer (what a UCX message carries); the receiver
scatters it into its head range. Where both ranks hold exactly the route's heads (matched degrees,
nothing replicated), the slice is the whole block and no copy is needed beyond the send itself;
otherwise this is the one re-laying copy a mismatched transfer pays on each side.
"""

import torch

from shared.parallel.heads import Route


def gather(kv: torch.Tensor, blocks: list[int], route: Route) -> torch.Tensor:
    """The route's heads of `blocks` in the sender's pool `kv`, contiguous:
    [len(blocks), layers, 2, block_size, route.heads, head_dim]."""
    index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    first = route.source_offset
    return kv.index_select(0, index)[..., first : first + route.heads, :].contiguous()


def scatter(kv: torch.Tensor, blocks: list[int], route: Route, data: torch.Tensor) -> None:
    """Writes `data` (as `gather` made it) into the route's heads of `blocks` in the receiver's
    pool `kv`."""
    first = route.dest_offset
    for i, block in enumerate(blocks):
        kv[block, ..., first : first + route.heads, :] = data[i]
