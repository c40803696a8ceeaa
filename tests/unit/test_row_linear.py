"""RowLinear (csrc/row_linear.cpp): decode rows' projections, against torch's linear, each row's
bits independent of the rest of the call; decode rows first in a step, and a decode row's logits
the same beside prompt rows as alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.forward_batch import arrange, is_decode_row
from shared.engine.kv_cache import KVPool, layout_of
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


def test_a_projection_without_a_gemm_copy_sends_prompt_rows_to_the_row_kernel(kernel, monkeypatch):
    """What a CPU without oneDNN bf16 kernels does with bf16 (torch would emulate it slowly)."""

    def refuse(weight, batch_size):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    torch.manual_seed(0)
    modules = [nn.Linear(48, 40).bfloat16()]
    projection = Projection(modules, kernels=kernel)
    assert projection.rows_only and projection.path == "rows-c++"
    x = torch.randn(30, 48).bfloat16()
    with torch.inference_mode():
        assert torch.equal(projection.one(x), projection.rows(x))
        torch.testing.assert_close(projection.one(x), modules[0](x), rtol=2e-2, atol=2e-2)


def test_bad_operands_are_refused(kernel):
    rows = RowLinear(kernel, torch.randn(8, 16), None, torch.float32)
    with pytest.raises(RuntimeError, match="panels"):
        kernel.row_linear(torch.randn(2, 15), rows.panels, 8, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.row_linear(torch.randn(2, 16, dtype=torch.float64), rows.panels, 8, None)


def test_a_projection_gives_decode_rows_the_row_kernel_and_prompt_rows_the_gemm(kernel):
    torch.manual_seed(0)
    modules = [nn.Linear(48, size) for size in (32, 16)]
    projection = Projection(modules, kernels=kernel)
    assert projection.path in ("rows-c++/onednn-packed", "rows-c++/torch")
    x = torch.randn(9, 48)
    with torch.inference_mode():
        out = projection.one(x, decode_rows=3)
        assert torch.equal(out[:3], projection.rows(x[:3]))
        assert torch.equal(out[3:], projection.one(x[3:]))  # no decode rows: the GEMM
        a, b = projection(x, 3)
        torch.testing.assert_close(a, modules[0](x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, modules[1](x), rtol=1e-5, atol=1e-5)
    head = Projection([nn.Linear(48, 100, bias=False)], kernels=kernel, gemm=False)
    assert head.rows_only and head.packed is None and head.path == "rows-c++"
    with torch.inference_mode():
        assert torch.equal(head.one(x), head.rows(x))


def test_arrange_puts_decode_rows_first_and_keeps_the_spans_order(tiny_model):
    pool = KVPool(layout_of(tiny_model.config, "tiny", torch.float32, 16), 32, 16, "cpu")
    spans = [
        SeqSpan([0, 1], list(range(20)), 0, 20),  # a prompt
        SeqSpan([2], list(range(9)), 8, 9),  # a decode row
        SeqSpan([3], list(range(5)), 4, 5, prompt=True),  # a prompt's one-row tail
        SeqSpan([4], list(range(12)), 11, 12),  # a decode row
    ]
    batch = arrange(spans, pool, None, 16, "cpu")
    assert [is_decode_row(s) for s in spans] == [False, True, False, True]
    assert batch.decode_rows == 2
    assert batch.ids.tolist()[:2] == [8, 11]  # the decode rows' tokens lead
    assert batch.last_rows.tolist() == [21, 0, 22, 1]  # each span's last row, in spans order


def test_a_decode_row_gets_the_same_logits_beside_prompt_rows(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=64, block_size=16, chunk=32)
    assert runner.rows_first and runner.stack is not None
    tokens = rand_tokens(20)
    tokens.append(int(runner.forward([SeqSpan([0, 1], tokens, 0, 20)])[0].argmax()))
    decode = SeqSpan([0, 1], tokens, 20, 21)
    alone = runner.forward([decode])[0]  # the fused decode stack
    prompt = SeqSpan([5, 6], rand_tokens(30), 0, 30)
    beside = runner.forward([prompt, decode])  # the per-layer loop, prompt rows through the GEMM
    assert torch.equal(beside[1], alone)
    assert runner.padded_rows(31, decode_rows=1) == 31  # prompt rows past the padded sizes
    assert runner.padded_rows(5, decode_rows=5) == 5  # decode rows: never padded
