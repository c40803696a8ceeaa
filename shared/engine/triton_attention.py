"""Paged attention for CUDA in Triton: decode rows and prompt spans over the same pool layout.

One kernel serves both. A program computes a tile of rows of one span for one kv head: the
`group` query heads that share the kv head are rows of the same tile (row r: position
first + r // group, head kv_head * group + r % group), so a key tile is loaded once for all of
them. Keys and values are read in place through the span's block table, BLOCK_N at a time, with
an online softmax in fp32; causal (and sliding-window) masking by absolute position. Prompt spans
use 64-row tiles, decode rows (a span of one row each) 16-row tiles.

The interfaces match the C++ kernels' (PagedAttention, PrefillAttention), so the model runner
takes either. On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which is how
`make test` checks it without a GPU (masks, indexing, the online softmax; a bf16 pool's dots run
on fp32 copies there, on bf16 tensor cores on a GPU).
"""

import os

import torch
import triton
import triton.language as tl

from shared.engine.paged_attention import padded_tables

# Triton's interpreter computes a bf16 tl.dot wrongly (3.9): there the dots run on fp32 copies.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _key_tile(
    k_ptr, v_ptr, table, k0, last, kv_head, d, dim_ok, block_stride,
    KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Positions k0.. (BLOCK_N of them, those < last) of one kv head, read through the table
    (blocks `block_stride` elements apart: every layer's KV lies between them)."""
    p = k0 + tl.arange(0, BLOCK_N)
    in_range = p < last
    block = tl.load(table + p // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    row = block * block_stride + (p % BLOCK_SIZE) * (KV_HEADS * DIM)
    rows = row[:, None] + kv_head * DIM + d[None, :]
    mask = in_range[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + rows, mask=mask, other=0.0)
    v = tl.load(v_ptr + rows, mask=mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return p, in_range, k, v


@triton.jit
def _softmax_step(
    q, k, v, p, in_range, position, valid, window, m, total, acc, PRECISION: tl.constexpr
):
    """One key tile into the running max `m`, sum `total` and weighted values `acc` of each row."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # fp32 accumulators
    seen = (p[None, :] <= position[:, None]) & in_range[None, :] & valid[:, None]
    if window > 0:
        seen = seen & (p[None, :] > position[:, None] - window)
    s = tl.where(seen, s, float("-inf"))
    top = tl.maximum(m, tl.max(s, 1))
    safe = tl.where(top == float("-inf"), 0.0, top)  # a row that has seen nothing yet
    weights = tl.where(seen, tl.exp(s - safe[:, None]), 0.0)
    alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - safe))
    total = total * alpha + tl.sum(weights, 1)
    acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
    return top, total, acc


@triton.jit
def _queries(q_ptr, rows, mask, scale, UPCAST: tl.constexpr):
    """The tile's queries, scaled; in their own dtype for the dots unless UPCAST."""
    q = tl.load(q_ptr + rows, mask=mask, other=0.0).to(tl.float32) * scale
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)  # bf16 stays bf16 for the dots
    return q


@triton.jit
def _paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ranges_ptr,
    q_row_stride, out_row_stride, table_width, scale, window, block_stride,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    span, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GROUP: tl.constexpr = HEADS // KV_HEADS
    per_tile: tl.constexpr = BLOCK_M // GROUP
    row0, first = tl.load(ranges_ptr + span * 3), tl.load(ranges_ptr + span * 3 + 1)
    count = tl.load(ranges_ptr + span * 3 + 2)
    if tile * per_tile >= count:
        return
    r = tl.arange(0, BLOCK_M)
    offset = tile * per_tile + r // GROUP  # within the span
    head = kv_head * GROUP + r % GROUP
    valid = (r < per_tile * GROUP) & (offset < count)
    d = tl.arange(0, DIM_P)
    dim_ok = d < DIM
    q_rows = (row0 + offset)[:, None] * q_row_stride + head[:, None] * DIM + d[None, :]
    q = _queries(q_ptr, q_rows, valid[:, None] & dim_ok[None, :], scale, UPCAST)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    last = first + tl.minimum(count, (tile + 1) * per_tile)  # one past the tile's last position
    start = first * 0  # of the positions' integer type, as the window branch's is
    if window > 0:
        start = tl.maximum(0, first + tile * per_tile - window + 1) // BLOCK_N * BLOCK_N
    table = tables_ptr + span * table_width
    for k0 in range(start, last, BLOCK_N):
        p, in_range, k, v = _key_tile(
            k_ptr, v_ptr, table, k0, last, kv_head, d, dim_ok, block_stride,
            KV_HEADS, DIM, BLOCK_SIZE, BLOCK_N, UPCAST,
        )  # fmt: skip
        m, total, acc = _softmax_step(
            q, k, v, p, in_range, first + offset, valid, window, m, total, acc, PRECISION
        )
    result = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    out_rows = (row0 + offset)[:, None] * out_row_stride + head[:, None] * DIM + d[None, :]
    tl.store(
        out_ptr + out_rows,
        result.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & dim_ok[None, :],
    )


def paged_attention(
    q, keys, values, plan, out, block_size: int, scale: float, window: int, rows: int
) -> None:
    """Rows ranges[i] = (first row, first position, count) of q attend causally to sequence i's
    keys through tables[i]; results into the same rows of out. plan = (tables, ranges, the
    longest count) (no device sync for the grid). `rows`: query rows per program. keys, values:
    one layer of the pool, [blocks, block_size, kv_heads, dim] views (see kv_cache.py)."""
    tables, ranges, longest = plan
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[2]
    if keys.stride() != values.stride() or keys.stride()[1:] != (kv_heads * dim, dim, 1):
        raise ValueError("keys and values: one layer of the pool, contiguous within a block")
    group = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(max(rows, group)))
    per_tile = block_m // group
    grid = (ranges.shape[0], kv_heads, triton.cdiv(longest, per_tile))
    _paged_attention[grid](
        q, keys, values, out, tables, ranges,
        q.stride(0), out.stride(0), tables.shape[1], scale, window, keys.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, DIM_P=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact fp32
        UPCAST=q.dtype == torch.float32 or INTERPRETED,
    )  # fmt: skip


class _Paged:
    name = "paged-triton"  # in the kernel report

    def __init__(self, block_size: int, scale: float, device="cuda"):
        self.block_size = block_size
        self.scale = scale
        self.device = device

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        return padded_tables(tables, torch.int32, self.device)


class TritonPagedAttention(_Paged):
    """Decode rows (one per sequence): PagedAttention's interface."""

    def plan(self, tables: list[list[int]], lengths: list[int], rows: list[int]):
        ranges = [(row, length - 1, 1) for row, length in zip(rows, lengths, strict=True)]
        spans = torch.tensor(ranges, dtype=torch.long, device=self.device)
        return self._tables(tables), spans, 1

    def __call__(self, q, keys, values, plan, out, window: int | None = None) -> None:
        paged_attention(q, keys, values, plan, out, self.block_size, self.scale, window or 0, 1)


class TritonPrefillAttention(_Paged):
    """Prompt spans: PrefillAttention's interface."""

    def plan(self, tables: list[list[int]], ranges: list[tuple[int, int, int]]):
        spans = torch.tensor(ranges, dtype=torch.long, device=self.device).view(-1, 3)
        return self._tables(tables), spans, max(count for _, _, count in ranges)

    def __call__(self, q, keys, values, plan, out, window: int | None = None) -> None:
        paged_attention(q, keys, values, plan, out, self.block_size, self.scale, window or 0, 64)
