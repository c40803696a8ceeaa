"""The paged KV pool, and the KV layout as it crosses the data plane.

The pool is one tensor [layers, 2, slots, kv_heads, head_dim], slot = block * block_size + offset,
so the keys (or values) of one layer over a run of consecutive blocks are one contiguous range:
that is what a KV transfer writes into directly (see shared.dataplane).
"""

import math

import torch

from shared.control.messages import KVLayout
from shared.engine.architecture import architecture_of, layer_windows
from shared.engine.shared_region import SharedRegion


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
    ):
        """`scratch`: one block more, past the `num_blocks` handed out, whose first slot
        (`scratch_slot`) takes the KV of rows that only pad a step (see cuda_graphs.py)."""
        if layout.block_size != block_size:
            raise ValueError("the layout's block size and the pool's differ")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.scratch_slot = num_blocks * block_size if scratch else None
        shape = (
            layout.num_layers,
            2,
            (num_blocks + scratch) * block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        dtype = getattr(torch, layout.dtype)
        self.region = None  # with `shared`: the memory a data-plane helper process maps too
        if shared:
            if device != "cpu":
                raise ValueError("only a host-memory KV pool can be shared with a helper process")
            self.region = SharedRegion(math.prod(shape) * dtype.itemsize)
            self.kv = self.region.tensor().view(dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._halves = [[layer[0], layer[1]] for layer in self.kv]  # span() slices these

    def slot_list(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slot indices of token positions [start, end) of a sequence with this block table, as
        plain ints (a batch makes one tensor of all its sequences' slots)."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """`slot_list` as a tensor on the pool's device."""
        slots = self.slot_list(block_table, start, end)
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def contiguous_run(self, block_table: list[int], num_tokens: int) -> int | None:
        """The first slot when positions [0, num_tokens) sit in consecutive blocks (read in place), else None."""
        needed = -(-num_tokens // self.block_size)
        first = block_table[0]
        for offset in range(1, needed):
            if block_table[offset] != first + offset:
                return None
        return first * self.block_size

    def copy_block(self, source: int, target: int) -> None:
        """Block `target` gets block `source`'s keys and values, every layer."""
        size = self.block_size
        self.kv[:, :, target * size : (target + 1) * size] = self.kv[
            :, :, source * size : (source + 1) * size
        ]

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.kv[layer, 0].index_copy_(0, slots, keys)
        self.kv[layer, 1].index_copy_(0, slots, values)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0].index_select(0, slots), self.kv[layer, 1].index_select(0, slots)

    def span(self, layer: int, kv: int, first_slot: int, num_slots: int) -> torch.Tensor:
        """Keys (kv=0) or values (kv=1) of one layer over consecutive slots: a contiguous view
        (a slice of a view made once: a KV transfer takes hundreds of them)."""
        return self._halves[layer][kv][first_slot : first_slot + num_slots]

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        """A sequence's KV as one contiguous transfer buffer [layers, 2, tokens, heads, dim]."""
        return self.kv.index_select(2, slots)
