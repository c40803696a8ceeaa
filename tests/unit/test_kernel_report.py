"""KernelReport says which paths a runner takes on this CPU, and each fallback computes correctly.

Every assertion holds on any x86-64 CPU with AVX2, with or without AVX-512/AMX: where a fast
path cannot exist here (bf16 dot products without AVX512-BF16) the fallback is expected, and
torch's fallback is also forced on every CPU and checked against Hugging Face.
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from shared.engine import kernel_report
from shared.engine import kernels as cpu_kernels
from shared.engine.kernel_report import bf16_path, cpu_capability
from shared.engine.model_runner import ModelRunner, SeqSpan
from shared.model_store import quantize_int8
from tests.unit.conftest import tiny_config


def runner_for(model, **kw) -> ModelRunner:
    return ModelRunner(model, "tiny", "cpu", pool_blocks=64, block_size=16, chunk=32, **kw)


@pytest.fixture(scope="module")
def bf16_model(tiny_model):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).to(torch.bfloat16).eval()


def refuse_packing(monkeypatch):
    """What oneDNN does for bfloat16 on a CPU without bf16 kernels, forced on any CPU."""

    def refuse(weight, batch_size):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)


def test_float32_takes_every_fast_path_on_any_avx2_cpu(tiny_model):
    report = runner_for(tiny_model).kernel_report()
    assert report.cpu == cpu_capability() and report.cpu.split("+")[0] in ("avx2", "avx512")
    assert (report.dtype, report.bf16, report.weights) == ("float32", "", "native")
    assert report.projections == "rows-c++"  # every row, decode and prompt
    assert (report.attention, report.decode_stack, report.layer_ops) == ("paged-c++", "c++", "c++")
    assert report.row_kernel and report.row_counts == ()  # nothing to probe, nothing padded
    line = report.line()
    assert line.startswith(report.cpu + " · float32 · matmul rows-c++ · attention paged-c++")
    assert "decode-stack c++" in line and "ops c++" in line and "invariant rows any" in line


def test_bfloat16_takes_the_row_kernel_on_any_cpu(bf16_model):
    """Every row through Tandem's row kernel (bf16 widened to fp32 where the CPU has no bf16
    dot products), so the fused decode stack runs everywhere; the report still says whether
    oneDNN could compute bf16 here (what the torch path would do)."""
    report = runner_for(bf16_model).kernel_report()
    pairs = cpu_kernels.load().row_linear_pairs()  # AVX512-BF16
    assert (report.dtype, report.bf16) == ("bfloat16", "native" if pairs else "widened")
    assert report.projections == "rows-c++"
    assert report.decode_stack == "c++"
    assert (report.attention, report.layer_ops) == ("paged-c++", "c++")
    assert f"bfloat16 {report.bf16} · matmul {report.projections}" in report.line()


@pytest.mark.parametrize("forced", [False, True], ids=["as-this-cpu-runs-it", "unpacked-forced"])
def test_bfloat16_runner_matches_hugging_face(bf16_model, rand_tokens, monkeypatch, forced):
    """The bf16 path this CPU takes, and torch's unpacked fallback (no C++ kernels, no oneDNN
    bf16) forced on any CPU: the same next-token choices as HF's own bf16 forward pass, logits
    within bf16 rounding."""
    if forced:
        refuse_packing(monkeypatch)
    runner = runner_for(bf16_model, use_kernels=not forced)
    if forced:
        report = runner.kernel_report()
        assert (report.projections, report.decode_stack) == ("torch", "per-layer")
    prompt = rand_tokens(40)
    ours = runner.forward([SeqSpan([0, 1, 2], prompt, 0, 40)])[0]
    with torch.no_grad():
        theirs = bf16_model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=5e-2)
    top2 = theirs.topk(2).values
    if top2[0] - top2[1] > 0.1:  # random weights: a near tie may flip under bf16 rounding
        assert int(ours.argmax()) == int(theirs.argmax())


def test_bfloat16_decode_does_not_depend_on_the_batch(bf16_model, rand_tokens):
    """Batch invariance holds on the bf16 path this CPU takes, packed or emulated, wherever the
    start-up probe found row counts that compute rows independently (where it found none, the
    report says so and the runner warns: that CPU's bf16 kernels are not batch-invariant)."""
    runner = runner_for(bf16_model)
    if not (runner.row_kernel or runner.row_counts):
        assert "invariant rows none" in runner.kernel_report().line()
        return
    segments = []
    for i in range(4):
        tokens = rand_tokens(5 + 7 * i)
        blocks = [10 * i, 10 * i + 1, 10 * i + 2]
        tokens.append(int(runner.forward([SeqSpan(blocks, tokens, 0, len(tokens))])[0].argmax()))
        segments.append(SeqSpan(blocks, tokens, len(tokens) - 1, len(tokens)))
    alone = runner.forward(segments[:1])[0]
    together = runner.forward(segments)[0]
    assert torch.equal(alone, together), runner.kernel_report().line()


def test_without_the_cpp_kernels_every_path_is_torch(tiny_model):
    report = runner_for(tiny_model, use_kernels=False).kernel_report()
    assert (report.attention, report.decode_stack, report.layer_ops) == (
        "sdpa",
        "per-layer",
        "torch",
    )
    assert report.projections == "onednn-packed"  # oneDNN is torch's, not ours


def test_without_batch_invariance_nothing_is_probed(tiny_model):
    report = runner_for(tiny_model, batch_invariant=False, use_kernels=False).kernel_report()
    assert report.row_counts is None and report.line().endswith("batch-invariance off")
    # the row kernel computes each row alone whatever the setting: nothing to turn off
    report = runner_for(tiny_model, batch_invariant=False).kernel_report()
    assert report.row_counts is None and report.line().endswith("invariant rows any")


def test_int8_weights_name_torchs_quantized_engine_and_find_no_invariant_rows():
    torch.manual_seed(0)
    model = quantize_int8(LlamaForCausalLM(tiny_config()).eval())
    report = runner_for(model).kernel_report()
    assert report.weights == "int8-" + torch.backends.quantized.engine
    assert report.projections in ("torch", "mixed")  # the output head may stay float and packed
    assert report.decode_stack == "per-layer" and report.row_counts == ()
    assert "weights int8-" in report.line() and report.line().endswith("invariant rows none")


def test_bf16_path_names(monkeypatch):
    assert bf16_path(torch.float32, "cpu") == ""
    assert bf16_path(torch.bfloat16, "cuda") == "native"
    monkeypatch.setattr(kernel_report, "onednn_bf16", lambda: True)
    assert bf16_path(torch.bfloat16, "cpu") == "native"
    monkeypatch.setattr(kernel_report, "onednn_bf16", lambda: False)
    assert bf16_path(torch.bfloat16, "cpu") == "emulated"
    assert bf16_path(torch.bfloat16, "cpu", row_pairs=False) == "widened"
    assert bf16_path(torch.bfloat16, "cpu", row_pairs=True) == "native"


def test_row_counts_read_as_ranges():
    assert kernel_report._ranges([1, 2, 3, 4, 8, 12, 13]) == "1-4,8,12-13"
    assert kernel_report._ranges([]) == ""
