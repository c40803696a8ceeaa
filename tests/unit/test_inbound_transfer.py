"""The decode side of a KV transfer (InboundTransfer driven by KVFetcher) over the in-memory bus
and the in-process data plane: the normal path and every abort path of docs/data-plane.md, each
ending settled, with its blocks free to go (or quarantined) and the error it owes the client."""

import asyncio
import time

import pytest
import torch

from shared.control.failure import Code, Retry, failed, worker_full
from shared.control.messages import KVDestination, PrefillResult, TaskAck
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.inbound import ALLOWED, InboundTransfer, TransferState
from shared.kvtransfer.machine import IllegalTransition
from shared.kvtransfer.plan import TransferPlan
from shared.kvtransfer.receiver import KVReceiver
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork
from tests.unit.transfer_fakes import LAYOUT, PREFILL, DecodeSide, until

S = TransferState


async def test_the_normal_path_lands_every_piece_and_hands_the_kv_to_the_engine():
    side = DecodeSide()
    fetch = await side.start()
    await side.prefill.got_task.wait()
    sender = side.prefill.send()
    await sender.finish()
    assert 0 < sender.first_sent_at <= time.time()
    sent_at = sender.first_sent_at - 0.25  # as if the first piece had left 250 ms earlier
    await side.prefill.result(queue_ms=1.5, prefill_ms=2.5, cached_tokens=0, sent_at=sent_at)
    await asyncio.wait_for(fetch, 5)
    t, req = side.req.transfer, side.req
    assert t.state is S.COMPLETE and req.may_free and req.failure is None
    assert side.arrived == [req.seq] and req.seq.first_tokens == [7]
    assert req.prefill_worker == PREFILL and side.fetcher.transports == {"inprocess"}
    assert (req.seq.queue_ms, req.seq.prefill_ms) == (1.5, 2.5)
    # the first piece sent (the prefill's clock) -> the last landed: one piece may be all
    assert req.seq.kv_transfer_ms == (t.receiver.last_landed - sent_at) * 1000 >= 250
    assert req.seq.kv_exposed_ms >= 0
    slots = side.pool.slots(req.seq.block_table, 0, 16)
    assert torch.equal(
        side.pool.export(slots), side.prefill.pool.export(side.prefill.pool.slots(range(8), 0, 16))
    )
    assert not side.fetcher.transfers and not side.prefill.aborts


async def aborted(side: DecodeSide, fetch: asyncio.Task, code: Code | None) -> None:
    """The fetch ended through an abort: released, nothing arrived, the error as given."""
    await asyncio.wait_for(fetch, 5)
    assert side.req.transfer.state is S.RELEASED and side.req.may_free
    assert side.arrived == []
    assert (side.req.failure.code if side.req.failure else None) == code


async def test_a_cancel_aborts_tells_the_prefill_worker_and_releases_every_receive():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    side.req.cancel("client went away")
    await aborted(side, fetch, None)
    assert side.req.cancel_reason == "client went away"
    assert [a.reason for a in side.prefill.aborts] == ["client went away"]
    assert side.plane.counters.receives_released == len(side.req.transfer.receiver.plan.pieces)


async def test_a_cancel_before_the_prefill_worker_answered_waits_for_the_answer_then_tells_it():
    side = DecodeSide()
    side.prefill.answer.clear()
    fetch = await side.start()
    await side.prefill.got_task.wait()
    side.req.cancel("early")
    await asyncio.sleep(0.3)  # a TransferAbort now could overtake the task it is about
    assert side.req.transfer.state is S.REQUESTED and side.prefill.aborts == []
    side.prefill.answer.set()
    await aborted(side, fetch, None)
    assert [a.reason for a in side.prefill.aborts] == ["early"]


async def test_a_passed_deadline_aborts_with_deadline_exceeded():
    side = DecodeSide(deadline=time.time() + 0.2)
    fetch = await side.start()
    await aborted(side, fetch, Code.DEADLINE_EXCEEDED)
    assert (
        side.req.failure.message == "the request's deadline passed" and not side.req.failure.movable
    )
    assert len(side.prefill.aborts) == 1


async def test_a_transfer_stalled_for_a_lease_after_the_result_aborts():
    side = DecodeSide(kv_lease_s=0.3)
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    side.prefill.send(segments=1)  # half the pieces, then nothing
    await side.prefill.result()
    await aborted(side, fetch, Code.UNAVAILABLE)
    assert side.req.failure.message in (
        "the KV transfer stalled for 0s",
        "the KV transfer from the prefill worker failed",  # the receiver's own lease came first
    )
    assert side.req.failure.avoid == PREFILL and len(side.prefill.aborts) == 1


async def test_a_prefill_worker_lost_mid_transfer_fails_the_request_for_another_worker():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    side.liveness.gone.add(PREFILL)
    await aborted(side, fetch, Code.UNAVAILABLE)
    assert side.req.failure.message == f"prefill worker {PREFILL} stopped responding"
    assert side.req.failure.avoid == PREFILL
    assert len(side.prefill.aborts) == 1  # it may only be slow: told anyway


async def test_a_prefill_worker_lost_before_it_answered_is_not_told():
    side = DecodeSide()
    side.prefill.ack = None  # never answers
    side.liveness.gone.add(PREFILL)
    fetch = await side.start()
    await aborted(side, fetch, Code.UNAVAILABLE)
    assert side.req.failure.message == f"prefill worker {PREFILL} stopped responding"
    assert side.prefill.aborts == []


