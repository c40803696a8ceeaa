"""PagedAttention: the single-row attention of a step in one kernel call per layer.

Decode tokens (and a prompt's one-token tail) read their keys and values in place through the
sequence's block table: no gather of scattered blocks and no per-sequence
scaled_dot_product_attention call. Each (row, kv head) is computed by one thread in a fixed
order, so a row's result does not depend on the rest of the batch.
"""

import torch


def padded_tables(tables: list[list[int]], dtype=torch.long, device="cpu") -> torch.Tensor:
    """Block tables as one [n, longest] tensor, padded with block 0 (never read past a length)."""
    width = max(len(t) for t in tables)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=dtype, device=device)


class PagedAttention:
    name = "paged-c++"  # in the kernel report

    def __init__(self, kernels, block_size: int, scale: float):
        self.kernels = kernels
        self.block_size = block_size
        self.scale = scale

    def plan(self, tables: list[list[int]], lengths: list[int], rows: list[int]):
        """Tensors for one forward pass: block tables (padded), context lengths, output rows."""
        lengths_, rows_ = (torch.tensor(x, dtype=torch.long) for x in (lengths, rows))
        return padded_tables(tables), lengths_, rows_

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan,
        out: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """q, out [rows, heads, dim]; keys, values [slots, kv_heads, dim]; writes out[plan rows].
        `window`: a sliding-window layer's, each row attends to its last `window` positions."""
        tables, lengths, rows = plan
        self.kernels.decode_attention(
            q, keys, values, tables, lengths, rows, out, self.block_size, self.scale, window or 0
        )
