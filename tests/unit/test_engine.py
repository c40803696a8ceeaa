"""Engine: continuous batching, chunked prefill, preemption, prefix caching, remote KV."""

import time

import pytest
import torch

from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.model_runner import ModelRunner
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence

BLOCK, CHUNK = 16, 32


def make_engine(
    model, num_blocks: int = 128, max_batch_tokens: int = 512, max_num_seqs: int = 64
) -> Engine:
    runner = ModelRunner(
        model, "tiny", "cpu", pool_blocks=num_blocks, block_size=BLOCK, chunk=CHUNK
    )
    return Engine(
        runner,
        BlockManager(num_blocks, BLOCK, cache_granularity=CHUNK),
        max_num_seqs=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
    )


def make_seq(
    prompt: list[int], max_tokens: int, attempt_id: str = "r", prefill_only: bool = False
) -> Sequence:
    task = GenerateTask(
        attempt_id=attempt_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        reply_subject="reply",
        arrival_time=time.time(),
    )
    return Sequence.from_task(task, None, set(), 512, prefill_only=prefill_only)


def task_of(seq: Sequence) -> GenerateTask:
    """The task a sequence was made from (as its worker keeps it)."""
    return GenerateTask(
        seq.attempt_id, seq.prompt_token_ids, seq.sampling, "reply", seq.arrival_time
    )


def run_to_end(engine: Engine, max_steps: int = 1000) -> int:
    steps = 0
    while engine.has_work():
        assert engine.step() is not None, "the engine has work but scheduled nothing"
        steps += 1
        assert steps < max_steps
    return steps


def alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one sequence in a roomy engine of its own."""
    engine = make_engine(model)
    seq = make_seq(prompt, max_tokens)
    engine.add(seq)
    run_to_end(engine)
    return seq.output_ids


def capture_logits(engine: Engine, seq: Sequence) -> list[torch.Tensor]:
    """Records the logits row of every token sampled for seq (spies stack)."""
    captured, forward = [], engine.runner.forward

    def spy(segments, abandon=None):
        logits = forward(segments, abandon)
        for row, segment in enumerate(segments):
            if segment.block_table is seq.block_table and segment.end == seq.num_tokens:
                captured.append(logits[row].clone())
        return logits

    engine.runner.forward = spy
    return captured


@pytest.fixture
def model(tiny_model):
    return tiny_model


# -- construction ----------------------------------------------------------------------------


def test_max_batch_tokens_below_one_chunk_is_refused(model):
    runner = ModelRunner(model, "tiny", "cpu", pool_blocks=8, block_size=BLOCK, chunk=CHUNK)
    with pytest.raises(ValueError):
        Engine(runner, BlockManager(8, BLOCK, cache_granularity=CHUNK), max_batch_tokens=CHUNK - 1)


def test_an_idle_engine_steps_to_none(model):
    engine = make_engine(model)
    assert not engine.has_work() and engine.step() is None


# -- continuous batching ---------------------------------------------------------------------


def test_sequences_join_at_step_boundaries_and_get_one_token_per_step(model, rand_tokens):
    engine = make_engine(model)
    seqs = [make_seq(rand_tokens(5 + 9 * i), 12, f"s{i}") for i in range(4)]
    for step in range(8):
        if step < len(seqs):
            engine.add(seqs[step])
            assert seqs[step].status is SeqStatus.WAITING and not seqs[step].output_ids
        before = {s.attempt_id: len(s.output_ids) for s in seqs}
        outputs = engine.step()
        joined = seqs[: min(step + 1, len(seqs))]
        assert sorted(s.attempt_id for s, _ in outputs) == sorted(s.attempt_id for s in joined)
        for seq, out in outputs:
            assert len(out.token_ids) == 1 and out.token_ids[0] == seq.output_ids[-1]
            assert len(seq.output_ids) == before[seq.attempt_id] + 1
            assert seq.status is SeqStatus.RUNNING
        assert engine.scheduler.running == joined and not engine.scheduler.waiting
    for i, seq in enumerate(seqs):
        assert len(seq.output_ids) == 8 - i
    run_to_end(engine)
    for seq in seqs:
        assert seq.output_ids == alone(model, seq.prompt_token_ids, 12)


def test_a_finished_sequence_leaves_at_once_and_its_blocks_return(model, rand_tokens):
    engine = make_engine(model, num_blocks=32)
    short, long = make_seq(rand_tokens(20), 3, "short"), make_seq(rand_tokens(40), 10, "long")
    engine.add(short)
    engine.add(long)
    assert engine.blocks.used == 0
    engine.step()
    assert engine.blocks.used == 2 + 3
    engine.step()
    outputs = engine.step()  # short's third and last token
    finished = [out for seq, out in outputs if seq is short]
    assert finished and short.status is SeqStatus.FINISHED_LENGTH
    assert short not in engine.scheduler.running and short.block_table == []
    assert engine.blocks.used == len(long.block_table) == 3
    assert [seq for seq, _ in engine.step()] == [long]
    run_to_end(engine)
    assert len(short.output_ids) == 3 and len(long.output_ids) == 10
    assert long.status is SeqStatus.FINISHED_LENGTH and not engine.scheduler.running
    assert engine.blocks.used == 0 and engine.blocks.free == 32
    assert engine.blocks.cached > 0  # cached blocks count as free


def test_max_model_len_ends_a_sequence(model, rand_tokens):
    engine = make_engine(model)
    seq = make_seq(rand_tokens(30), 100)
    seq.max_model_len = 34
    engine.add(seq)
    run_to_end(engine)
    assert (
        seq.num_tokens == 34 and seq.status is SeqStatus.FINISHED_LENGTH and engine.blocks.used == 0
    )


def test_release_frees_a_running_sequence(model, rand_tokens):
    engine = make_engine(model)
    seq = make_seq(rand_tokens(30), 50)
    engine.add(seq)
    engine.step()
    engine.step()
    engine.release(seq)
    assert not engine.has_work() and engine.blocks.used == 0
    engine.release(seq)  # twice is harmless
    assert engine.step() is None


def test_release_while_a_step_runs_frees_the_blocks_when_it_ends(tiny_model):
    """The step may still be writing a released sequence's blocks: they are not free (for a new
    sequence, a KV transfer) until it ends; the step gives it nothing."""
    engine = make_engine(tiny_model)
    seq = make_seq(list(range(3, 40)), 8)
    engine.add(seq)
    engine.step()
    held = engine.blocks.used
    ask, seen = engine.runner.forward, []

    def forward(segments, abandon=None):
        engine.release(seq)  # as the loop reaps it, while the engine thread steps
        seen.append((engine.blocks.used, list(engine.releasing)))
        return ask(segments, abandon)

    engine.runner.forward = forward
    assert engine.step() == []  # aborted while it ran: no token for it
    assert seen == [(held, [seq])]
    assert engine.blocks.used == 0 and not engine.releasing and not engine.stepping


def test_release_of_a_waiting_sequence(model, rand_tokens):
    engine = make_engine(model)
    seq = make_seq(rand_tokens(30), 5)
    engine.add(seq)
    engine.release(seq)
    assert not engine.has_work() and engine.blocks.used == 0


# -- chunked prefill -------------------------------------------------------------------------


def test_chunked_prefill_keeps_running_sequences_decoding(model, rand_tokens):
    engine = make_engine(model, max_batch_tokens=64)
    runner_seq = make_seq(rand_tokens(10), 40, "running")
    engine.add(runner_seq)
    engine.step()
    big = make_seq(rand_tokens(200), 5, "big")
    engine.add(big)
    steps_to_first = 0
    computed = []
    while not big.output_ids:
        tokens_before = len(runner_seq.output_ids)
        outputs = engine.step()
        steps_to_first += 1
        computed.append(big.num_computed_tokens)
        assert len(runner_seq.output_ids) == tokens_before + 1
        assert runner_seq in [seq for seq, _ in outputs]
        assert steps_to_first < 20
    # 63 tokens of budget beside the decode: one 32-token chunk a step; the last 40 fit at once.
    assert computed == [32, 64, 96, 128, 160, 200]
    assert all(c % CHUNK == 0 for c in computed[:-1])
    run_to_end(engine)
    assert big.output_ids == alone(model, big.prompt_token_ids, 5)
    assert runner_seq.output_ids == alone(model, runner_seq.prompt_token_ids, 40)


def test_a_lone_prompt_takes_the_whole_budget_in_chunks(model, rand_tokens):
    engine = make_engine(model, max_batch_tokens=64)
    seq = make_seq(rand_tokens(150), 3)
    engine.add(seq)
    progress = []
    while not seq.output_ids:
        engine.step()
        progress.append(seq.num_computed_tokens)
    assert progress == [64, 128, 150]


def test_a_prompt_wider_than_the_budget_still_gets_its_first_chunk(model, rand_tokens):
    engine = make_engine(model, max_batch_tokens=CHUNK)
    seq = make_seq(rand_tokens(70), 2)
    engine.add(seq)
    engine.step()
    assert seq.num_computed_tokens == 32
    run_to_end(engine)
    assert seq.output_ids == alone(model, seq.prompt_token_ids, 2)


def test_a_short_prompt_behind_a_long_one_is_computed_in_the_same_step(model, rand_tokens):
    """Each prompt in line gets a chunk first, then the rest of the budget goes in order: the
    short prompt's first token comes after one step, not after the long prompt's whole prefill;
    both answer as they do alone."""
    engine = make_engine(model, max_batch_tokens=128)
    long, short = make_seq(rand_tokens(200), 2, "long"), make_seq(rand_tokens(20), 2, "short")
    engine.add(long)
    engine.add(short)
    engine.step()
    assert short.output_ids and long.num_computed_tokens == CHUNK + 64
    run_to_end(engine)
    assert long.output_ids == alone(model, long.prompt_token_ids, 2)
    assert short.output_ids == alone(model, short.prompt_token_ids, 2)


# -- preemption ------------------------------------------------------------------------------


def test_preempted_sequences_are_recomputed_and_finish_with_the_same_tokens(model, rand_tokens):
    prompts = [rand_tokens(n) for n in (20, 25, 30)]
    engine = make_engine(model, num_blocks=6)  # 96 tokens; the three need 3 x 4 blocks
    seqs = [make_seq(p, 40, f"s{i}") for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    max_used = 0
    while engine.has_work():
        assert engine.step() is not None
        max_used = max(max_used, engine.blocks.used)
    assert engine.preemptions > 0
    assert max_used <= 6
    for seq, prompt in zip(seqs, prompts):
        assert seq.status is SeqStatus.FINISHED_LENGTH and len(seq.output_ids) == 40
        assert seq.output_ids == alone(model, prompt, 40), seq.attempt_id
    assert engine.blocks.used == 0


def test_preemption_takes_the_newest_running_sequence(model, rand_tokens):
    engine = make_engine(model, num_blocks=4)  # 64 tokens
    old, new = make_seq(rand_tokens(30), 10, "old"), make_seq(rand_tokens(31), 10, "new")
    engine.add(old)
    engine.add(new)
    engine.step()  # prompts + first tokens: 31 and 32 tokens
    assert engine.blocks.free == 0 and engine.scheduler.running == [old, new]
    engine.step()  # their KV fills the 4 blocks: 32 and 33 tokens
    assert engine.preemptions == 0
    engine.step()  # new's 33rd token needs a fifth block
    assert engine.preemptions == 1
    assert engine.scheduler.running == [old] and list(engine.scheduler.waiting) == [new]
    assert (
        new.block_table == [] and new.num_computed_tokens == 0 and new.status is SeqStatus.PREEMPTED
    )
    run_to_end(engine)
    assert new.output_ids == alone(model, new.prompt_token_ids, 10)
    assert old.output_ids == alone(model, old.prompt_token_ids, 10)


@pytest.mark.xfail(
    strict=True,
    reason="KNOWN LIMITATION recompute after preemption is not bit-identical: the tokens a sequence "
    "decoded one at a time are recomputed as a prompt chunk, whose KV differs "
    "in the last bits (see test_model_runner), so later logits differ",
)
def test_preemption_gives_bit_identical_logits(model, rand_tokens):
    prompts = [rand_tokens(n) for n in (20, 25, 30)]
    engine = make_engine(model, num_blocks=6)
    seqs = [make_seq(p, 40, f"s{i}") for i, p in enumerate(prompts)]
    captured = [capture_logits(engine, seq) for seq in seqs]
    for seq in seqs:
        engine.add(seq)
    run_to_end(engine)
    assert engine.preemptions > 0
    for prompt, logits in zip(prompts, captured):
        solo_engine = make_engine(model)
        solo = make_seq(prompt, 40)
        expected = capture_logits(solo_engine, solo)
        solo_engine.add(solo)
        run_to_end(solo_engine)
        assert len(logits) == len(expected) == 40
        assert all(torch.equal(a, b) for a, b in zip(logits, expected))


# -- prefix caching --------------------------------------------------------------------------


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_output(model, rand_tokens):
    prefix = rand_tokens(64)
    first_prompt, second_prompt = prefix + rand_tokens(10), prefix + rand_tokens(13)
    engine = make_engine(model)
    first = make_seq(first_prompt, 5, "first")
    engine.add(first)
    run_to_end(engine)
    second = make_seq(second_prompt, 8, "second")
    cached_logits = capture_logits(engine, second)
    engine.add(second)
    engine.step()
    assert second.num_cached_tokens == 64
    assert engine.blocks.hits == 64
    run_to_end(engine)
    assert second.output_ids == alone(model, second_prompt, 8)
    assert first.output_ids == alone(model, first_prompt, 5)
    fresh = make_engine(model)
    uncached = make_seq(second_prompt, 8, "uncached")
    fresh_logits = capture_logits(fresh, uncached)
    fresh.add(uncached)
    run_to_end(fresh)
    assert fresh.blocks.hits == 0
    assert len(cached_logits) == len(fresh_logits) == 8
    assert all(torch.equal(a, b) for a, b in zip(cached_logits, fresh_logits))  # bit-identical


def test_prefix_hits_count_whole_granules_only(model, rand_tokens):
    prefix = rand_tokens(48)  # three blocks: one 32-token granule
    engine = make_engine(model)
    engine.add(make_seq(prefix + rand_tokens(20), 1, "a"))
    run_to_end(engine)
    seq = make_seq(prefix + rand_tokens(20), 3, "b")
    engine.add(seq)
    engine.step()
    assert seq.num_cached_tokens == 32
    run_to_end(engine)
    assert seq.output_ids == alone(model, seq.prompt_token_ids, 3)


def test_a_running_sequence_shares_its_prefix_blocks(model, rand_tokens):
    prefix = rand_tokens(64)
    engine = make_engine(model)
    a = make_seq(prefix + rand_tokens(5), 30, "a")
    engine.add(a)
    engine.step()
    b = make_seq(prefix + rand_tokens(7), 10, "b")
    engine.add(b)
    engine.step()
    assert b.num_cached_tokens == 64 and b.block_table[:4] == a.block_table[:4]
    run_to_end(engine)
    assert b.output_ids == alone(model, b.prompt_token_ids, 10)
    assert a.output_ids == alone(model, a.prompt_token_ids, 30)
    assert engine.blocks.used == 0


def test_blocks_filled_by_decode_steps_are_not_shared(model, rand_tokens):
    """Decoded tokens' KV differs in the last bits from a prompt pass over them: never reused."""
    engine = make_engine(model)
    writer = make_seq(rand_tokens(10), 60, "writer")  # blocks 1-3 filled by decode steps
    engine.add(writer)
    run_to_end(engine)
    prompt = writer.token_ids[:64] + rand_tokens(3)
    reader = make_seq(prompt, 1, "reader")
    captured = capture_logits(engine, reader)
    engine.add(reader)
    run_to_end(engine)
    assert engine.blocks.hits == 0  # writer's decode-filled blocks were not offered
    fresh = make_engine(model)
    uncached = make_seq(prompt, 1, "uncached")
    expected = capture_logits(fresh, uncached)
    fresh.add(uncached)
    run_to_end(fresh)
    assert torch.equal(captured[-1], expected[-1])


