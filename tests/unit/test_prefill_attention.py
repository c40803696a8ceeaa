"""The prefill attention kernel against scaled_dot_product_attention, and its batch invariance."""

import pytest
import torch
import torch.nn.functional as F

from shared.engine.prefill_attention import PrefillAttention
from tests.unit.block_tables import in_pool, scattered_tables

BLOCK = 16


def pool(g, blocks, kv_heads, dim, dtype):
    return (torch.randn(blocks * BLOCK, kv_heads, dim, generator=g).to(dtype) for _ in range(2))


def reference(q, keys, values, table, first, window=0):
    """Rows at positions first.. of one sequence, causal over its keys gathered from the pool."""
    rows = q.shape[0]
    length = first + rows
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(length)])
    k, v = (t[slots].transpose(0, 1)[None].float() for t in (keys, values))
    mask = torch.ones(rows, length, dtype=torch.bool).tril(first)
    if window:
        mask = mask.triu(first - window + 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), k, v, attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, window",
    [
        (torch.float32, 9, 3, 64, 0),  # SmolLM2's heads
        (torch.bfloat16, 9, 3, 64, 0),
        (torch.float32, 4, 4, 128, 0),  # no grouping, wide heads
        (torch.float32, 6, 2, 40, 0),  # a head size off the vector width
        (torch.float32, 8, 2, 64, 50),  # a sliding-window layer
    ],
)
def test_matches_sdpa_for_several_spans_in_one_call(kernel, dtype, heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(0)
    keys, values = pool(g, 80, kv_heads, dim, dtype)
    # (first position, rows): a whole prompt, a chunk deep in a long one, one prompt row, a
    # span across query and key tile boundaries
    spans = [(0, 37), (384, 128), (200, 1), (100, 190)]
    tables = scattered_tables(g, [f + n for f, n in spans], 80, BLOCK)
    total = sum(n for _, n in spans) + 3
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    attention = PrefillAttention(kernel, BLOCK, dim**-0.5)
    ranges, row = [], 2
    for first, n in spans:
        ranges.append((row, first, n))
        row += n
    attention(q, *in_pool(keys, values, BLOCK), attention.plan(tables, ranges), out, window or None)
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=2e-6)
    )
    for (row, first, n), table in zip(ranges, tables):
        expected = reference(q[row : row + n], keys, values, table, first, window)
        torch.testing.assert_close(out[row : row + n].float(), expected, **tolerance)
    assert out[:2].isnan().all() and out[-1].isnan().all()  # rows not planned are not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_cut_or_the_company(kernel, dtype):
    """The same prompt computed whole, in uneven pieces over several calls, and beside other
    sequences gives bit-identical rows."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, length = 9, 3, 64, 700
    keys, values = pool(g, 120, kv_heads, dim, dtype)
    table, other = scattered_tables(g, [length, 500], 120, BLOCK)
    q = torch.randn(length, heads, dim, generator=g).to(dtype)
    attention = PrefillAttention(kernel, BLOCK, dim**-0.5)
    whole = torch.empty_like(q)
    attention(q, *in_pool(keys, values, BLOCK), attention.plan([table], [(0, 0, length)]), whole)
    pieces = torch.empty_like(q)
    for a, b in [(0, 1), (1, 130), (130, 131), (131, 600), (600, 700)]:
        attention(
            q, *in_pool(keys, values, BLOCK), attention.plan([table], [(a, a, b - a)]), pieces
        )
    assert torch.equal(whole, pieces)
    crowd_q = torch.cat([torch.randn(500, heads, dim, generator=g).to(dtype), q[250:]])
    crowd = torch.empty_like(crowd_q)
    plan = attention.plan([other, table], [(0, 0, 500), (500, 250, length - 250)])
    attention(crowd_q, *in_pool(keys, values, BLOCK), plan, crowd)
    assert torch.equal(crowd[500:], whole[250:])


def test_q_may_be_a_view_of_the_fused_qkv_rows(kernel):
    g = torch.Generator().manual_seed(2)
    keys, values = pool(g, 8, 2, 16, torch.float32)
    qkv = torch.randn(40, 4 * 16 + 2 * 2 * 16, generator=g)
    q = qkv[:, :64].view(40, 4, 16)
    attention = PrefillAttention(kernel, BLOCK, 0.25)
    plan = attention.plan([[5, 1, 7]], [(0, 0, 40)])
    strided, contiguous = torch.empty(40, 4, 16), torch.empty(40, 4, 16)
    attention(q, *in_pool(keys, values, BLOCK), plan, strided)
    attention(q.contiguous(), *in_pool(keys, values, BLOCK), plan, contiguous)
    assert torch.equal(strided, contiguous)


@pytest.mark.parametrize(
    "tables, ranges, message",
    [
        ([[0, 99]], [(0, 0, 20)], "block out of range"),
        ([[0]], [(0, 0, 20)], "longer than its table"),
        ([[0, 1]], [(30, 0, 20)], "rows out of range"),
    ],
)
def test_bad_plans_are_refused(kernel, tables, ranges, message):
    keys, values = pool(torch.Generator().manual_seed(3), 4, 1, 16, torch.float32)
    q = torch.randn(40, 2, 16)
    attention = PrefillAttention(kernel, BLOCK, 0.25)
    with pytest.raises(RuntimeError, match=message):
        attention(
            q, *in_pool(keys, values, BLOCK), attention.plan(tables, ranges), torch.empty_like(q)
        )
