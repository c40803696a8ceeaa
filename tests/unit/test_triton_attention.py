"""The Triton paged attention kernel (the CUDA path), run on CPU in Triton's interpreter against
scaled_dot_product_attention and against Tandem's C++ kernels: every change to it is checked in
`make test`, without a GPU."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it for the session
    pytest.skip("needs TRITON_INTERPRET=1 from the start", allow_module_level=True)

from shared.engine.triton_attention import (  # noqa: E402
    TritonPagedAttention,
    TritonPrefillAttention,
)
from tests.unit.block_tables import in_pool, scattered_tables  # noqa: E402
from tests.unit.test_prefill_attention import BLOCK, pool, reference  # noqa: E402


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, window",
    [
        (torch.float32, 9, 3, 64, 0),  # SmolLM2's heads
        (torch.bfloat16, 4, 2, 32, 0),
        (torch.float32, 6, 2, 40, 0),  # a head size that is not a power of two
        (torch.float32, 4, 1, 16, 20),  # MQA, a sliding window
    ],
)
def test_prompt_spans_match_sdpa(dtype, heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(0)
    keys, values = pool(g, 24, kv_heads, dim, dtype)
    spans = [(0, 37), (64, 30), (50, 1)]  # a whole prompt, a later chunk, one prompt row
    tables = scattered_tables(g, [f + n for f, n in spans], 24, BLOCK)
    total = sum(n for _, n in spans) + 2
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    attention = TritonPrefillAttention(BLOCK, dim**-0.5, device="cpu")
    ranges, row = [], 1
    for first, n in spans:
        ranges.append((row, first, n))
        row += n
    attention(q, *in_pool(keys, values, BLOCK), attention.plan(tables, ranges), out, window or None)
    tolerance = (
        dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=2e-6)
    )
    for (row, first, n), table in zip(ranges, tables):
        expected = reference(q[row : row + n], keys, values, table, first, window)
        torch.testing.assert_close(out[row : row + n].float(), expected, **tolerance)
    assert out[0].isnan().all() and out[-1].isnan().all()  # rows not planned are not touched


def test_decode_rows_match_the_cpp_kernel():
    from shared.engine import kernels
    from shared.engine.paged_attention import PagedAttention

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 9, 3, 64
    keys, values = pool(g, 30, kv_heads, dim, torch.float32)
    lengths = [1, 45, 130]
    tables = scattered_tables(g, lengths, 30, BLOCK)
    q = torch.randn(4, heads, dim, generator=g)
    rows = [3, 0, 2]
    triton_out, cpp_out = torch.zeros_like(q), torch.zeros_like(q)
    triton = TritonPagedAttention(BLOCK, dim**-0.5, device="cpu")
    triton(q, *in_pool(keys, values, BLOCK), triton.plan(tables, lengths, rows), triton_out)
    cpp = PagedAttention(kernels.load(), BLOCK, dim**-0.5)
    cpp(q, *in_pool(keys, values, BLOCK), cpp.plan(tables, lengths, rows), cpp_out)
    torch.testing.assert_close(triton_out, cpp_out, rtol=1e-5, atol=2e-6)
    assert triton_out[1].abs().sum() == 0  # row 1 was not planned


def test_a_model_runner_on_triton_attention_matches_the_cpp_kernels(tiny_model, rand_tokens):
    """The runner's plumbing for the CUDA path: plans, the prompt/decode split and the pool
    reads, with Triton's attention in place of the C++ kernels in one pass of both kinds."""
    from shared.engine.model_runner import ModelRunner, SeqSpan

    def table(first_block: int, tokens: int) -> list[int]:
        return list(range(first_block, first_block + -(-tokens // BLOCK)))

    prompt, other = rand_tokens(40), rand_tokens(20)

    def run(triton: bool):
        runner = ModelRunner(
            tiny_model, "tiny", "cpu", pool_blocks=32, block_size=BLOCK, chunk=32, triton=triton
        )
        first = runner.forward([SeqSpan(table(0, 41), prompt, 0, 40, prompt=True)])
        token = int(first[0].argmax())
        decode = SeqSpan(table(0, 41), prompt + [token], 40, 41)
        both = runner.forward([decode, SeqSpan(table(10, 20), other, 0, 20, prompt=True)])
        return first, both, runner.kernel_report().attention

    first, both, name = run(triton=True)
    cpp_first, cpp_both, cpp_name = run(triton=False)
    assert (name, cpp_name) == ("paged-triton", "paged-c++")
    torch.testing.assert_close(first, cpp_first, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(both, cpp_both, rtol=1e-4, atol=1e-5)
