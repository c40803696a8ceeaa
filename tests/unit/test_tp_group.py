"""A tensor-parallel worker's group: rank 0 (this process, through load_runtime) starts rank 1 as
a process of its own (shared.worker.tp_rank), drives it over the command link, and decodes what
one engine decodes on the whole model, an n = 2 request's fork (a block copy on every rank)
included; a rank that dies fails the group (GroupFailed, never a hang); the command link and the
spans' encoding round-trip."""

import os
import signal
import socket
import threading

import pytest

from shared.control.worker_roles import Role
from shared.engine.forward_batch import SeqSpan
from shared.engine.sequence import Sequence
from shared.parallel.commands import CommandReader, CommandWriter, GroupGone, Op
from shared.parallel.group import GroupFailed, decode_spans, encode_spans
from shared.parallel.heads import TPError
from shared.values.sampling import SamplingParams
from shared.worker.runtime import load_runtime
from shared.worker.settings import WorkerSettings

NEW = 8
PROMPTS = [[(5 * i + 11 * j) % 3000 + 7 for j in range(n)] for i, n in enumerate((50, 21, 9))]


def runtime_of(path, tp: int):
    settings = WorkerSettings(model=str(path), tp=tp, kv_cache_mb=16, prefill_chunk_tokens=32)
    return load_runtime(settings, Role.DECODE)


def decode(engine) -> list[list[int]]:
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=NEW, ignore_eos=True, n=2 if i == 1 else 1)
        seqs.append(Sequence(f"r{i}", prompt, params, None, set(), 512))
        engine.add(seqs[-1])
        engine.step()
    while engine.has_work():
        engine.step()
    forked = engine.take_forked()
    return [s.output_ids for s in seqs] + [s.output_ids for s in forked if s.forked_from]


@pytest.mark.parametrize("name", ["qwen2.5-heads", "gemma"])  # 14/2 heads; 4/1 (replicated)
def test_a_group_of_two_processes_decodes_what_one_engine_decodes(family_checkpoint, name):
    path = family_checkpoint(name)
    one = runtime_of(path, 1)
    want = decode(one.engine)
    group = runtime_of(path, 2)
    try:
        assert group.tp == 2 and len(group.pools) == 2
        assert group.layout == one.layout  # peers pair with the whole model's layout
        heads = group.layout.num_kv_heads
        assert [p.layout.num_kv_heads for p in group.pools] == [max(1, heads // 2)] * 2
        got = decode(group.engine)
    finally:
        group.close()
    assert len(got) == len(PROMPTS) + 1  # the n = 2 request's second choice
    assert got == want
    assert all(p.poll() == 0 for p in group.group.processes)  # left when told


def test_a_rank_that_dies_fails_the_group_instead_of_hanging(family_checkpoint):
    rt = runtime_of(family_checkpoint("qwen2.5-heads"), 2)
    try:
        victim = rt.group.processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        assert rt.group.failed.wait(10)
        assert "rank 1" in rt.group.failure and "-9" in rt.group.failure
        rt.engine.add(Sequence("r", PROMPTS[0], SamplingParams(max_tokens=2), None, set(), 512))
        with pytest.raises(GroupFailed):
            while rt.engine.has_work():
                rt.engine.step()
    finally:
        rt.close()


def test_a_degree_that_does_not_split_the_heads_is_refused_before_loading(family_checkpoint):
    with pytest.raises(TPError, match="degrees that would: 1, 2, 14"):
        runtime_of(family_checkpoint("qwen2.5-heads"), 4)


def test_commands_round_trip_and_a_closed_link_is_group_gone():
    ours, theirs = socket.socketpair()
    writer, reader = CommandWriter([ours]), CommandReader(theirs)

    def send() -> None:  # larger than the socket's buffer: the reader must keep up
        writer.send(Op.FORWARD, list(range(100_000)))
        writer.send(Op.COPY_BLOCK, [3, 4])
        writer.send(Op.STOP, [])

    sender = threading.Thread(target=send)
    sender.start()
    assert reader.receive() == (Op.FORWARD, list(range(100_000)))
    assert reader.receive() == (Op.COPY_BLOCK, [3, 4])
    assert reader.receive() == (Op.STOP, [])
    sender.join()
    writer.close()
    with pytest.raises(GroupGone):
        reader.receive()


def test_spans_round_trip_through_their_encoding_with_only_the_ids_they_compute():
    spans = [
        SeqSpan([3, 9, 4], list(range(40)), 32, 40, True),
        SeqSpan([1], [5, 6, 7], 2, 3, False),
        SeqSpan([2, 8], list(range(100)), 16, 32, True),  # a chunk of a longer prompt
        SeqSpan([], [], 0, 0, False),
    ]
    back = decode_spans(encode_spans(spans))
    for sent, got in zip(spans, back, strict=True):
        assert (got.block_table, got.start, got.end, got.prompt) == (
            sent.block_table,
            sent.start,
            sent.end,
            sent.prompt,
        )
        assert got.token_ids[got.start : got.end] == sent.token_ids[sent.start : sent.end]
        assert len(got.token_ids) == len(sent.token_ids)  # a length-dependent rope reads it
    # a decode step of a 10,000-token sequence: one id travels, not its history
    assert (
        len(encode_spans([SeqSpan(list(range(625)), list(range(10_000)), 9_999, 10_000, False)]))
        == 5 + 625 + 1
    )
