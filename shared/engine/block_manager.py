"""KV cache capacity in fixed-size blocks: what a worker can hold, who holds what, freed on every path.

Pure bookkeeping, no tensors. A sequence reserves the blocks for its whole budget (prompt plus
max_tokens) when it is admitted, so it can never run out of KV mid-generation.
"""

import math


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[str, int] = {}
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.num_blocks - self._used

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError("num_tokens must not be negative")
        return math.ceil(num_tokens / self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.free

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        if seq_id in self._held:
            raise ValueError(f"{seq_id} already holds blocks")
        need = self.blocks_for(num_tokens)
        if need > self.free:
            raise MemoryError(f"{seq_id} needs {need} KV blocks, {self.free} free")
        self._held[seq_id] = need
        self._used += need

    def deallocate(self, seq_id: str) -> None:
        """Frees what seq_id holds; freeing twice is harmless."""
        self._used -= self._held.pop(seq_id, 0)

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._held
