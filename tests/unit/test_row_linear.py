"""RowLinear (csrc/row_linear.cpp): every projection's rows, against torch's linear, each row's
bits independent of the rest of the call; a decode row's logits the same beside prompt rows as
alone, with no padding to an invariant row count."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.model_runner import ModelRunner, SeqSpan
from shared.engine.projection import Projection
from shared.engine.row_linear import RowLinear, pack_rows

# (outputs, inputs): a panel and a half, fewer outputs than a panel, odd sizes, SmolLM2's down
SHAPES = [(48, 64), (7, 5), (101, 37), (576, 1536)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True])
def test_rows_match_torch_and_each_other_in_any_batch(kernel, dtype, shape, bias):
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    rows = RowLinear(kernel, weight, b, dtype)
    x = torch.randn(40, k).to(dtype)  # past the register block, and past bf16's widening point
    full = rows(x)
    assert full.dtype == dtype and full.shape == (40, n)
    expected = F.linear(
        x.float(), weight.to(dtype).float(), None if b is None else b.to(dtype).float()
    )
    if dtype == torch.float32:
        torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-4)
    else:  # computed in float32, rounded once at the end
        torch.testing.assert_close(full.float(), expected, rtol=1e-2, atol=1e-2)
    for m in range(1, 40):  # every row of a smaller call: the same bits
        assert torch.equal(rows(x[:m]), full[:m]), m
    assert torch.equal(rows(x[17:18]), full[17:18])


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_a_bf16_call_rounds_its_float32_sums_once_and_can_hand_them_back_unrounded(kernel, rows):
    """float_out (the output head's logits): the sums themselves; the bf16 output is exactly
    those sums rounded to nearest even. A bf16 input with a row stride (a narrowed tensor) is
    widened by the kernel, the same bits as a contiguous copy."""
    torch.manual_seed(3)
    weight, b = torch.randn(101, 64), torch.randn(101)
    layer = RowLinear(kernel, weight, b, torch.bfloat16)
    wide = torch.randn(rows, 80).to(torch.bfloat16)
    x = wide[:, 8:72]  # rows 80 apart
    sums = layer(x, float_out=True)
    assert sums.dtype == torch.float32 and sums.shape == (rows, 101)
    assert torch.equal(layer(x), sums.to(torch.bfloat16))
    assert torch.equal(layer(x.contiguous(), float_out=True), sums)
    expected = F.linear(x.float(), weight.bfloat16().float(), b)  # the bias as given, float32
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-4)
    fp32 = RowLinear(kernel, weight, b, torch.float32)
    assert torch.equal(fp32(x.float(), float_out=True), fp32(x.float()))


def test_panels_hold_the_weight_in_panel_order():
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    panels = pack_rows(weight, 4)
    assert panels.shape == (2, 3, 4)
    assert torch.equal(panels[0], weight[:4].t()) and torch.equal(panels[1, :, 0], weight[4])
    assert not panels[1, :, 1:].any()  # past the last output: zeros


def test_bf16_panels_in_k_pairs_hold_the_weight_in_pair_order(kernel):
    weight = torch.arange(3 * 4, dtype=torch.float32).view(3, 4).bfloat16()
    panels = pack_rows(weight, 2, pairs=True)  # [2 panels, K=4 as 2 pairs x (2 outputs x 2)]
    assert panels.shape == (2, 4, 2)
    assert panels[0].flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # k-pair 0 of rows 0, 1...
    assert panels[1].flatten().tolist() == [8, 9, 0, 0, 10, 11, 0, 0]
    odd = torch.ones(3, 5).bfloat16()  # an odd K is never paired
    assert torch.equal(pack_rows(odd, 2, pairs=True), pack_rows(odd, 2))


def test_bf16_panels_in_halves_interleave_a_panels_two_vectors():
    """Position 2j holds output j, 2j + 1 output j + panel / 2: one load of 32-bit words gives
    both vectors (low halves shifted, high halves masked)."""
    weight = torch.arange(6 * 2, dtype=torch.float32).view(6, 2).bfloat16()
    panels = pack_rows(weight, 4, halves=True)  # outputs 0..3, then 4, 5 and two zeros
    assert panels.shape == (2, 2, 4)
    assert panels[0, 0].tolist() == [0, 4, 2, 6]  # k = 0 of outputs 0, 2, 1, 3
    assert panels[1, 1].tolist() == [9, 0, 11, 0]  # k = 1 of outputs 4, (6), 5, (7)


def test_bf16_rounding_matches_torch_on_ties_overflow_and_nan(kernel):
    """A zero input's sums are the bias itself: its bf16 rounding, vectorized in the kernel, is
    torch's, bit for bit (ties to even, overflow to infinity, subnormals; a NaN as c10's 0x7FC0)."""
    one = 1.0 + 2.0**-8  # a tie between 1 and 1 + 2^-7: to even, 1
    specials = [one, 1.0 + 3 * 2.0**-8, -one, 3.4e38, -3.4e38, float("inf"), float("-inf")]
    specials += [float("nan"), 1e-40, -1e-40, 2.0**-133, 0.0, 65504.0, 1.0 - 2.0**-24]
    torch.manual_seed(4)
    bias = torch.cat([torch.tensor(specials), torch.randn(37) * 1e3])
    layer = RowLinear(kernel, torch.randn(len(bias), 24), bias, torch.bfloat16)
    for rows in (1, 9):  # one register block, and tiles of k across blocks
        out = layer(torch.zeros(rows, 24, dtype=torch.bfloat16))
        expected = bias.to(torch.bfloat16).expand(rows, -1)
        nan = expected.isnan()  # torch's vector path writes 0xFFFF, c10's scalar one 0x7FC0
        assert torch.equal(out.isnan(), nan) and (out.view(torch.int16)[nan] == 0x7FC0).all()
        assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_a_projection_computes_every_row_through_the_row_kernel(kernel):
    torch.manual_seed(0)
    modules = [nn.Linear(48, size) for size in (32, 16)]  # fused, with biases
    projection = Projection(modules, kernels=kernel)
    assert projection.path == "rows-c++" and projection.packed is None
    x = torch.randn(300, 48)  # a prompt chunk's rows
    with torch.inference_mode():
        assert torch.equal(projection.one(x), projection.rows(x))
        a, b = projection(x)
        torch.testing.assert_close(a, modules[0](x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, modules[1](x), rtol=1e-5, atol=1e-5)
    without = Projection(modules)  # no kernels: oneDNN where torch has it
    assert without.path in ("onednn-packed", "torch") and without.rows is None


def test_bf16_projections_take_the_row_kernel_where_onednn_cannot_pack(kernel, monkeypatch):
    """What a CPU without oneDNN bf16 kernels sees: the row kernel, not torch's emulation."""

    def refuse(weight, batch_size):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    torch.manual_seed(0)
    modules = [nn.Linear(48, 40).bfloat16()]
    projection = Projection(modules, kernels=kernel)
    assert projection.path == "rows-c++"
    x = torch.randn(30, 48).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(projection.one(x), modules[0](x), rtol=2e-2, atol=2e-2)
    assert Projection(modules).path == "torch"  # no kernels: nothing packs it