async def test_a_full_prefill_worker_refuses_and_the_request_is_placed_again():
    side = DecodeSide()
    side.prefill.ack = TaskAck(worker_full(PREFILL, "queue is full"))
    fetch = await side.start()
    await aborted(side, fetch, Code.RESOURCE_EXHAUSTED)
    assert side.req.failure == worker_full(PREFILL, "queue is full")  # moved, PREFILL allowed
    assert side.prefill.aborts == []  # it ended the transfer itself
    await until(lambda: not side.fetcher.transfers)  # nothing was sent: nothing to drain


async def test_a_prefill_worker_nobody_listens_to_did_not_answer():
    side = DecodeSide()
    side.req.transfer = side.fetcher.open(side.req.seq, PREFILL)  # no ScriptedPrefill listening
    await aborted(side, asyncio.create_task(side.fetch()), Code.UNAVAILABLE)
    assert side.req.failure.message == f"prefill worker {PREFILL} did not answer"
    assert side.req.failure.avoid == PREFILL


async def test_a_failed_receive_aborts_the_transfer():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    first = side.prefill.tasks[-1].destination.base_tag
    too_big = torch.zeros(1 << 16, dtype=torch.uint8)  # more than the piece: truncated
    sending = asyncio.ensure_future(side.prefill.plane.send(b"decode", first, too_big, 1.0))
    await aborted(side, fetch, Code.UNAVAILABLE)
    assert side.req.failure.message == "the KV transfer from the prefill worker failed"
    assert len(side.prefill.aborts) == 1
    await asyncio.gather(sending, return_exceptions=True)


async def test_a_restart_of_this_workers_own_data_plane_blames_nobody():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    side.plane.restart()  # its helper process died: the receives fail, the peer is not at fault
    await aborted(side, fetch, Code.UNAVAILABLE)
    failure = side.req.failure
    assert failure.message == "this decode worker's KV data plane restarted mid-transfer"
    assert (failure.retry, failure.avoid) == (Retry.HERE, "")  # placed again, anywhere


async def test_the_prefill_workers_own_abort_ends_the_transfer_without_telling_it_back():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    await side.prefill.result(failed(Code.CANCELLED, "gone"), pieces_sent=0)
    await aborted(side, fetch, Code.CANCELLED)
    assert side.prefill.aborts == [] and not side.req.failure.movable


async def test_pieces_in_flight_at_an_abort_are_drained_and_discarded():
    side = DecodeSide()
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    side.req.cancel("client went away")
    await aborted(side, fetch, None)
    assert side.fetcher.transfers  # still routed: the drain waits for how far the sender got
    before = side.pool.kv.clone()
    sender = side.prefill.send(segments=1)  # pieces that left before the abort reached it
    await side.prefill.result(failed(Code.CANCELLED, ""), pieces_sent=sender.pieces_sent)
    await asyncio.wait_for(sender.finish(), 5)  # taken off the wire...
    assert torch.equal(side.pool.kv, before)  # ...into a scratch buffer, not the blocks
    await until(lambda: not side.fetcher.transfers and not side.fetcher.drains)


async def test_a_receive_that_never_ends_quarantines_the_blocks_until_its_peer_is_gone():
    """Before, quarantined blocks were lost for good (and counted nowhere)."""
    side = DecodeSide(kv_lease_s=0.2)
    release = side.plane.release

    async def release_all_but_the_first(tags, timeout=10.0):
        await release(tags[1:], timeout)

    side.plane.release = release_all_but_the_first
    fetch = await side.start()
    await until(lambda: side.req.transfer.state is S.LANDING)
    blocks = list(side.req.seq.block_table)
    side.req.cancel("client went away")
    await asyncio.wait_for(fetch, 5)
    assert side.req.transfer.state is S.QUARANTINED and side.req.may_free
    assert [q.blocks for q in side.fetcher.quarantined] == [blocks]
    assert side.req.seq.block_table == [] and side.freed == []
    side.liveness.gone.add(PREFILL)  # the sender is known gone: nothing can write there now
    await until(lambda: not side.fetcher.quarantined)
    assert side.freed == [blocks]
    side.plane.release = release
    await side.plane.release([side.prefill.tasks[-1].destination.base_tag])


def transfer_alone() -> InboundTransfer:
    destination = KVDestination(b"decode", 1 << 40, [0, 1], segment_tokens=8)
    plan = TransferPlan(LAYOUT, 8, destination)
    plane = InProcessDataPlane(LoopbackNetwork(), "decode")
    receiver = KVReceiver(plane, [KVPool(LAYOUT, 2, 4, "cpu")], plan)
    return InboundTransfer("r", PREFILL, receiver, lease_s=1.0, timeout_s=1.0)


async def test_a_transition_the_table_does_not_allow_raises():
    t = transfer_alone()
    with pytest.raises(IllegalTransition):
        t.requested()  # the receives are not posted yet
    with pytest.raises(IllegalTransition):
        t.released()  # not aborting
    t.abort(failed(Code.CANCELLED, "x"))
    t.released()
    with pytest.raises(IllegalTransition):
        t.abort(failed(Code.CANCELLED, "again"))
    assert all(not ALLOWED[s] for s in (S.COMPLETE, S.RELEASED, S.QUARANTINED))


async def test_events_after_the_end_change_nothing():
    t = transfer_alone()
    t.on_cancel("first")
    t.released()
    t.on_cancel("second")
    t.on_deadline()
    t.on_peer_lost()
    t.on_piece_landed()
    t.on_ack(TaskAck())
    t.on_result(PrefillResult(attempt_id="r", base_tag=1 << 40))
    t.tick()
    assert t.state is S.RELEASED and t.cause.failure.message == "first" and t.result is None
