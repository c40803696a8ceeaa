"""The dtype a worker computes in: the one asked for, or with "auto" the checkpoint's own."""

import logging

import torch

from shared.engine.kernels import cpu_flags

log = logging.getLogger(__name__)
FLOATS = ("float32", "bfloat16", "float16")


def native_float16() -> bool:
    """Whether this CPU computes float16 natively (AVX512-FP16 or AMX-FP16); elsewhere torch
    emulates it, slowly, and it is refused."""
    flags = cpu_flags().split()
    return "avx512_fp16" in flags or "amx_fp16" in flags


def compute_dtype(dtype: str, config, device: str) -> torch.dtype:
    """`dtype`, or with "auto" the checkpoint's (a float16 checkpoint runs in float32 on a CPU
    without float16 arithmetic). ValueError for float16 asked of such a CPU."""
    name = dtype
    if dtype == "auto":
        name = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
        name = name if name in FLOATS else "float32"
        if name == "float16" and device == "cpu" and not native_float16():
            log.info("float16 checkpoint computed in float32: this CPU has no float16 arithmetic")
            name = "float32"
    elif dtype == "float16" and device == "cpu" and not native_float16():
        raise ValueError(
            "--dtype float16 needs a CPU with AVX512-FP16 or AMX-FP16; use bfloat16 or float32"
        )
    return getattr(torch, name)