def test_bad_operands_are_refused(kernel):
    rows = RowLinear(kernel, torch.randn(8, 16), None, torch.float32)
    with pytest.raises(RuntimeError, match="panels"):
        kernel.row_linear(torch.randn(2, 15), rows.panels, 8, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.row_linear(torch.randn(2, 16, dtype=torch.float64), rows.panels, 8, None)
    empty = torch.zeros(1, 0, kernel.row_linear_panel())  # K = 0: nothing to sum
    with pytest.raises(RuntimeError, match="panels"):
        kernel.row_linear(torch.randn(20, 0), empty, 8, None)


def test_a_decode_row_gets_the_same_logits_beside_prompt_rows(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=64, block_size=16, chunk=32)
    assert runner.row_kernel and runner.stack is not None
    assert runner.row_counts == [] and runner.padded_rows(5) == 5  # nothing padded
    tokens = rand_tokens(20)
    tokens.append(int(runner.forward([SeqSpan([0, 1], tokens, 0, 20)])[0].argmax()))
    decode = SeqSpan([0, 1], tokens, 20, 21)
    alone = runner.forward([decode])[0]  # the fused decode stack
    prompt = SeqSpan([5, 6], rand_tokens(30), 0, 30)
    beside = runner.forward([prompt, decode])  # the per-layer loop, 31 rows in one call
    assert torch.equal(beside[1], alone)
