"""The paged KV pool, and the KV layout as it crosses the data plane.

The pool is one tensor [layers, 2, slots, kv_heads, head_dim], slot = block * block_size + offset.
A transfer carries a sequence's KV as [layers, 2, tokens, kv_heads, head_dim]: the prefill side
gathers it from its blocks (one copy), the decode side scatters it into its own (one copy).
"""

import torch

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
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    return torch.empty(shape, dtype=getattr(torch, layout.dtype), device=device)


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: str):
        self.layout = layout
        self.block_size = block_size
        self.device = device
        shape = (layout.num_layers, 2, num_blocks * block_size, layout.num_kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=getattr(torch, layout.dtype), device=device)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of token positions [start, end) of a sequence with this block table."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).to(self.device)

    def contiguous_run(self, block_table: list[int], num_tokens: int) -> int | None:
        """The first slot when positions [0, num_tokens) sit in consecutive blocks (read in place), else None."""
        needed = -(-num_tokens // self.block_size)
        first = block_table[0]
        for offset in range(1, needed):
            if block_table[offset] != first + offset:
                return None
        return first * self.block_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.kv[layer, 0].index_copy_(0, slots, keys)
        self.kv[layer, 1].index_copy_(0, slots, values)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0].index_select(0, slots), self.kv[layer, 1].index_select(0, slots)

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        """A sequence's KV as one contiguous transfer buffer [layers, 2, tokens, heads, dim]."""
        return self.kv.index_select(2, slots)

    def load(self, slots: torch.Tensor, buffer: torch.Tensor) -> None:
        """Writes a received transfer buffer into the given slots."""
        self.kv.index_copy_(2, slots, buffer)
