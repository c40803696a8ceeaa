"""n > 1 choices: the prompt computed once, then forked: full blocks shared, the last one copied,
each choice sampled with the request's seed + its index (the same as a request of n = 1 with it)."""

import time

import pytest

from shared.control.choices import choice_id, choice_sampling
from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence
from tests.unit.test_engine import BLOCK, make_engine, run_to_end


def make_seq(prompt, max_tokens=6, n=1, seed=7, temperature=1.0, prefill_only=False, **kw):
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, n=n, ignore_eos=True, **kw
    )
    task = GenerateTask("r.abc", list(prompt), params, "reply", time.time())
    return Sequence.from_task(task, None, set(), 512, prefill_only=prefill_only)


def run(engine, seq) -> dict[str, list[int]]:
    """Every choice's output, by attempt id, once all finished."""
    engine.add(seq)
    run_to_end(engine)
    return {s.attempt_id: s.output_ids for s in [seq, *engine.take_forked()]}


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    blocks = BlockManager(8, BLOCK)
    parent, child = make_seq(range(40)), make_seq(range(40))
    blocks.allocate(parent)  # 3 blocks: 2 full, the last holds 8 tokens
    source, copy = blocks.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2] and source == parent.block_table[2]
    assert copy not in parent.block_table and child.block_table[2] == copy
    assert [blocks.ref_count[b] for b in parent.block_table] == [2, 2, 1]
    assert blocks.leaked([parent.block_table, child.block_table]) == 0
    blocks.deallocate(parent)
    blocks.deallocate(child)
    assert blocks.free == 8


def test_a_fork_without_a_free_block_takes_nothing():
    blocks = BlockManager(3, BLOCK)
    parent, child = make_seq(range(40)), make_seq(range(40))
    blocks.allocate(parent)
    with pytest.raises(MemoryError):
        blocks.fork(parent, child)
    assert child.block_table == [] and [blocks.ref_count[b] for b in parent.block_table] == [1] * 3


@pytest.mark.parametrize("prompt_len", [40, 48])  # the last block partly filled, or full
def test_each_choice_is_the_request_of_n_1_with_its_seed(tiny_model, rand_tokens, prompt_len):
    prompt = rand_tokens(prompt_len)
    engine = make_engine(tiny_model)
    rows = []
    forward = engine.runner.forward
    engine.runner.forward = lambda spans, abandon=None: (
        rows.append(sum(s.end - s.start for s in spans)) or forward(spans, abandon)
    )
    choices = run(engine, make_seq(prompt, n=3, logprobs=True))
    assert rows[0] == prompt_len and sum(rows) == prompt_len + 3 * 5  # the prompt once
    assert engine.blocks.free == engine.blocks.num_blocks
    for index in range(3):
        alone = make_seq(prompt, seed=choice_sampling(SamplingParams(seed=7), index).seed)
        assert choices[choice_id("r.abc", index)] == run(make_engine(tiny_model), alone)["r.abc"]
    assert len({tuple(ids) for ids in choices.values()}) == 3  # sampled, they differ


def test_greedy_choices_agree(tiny_model, rand_tokens):
    choices = run(make_engine(tiny_model), make_seq(rand_tokens(30), n=2, temperature=0))
    assert len(choices) == 2 and len(set(map(tuple, choices.values()))) == 1


def test_forked_choices_without_room_compute_their_prompt_again(tiny_model, rand_tokens):
    """A pool too small for the copies: the choices still come out right, only later."""
    prompt = rand_tokens(40)
    roomy = run(make_engine(tiny_model), make_seq(prompt, n=3, max_tokens=4))
    tight = make_engine(tiny_model, num_blocks=4)  # the prompt's 3 blocks + 1
    assert run(tight, make_seq(prompt, n=3, max_tokens=4)) == roomy
    assert tight.blocks.free == 4


def test_a_prefill_worker_samples_every_choices_first_token(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(20), n=3, prefill_only=True, logprobs=True)
    engine.add(seq)
    ((_, out),) = engine.step()
    assert len(out.token_ids) == 3 and len(out.logprobs) == 3 and engine.take_forked() == []
    assert out.token_ids[0] == seq.output_ids[0]


def test_a_remote_prompt_forks_into_the_tokens_it_was_handed(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(20), n=3, max_tokens=2)
    seq.first_tokens = [5, 6, 7]
    assert engine.admit(seq)
    engine.kv_arrived(seq)
    outputs = engine.step()
    assert [(s.attempt_id, out.token_ids) for s, out in outputs] == [
        ("r.abc~0", [5]),
        ("r.abc~1", [6]),
        ("r.abc~2", [7]),
    ]
    run_to_end(engine)
    assert engine.blocks.free == engine.blocks.num_blocks


def test_a_fork_that_fails_midway_gives_back_what_it_took(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    calls = []

    def copy_block(source, target):
        calls.append(source)
        if len(calls) == 2:
            raise RuntimeError("copy failed")

    engine.runner.pool.copy_block = copy_block
    seq = make_seq(rand_tokens(40), n=3)
    engine.add(seq)
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.take_forked() == [] and seq.attempt_id == "r.abc"  # still the group's
    engine.release(seq)
    assert engine.blocks.free == engine.blocks.num_blocks
