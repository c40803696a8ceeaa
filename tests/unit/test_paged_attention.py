"""The decode attention kernel against scaled_dot_product_attention, and its fallback."""

import logging

import pytest
import torch
import torch.nn.functional as F

from shared.engine import kernels as cpu_kernels
from shared.engine import paged_attention
from shared.engine.model_runner import ModelRunner, SeqSpan
from tests.unit.block_tables import in_pool, scattered_tables

BLOCK = 4


def reference(q, keys, values, table, length, window=0):
    first = max(0, length - window) if window else 0
    slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(first, length)])
    k, v = keys[slots].transpose(0, 1)[None].float(), values[slots].transpose(0, 1)[None].float()
    return F.scaled_dot_product_attention(q[None, :, None].float(), k, v, enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_over_scattered_blocks(kernel, dtype):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 40  # dim not a multiple of the kernel's 16 lanes
    keys, values = (torch.randn(64 * BLOCK, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    tables = [[9, 3, 40, 1, 7], [2], [63, 62, 61]]
    lengths = [17, 1, 12]
    q = torch.randn(5, heads, dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    attention = paged_attention.PagedAttention(kernel, BLOCK, dim**-0.5)
    attention(q, *in_pool(keys, values, BLOCK), attention.plan(tables, lengths, [4, 0, 2]), out)
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    )
    for row, table, length in zip([4, 0, 2], tables, lengths):
        torch.testing.assert_close(
            out[row].float(), reference(q[row], keys, values, table, length), **tolerance
        )
    assert out[1].isnan().all() and out[3].isnan().all()  # rows not planned are not touched


# 64 and 128: the vector paths (a multiple of 8 and 16 lanes); contexts long enough, together,
# for the call to be split over threads, and a sliding window.
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 37])
def test_matches_sdpa_at_the_vector_head_sizes(kernel, dim, dtype, window):
    g = torch.Generator().manual_seed(dim + window)
    heads, kv_heads, lengths = 9, 3, [150, 1, 38, 64, 97, 5]
    keys, values = (
        torch.randn(256 * BLOCK, kv_heads, dim, generator=g).to(dtype) for _ in range(2)
    )
    tables = scattered_tables(g, lengths, 256, BLOCK)
    q = torch.randn(len(lengths), heads, dim, generator=g).to(dtype)
    out = torch.zeros_like(q)
    attention = paged_attention.PagedAttention(kernel, BLOCK, dim**-0.5)
    rows = list(range(len(lengths)))[::-1]
    attention(
        q, *in_pool(keys, values, BLOCK), attention.plan(tables, lengths, rows), out, window=window
    )
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    )
    for row, table, length in zip(rows, tables, lengths):
        expected = reference(q[row], keys, values, table, length, window)
        torch.testing.assert_close(out[row].float(), expected, **tolerance)


def test_q_may_be_a_view_of_the_fused_qkv_rows(kernel):
    g = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(16 * BLOCK, 2, 16, generator=g) for _ in range(2))
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16, generator=g)
    q = qkv[:, :64].view(3, 4, 16)
    attention = paged_attention.PagedAttention(kernel, BLOCK, 0.25)
    plan = attention.plan([[3, 5], [1], [9, 2]], [6, 2, 8], [0, 1, 2])
    strided, contiguous = torch.zeros(3, 4, 16), torch.zeros(3, 4, 16)
    attention(q, *in_pool(keys, values, BLOCK), plan, strided)
    attention(q.contiguous(), *in_pool(keys, values, BLOCK), plan, contiguous)
    assert torch.equal(strided, contiguous)


