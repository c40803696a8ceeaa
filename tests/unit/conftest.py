"""Unit-test fixtures: a tiny random Llama, built once per test module."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_config() -> LlamaConfig:
    # initializer_range 0.1 (instead of 0.02) keeps greedy continuations from collapsing into a
    # two-token loop, so comparisons of generated ids actually exercise every step.
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )


def pytest_report_header(config) -> list[str]:
    """Which CPU paths these tests exercise here (each engine test's failure names its runner's)."""
    from shared.engine.kernel_report import cpu_capability
    from shared.engine.projection import onednn_bf16

    bf16 = "native (oneDNN bf16 kernels)" if onednn_bf16() else "emulated (no oneDNN bf16 kernels)"
    return [f"cpu: {cpu_capability()}; bfloat16: {bf16}; int8: {torch.backends.quantized.engine}"]


@pytest.fixture(scope="module")
def tiny_model():
    # One intra-op thread: on a busy 2-core box, OpenMP's spinning threads make each tiny GEMM
    # ~100x slower. The bit-exactness tests compare runs within one setting, so any count works;
    # test_model_runner re-checks the GEMM row invariance at the default count as well.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield LlamaForCausalLM(tiny_config()).eval()
    torch.set_num_threads(threads)


@pytest.fixture
def rand_tokens():
    """rand_tokens(n) -> n random ids in [3, 128), reproducible within a test."""
    generator = torch.Generator().manual_seed(1234)

    def make(n: int) -> list[int]:
        return torch.randint(3, 128, (n,), generator=generator).tolist()

    return make


@pytest.fixture(scope="session")
def kernel():
    """Tandem's compiled CPU kernels: they must build on the test machine (a C++ compiler)."""
    from shared.engine import kernels

    loaded = kernels.load()
    assert loaded is not None, "the kernels must build here (is a C++ compiler installed?)"
    return loaded
