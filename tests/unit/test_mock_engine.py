"""The mock engine: a timing model fitted by least squares, a MockRunner under the real Engine and
BlockManager that answers deterministically (alone or batched, after a preemption), waits as
the model says, and holds the KV bytes per token it is given."""

import time

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.kv_cache import bytes_per_token
from shared.engine.mock_runner import MockRunner, mock_layout
from shared.engine.timing_model import DEFAULT_PATH, FEATURES, TimingModel, features
from tests.unit.test_engine import make_seq, run_to_end

BLOCK, CHUNK = 16, 32
ZERO = TimingModel(dict.fromkeys(FEATURES, 0.0), "zero")


def runner(timing: TimingModel = ZERO, speedup: float = 0.0, blocks: int = 64, per_token=64):
    layout = mock_layout("tiny", 4, per_token, BLOCK)
    return MockRunner(layout, blocks, CHUNK, range(10, 500), timing, speedup)


def engine_of(mock: MockRunner, max_num_seqs: int = 64) -> Engine:
    blocks = BlockManager(mock.pool.num_blocks, BLOCK, cache_granularity=CHUNK)
    return Engine(mock, blocks, max_num_seqs=max_num_seqs, max_batch_tokens=256)


def expected(mock: MockRunner, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(mock.next_token(tokens[-1], len(tokens)))
    return tokens[len(prompt) :]


def test_the_fit_recovers_a_known_timing_model():
    truth = TimingModel(
        dict(zip(FEATURES, (2e-3, 1e-4, 3e-5, 4e-4, 2e-5))), "synthetic"
    )  # seconds per unit
    steps = [([(c, c + n)], []) for c in (0, 500, 2000) for n in (16, 128)]
    steps += [([], [ctx] * b) for b in (1, 8, 64) for ctx in (64, 1000)]
    samples = [(features(p, d), truth.step_s(p, d)) for p, d in steps]
    fitted = TimingModel.fitted(samples, "synthetic")
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(truth.coefficients[name], rel=1e-6)
    assert fitted.fit["r2"] == pytest.approx(1.0) and fitted.fit["samples"] == len(steps)


def test_a_timing_model_round_trips_and_refuses_missing_coefficients(tmp_path):
    path = tmp_path / "t.json"
    ZERO.save(path)
    assert TimingModel.load(path) == ZERO
    path.write_text('{"coefficients": {"base": 1}}')
    with pytest.raises(ValueError, match="prompt_row"):
        TimingModel.load(path)
    shipped = TimingModel.load(DEFAULT_PATH)  # fitted by bench/fit_timing.py, kept in the repo
    assert shipped.coefficients["decode_row"] > 0 and shipped.fit["r2"] > 0.9


def test_answers_are_the_same_alone_batched_and_after_preemption():
    prompts = [[3 + i] * (20 + 7 * i) for i in range(6)]
    alone = []
    for prompt in prompts:
        mock = runner()
        engine = engine_of(mock)
        seq = make_seq(prompt, 24)
        engine.add(seq)
        run_to_end(engine)
        assert seq.output_ids == expected(mock, prompt, 24)
        alone.append(seq.output_ids)
        assert engine.blocks.used == 0
    mock = runner(blocks=12)  # too few blocks for all: some are preempted and computed again
    engine = engine_of(mock)
    seqs = [make_seq(p, 24, attempt_id=f"r{i}") for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_end(engine)
    assert engine.preemptions > 0
    assert [s.output_ids for s in seqs] == alone
    assert all(10 <= t < 500 for out in alone for t in out)
    assert engine.blocks.used == 0


def test_a_step_takes_the_timing_model_s_time_over_the_speedup():
    slow = TimingModel({**ZERO.coefficients, "base": 0.05, "decode_row": 0.01}, "slow")
    mock = runner(slow, speedup=2.0)
    seq = make_seq([5] * 20, 3)
    engine = engine_of(mock)
    engine.add(seq)
    started = time.perf_counter()
    steps = run_to_end(engine)
    # the prompt step: 0.05 / 2; each decode step: 0.06 / 2 (lower bounds: a busy machine adds)
    assert time.perf_counter() - started >= 0.025 + (steps - 1) * 0.03
    assert mock.step_s([]) == pytest.approx(0.05)


def test_the_pool_holds_the_bytes_per_token_asked_for():
    assert bytes_per_token(mock_layout("m", 30, 46080, BLOCK)) == 46080  # SmolLM2's fp32 KV
    assert bytes_per_token(mock_layout("m", 30, 100, BLOCK)) == 120  # rounded up to 2 x layers
    least = mock_layout("m", 30, 0, BLOCK)
    assert least.num_layers == 1 and bytes_per_token(least) == 2
    mock = runner(per_token=0)
    assert mock.pool.kv.numel() == 2 * mock.pool.num_blocks * BLOCK
    seq = make_seq([4] * 40, 5)
    engine = engine_of(mock)
    engine.add(seq)
    run_to_end(engine)
    assert seq.output_ids == expected(mock, [4] * 40, 5)


def test_a_fleet_needs_the_mock_engine_and_names_its_workers_in_order():
    from shared.worker.fleet import fleet_ids
    from shared.worker.settings import WorkerSettings

    with pytest.raises(ValueError, match="engine mock"):
        WorkerSettings(mock_workers=3)
    with pytest.raises(ValueError, match="negative"):
        WorkerSettings(engine="mock", mock_speedup=-1)
    settings = WorkerSettings(engine="mock", mock_workers=3, worker_id="fleet-a")
    assert fleet_ids(settings, "decode") == ["fleet-a-0000", "fleet-a-0001", "fleet-a-0002"]
    many = fleet_ids(WorkerSettings(engine="mock", mock_workers=12_000), "decode")
    assert len(set(many)) == 12_000 and many[-1].endswith("-11999")


def test_the_mock_names_its_rows_argmax_without_reading_them():
    """The argmax of a pass's logits is the tokens it picked (a scan of each row costs the mock's
    worker what a GPU's does on its side); any other tensor is read."""
    import torch

    from shared.engine.forward_batch import SeqSpan
    from shared.engine.sampler import argmax_rows

    mock = runner()
    spans = [SeqSpan([], [20 + i, 30 + i], 1, 2, False) for i in range(3)]
    logits = mock.forward(spans)
    assert (
        mock.argmax(logits) == argmax_rows(logits) == [mock.next_token(30 + i, 2) for i in range(3)]
    )
    assert mock.argmax(logits[:2]) == argmax_rows(logits[:2])
    other = torch.zeros(2, 500)
    other[0, 7], other[1, 9] = 1.0, 1.0
    assert mock.argmax(other) == [7, 9]


def test_a_request_of_several_choices_forks_on_a_mock_worker_too():
    """The choices share the prompt's KV; its last block, part full, is copied (copy_block)."""
    from shared.control.messages import GenerateTask, SamplingParams
    from shared.engine.sequence import Sequence

    mock, prompt = runner(), [5] * (BLOCK + 4)
    engine = engine_of(mock)
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    task = GenerateTask("g", prompt, sampling, "reply", time.time())
    engine.add(Sequence.from_task(task, None, set(), 512))
    run_to_end(engine)
    choices = engine.take_forked()
    assert [s.output_ids for s in choices] == [expected(mock, prompt, 6)] * 2