def test_a_row_gets_the_same_bits_whatever_else_is_in_the_call(kernel):
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(32 * BLOCK, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(8, 4, 16, generator=g)
    attention = paged_attention.PagedAttention(kernel, BLOCK, 0.25)
    tables = [[i, 31 - i, 10 + i, 20 + i] for i in range(8)]
    together = torch.zeros_like(q)
    attention(
        q,
        *in_pool(keys, values, BLOCK),
        attention.plan(tables, [9 + i for i in range(8)], list(range(8))),
        together,
    )
    for i in range(8):
        alone = torch.zeros_like(q)
        attention(
            q, *in_pool(keys, values, BLOCK), attention.plan([tables[i]], [9 + i], [i]), alone
        )
        assert torch.equal(alone[i], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bits_alone_and_in_a_call_split_over_threads(kernel, dtype):
    """A row alone is split by kv heads over the threads; in a batch whole rows are: either way
    each head's sums run in the same order."""
    g = torch.Generator().manual_seed(4)
    lengths = [40 + (i * 37) % 200 for i in range(24)]
    keys, values = (torch.randn(1600 * BLOCK, 3, 64, generator=g).to(dtype) for _ in range(2))
    tables = scattered_tables(g, lengths, 1600, BLOCK)
    q = torch.randn(len(lengths), 9, 64, generator=g).to(dtype)
    attention = paged_attention.PagedAttention(kernel, BLOCK, 0.125)
    together = torch.zeros_like(q)
    attention(
        q,
        *in_pool(keys, values, BLOCK),
        attention.plan(tables, lengths, list(range(len(lengths)))),
        together,
    )
    for i in (0, 7, 23):
        alone = torch.zeros_like(q)
        attention(
            q, *in_pool(keys, values, BLOCK), attention.plan([tables[i]], [lengths[i]], [i]), alone
        )
        assert torch.equal(alone[i], together[i])


def test_runner_with_the_kernels_matches_the_plain_torch_path(tiny_model):
    with_kernel = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=256, block_size=16, chunk=32)
    without = ModelRunner(
        tiny_model, "tiny", "cpu", pool_blocks=256, block_size=16, chunk=32, use_kernels=False
    )
    assert with_kernel.paged and not without.paged
    g = torch.Generator().manual_seed(2)
    segments = []
    for i in range(5):
        n = 5 + 19 * i
        tokens = torch.randint(3, 128, (n + 1,), generator=g).tolist()
        table = list(range(200 - 10 * i, 210 - 10 * i))[::-1]  # scattered, descending blocks
        for runner in (with_kernel, without):
            runner.forward([SeqSpan(table, tokens, 0, n)])
        segments.append(SeqSpan(table, tokens, n, n + 1))
    a, b = with_kernel.forward(segments), without.forward(segments)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(with_kernel.pool.kv, without.pool.kv, rtol=1e-4, atol=1e-5)


def test_without_a_compiler_the_runner_falls_back_with_a_warning(tiny_model, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", broken)
    # as if nothing were built yet
    monkeypatch.setattr(cpu_kernels, "_import_built", lambda name, directory: None)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=16, block_size=16, chunk=32)
    assert (
        not runner.paged
        and type(runner.ops).__name__ == "TorchOps"
        and "no C++ compiler" in caplog.text
    )
    logits = runner.forward([SeqSpan([0, 1], list(range(3, 20)), 0, 17)])
    assert logits.shape == (1, 128)


def test_a_table_too_short_for_its_context_is_refused(kernel):
    keys = values = torch.zeros(8 * BLOCK, 1, 16)
    q = torch.zeros(1, 1, 16)
    attention = paged_attention.PagedAttention(kernel, BLOCK, 0.25)
    with pytest.raises(RuntimeError, match="longer than its table"):
        attention(
            q,
            *in_pool(keys, values, BLOCK),
            attention.plan([[0, 1]], [BLOCK * 2 + 1], [0]),
            torch.zeros_like(q),
        )
    with pytest.raises(RuntimeError, match="block out of range"):
        attention(
            q,
            *in_pool(keys, values, BLOCK),
            attention.plan([[0, 8]], [BLOCK * 2], [0]),
            torch.zeros_like(q),
        )


# kernel: built first
def test_a_built_kernel_module_is_imported_without_a_build_step(kernel, monkeypatch):
    from torch.utils import cpp_extension

    def no_build(**kwargs):
        raise AssertionError("a cached build must load without cpp_extension.load (it forks ninja)")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.load() is not None
