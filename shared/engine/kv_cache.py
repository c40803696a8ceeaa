"""The paged KV pool, and the KV layout as it crosses the data plane.

The pool is block-major: one tensor [blocks, layers, 2, block_size, kv_heads, head_dim], so a
run of consecutive blocks holds every layer's keys and values for its positions as one
contiguous range. A KV transfer moves such a run as one piece, straight from one pool into the
other (see shared.dataplane): a piece costs tens of microseconds whatever its size, so one per
run, not one per layer and keys|values, is what lets a transfer approach a plain copy. The
attention kernels read a layer as [blocks, block_size, kv_heads, head_dim] views, whose block
stride spans every layer.
"""

import math

import torch

from shared.engine.architecture import architecture_of, layer_windows
from shared.engine.shared_region import SharedRegion
from shared.values.kv_layout import KVLayout

POOL_ORDER = "blocks"  # KVLayout.pool_order of this pool


def layout_of(config, model: str, dtype: torch.dtype, block_size: int = 16) -> KVLayout:
    """What a prefill and a decode worker compare before any KV moves: the model and its
    architecture, the dtype, the pool's shape and each layer's sliding window."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = [w or 0 for w in layer_windows(config)]
    return KVLayout(
        model=model,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        block_size=block_size,
        architecture=architecture_of(config),
        windows=windows if any(windows) else [],
        pool_order=POOL_ORDER,
    )


def bytes_per_token(layout: KVLayout) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * itemsize


class KVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        device: str,
        shared: bool = False,
        scratch: bool = False,
        region: SharedRegion | None = None,
    ):
        """`scratch`: one block more, past the `num_blocks` handed out, whose first slot
        (`scratch_slot`) takes the KV of rows that only pad a step (see cuda_graphs.py).
        `region`: the shared memory to hold it (made by another process: a tensor-parallel
        rank's pool, which its group's rank 0 maps too); `shared` makes a new one."""
        if layout.block_size != block_size:
            raise ValueError("the layout's block size and the pool's differ")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.scratch_slot = num_blocks * block_size if scratch else None
        layers, heads, dim = layout.num_layers, layout.num_kv_heads, layout.head_dim
        shape = (num_blocks + scratch, layers, 2, block_size, heads, dim)
        dtype = getattr(torch, layout.dtype)
        self.region = None  # with `shared`: the memory a data-plane helper process maps too
        if shared or region is not None:
            if device != "cpu":
                raise ValueError("only a host-memory KV pool can be shared with a helper process")
            nbytes = math.prod(shape) * dtype.itemsize
            if region is not None and region.nbytes != nbytes:
                raise ValueError(f"a {region.nbytes}-byte region for a {nbytes}-byte KV pool")
            self.region = region or SharedRegion(nbytes)
            self.kv = self.region.tensor().view(dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's keys and values as [blocks, block_size, heads, dim] views (what the
        # attention kernels read), and as rows of [heads, dim] from its first one on (what a
        # write indexes: `rows(slots)` are the same indices in every one of them).
        self.layers = [(self.kv[:, i, 0], self.kv[:, i, 1]) for i in range(layers)]
        flat = self.kv.view(-1, heads, dim)
        self._halves = [flat[i * block_size :] for i in range(2 * layers)]

    def slot_list(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slot indices of token positions [start, end) of a sequence with this block table, as
        plain ints (a batch makes one tensor of all its sequences' slots). A slot names a
        position (block * block_size + offset), not an address: the kernels find it through
        the block's stride."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """`slot_list` as a tensor on the pool's device."""
        slots = self.slot_list(block_table, start, end)
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The row indices `write` and `read` take for `slots`: alike for every layer's keys
        and values, so a pass computes them once, not per layer."""
        size = self.block_size
        return slots // size * (2 * self.layout.num_layers * size) + slots % size

    def copy_block(self, source: int, target: int) -> None:
        """Block `target` gets block `source`'s keys and values, every layer."""
        self.kv[target] = self.kv[source]

    def write(
        self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """`rows`: `rows(slots)`."""
        self._halves[2 * layer].index_copy_(0, rows, keys)
        self._halves[2 * layer + 1].index_copy_(0, rows, values)

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: `rows(slots)`."""
        return (
            self._halves[2 * layer].index_select(0, rows),
            self._halves[2 * layer + 1].index_select(0, rows),
        )

    def blocks(self, first: int, count: int) -> torch.Tensor:
        """Consecutive blocks, every layer's keys and values: one contiguous view, what a KV
        transfer reads or writes as one piece."""
        return self.kv[first : first + count]

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        """A sequence's KV as one tensor [layers, 2, tokens, heads, dim] (tests compare these)."""
        size = self.block_size
        return self.kv[slots // size, :, :, slots % size].permute(1, 2, 0, 3, 4).contiguous()