# -- prefill-only sequences and remote KV -----------------------------------------------------


def test_a_prefill_only_sequence_keeps_its_blocks_until_released(model, rand_tokens):
    engine = make_engine(model)
    seq = make_seq(rand_tokens(50), 100, prefill_only=True)
    engine.add(seq)
    outputs = engine.step()
    assert [s for s, _ in outputs] == [seq] and outputs[0][1].finished is SeqStatus.FINISHED_LENGTH
    assert seq.status is SeqStatus.FINISHED_LENGTH and len(seq.output_ids) == 1
    assert not engine.has_work() and engine.step() is None
    assert len(seq.block_table) == 4 and engine.blocks.used == 4 and seq.num_computed_tokens == 50
    engine.release(seq)
    assert engine.blocks.used == 0 and seq.block_table == []


def prefill_elsewhere(model, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """What a prefill worker sends: the prompt's KV and the first token."""
    engine = make_engine(model)
    seq = make_seq(prompt, 1, "prefill", prefill_only=True)
    engine.add(seq)
    run_to_end(engine)
    pool = engine.runner.pool
    buffer = pool.export(pool.slots(seq.block_table, 0, seq.prompt_len)).clone()
    engine.release(seq)
    return buffer, seq.output_ids[0]


def land(engine, seq, buffer: torch.Tensor) -> None:
    """What the KV transfer does: the prompt's KV past the cached prefix, written into seq's blocks."""
    pool = engine.runner.pool
    start = seq.num_cached_tokens
    rows = pool.rows(pool.slots(seq.block_table, start, seq.prompt_len))
    for layer, (keys, values) in enumerate(buffer[:, :, start : seq.prompt_len]):
        pool.write(layer, rows, keys, values)


def test_remote_kv_decodes_like_the_colocated_run(model, rand_tokens):
    prompt = rand_tokens(45)
    buffer, first = prefill_elsewhere(model, prompt)
    engine = make_engine(model, num_blocks=64)
    engine.add(make_seq(rand_tokens(33), 3, "other"))  # the decode pool is not empty
    engine.step()
    seq = make_seq(prompt, 12, "remote")
    assert engine.admit(seq) and seq.status is SeqStatus.WAITING_KV
    assert len(seq.block_table) == 3 and seq.num_cached_tokens == 0
    assert not seq.output_ids and seq not in engine.scheduler.running
    land(engine, seq, buffer)
    seq.first_tokens = [first]
    outputs = engine.kv_arrived(seq)  # the batch has room: it joins now, its first token out
    assert (seq, [first]) in [(s, out.token_ids) for s, out in outputs]
    assert seq.status is SeqStatus.RUNNING and seq.num_computed_tokens == 45
    run_to_end(engine)
    assert seq.output_ids == alone(model, prompt, 12)
    assert engine.blocks.used == 0


def test_remote_kv_waits_for_a_step_when_the_batch_is_full(model, rand_tokens):
    prompt = rand_tokens(40)
    buffer, first = prefill_elsewhere(model, prompt)
    engine = make_engine(model, num_blocks=64, max_num_seqs=1)
    engine.add(make_seq(rand_tokens(20), 4, "other"))
    engine.step()  # "other" holds the batch's one slot
    seq = make_seq(prompt, 6, "remote")
    assert engine.admit(seq)
    land(engine, seq, buffer)
    seq.first_tokens = [first]
    assert engine.kv_arrived(seq) == [] and seq.status is SeqStatus.KV_READY
    run_to_end(engine)  # it joins once "other" is done
    assert seq.output_ids == alone(model, prompt, 6)
    assert engine.blocks.used == 0


def test_remote_kv_over_a_cached_prefix_loads_only_the_rest(model, rand_tokens):
    prefix = rand_tokens(64)
    prompt = prefix + rand_tokens(20)
    buffer, first = prefill_elsewhere(model, prompt)
    engine = make_engine(model)
    engine.add(make_seq(prefix + rand_tokens(3), 2, "warm"))
    run_to_end(engine)
    seq = make_seq(prompt, 10, "remote")
    assert engine.admit(seq) and seq.num_cached_tokens == 64
    buffer[:, :, :64] = float("nan")  # the cached part is not sent
    land(engine, seq, buffer)
    seq.first_tokens = [first]
    engine.kv_arrived(seq)
    run_to_end(engine)
    assert seq.output_ids == alone(model, prompt, 10)


def test_admit_refuses_when_the_pool_is_full(model, rand_tokens):
    engine = make_engine(model, num_blocks=4)
    assert engine.admit(make_seq(rand_tokens(48), 5, "a"))
    refused = make_seq(rand_tokens(17), 5, "b")
    assert not engine.admit(refused)
    assert refused.block_table == [] and engine.blocks.used == 3


# -- known bugs --------------------------------------------------------------------------------


def test_max_num_seqs_sequences_run_together(model, rand_tokens):
    engine = make_engine(model, max_num_seqs=4)
    seqs = [make_seq(rand_tokens(10), 20, f"s{i}") for i in range(4)]
    for seq in seqs:  # one arrives per step
        engine.add(seq)
        engine.step()
    assert len(engine.scheduler.running) == 4
    assert all(seq.output_ids for seq in seqs)


def test_a_preempted_sequence_does_not_stall_a_partial_prefill(model, rand_tokens):
    engine = make_engine(model, num_blocks=8, max_batch_tokens=64)
    a = make_seq(rand_tokens(31), 20, "a")
    engine.add(a)
    engine.step()  # a: 32 tokens in 2 blocks
    b = make_seq(rand_tokens(96), 3, "b")  # 6 blocks: the rest of the pool
    engine.add(b)
    engine.step()  # a decodes; b's first chunk
    assert 0 < b.num_computed_tokens < b.prompt_len and engine.blocks.free == 0
    run_to_end(engine, max_steps=200)  # a must be preempted for a block
    assert len(a.output_ids) == 20 and len(b.output_ids) == 3


def test_a_prompt_chunk_is_not_starved_by_running_decodes(model, rand_tokens):
    """With the budget one chunk wide, decode rows must not keep every chunk out: one always goes."""
    engine = make_engine(model, max_batch_tokens=CHUNK)
    running = make_seq(rand_tokens(5), 50, "running")
    engine.add(running)
    engine.step()  # running now decodes every step
    waiting = make_seq(rand_tokens(70), 2, "waiting")
    engine.add(waiting)
    engine.step()
    assert waiting.num_computed_tokens == CHUNK  # its first chunk went with the decode row
    run_to_end(engine)
    assert waiting.output_ids == alone(model, waiting.prompt_token_ids, 2)


def test_waiting_prompts_are_served_by_priority_then_arrival(tiny_model):
    engine = make_engine(tiny_model, max_batch_tokens=CHUNK, max_num_seqs=1)
    order = []
    for rid, priority in (("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", 5)):
        seq = make_seq(toks_of(rid), 1, attempt_id=rid)
        seq.priority = priority
        engine.add(seq)
    assert engine.prompt_tokens_queued() == 5 * 20
    while engine.has_work():
        for seq, out in engine.step() or []:
            if out.finished:
                order.append(seq.attempt_id)
    assert order == ["e", "b", "d", "a", "c"]
    assert engine.prefill_tokens_per_s == 0.0  # one-chunk-or-less prompt steps say nothing of speed


def test_prompt_speed_is_measured_on_prompt_steps(tiny_model):
    engine = make_engine(tiny_model, max_batch_tokens=2 * CHUNK)
    engine.add(make_seq(list(range(1, 3 * CHUNK)), 2))
    run_to_end(engine)
    assert engine.prefill_tokens_per_s > 0


def test_decode_step_time_is_measured_only_while_sequences_decode(tiny_model):
    engine = make_engine(tiny_model, max_batch_tokens=CHUNK)
    engine.add(make_seq(list(range(1, 3 * CHUNK)), 1))
    run_to_end(engine)
    assert engine.decode_step_s == 0.0  # prompt chunks and its one token: nothing decoded
    engine.add(make_seq(list(range(1, 10)), 4))
    run_to_end(engine)
    assert engine.decode_step_s > 0


def toks_of(rid: str) -> list[int]:
    return [ord(rid) + i for i in range(20)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_resumed_sequence_goes_on_with_the_tokens_of_an_undisturbed_run(tiny_model, temperature):
    """A request moved after k tokens: prompt + those k as the new prompt, resume_tokens = k. Greedy
    and seeded sampling both give the rest of the undisturbed run's tokens."""

    def run(prompt: list[int], max_tokens: int, resume: int = 0) -> list[int]:
        engine = make_engine(tiny_model)
        seq = make_seq(prompt, max_tokens)
        seq.sampling.temperature, seq.sampling.seed = temperature, 7
        seq.resume_tokens = resume
        engine.add(seq)
        run_to_end(engine)
        return seq.output_ids

    prompt = list(range(3, 40))
    whole = run(prompt, 12)
    for k in (1, 5, 11):
        assert run(prompt + whole[:k], 12 - k, resume=k) == whole[k:]


def test_a_step_whose_sequences_were_all_cancelled_stops_between_layers(tiny_model):
    engine = make_engine(tiny_model)
    gone, kept = (
        make_seq(list(range(3, 60)), 4, attempt_id="gone"),
        make_seq(list(range(3, 40)), 4, attempt_id="kept"),
    )
    engine.add(gone)
    layers_run = []
    ask = engine.runner.forward

    def forward(segments, abandon=None):
        def counting():
            layers_run.append(1)
            gone.abandoned = len(layers_run) > 1  # the client went away mid-step
            return abandon()

        return ask(segments, counting)

    engine.runner.forward = forward
    assert engine.step() == []  # stopped after the first layer: nothing emitted
    assert len(layers_run) == 2 and gone.num_computed_tokens == 0
    engine.release(gone)
    engine.add(kept)
    gone.abandoned = False
    while engine.has_work():  # a step with a live sequence runs to the end
        engine.step()
    assert kept.output_ids == alone(tiny_model, kept.prompt_token_ids, 4)
    assert engine.blocks.used == 0


def test_an_aborted_sequence_gets_nothing_more_and_release_frees_it(tiny_model):
    engine = make_engine(tiny_model)
    gone, kept = make_seq(list(range(3, 30)), 8, "gone"), make_seq(list(range(5, 30)), 8, "kept")
    engine.add(gone)
    engine.add(kept)
    engine.step()
    assert gone.status is SeqStatus.RUNNING and engine.abort(gone)
    assert gone.status is SeqStatus.FINISHED_ABORTED and gone not in engine.scheduler.running
    assert not engine.abort(gone)  # once
    outputs = engine.step()
    assert [s for s, _ in outputs] == [kept]
    engine.release(gone)
    run_to_end(engine)
    assert kept.status is SeqStatus.FINISHED_LENGTH and engine.blocks.used == 0


def test_an_aborted_sequence_still_in_the_inbox_never_starts(tiny_model):
    engine = make_engine(tiny_model)
    seq = make_seq(list(range(3, 30)), 4)
    engine.add(seq)
    assert engine.abort(seq) and not engine.has_work()
    assert engine.step() is None and not seq.block_table
