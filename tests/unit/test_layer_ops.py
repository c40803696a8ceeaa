"""The fused C++ layer ops against the Hugging Face modules they stand in for."""

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from shared.engine import kernels as cpu_kernels
from shared.engine.layer_ops import KernelOps, TorchOps


@pytest.fixture(scope="module")
def ops():
    kernels = cpu_kernels.load()
    assert kernels is not None, (
        "the kernels must build on the test machine (a C++ compiler is installed)"
    )
    return KernelOps(kernels), TorchOps()


def tolerance(dtype):
    return dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(ops, dtype, with_delta):
    fused, plain = ops
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(72, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(72, generator=g).to(dtype)
    residual = torch.randn(9, 72, generator=g).to(dtype)
    delta = torch.randn(9, 72, generator=g).to(dtype) if with_delta else None
    expected_residual, expected = plain.norm(residual.clone(), delta, norm)
    got_residual, got = fused.norm(residual, delta, norm)
    assert torch.equal(got_residual, expected_residual)  # the add rounds as torch's does
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def reference_norm(residual, weight, eps):
    """The kernel's arithmetic one float32 torch op at a time: the squares summed over 16 lanes
    (lane l takes every i = l mod 16), the lanes halved 8, 4, 2, 1, the tail after."""
    h = residual.float()
    full = h.shape[1] // 16 * 16
    lanes = torch.zeros(h.shape[0], 16)
    for i in range(0, full, 16):
        lanes += h[:, i : i + 16] * h[:, i : i + 16]
    tail = torch.zeros(h.shape[0])
    for i in range(full, h.shape[1]):
        tail += h[:, i] * h[:, i]
    for width in (8, 4, 2, 1):
        lanes[:, :width] += lanes[:, width : 2 * width]
    # numpy's float32 division and square root, correctly rounded as the kernel's are (torch's
    # vectorized ones were an ulp off on one of these rows)
    total = (lanes[:, 0] + tail).numpy()
    root = np.sqrt(total / np.float32(h.shape[1]) + np.float32(eps))
    inv = torch.from_numpy(np.float32(1) / root)
    scaled = (h * inv[:, None]).to(residual.dtype).float()
    return (weight.float() * scaled).to(residual.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [72, 576, 13])
def test_add_rms_norm_bits(ops, dtype, hidden):
    """The norm's bits are those of its plain arithmetic in its sum order (a kernel change that
    reorders the sum fails here, where the HF comparison above only bounds the error), with and
    without a tail past the 16 lanes."""
    fused, _ = ops
    g = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    residual = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(5, hidden, generator=g).to(dtype)
    expected_residual = (residual.float() + delta.float()).to(dtype)
    got_residual, got = fused.norm(residual, delta, norm)
    assert torch.equal(got_residual, expected_residual)
    assert torch.equal(got, reference_norm(expected_residual, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [32, 20])
def test_rope_in_place_is_bit_identical_to_hf(ops, dtype, dim):
    """Heads of 32 (whole vectors) and 20 (a vector and a scalar tail per half)."""
    fused, plain = ops
    g = torch.Generator().manual_seed(1)
    # q|k|v rows, as the fused GEMM gives them
    qkv = torch.randn(5, (4 + 2 + 2) * dim, generator=g).to(dtype)
    q, k, _ = qkv.split([4 * dim, 2 * dim, 2 * dim], dim=-1)
    q, k = q.view(5, 4, dim), k.view(5, 2, dim)
    angles = torch.randn(5, dim // 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    expected_q, expected_k = plain.rope(q.clone(), k.clone(), cos, sin)
    got_q, got_k = fused.rope(q, k, cos, sin)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


def test_bad_shapes_are_refused(ops):
    fused, _ = ops
    with pytest.raises(RuntimeError, match="rope_"):
        fused.rope(torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(3, 8), torch.zeros(3, 8))


def test_store_kv_writes_the_rows_into_their_slots(ops):
    from shared.control.messages import KVLayout
    from shared.engine.kv_cache import KVPool

    fused, plain = ops
    layout = KVLayout(
        model="t", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4
    )
    pools = [KVPool(layout, 4, 4, "cpu") for _ in range(2)]
    qkv = torch.randn(5, 8 * 6)  # 3 real rows, 2 padding
    k, v = (t.view(5, 2, 8) for t in qkv.split([16, 16, 16], dim=-1)[1:])
    slots = torch.tensor([7, 2, 13])
    fused.store(pools[0], 1, fused.kv_index(pools[0], slots), k, v)
    plain.store(pools[1], 1, plain.kv_index(pools[1], slots), k, v)
    assert torch.equal(pools[0].kv, pools[1].kv)
    assert torch.equal(pools[0].kv[3, 1, 0, 1], k[2]) and torch.equal(pools[0].kv[3, 1, 1, 1], v[2])
    assert pools[0].kv.count_nonzero() == 3 * 2 * 16  # 3 rows of keys and values, 1 layer
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.store(pools[0], 0, torch.tensor([16]), k, v)
