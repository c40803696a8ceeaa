"""The C++ decoder stack against the Python loop it replaces for all-decode steps: same bits."""

import torch

from shared.engine.model_runner import ModelRunner, SeqSpan


def test_an_all_decode_step_gives_the_python_loops_bits(tiny_model):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=256, block_size=16, chunk=32)
    assert runner.stack is not None, runner.kernel_report().line()  # fp32 packs on any CPU
    g = torch.Generator().manual_seed(5)
    segments = []
    for i in range(6):
        n = 4 + 13 * i
        tokens = torch.randint(3, 128, (n + 1,), generator=g).tolist()
        table = list(range(100 - 8 * i, 108 - 8 * i))[::-1]
        runner.forward([SeqSpan(table, tokens, 0, n)])
        segments.append(SeqSpan(table, tokens, n, n + 1))
    for batch in (segments[:1], segments[:3], segments):  # padded and unpadded row counts
        stacked = runner.forward(batch)
        kv_after_stack = runner.pool.kv.clone()
        stack, runner.stack = runner.stack, None
        try:
            looped = runner.forward(batch)
        finally:
            runner.stack = stack
        assert torch.equal(stacked, looped)
        assert torch.equal(kv_after_stack, runner.pool.kv)


def test_the_stack_is_not_used_for_steps_with_prompt_chunks(tiny_model, monkeypatch):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=64, block_size=16, chunk=32)
    calls = []
    kernels = runner.ops.kernels

    class Spy:
        def __getattr__(self, name):
            if name == "decode_stack":
                calls.append(name)
            return getattr(kernels, name)

    monkeypatch.setattr(runner.ops, "kernels", Spy())
    tokens = list(range(3, 40))
    runner.forward([SeqSpan([0, 1, 2], tokens, 0, 20)])
    assert calls == []
    runner.forward([SeqSpan([0, 1, 2], tokens, 20, 21)])
    assert calls == ["decode_stack"]
