"""The engine's Scheduler on its own (no model): which sequences a step runs, in what order,
within the prompt budget and the KV blocks, and how it preempts."""

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence
from shared.values.sampling import SamplingParams

BLOCK, CHUNK = 16, 32


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, recompute=None):
    blocks = BlockManager(num_blocks, BLOCK, cache_granularity=CHUNK)
    return Scheduler(blocks, CHUNK, recompute or (lambda n: False), max_num_seqs, budget)


def seq(rid: str, prompt_len: int = 20, priority: int = 0, max_tokens: int = 8) -> Sequence:
    prompt = [ord(rid[0]) * 100 + i for i in range(prompt_len)]
    s = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), None, set(), 4096)
    s.priority = priority
    return s


def decode_one(s: Scheduler, batch) -> None:
    """What the engine does after a step: each row's prompt done, a token each."""
    for w in batch.work:
        w.seq.num_computed_tokens = w.end
        if w.end < w.seq.num_tokens:
            continue
        if w.seq.computing_prompt:
            s.prompt_done(w.seq)
        w.seq.append(1)
        s.sampled(w.seq)


def test_waiting_prompts_are_queued_by_priority_then_arrival():
    s = scheduler()
    for rid, priority in (("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", 5)):
        s.queue(seq(rid, priority=priority))
    assert [x.attempt_id for x in s.waiting] == ["e", "b", "d", "a", "c"]
    assert s.prompt_tokens_queued() == 5 * 20


def test_a_started_prompt_is_never_overtaken_by_a_higher_priority():
    s = scheduler()
    started = seq("a")
    started.prefill_started = 1.0  # preempted after it had started: no blocks now
    s.queue(started)
    s.queue(seq("b", priority=9))
    assert [x.attempt_id for x in s.waiting] == ["a", "b"]


def test_prompts_are_cut_to_the_budget_a_chunk_each_first():
    s = scheduler(budget=CHUNK * 2)
    long, short = seq("l", 5 * CHUNK), seq("s", 10)
    s.queue(long)
    s.queue(short)
    batch = s.schedule()
    spans = {w.seq.attempt_id: (w.start, w.end) for w in batch.work}
    assert spans["s"] == (0, 10)  # its one chunk
    assert spans["l"][0] == 0 and 0 < spans["l"][1] <= 2 * CHUNK - 10
    assert sum(e - b for b, e in spans.values()) <= 2 * CHUNK
    assert long.status is SeqStatus.WAITING and long.block_table


def test_a_prompt_waits_while_max_num_seqs_decode():
    s = scheduler(max_num_seqs=2, budget=1024)
    a, b, c = seq("a"), seq("b"), seq("c")
    s.queue(a)
    s.queue(b)
    decode_one(s, s.schedule())
    assert s.running == [a, b] and all(x.status is SeqStatus.RUNNING for x in (a, b))
    s.queue(c)
    batch = s.schedule()
    assert [w.seq for w in batch.work] == [a, b] and not c.block_table
    assert list(s.waiting) == [c]


def test_a_dry_pool_preempts_the_newest_running_sequence():
    s = scheduler(num_blocks=2, budget=1024)  # two blocks: one per 16-token prompt
    old, new = seq("o", 16, max_tokens=50), seq("n", 16, max_tokens=50)
    s.queue(old)
    s.queue(new)
    decode_one(s, s.schedule())
    assert s.running == [old, new] and s.blocks.free == 0
    batch = s.schedule()  # old needs a second block for its 17th token: new gives its one back
    assert [w.seq for w in batch.work] == [old] and s.preemptions == 1
    assert new.status is SeqStatus.PREEMPTED and not new.block_table
    assert list(s.waiting) == [new] and new.num_computed_tokens == 0


def test_a_preempted_sequence_waits_again_when_it_gets_blocks_back():
    s = scheduler(num_blocks=8, budget=1024)
    x = seq("x", 20)
    s.queue(x)
    decode_one(s, s.schedule())
    s.running.remove(x)
    s.blocks.deallocate(x)
    x.move(SeqStatus.PREEMPTED)
    s.requeue(x)
    batch = s.schedule()
    assert x.status is SeqStatus.WAITING and x.block_table
    assert [(w.start, w.end) for w in batch.work] == [(0, 21)]  # prompt and its token again


def test_a_sequence_whose_rope_changes_at_its_length_is_computed_again():
    s = scheduler(recompute=lambda n: n == 21)
    x = seq("x", 20)
    s.queue(x)
    decode_one(s, s.schedule())
    batch = s.schedule()
    assert x.status is SeqStatus.WAITING and batch.work[0].start == 0  # recomputed at once


def test_remote_kv_reserves_then_joins_at_once_or_at_a_step():
    s = scheduler(max_num_seqs=1, budget=1024)
    a, b = seq("a"), seq("b")
    assert s.reserve(a) and a.status is SeqStatus.WAITING_KV and a.block_table
    a.first_tokens = [5]
    assert s.kv_ready(a) and a.status is SeqStatus.KV_READY  # room: it joins now
    a.append(5)
    s.sampled(a)
    assert s.running == [a]
    assert s.reserve(b)
    b.first_tokens = [6]
    assert not s.kv_ready(b) and s.loading == [b]  # the batch is full: at a step
    assert s.schedule().loads == []  # still full


def test_reserve_refuses_when_the_pool_is_short():
    s = scheduler(num_blocks=1)
    x = seq("x", 40)
    assert not s.reserve(x) and x.status is SeqStatus.WAITING and not x.block_table


def test_a_finished_sequence_leaves_the_batch_and_its_blocks():
    s = scheduler()
    x = seq("x", 20, max_tokens=1)
    s.queue(x)
    decode_one(s, s.schedule())
    assert x.status is SeqStatus.FINISHED_LENGTH and x not in s.running
    assert s.blocks.used == 0 and not s.has_work()


def test_a_finished_prefill_keeps_its_blocks_for_its_transfer():
    s = scheduler()
    x = Sequence("p", list(range(20)), SamplingParams(), None, set(), 4096, prefill_only=True)
    s.queue(x)
    decode_one(s, s.schedule())
    assert x.status is SeqStatus.FINISHED_LENGTH and s.blocks.used == 2


@pytest.mark.parametrize("where", ["waiting", "loading", "running"])
def test_remove_takes_a_sequence_out_of_any_queue(where):
    s = scheduler()
    x = seq("x")
    getattr(s, where).append(x)
    s.remove(x)
    assert not s.has_work()
