"""RowLinear: a linear layer through Tandem's own kernel (csrc/row_linear.cpp), for every row.

The weight is repacked once into panels of `panel` outputs, [panel][k][output], which the kernel
streams once per call, every row served from each panel while it is in cache. Every output is
one chain of FMAs over k in order, so a row's bits do not depend on the other rows of the call:
no row count needs padding for batch invariance. bfloat16 weights are computed in
float32 (widened exactly, in registers), which is what makes bf16 usable on CPUs without bf16 instructions;
with AVX512-BF16 they go through its dot-product instruction, in k-pairs.
"""

import torch
from torch import nn


def pack_rows(
    weight: torch.Tensor, panel: int, pairs: bool = False, halves: bool = False
) -> torch.Tensor:
    """[N, K] -> [ceil(N / panel), K, panel], the outputs past N zero. `pairs` (bf16 with an
    even K, on a CPU with AVX512-BF16): each panel's k in pairs, [K / 2][panel][2], for the
    CPU's bf16 dot-product instruction (the same shape, another order within a panel). `halves`
    (other bf16 panels): each k's outputs interleaved, position 2j output j and 2j + 1 output
    j + panel / 2, so the kernel widens both halves of a panel from one load."""
    n, k = weight.shape
    padded = -(-n // panel) * panel
    if padded > n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    panels = weight.reshape(padded // panel, panel, k)
    if halves:
        panels = panels.reshape(-1, 2, panel // 2, k).transpose(1, 2).reshape(-1, panel, k)
    if pairs and k % 2 == 0:
        paired = panels.reshape(padded // panel, panel, k // 2, 2).permute(0, 2, 1, 3)
        return paired.contiguous().reshape(padded // panel, k, panel)
    return panels.transpose(1, 2).contiguous()


def applies(modules: list[nn.Module], dtype: torch.dtype) -> bool:
    """Plain float32/bfloat16 nn.Linear modules on the CPU (not int8-quantized ones)."""
    return dtype in (torch.float32, torch.bfloat16) and all(
        type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.is_floating_point()
        for m in modules
    )


class RowLinear:
    """x [M, K] -> x @ weight.T + bias, [M, N], in x's dtype (float32 with `float_out`)."""

    def __init__(self, kernels, weight: torch.Tensor, bias: torch.Tensor | None, dtype):
        self.kernels = kernels
        self.out_features = weight.shape[0]
        with torch.no_grad():
            k = weight.shape[1]
            self.pairs = dtype == torch.bfloat16 and k % 2 == 0 and kernels.row_linear_pairs()
            self.panels = pack_rows(
                weight.detach().to(dtype),
                kernels.row_linear_panel(),
                self.pairs,
                halves=dtype == torch.bfloat16 and not self.pairs,
            )
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        return self.kernels.row_linear(x, self.panels, self.out_features, self.bias, float_out)
