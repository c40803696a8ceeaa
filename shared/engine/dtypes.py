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


def compute_dtype(dtype: str, config, device: str) -> torch.dtype:
    """`dtype`, or with "auto" the checkpoint's, where this CPU computes it natively (a float16
    checkpoint elsewhere runs in float32, and a bfloat16 one where oneDNN has no bf16 kernels:
    there the row kernel widens bf16 to float32, 0.94x float32's decode speed at 8 and 32 rows
    held to AVX2, and torch's emulation is slower still).
    UnsupportedModel for float16 asked of a CPU without float16 arithmetic."""
    name = dtype
    if dtype == "auto":
        name = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
        name = name if name in FLOATS else "float32"
        native = {"float16": native_float16, "bfloat16": onednn_bf16}.get(name)
        if device == "cpu" and native is not None and not native():
            log.info("%s checkpoint computed in float32: this CPU has no %s kernels", name, name)
            name = "float32"
    elif dtype == "float16" and device == "cpu" and not native_float16():
        raise UnsupportedModel(
            "--dtype float16 needs a CPU with AVX512-FP16 or AMX-FP16; use bfloat16 or float32"
        )
    return getattr(torch, name)
