"""Projection: packed (oneDNN) fused GEMMs against the modules they replace."""

import pytest
import torch
from torch import nn

from shared.engine.projection import (
    SMALL,
    Projection,
    fastest_row_count,
    invariant_row_counts,
    onednn_bf16,
)
from shared.model_store import quantize_int8


def linears(*sizes: int, bias: bool = False) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(48, size, bias=bias) for size in sizes]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projection_matches_each_module(bias, dtype):
    """Packed wherever oneDNN has kernels for the dtype on this CPU (float32 always; bfloat16 only
    with AVX-512 or AVX-NE-CONVERT), the plain modules elsewhere: correct either way."""
    modules = [m.to(dtype) for m in linears(32, 16, 16, bias=bias)]
    projection = Projection(modules)
    packable = dtype == torch.float32 or onednn_bf16()
    assert projection.path == ("onednn-packed" if packable else "torch")
    assert_matches_modules(projection, modules, dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_unpacked_fallback_matches_each_module_on_any_cpu(monkeypatch, bias, dtype):
    """The path an AVX2-only CPU takes for bfloat16 (oneDNN refuses to pack), forced on every CPU."""

    def refuse(weight, batch_size):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    modules = [m.to(dtype) for m in linears(32, 16, 16, bias=bias)]
    projection = Projection(modules)
    assert projection.packed is None and projection.path == "torch"
    assert_matches_modules(projection, modules, dtype)


def assert_matches_modules(
    projection: Projection, modules: list[nn.Module], dtype: torch.dtype
) -> None:
    x = torch.randn(7, 48).to(dtype)
    with torch.inference_mode():
        outputs = projection(x)
        assert [o.shape for o in outputs] == [(7, 32), (7, 16), (7, 16)]
        for out, module in zip(outputs, modules):
            tolerance = (
                dict(rtol=2e-2, atol=2e-2)
                if dtype == torch.bfloat16
                else dict(rtol=1e-5, atol=1e-6)
            )
            torch.testing.assert_close(out, module(x), **tolerance)


def test_modules_that_cannot_be_packed_are_called_as_they_are():
    model = quantize_int8(nn.Sequential(*linears(24, 8)))
    projection = Projection([model[0], model[1]])
    assert projection.packed is None
    x = torch.randn(5, 48)
    with torch.inference_mode():
        a, b = projection(x)
        assert torch.equal(a, model[0](x)) and torch.equal(b, model[1](x))


def test_invariant_row_counts_are_invariant():
    projection = Projection(linears(40, 24))
    counts = invariant_row_counts([projection])
    assert counts and set(counts) <= set(range(1, SMALL + 1))
    x = torch.randn(64, 48)
    with torch.inference_mode():
        full = projection(x)
        for rows in counts:
            assert all(
                torch.equal(part, whole[:rows]) for part, whole in zip(projection(x[:rows]), full)
            )


def test_int8_dynamic_quantization_is_not_batch_invariant():
    """Activations are quantized with one scale per call, so other rows change a row's bits:
    the probe finds (and docs/engine.md states) no invariant row count for int8 weights."""
    model = quantize_int8(nn.Sequential(*linears(64)))
    assert invariant_row_counts([Projection([model[0]])]) == []


def test_fastest_row_count_picks_one_of_the_candidates():
    projections = [Projection(linears(40, 24)), Projection(linears(8))]
    assert fastest_row_count(projections, [2, 3, 4]) in (2, 3, 4)
    assert fastest_row_count(projections, [4]) == 4 and fastest_row_count(projections, []) == 1


def test_released_modules_keep_only_the_packed_weight_and_a_kept_one():
    modules = linears(24, 8)
    keep = modules[1].weight
    projection = Projection(modules)
    x = torch.randn(3, 48)
    with torch.inference_mode():
        before = projection(x)
        projection.release_modules(keep=keep)
        after = projection(x)
    assert modules[0].weight.numel() == 0 and modules[1].weight is keep
    assert all(torch.equal(a, b) for a, b in zip(before, after))
