"""OutputHead: float32 logits, the top of each row recomputed in float32 for rounded dtypes."""

import pytest
import torch
from torch import nn

from shared.engine.output_head import TOP, OutputHead
from shared.engine.projection import Projection


def head_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> OutputHead:
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    module = module.to(weight.dtype)
    return OutputHead(Projection([module]), module.weight, module.bias)


def test_a_tie_in_bfloat16_goes_to_the_token_float32_ranks_first():
    """16 and 16.0625 are one value in bf16 (its step at 16 is 0.125): argmax over bf16 logits
    takes token 0; the head's float32 logits put token 1 first, as a float32 model does."""
    weight = torch.tensor([[16.0, 0.0], [16.0, 0.0625], [1.0, 1.0]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    rounded = Projection([head_of(weight).projection.modules[0]]).one(x)
    assert rounded[0, 0] == rounded[0, 1]  # the tie the head undoes
    logits = head_of(weight)(x)
    assert logits.dtype == torch.float32
    assert logits[0].tolist() == [16.0, 16.0625, 2.0]
    assert int(logits.argmax()) == 1


@pytest.mark.parametrize("bias", [False, True])
def test_the_top_of_each_row_is_float32_from_the_same_weights(bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 64, generator=generator).to(torch.bfloat16)
    b = torch.randn(500, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    logits = head_of(weight, b)(x)
    exact = x.float() @ weight.float().T + (b.float() if bias else 0)
    top = logits.topk(TOP).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    torch.testing.assert_close(logits[rest], exact[rest], rtol=2**-8, atol=1e-3)  # bf16-rounded
    assert not torch.equal(logits[rest], exact[rest])


def test_a_row_s_logits_do_not_depend_on_the_batch():
    generator = torch.Generator().manual_seed(1)
    head = head_of(torch.randn(300, 32, generator=generator).to(torch.bfloat16))
    x = torch.randn(9, 32, generator=generator).to(torch.bfloat16)
    together = head(x)
    for row in range(len(x)):
        assert torch.equal(head(x[row : row + 1])[0], together[row])


def test_float32_is_not_recomputed():
    weight = torch.randn(40, 8)
    head = head_of(weight)
    assert head.weight is None  # nothing kept beyond the packed copy
    x = torch.randn(3, 8)
    assert torch.equal(head(x), head.projection.one(x))


def test_padding_rows_are_cut_before_the_recompute():
    generator = torch.Generator().manual_seed(2)
    head = head_of(torch.randn(200, 16, generator=generator).to(torch.bfloat16))
    x = torch.randn(2, 16, generator=generator).to(torch.bfloat16)
    padded = torch.cat([x, x.new_zeros(2, 16)])
    assert torch.equal(head(padded, 2), head(padded)[:2])  # the same GEMM, padding cut
    assert head(padded, 2).shape == (2, 200)


def test_the_row_kernel_hands_the_head_its_float32_sums(kernel):
    """Where the row kernel computes the head, every logit is its float32 sum (none rounded to
    bf16, nothing recomputed, no copy of the weight kept), each row's alone."""
    generator = torch.Generator().manual_seed(4)
    module = nn.Linear(64, 500, bias=True).to(torch.bfloat16)
    head = OutputHead(Projection([module], kernels=kernel), module.weight, module.bias)
    assert head.weight is None and head.projection.path == "rows-c++"
    x = torch.randn(6, 64, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        logits = head(x)
        exact = x.float() @ module.weight.float().T + module.bias.float()
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, exact, rtol=1e-5, atol=1e-4)
        assert not torch.equal(logits, logits.to(torch.bfloat16).float())  # not rounded
        assert torch.equal(head(x, 2), logits[:2])
        for row in range(len(x)):
            assert torch.equal(head(x[row : row + 1])[0], logits[row])
