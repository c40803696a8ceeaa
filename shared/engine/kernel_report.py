"""KernelReport: which code paths a ModelRunner computes with, on this machine.

The same model runs through different kernels on different CPUs, and a result means little
without saying which: oneDNN packs bfloat16 weights only where it has bf16 kernels (AVX-512,
AVX-NE-CONVERT, AMX), and elsewhere torch emulates bf16 through float32; int8 weights go through
torch's quantized engine; Tandem's C++ kernels (compiled for this CPU) may be missing, and the
fused decode stack applies only when every projection has Tandem's row kernel. Workers announce the report in
their heartbeat (`tandem status` shows it), the engine bench records it with each result, and
tests say which path they exercised.
"""

from dataclasses import dataclass

import torch

from shared.engine.layer_ops import KernelOps
from shared.engine.projection import onednn_bf16


@dataclass(frozen=True)
class KernelReport:
    cpu: str  # torch's vector ISA for this CPU ("avx2", "avx512", "default"; "+amx"), or "cuda"
    dtype: str  # of the weights and activations: float32, bfloat16
    bf16: str  # "native" (bf16 dot products: the row kernel's AVX512-BF16 or oneDNN's kernels),
    # "widened" (the row kernel widens bf16 to fp32 in registers), "emulated" (torch, through
    # fp32); "" if unused
    weights: str  # "native", or "int8-<torch's quantized engine>" (dynamically quantized)
    projections: str  # "rows-c++" (Tandem's row kernel), "onednn-packed", "torch", or "mixed"
    attention: str  # "paged-c++" (Tandem's kernels, decode and prompt rows), "paged-triton", "sdpa"
    decode_stack: str  # all-decode steps: "c++" (one call for every layer), "cuda-graphs"
    # (replayed, one graph per batch size) or "per-layer"
    layer_ops: str  # norms, rotary, KV write: "c++" (fused) or "torch"
    row_counts: tuple[int, ...] | None  # batch-invariant row counts found; None = not probed
    row_kernel: bool = False  # every projection computes each row alone: any count invariant

    def line(self) -> str:
        """The report in one line, e.g. "avx2 · float32 · matmul rows-c++ · attention paged-c++
        · decode-stack c++ · ops c++ · invariant rows any"."""
        if self.row_kernel:
            rows = "invariant rows any"
        elif self.row_counts is None:
            rows = "batch-invariance off"
        else:
            rows = "invariant rows " + (_ranges(self.row_counts) or "none")
        parts = [
            self.cpu,
            f"{self.dtype} {self.bf16}" if self.bf16 else self.dtype,
            *([f"weights {self.weights}"] if self.weights != "native" else []),
            f"matmul {self.projections}",
            f"attention {self.attention}",
            f"decode-stack {self.decode_stack}",
            f"ops {self.layer_ops}",
            rows,
        ]
        return " · ".join(parts)


def cpu_capability() -> str:
    """torch's name for the vector ISA it dispatches to here ("avx2", "avx512"), with "+amx"
    where the CPU has AMX tiles (oneDNN's bf16 and int8 kernels use them)."""
    name = torch.backends.cpu.get_cpu_capability().lower()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return name + "+amx" if amx else name


def bf16_path(dtype: torch.dtype, device: str, row_pairs: bool | None = None) -> str:
    """How bfloat16 is computed here: "native", "widened", "emulated", or "" for another dtype.
    `row_pairs`: None where the row kernel does not compute the projections, else whether it
    has bf16 pair dot products here."""
    if dtype != torch.bfloat16:
        return ""
    if device == "cpu" and row_pairs is not None:
        return "native" if row_pairs else "widened"
    return "native" if device != "cpu" or onednn_bf16() else "emulated"


def report_of(runner) -> KernelReport:
    """The paths `runner` (a ModelRunner) takes, as it stands."""
    paths = {p.path for p in runner.projections}
    return KernelReport(
        cpu=cpu_capability() if runner.device == "cpu" else runner.device,
        dtype=str(runner.dtype).removeprefix("torch."),
        bf16=bf16_path(runner.dtype, runner.device, _row_pairs(runner)),
        weights=_weights(runner.projections),
        projections=paths.pop() if len(paths) == 1 else "mixed",
        attention=runner.paged.name if runner.paged else "sdpa",
        decode_stack=_decode_stack(runner),
        layer_ops="c++" if isinstance(runner.ops, KernelOps) else "torch",
        row_counts=tuple(runner.row_counts) if runner.batch_invariant else None,
        row_kernel=runner.row_kernel,
    )


def _decode_stack(runner) -> str:
    if runner.stack is not None:
        return "c++"
    return "cuda-graphs" if runner.graphs is not None else "per-layer"


def _row_pairs(runner) -> bool | None:
    """Whether the row kernel computes bf16 in pair dot products (None: it is not used)."""
    return runner.projections[0].rows.pairs if runner.row_kernel else None


def _weights(projections) -> str:
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    modules = [m for p in projections for m in p.modules]
    if any(isinstance(m, Int8Linear) for m in modules):
        return "int8-" + torch.backends.quantized.engine
    return "native"


def _ranges(counts) -> str:
    """1,2,3,4,8 -> "1-4,8"."""
    runs: list[list[int]] = []
    for count in sorted(counts):
        if runs and count == runs[-1][-1] + 1:
            runs[-1].append(count)
        else:
            runs.append([count])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
