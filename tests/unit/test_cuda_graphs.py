"""DecodeGraphs' static-buffer step (what a CUDA graph captures), run on CPU without a graph, with
Triton's attention in its interpreter: padded to the graph's size, it gives the eager step's
logits, writes each real row's KV where the eager step does and the padding's into the scratch
block only. The capture itself runs on a GPU: `make gpu-check`."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it for the session
    pytest.skip("needs TRITON_INTERPRET=1 from the start", allow_module_level=True)

from shared.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from shared.engine.kv_cache import KVPool  # noqa: E402
from shared.engine.model_runner import ModelRunner, SeqSpan  # noqa: E402

BLOCK = 16


def test_a_padded_static_step_matches_the_eager_one(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", 32, BLOCK, chunk=32, triton=True)
    runner.pool = KVPool(runner.layout, 32, BLOCK, "cpu", scratch=True)
    graphs = DecodeGraphs(runner, max_tokens=8 * BLOCK, sizes=(1, 4, 8), capture=False)
    tables = [[5, 2, 9], [0], [20, 11, 30, 1]]  # scattered blocks
    lengths = [40, 9, 50]  # prompt tokens; each decodes one more
    prompts = [rand_tokens(n) for n in lengths]
    runner.forward([SeqSpan(t, p, 0, len(p), prompt=True) for t, p in zip(tables, prompts)])
    steps = [SeqSpan(t, p + [7], len(p), len(p) + 1) for t, p in zip(tables, prompts)]
    assert graphs.fits(steps)

    eager = runner.forward(steps)
    after_eager = runner.pool.kv.clone()
    padded = graphs.run(steps)  # 3 rows, run as 4

    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert int(eager[0].argmax()) == int(padded[0].argmax())
    scratch = runner.pool.scratch_slot
    # [blocks, layers, 2, block_size, heads, dim] -> the slots (block, offset) any write changed
    changed = (runner.pool.kv != after_eager).flatten(4).any(-1).any(1).any(1).flatten()
    assert set(changed.nonzero().flatten().tolist()) <= {scratch}, "the padding's KV: scratch only"
    assert runner.pool.kv[scratch // BLOCK, :, :, scratch % BLOCK].abs().sum() > 0
    torch.testing.assert_close(runner.pool.kv[: scratch // BLOCK], after_eager[: scratch // BLOCK])


def test_only_steps_of_decode_rows_that_fit_are_replayed(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", 32, BLOCK, chunk=32, triton=True)
    runner.pool = KVPool(runner.layout, 32, BLOCK, "cpu", scratch=True)
    graphs = DecodeGraphs(runner, max_tokens=4 * BLOCK, sizes=(1, 2), capture=False)
    p = rand_tokens(70)
    row = SeqSpan([0, 1, 2, 3, 4], p, 60, 61)
    assert graphs.fits([row]) and graphs.fits([row, row])
    assert not graphs.fits([row, row, row])  # more rows than the largest graph
    assert not graphs.fits([SeqSpan([0, 1, 2, 3, 4], p, 64, 65)])  # a table wider than its rows
    assert not graphs.fits([SeqSpan([0, 1], p, 0, 20, prompt=True)])
    assert not graphs.fits([SeqSpan([0], p, 3, 4, prompt=True)])  # a prompt's one-token tail
    assert not graphs.fits([])
