"""PrefillAttention: the prompt rows of a step in one kernel call per layer.

Each span of several rows (prompt chunks, whole prompts, a preempted sequence's recomputation)
attends causally to its sequence's keys and values read in place through its block table, a
tile of keys at a time with an online softmax (csrc/prefill_attention.cpp): no gather, no mask
tensor, no per-chunk call. A row's result depends only on its own query and the keys it sees,
so a prompt gets the same bits however it was cut into chunks and whatever shares its step.
"""

import torch

from shared.engine.paged_attention import padded_tables


class PrefillAttention:
    name = "paged-c++"  # in the kernel report

    def __init__(self, kernels, block_size: int, scale: float):
        self.kernels = kernels
        self.block_size = block_size
        self.scale = scale

    def plan(self, tables: list[list[int]], ranges: list[tuple[int, int, int]]):
        """Tensors for one forward pass: block tables (padded) and (first row, first position,
        rows) of each span."""
        return padded_tables(tables), torch.tensor(ranges, dtype=torch.long).view(-1, 3)

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan,
        out: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """q, out [rows, heads, dim]; keys, values [slots, kv_heads, dim]; writes the planned rows
        of out. `window`: a sliding-window layer's, each row attends to its last `window` positions."""
        tables, ranges = plan
        self.kernels.prefill_attention(
            q, keys, values, tables, ranges, out, self.block_size, self.scale, window or 0
        )
