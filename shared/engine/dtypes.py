"""The dtype a worker computes in: the one asked for, or with "auto" the checkpoint's own."""

import logging

import torch

from shared.engine.architecture import UnsupportedModel
from shared.engine.kernels import cpu_flags
from shared.engine.projection import onednn_bf16

log = logging.getLogger(__name__)
FLOATS = ("float32", "bfloat16", "float16")


def native_float16() -> bool:
    """Whether this CPU computes float16 natively (AVX512-FP16 or AMX-FP16); elsewhere torch
    emulates it, slowly, and it is refused."""
    flags = cpu_flags().split()
    return "avx512_fp16" in flags or "amx_fp16" in flags


def _computes(name: str, row_kernel: bool) -> bool:
    """Whether this CPU computes the float type `name` at least as fast as float32."""
    if name == "float16":
        return native_float16()
    if name == "bfloat16":
        return row_kernel or onednn_bf16()
    return True


def compute_dtype(dtype: str, config, device: str, row_kernel: bool = False) -> torch.dtype:
    """`dtype`, or with "auto" the checkpoint's, where this CPU computes it well: a bfloat16
    checkpoint where oneDNN has bf16 kernels or Tandem's row kernel computes its linear layers
    (`row_kernel`: bf16 widened to float32 in registers, never slower than float32 at 1 to 512
    rows on an AVX2-only CPU), else in float32 (torch's emulation collapses from 8 rows); a float16
    one only with float16 arithmetic. Chosen by the CPU, not by a timing at start-up: the dtype
    decides a reply's bits, and a noisy timing must not.
    UnsupportedModel for float16 asked of a CPU without float16 arithmetic."""
    name = dtype
    if dtype == "auto":
        name = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
        name = name if name in FLOATS else "float32"
        if device == "cpu" and not _computes(name, row_kernel):
            log.info("%s checkpoint computed in float32: this CPU has no %s kernels", name, name)
            name = "float32"
    elif dtype == "float16" and device == "cpu" and not native_float16():
        raise UnsupportedModel(
            "--dtype float16 needs a CPU with AVX512-FP16 or AMX-FP16; use bfloat16 or float32"
        )
    return getattr(torch, name)
