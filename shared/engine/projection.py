"""Projection: the model's linear layers as the engine runs them.

Layers that read the same input are fused into one weight (q|k|v, gate|up), one call instead of
several. On CPU, where Tandem's C++ kernels are built, float32 and bfloat16 weights are repacked
once into the row kernel's panels (`RowLinear`) and every row goes through it: it reads the
weights at close to the machine's read rate at one row and keeps pace with oneDNN's GEMMs from a
few dozen rows to hundreds (prompt chunks), on AVX2 as on AVX-512; it computes bfloat16 where
oneDNN cannot (AVX2 without AVX-NE-CONVERT); and it computes each row alone, so no row count
needs padding for batch invariance. One copy of the weights is kept.

Without the kernels, float32 and bfloat16 weights are packed into oneDNN's blocked layout and
every call goes straight to oneDNN's matmul (no per-call repacking of the weight, which is what
makes torch's default, MKL sgemm on the transposed weight, 2-4x slower at decode's row counts).
Anything else (CUDA, int8 dynamic-quantized modules, a torch without oneDNN, bfloat16 on a CPU
oneDNN has no bf16 kernels for) calls the modules themselves; `path` says which ran.

`invariant_row_counts` measures, on the projections in hand, which row counts give each row the
same bits as a larger batch does (the GEMM kernel oneDNN or MKL picks depends on the row count);
the model runner pads tiny batches up to one of them where a GEMM computes the rows.
"""

import time

import torch
from torch import nn

from shared.engine import row_linear
from shared.engine.row_linear import RowLinear

PROBE_ROWS = 64  # the reference batch; row counts up to SMALL are probed against it
SMALL = 16


def onednn_bf16() -> bool:
    """Whether oneDNN computes bfloat16 natively on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX);
    elsewhere torch emulates bf16 matmuls through float32 and nothing is packed."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packable(modules: list[nn.Module], dtype: torch.dtype) -> bool:
    first = modules[0].weight if isinstance(modules[0], nn.Linear) else None
    return (
        first is not None
        and first.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and all(type(m) is nn.Linear and m.weight.dtype == first.dtype for m in modules)
        and first.is_floating_point()
        and dtype in (torch.float32, torch.bfloat16)
    )


class Projection:
    """x -> [m(x) for m in modules], computed as one call: the row kernel, or one GEMM on packed
    weights. `sizes` splits one fused module's output (Phi-3's qkv_proj and gate_up_proj).
    `dtype`, where it is not the weights' own, is the one they are packed in (unpacked, the
    modules must be converted to it before they are called). `kernels`: Tandem's C++ kernels,
    for `RowLinear` (None: oneDNN where it packs, else the modules)."""

    def __init__(
        self,
        modules: list[nn.Module],
        sizes: list[int] | None = None,
        dtype: torch.dtype | None = None,
        kernels=None,
    ):
        self.modules = modules
        self.sizes = sizes or [m.out_features for m in modules]
        self.in_features = modules[0].in_features
        self.dtype = dtype or _dtype_of(modules[0])  # of the input it takes
        self.packed = self.rows = self.bias = None
        rows = kernels is not None and row_linear.applies(modules, self.dtype)
        if not (rows or _packable(modules, self.dtype)):
            return
        with torch.no_grad():
            weight = (
                torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight
            )
            self.bias = _fused_bias(modules, self.dtype)
            if rows:
                self.rows = RowLinear(kernels, weight, self.bias, self.dtype)
                return
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach().to(self.dtype), None
                )
                self._matmul = torch.ops.mkldnn._linear_pointwise.default
            except RuntimeError:  # e.g. bf16 on a CPU oneDNN has no bf16 kernels for
                pass

    @property
    def path(self) -> str:
        """Which kernel computes this projection: "rows-c++", "onednn-packed" or "torch"."""
        if self.rows is not None:
            return "rows-c++"
        return "torch" if self.packed is None else "onednn-packed"

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of the modules."""
        if self.rows is None and self.packed is None:
            outs = [m(x) for m in self.modules]
            if len(outs) == len(self.sizes):
                return outs
            out = outs[0]
        else:
            out = self.one(x)
        return list(out.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [out]

    def release_modules(self, keep: torch.Tensor, pages=None) -> None:
        """Drops the modules' own weights once copied (the row panels or the packed weights are
        all the engine reads), except `keep` (a tied output head's weight is the embedding
        table). `pages`, a FilePages, gives back the resident pages of weights read from a
        mapped file. Modules nothing copied are kept: they compute."""
        if self.packed is None and self.rows is None:
            return
        for module in self.modules:
            if module.weight is not keep:
                if pages is not None:
                    pages.drop(module.weight)
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)

    def one(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a (fused) projection as one tensor."""
        if self.rows is not None:
            return self.rows(x)
        if self.packed is not None:
            return self._matmul(x, self.packed, self.bias, "none", [], "")
        outs = [m(x) for m in self.modules]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _row_invariant(self, rows: int, reference: torch.Tensor, full: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b[:rows]) for a, b in zip(self(reference[:rows]), full))

    def invariant_rows(self, generator: torch.Generator) -> set[int]:
        """The row counts in 1..SMALL at which every row gets the bits it gets among PROBE_ROWS rows."""
        reference = torch.randn(PROBE_ROWS, self.in_features, generator=generator).to(self.dtype)
        with torch.inference_mode():
            full = self(reference)
            return {
                rows for rows in range(1, SMALL + 1) if self._row_invariant(rows, reference, full)
            }


def _fused_bias(modules: list[nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    """The modules' biases end to end (zeros for a module without one), or None if none has one."""
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    weight = modules[0].weight
    return torch.cat(
        [
            b.detach() if b is not None else weight.new_zeros(m.out_features)
            for b, m in zip(biases, modules)
        ]
    ).to(dtype)


def _dtype_of(module: nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)
    return (
        weight.dtype
        if isinstance(weight, torch.Tensor) and weight.is_floating_point()
        else torch.float32
    )


def invariant_row_counts(projections: list[Projection]) -> list[int]:
    """Row counts in 1..SMALL that are row-invariant in every projection, ascending (SMALL+ rows are
    taken as invariant: the kernels only change at the smallest counts; a unit test re-checks)."""
    generator = torch.Generator().manual_seed(0)
    common = set(range(1, SMALL + 1))
    for projection in projections:
        common &= projection.invariant_rows(generator)
    return sorted(common)


def fastest_row_count(
    projections: list[Projection], candidates: list[int], repeats: int = 3
) -> int:
    """The candidate row count at which one pass over all the projections takes the least time.

    A GEMM library's kernels for 1 or 2 rows can stream the weights slower than its kernel for 4
    (oneDNN on AVX-512: ~30 ms against ~25 ms per SmolLM2 step), so a lone decode row is padded to
    whichever invariant count is fastest here. Any invariant count gives the same bits, so the
    choice, timed at start-up, cannot change a result.
    """
    if len(candidates) <= 1:
        return candidates[0] if candidates else 1
    inputs = [torch.zeros(max(candidates), p.in_features, dtype=p.dtype) for p in projections]
    best = {}
    with torch.inference_mode():
        for _ in range(repeats):
            for rows in candidates:
                started = time.perf_counter()
                for p, x in zip(projections, inputs):
                    p(x[:rows])
                elapsed = time.perf_counter() - started
                best[rows] = min(best.get(rows, elapsed), elapsed)
    return min(candidates, key=lambda rows: (best[rows], rows))
