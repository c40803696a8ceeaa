"""Compiles the Triton attention kernel for a Hopper GPU (sm_90) on a machine without one, the
way Triton would on first launch there: front end, optimizer, LLVM, PTX, ptxas. Triton's
interpreter (the other tests) runs the kernel's arithmetic but not its type rules: an int32 and
an int64 meeting in one variable passed there and failed the compile on the GPU. Run without
TRITON_INTERPRET (which swaps every kernel for an interpreted one), as a subprocess of
test_triton_compile.py:  python -m tests.unit.triton_sm90"""

import itertools
import os
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shared.engine import triton_attention

SHAPES = [(9, 3, 64), (32, 8, 128)]  # (heads, kv heads, head dim): SmolLM2, Llama-3-8B


def variants():
    """What paged_attention launches: fp32 exact or bf16 dots, decode (rows=1) or prompt (64)."""
    for (heads, kv_heads, dim), dtype, rows in itertools.product(SHAPES, ("fp32", "bf16"), (1, 64)):
        group = heads // kv_heads
        yield (
            dtype,
            dict(
                HEADS=heads,
                KV_HEADS=kv_heads,
                DIM=dim,
                DIM_P=max(16, triton.next_power_of_2(dim)),
                BLOCK_SIZE=16,
                BLOCK_M=max(16, triton.next_power_of_2(max(rows, group))),
                BLOCK_N=32,
                PRECISION="ieee" if dtype == "fp32" else "tf32",
                UPCAST=dtype == "fp32",
            ),
        )


def compile_one(dtype: str, constants: dict):
    kernel = triton_attention._paged_attention
    pointer = f"*{dtype}"
    signature = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), pointer)
    signature.update(tables_ptr="*i32", ranges_ptr="*i64")
    signature.update(q_row_stride="i32", out_row_stride="i32", table_width="i32")
    signature.update(scale="fp32", window="i32", block_stride="i32")
    signature.update(dict.fromkeys(constants, "constexpr"))
    where = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(
        ASTSource(kernel, signature, constexprs=where), target=GPUTarget("cuda", 90, 32)
    )


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter compiles nothing"
    for dtype, constants in variants():
        started = time.perf_counter()
        compiled = compile_one(dtype, constants)
        assert compiled.asm["cubin"], "no machine code"
        shape = (constants["HEADS"], constants["KV_HEADS"], constants["DIM"])
        print(
            f"sm_90 {dtype} {shape} BLOCK_M={constants['BLOCK_M']}: "
            f"{len(compiled.asm['cubin'])} bytes, {time.perf_counter() - started:.1f} s"
        )


if __name__ == "__main__":
    main()
