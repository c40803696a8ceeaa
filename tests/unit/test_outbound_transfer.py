"""The prefill side of a KV transfer (OutboundTransfer): its states, the abort paths, and its
blocks freed exactly once whichever way it ends."""

import time

import pytest

from shared.control.failure import Code, Retry, failed
from shared.control.messages import KVDestination, PrefillTask
from shared.dataplane.plane import KVTransferError, PlaneRestarted
from shared.engine.kv_cache import KVPool
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence, StepOutput
from shared.kvtransfer.machine import IllegalTransition
from shared.kvtransfer.outbound import (
    ALLOWED,
    OutboundState,
    OutboundTransfer,
    send_failure,
)
from shared.kvtransfer.plan import TransferPlan
from shared.kvtransfer.receiver import KVReceiver
from shared.kvtransfer.sender import KVSender
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork
from tests.unit.transfer_fakes import BS, LAYOUT, make_task

S = OutboundState


class Transfer:
    """An OutboundTransfer of a 16-token prompt (two segments) to a decode plane that listens."""

    def __init__(self, deadline: float = 0.0):
        net = LoopbackNetwork()
        self.decode_plane = InProcessDataPlane(net, "decode")
        task = make_task("r", 16, deadline)
        destination = KVDestination(b"decode", 1 << 40, [0, 1, 2, 3], segment_tokens=8)
        plan = TransferPlan(LAYOUT, 16, destination)
        self.receiver = KVReceiver(self.decode_plane, [KVPool(LAYOUT, 4, BS, "cpu")], plan)
        sender = KVSender(
            InProcessDataPlane(net, "prefill"), [KVPool(LAYOUT, 4, BS, "cpu")], plan, 1
        )
        self.seq = Sequence.from_task(task, None, set(), 512, prefill_only=True)
        self.seq.block_table = [0, 1, 2, 3]
        self.freed: list[Sequence] = []
        prefill_task = PrefillTask(task, LAYOUT, destination, "d")
        self.t = OutboundTransfer(prefill_task, self.seq, sender, self.freed.append)

    def compute(self, tokens: int) -> None:
        """The engine computed the prompt up to `tokens`; the computed segments go out."""
        self.seq.num_computed_tokens = tokens
        if tokens == 16:
            self.seq.move(SeqStatus.FINISHED_LENGTH)
        for seg in self.t.ready():
            staged = self.t.sender.stage(seg, self.seq.block_table)
            self.t.sender.send(staged.direct)
            self.t.sender.send(self.t.sender.gather(staged))


async def test_the_normal_path_sends_every_piece_then_frees_the_blocks_once():
    x = Transfer()
    x.receiver.start()
    assert x.t.state is S.QUEUED and x.t.ready() == []
    x.compute(8)
    assert x.t.state is S.PREFILLING and not x.t.on_all_staged()
    x.compute(16)
    x.t.on_prompt_done(StepOutput([42], ""))
    assert x.t.on_all_staged() and x.t.state is S.SENDING and x.freed == []
    result = x.t.result("prefill-1", "inprocess")
    assert result.ok and result.first_tokens == [42] and result.kv_bytes == x.t.sender.plan.nbytes
    await x.t.sender.finish()
    x.t.on_sends_done()
    assert x.t.state is S.RELEASED and x.freed == [x.seq] and x.receiver.complete


async def test_an_abort_before_anything_was_sent_releases_at_once():
    x = Transfer()
    x.t.on_cancel("client went away")
    assert x.t.pending_abort() == failed(Code.CANCELLED, "cancelled before its prefill finished")
    assert x.seq.abandoned  # a step computing it stops early
    assert not x.t.abort()
    assert x.t.state is S.RELEASED and x.freed == [x.seq]
    assert x.t.aborted("p", failed(Code.CANCELLED, "m")).pieces_sent == 0


async def test_an_abort_with_pieces_on_the_wire_frees_now_and_releases_when_they_left():
    x = Transfer()
    x.decode_plane.hold = True
    x.compute(8)
    assert x.t.on_transfer_abort(1 << 40, "stalled")
    assert x.t.pending_abort() == failed(Code.CANCELLED, "aborted by the decode worker: stalled")
    assert x.t.abort()  # the owner waits for the sends
    assert x.t.state is S.ABORTING and x.freed == [x.seq]
    assert x.t.aborted("p", failed(Code.CANCELLED, "m")).pieces_sent == len(
        x.t.sender.plan.segments[0].pieces
    )
    x.decode_plane.hold = False
    x.receiver.start()
    await x.t.sender.finish()
    x.t.on_sends_done()
    assert x.t.state is S.RELEASED and x.freed == [x.seq]  # once


async def test_a_transfer_abort_while_sending_frees_once_and_the_send_watcher_releases():
    x = Transfer()
    x.decode_plane.hold = True
    x.compute(16)
    assert x.t.on_all_staged()
    x.t.on_cancel("too late")  # the prompt is done: a cancel no longer stops it
    assert x.t.pending_abort() is None
    assert not x.t.on_transfer_abort(1 << 41, "not this transfer")
    assert x.t.on_transfer_abort(1 << 40, "")
    assert x.t.pending_abort() == failed(Code.CANCELLED, "aborted by the decode worker: aborted")
    assert not x.t.abort() and x.t.state is S.ABORTING and x.freed == [x.seq]
    x.decode_plane.hold = False
    x.receiver.start()
    await x.t.sender.finish()  # the watcher started by on_all_staged sees them leave
    x.t.on_sends_done()
    assert x.t.state is S.RELEASED and x.freed == [x.seq]
    assert not x.t.on_transfer_abort(1 << 40, "again")


async def test_a_passed_deadline_is_due_between_steps():
    x = Transfer(deadline=time.time() - 1)
    assert x.t.pending_abort() == failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed")


async def test_a_transition_the_table_does_not_allow_raises():
    x = Transfer()
    with pytest.raises(IllegalTransition):
        x.t.on_sends_done()  # QUEUED -> RELEASED skips the sending
    assert x.freed == [] and x.t.state is S.QUEUED
    assert not ALLOWED[S.RELEASED] and ALLOWED[S.SENT] == {S.RELEASED}


def test_a_send_lost_to_this_workers_own_data_plane_restart_blames_nobody():
    restarted = send_failure("p", PlaneRestarted("the data-plane helper was replaced"))
    assert (restarted.retry, restarted.avoid) == (Retry.HERE, "")
    failed_here = send_failure("p", KVTransferError("timed out"))
    assert (failed_here.retry, failed_here.avoid) == (Retry.ELSEWHERE, "p")
